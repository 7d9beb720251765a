"""Context-parallel attention: per-rank peak memory of forward + backward vs cp.

    python benchmarks/context_memory.py --seq 4096 --heads 8 --dim 64 --cps 1 2 4 --repeats 5

For one fixed total sequence, causal attention (fp32, zigzag order) forward + backward on
``cp`` gloo ranks for each ``cp`` in ``--cps``: ``ring`` and ``ulysses`` at every cp > 1,
``double_ring`` (window 2) and ``hybrid`` (Ulysses degree 2) where valid (cp ≥ 4); the cp=1
baseline is the same dtp call on a one-rank mesh (a ring of size one: one fused SDPA block,
O(S) saved), and ``1 device math`` (``softmax(QK^T)V``, the S×S wall) is shown for scale.
``1 device SDPA`` is plain ``F.scaled_dot_product_attention`` (the fused CPU kernel) on one
device with no dtp at all; ``/ SDPA`` is each row's peak against it, the stricter
baseline (dtp's ring of one carries its own fp32 accumulators and K/V buffers).

**Peak memory** is the peak of live CPU bytes allocated from creating this rank's q/k/v
shards to the end of backward, measured at the allocator: ``torch.profiler`` with
``profile_memory=True`` records every allocation and free of the CPU allocator (on every
thread, gloo's included) as a ``[memory]`` event with its signed size; the running sum of
those, in time order, peaks at the answer. Chosen over process RSS (glibc keeps freed
pages, other processes share the machine: noisy and inflated) and over counting
saved-for-backward tensors (misses transient buffers: the K/V blocks in flight, the
all-to-all outputs, the S×S scores of a non-fused kernel). It covers inputs, outputs,
gradients, saved activations and communication buffers, all through the CPU allocator.

Columns: peak MiB per rank (max over ranks of the median of ``--repeats`` runs), its ratio
to the cp=1 peak against the goal ``≤ 1/cp + 15%``, bytes sent per rank (``dtp.comm_log``)
the median wall time, and the peak against one-device SDPA with the same goal. Not a test: times on a shared CPU are noisy; memory is stable.
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import peak_bytes as _peak_bytes


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    seq, dim = q.shape[-2:]
    s = (q @ k.transpose(-1, -2)) / dim**0.5
    s = s.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    return s.softmax(-1) @ v


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _single(attend, seq: int, heads: int, dim: int, repeats: int) -> dict:
    """One device, no dtp: ``attend(q, k, v)`` forward + backward on the whole sequence."""
    def once():
        q, k, v = (torch.randn(1, heads, seq, dim).requires_grad_() for _ in range(3))
        attend(q, k, v).sum().backward()

    once()
    peaks, times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        peaks.append(_peak_bytes(once))
        times.append(time.perf_counter() - t0)
    return dict(peak=statistics.median(peaks), sent=0, ms=1e3 * statistics.median(times))


def _distributed(algo: str, kw: dict, seq: int, heads: int, dim: int, repeats: int) -> dict:
    import torch.distributed as dist

    import dtp
    from dtp import P
    from dtp.ops import context as C
    from dtp.redistribute import from_local, to_local

    world = dist.get_world_size()
    mesh = dtp.make_mesh(cp=world)
    L = seq // world
    spec = P(None, None, "cp")
    sent = []

    def once():
        # This rank's shards are created inside the measured region: inputs count too.
        q, k, v = (from_local(torch.randn(1, heads, L, dim), mesh, spec).requires_grad_() for _ in range(3))
        with dtp.comm_log() as log:
            out = C.context_attention(q, k, v, algo=algo, causal=True, load_balance="zigzag", **kw)
            to_local(out).sum().backward()
        sent.append(log.bytes())

    once()  # warm-up (creates mesh views)
    peaks, times = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        peaks.append(_peak_bytes(once))
        times.append(time.perf_counter() - t0)
    return dict(peak=statistics.median(peaks), sent=sent[-1], ms=1e3 * statistics.median(times))


def main() -> None:
    from _common import attention_parser

    ap = attention_parser(__doc__, seq=4096)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--head-chunks", type=int, nargs="+", default=[0],
                    help="head chunks to compare, 0 for dtp's default (dtp.ops.context.default_chunks)")
    args = ap.parse_args()

    from dtp.testing import run

    torch.set_num_threads(1)
    mib = 2.0**20
    print(f"seq = {args.seq} total, heads = {args.heads}, head_dim = {args.dim}, fp32, causal, zigzag; "
          f"median of {args.repeats}; goal: peak ≤ (1/cp + 15%) × cp=1 peak")
    print(f"{'cp':>3}  {'algorithm':<14}{'peak MiB/rank':>14}{'/ cp=1':>8}{'goal':>7}  {'ok':<4}"
          f"{'sent MiB/rank':>14}{'ms':>9}{'/ SDPA':>9}  ok")
    for name, attend in (("1 device math", _math_attention), ("1 device SDPA", _sdpa_attention)):
        row = _single(attend, args.seq, args.heads, args.dim, args.repeats)
        print(f"{1:>3}  {name:<14}{row['peak'] / mib:>14.2f}{'':>8}{'':>7}  {'':<4}{0:>14.2f}{row['ms']:>9.1f}")
    sdpa = row["peak"]
    base = None
    for cp in sorted(args.cps):
        # (algorithm, options, kv heads a rank attends with: what head_chunks must divide)
        algos = [("ring", {}, args.heads)] if cp == 1 else [("ring", {}, args.heads), ("ulysses", {}, args.heads // cp)]
        if cp >= 4 and cp % 2 == 0:
            algos += [("double_ring", {"window": 2}, args.heads), ("hybrid", {"ulysses_degree": 2}, args.heads // 2)]
        # cp=1 is one SDPA call whatever the chunks; skip chunk counts an algorithm rejects.
        chunk_counts = args.head_chunks if cp > 1 else [0]
        algos = [(algo, {**kw, "head_chunks": c} if c else kw) for algo, kw, kv in algos
                 for c in chunk_counts if not c or kv % c == 0]
        for algo, kw in algos:
            res = run(_distributed, algo, kw, args.seq, args.heads, args.dim, args.repeats, world_size=cp,
                      timeout=1200)
            r = max(res, key=lambda x: x["peak"])
            if base is None:
                base = r["peak"] if cp == 1 else sdpa
            ratio, goal = r["peak"] / base, 1 / cp + 0.15
            name = algo if cp > 1 else "dtp (ring of 1)"
            if "head_chunks" in kw:
                name += f" c={kw['head_chunks']}"
            print(f"{cp:>3}  {name:<14}{r['peak'] / mib:>14.2f}{ratio:>8.3f}{goal:>7.3f}  "
                  f"{'yes' if ratio <= goal else 'NO':<4}{r['sent'] / mib:>14.2f}{r['ms']:>9.1f}"
                  f"{r['peak'] / sdpa:>9.3f}  {'yes' if r['peak'] / sdpa <= goal else 'NO'}")


if __name__ == "__main__":
    main()
