"""Ring attention's hops on a slow link: dtp's causal ring attention (zigzag), forward and
backward, with and without ``dtp.comm.simulated_link`` on ``cp``.

    python benchmarks/ring_link.py --world-size 2 --seq 2048 --repeats 7
    python benchmarks/ring_link.py --world-size 4 --seq 2048 --comm-ratio 0.5

q/k/v of shape (1, ``--heads``, ``--seq``, ``--dim``), fp32, zigzag shards over ``cp`` = the
world size, ``dtp.ops.context.context_attention(..., algo="ring", causal=True,
load_balance="zigzag")`` and the backward of its output's sum — ``context_vs_torch.py``'s
ring. The link's bandwidth is set so that the modelled time of a rank's ring traffic (the
bytes its ``cp`` records count, forward and backward) is ``--comm-ratio`` × the fwd+bwd
time without the link (its median over a first set of runs). Each ring step sends the K/V
block on (and in backward the gradients) while it computes on the block in hand, so on a
link no slower than the compute the ring should cost little more than the compute.

Runs alternate without and with the link (a barrier before each); medians of
``--repeats``, the slower rank. Columns: ``free`` and ``link`` ms; ``link / max(free,
comm)`` (1.00: every hop hidden); ``exposed``: what the link added to the ranks' waits
(Σ ``CommRecord.waited`` of the ``cp`` records with the link − without, the slower rank)
over the link time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _rounds(seq: int, heads: int, dim: int, comm_ratio: float, warmup: int, repeats: int) -> dict:
    import torch.distributed as dist

    import dtp
    from dtp import P
    from dtp.ops import context as C
    from dtp.ops.blockwise import to_cp_order
    from dtp.redistribute import to_local

    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = dtp.make_mesh(cp=world)
    g = torch.Generator().manual_seed(0)
    glob = [torch.randn(1, heads, seq, dim, generator=g) for _ in range(3)]
    shards = [to_local(dtp.shard(to_cp_order(t, 2, world), mesh, P(None, None, "cp"))) for t in glob]

    def once() -> tuple[float, float, int]:
        dist.barrier()
        with dtp.comm_log() as log:
            t0 = time.perf_counter()
            q, k, v = (dtp.from_local(t.clone(), mesh, P(None, None, "cp")).requires_grad_() for t in shards)
            out = C.context_attention(q, k, v, algo="ring", causal=True, load_balance="zigzag")
            to_local(out).sum().backward()
            took = time.perf_counter() - t0
        cp = [r for r in log.records if r.axis == "cp"]
        return took, sum(r.waited or 0.0 for r in cp), sum(r.bytes for r in cp)

    for _ in range(warmup):
        once()
    first = [once() for _ in range(repeats)]
    compute = torch.tensor(statistics.median(t for t, _, _ in first))
    dist.all_reduce(compute, op=dist.ReduceOp.MAX)  # one bandwidth on every rank: the slower rank's time
    nbytes = first[0][2]
    bandwidth = nbytes / (comm_ratio * compute.item())
    free, link = [], []
    for _ in range(repeats):
        free.append(once())
        with dtp.comm.simulated_link(bandwidth, axes=("cp",)):
            link.append(once())
    return dict(free=free, link=link, comm=nbytes / bandwidth, bandwidth=bandwidth, nbytes=nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--comm-ratio", type=float, default=1.0, help="modelled ring traffic / fwd+bwd without the link")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    from dtp.testing import run

    res = run(_rounds, args.seq, args.heads, args.dim, args.comm_ratio, args.warmup, args.repeats,
              world_size=args.world_size, timeout=1800)

    def slower(key: str, i: int) -> float:
        return statistics.median(max(r[key][k][i] for r in res) for k in range(args.repeats))

    free, link = slower("free", 0), slower("link", 0)
    comm = max(r["comm"] for r in res)
    exposed = (slower("link", 1) - slower("free", 1)) / comm
    print(f"ring attention (zigzag, causal) fwd+bwd, cp={args.world_size}, q/k/v (1, {args.heads}, {args.seq}, "
          f"{args.dim}) fp32; a rank's cp traffic {res[0]['nbytes'] / 2 ** 20:.2f} MiB, link "
          f"{res[0]['bandwidth'] / 1e6:.1f} MB/s: {1e3 * comm:.1f} ms ({args.comm_ratio:g} × fwd+bwd); medians of "
          f"{args.repeats} alternated runs, slower rank")
    print(f"{'free ms':>9}{'link ms':>9}{'link / max(free, comm)':>24}{'exposed':>9}")
    print(f"{1e3 * free:>9.1f}{1e3 * link:>9.1f}{link / max(free, comm):>24.2f}{exposed:>9.2f}")


if __name__ == "__main__":
    main()
