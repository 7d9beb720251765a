"""Context-parallel attention: activation memory and traffic per rank, by algorithm.

    python benchmarks/context_memory.py --world-size 4 --seq 1024 4096 --heads 8 --dim 64

For each sequence length, one causal attention (fp32, zigzag order) forward + backward:

* ``1 device math``: the textbook ``softmax(QK^T)V`` on one device (saves the S×S
  probabilities: the memory wall context parallelism exists to break);
* ``1 device sdpa``: one device's fused SDPA (saves O(S): out + LSE);
* ``ulysses``, ``ring``, ``double_ring`` (window 2), ``hybrid`` (Ulysses degree 2) on
  ``--world-size`` gloo ranks, ``cp`` = world size.

Columns: bytes saved for backward per rank (counted with
``torch.autograd.graph.saved_tensors_hooks``, storages deduplicated), the score matrix of
the largest single attention call a rank makes (what a non-fused kernel materialises; a
fused one tiles it, but it is the work per call), bytes sent per rank
(forward + backward, from ``dtp.comm_log``), and the median wall time of ``--repeats``
runs. Not a test: times on a shared CPU are noisy; memory and bytes are exact.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _saved_bytes(fn) -> tuple[int, object]:
    """Run ``fn`` and count the distinct storages autograd saves for backward."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        local = t._local_tensor if isinstance(t, DTensor) else t
        try:
            st = local.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _single(seq: int, heads: int, dim: int, math_path: bool) -> dict:
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=g).requires_grad_() for _ in range(3))

    def fwd():
        if math_path:
            s = (q @ k.transpose(-1, -2)) / dim**0.5
            s = s.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
            return s.softmax(-1) @ v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    saved, _ = _saved_bytes(fwd)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fwd().sum().backward()
        times.append(time.perf_counter() - t0)
    return dict(saved=saved, scores=heads * seq * seq * 4, sent=0, ms=1e3 * statistics.median(times))


def _distributed(algo: str, kw: dict, seq: int, heads: int, dim: int, repeats: int) -> dict:
    import torch.distributed as dist

    import dtp
    from dtp import P
    from dtp.ops import context as C
    from dtp.redistribute import to_local

    world = dist.get_world_size()
    mesh = dtp.make_mesh(cp=world)
    g = torch.Generator().manual_seed(0)
    glob = [torch.randn(1, heads, seq, dim, generator=g) for _ in range(3)]

    def once() -> tuple[int, int]:
        q, k, v = (dtp.shard(t, mesh, P(None, None, "cp")).requires_grad_() for t in glob)
        with dtp.comm_log() as log:
            saved, out = _saved_bytes(lambda: C.context_attention(q, k, v, algo=algo, **kw))
            to_local(out).sum().backward()
        return saved, log.bytes()

    saved, sent = once()  # warm-up (creates mesh views)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    L = seq // world
    if algo == "ulysses":
        scores = heads // world * seq * seq * 4
    elif algo == "hybrid":
        u = kw["ulysses_degree"]
        scores = heads // u * (L * u) ** 2 * 4
    else:
        scores = heads * L * L * 4
    return dict(saved=saved, scores=scores, sent=sent, ms=1e3 * statistics.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from dtp.testing import run

    torch.set_num_threads(1)
    algos = [("ulysses", {}), ("ring", {}), ("double_ring", {"window": 2}), ("hybrid", {"ulysses_degree": 2})]
    mib = 2.0**20
    print(f"cp = {args.world_size}, heads = {args.heads}, head_dim = {args.dim}, fp32, causal, zigzag")
    print(f"{'seq':>6}  {'algorithm':<16}{'saved MiB/rank':>15}{'call scores MiB':>16}{'sent MiB/rank':>15}{'ms':>9}")
    for seq in args.seq:
        rows = [("1 device math", _single(seq, args.heads, args.dim, True)),
                ("1 device sdpa", _single(seq, args.heads, args.dim, False))]
        for algo, kw in algos:
            res = run(_distributed, algo, kw, seq, args.heads, args.dim, args.repeats, world_size=args.world_size)
            rows.append((algo, max(res, key=lambda r: r["saved"])))
        for name, r in rows:
            print(f"{seq:>6}  {name:<16}{r['saved'] / mib:>15.2f}{r['scores'] / mib:>16.2f}"
                  f"{r['sent'] / mib:>15.2f}{r['ms']:>9.1f}")


if __name__ == "__main__":
    main()
