"""Context parallel on gloo: dtp vs PyTorch's own tools on the same shapes.

    python benchmarks/context_vs_torch.py --world-size 4 --seq 1024 4096 --heads 8 --dim 64 --repeats 5 [--head-chunks 1]

(a) **Ulysses vs DTensor redistribute.** q/k/v of shape (1, heads, seq, dim), fp32, split on
    sequence over ``cp`` = world size:

    * ``S(seq)->S(heads)``: one reshard, ``dtp.reshard(x, P(None, "cp"))`` (a real
      all-to-all) vs ``x.redistribute(mesh, [Shard(1)])`` (torch 2.13 on gloo: all-gather
      + local chunk);
    * ``ulysses fwd+bwd``: ``dtp.ops.context.context_attention(..., algo="ulysses")``
      (4 all-to-alls forward, 4 backward) vs the same algorithm written with DTensor:
      redistribute q/k/v to Shard(heads), local SDPA, redistribute the output back to
      Shard(seq), backward through DTensor's autograd.

    Bytes are per rank. dtp's come from ``dtp.comm_log``; DTensor's from a
    ``TorchDispatchMode`` that sees every ``_c10d_functional`` collective DTensor issues,
    counted with the same formulas as ``dtp.comm`` (all-gather (n−1)×input, all-to-all
    (n−1)/n×input, reduce-scatter (n−1)/n×input, all-reduce 2(n−1)/n×input).

(b) **Ring vs PyTorch's context-parallel ring** (``torch.distributed.tensor.experimental.
    context_parallel``, which swaps SDPA for its ``_templated_ring_attention``), causal,
    its head-tail load balancing vs dtp's zigzag (the same chunk assignment). PyTorch's
    ring only dispatches the CUDA SDPA kernels (flash / efficient / cuDNN); this script
    tries it on CPU/gloo and prints the exact error when it does not run.

Medians of ``--repeats`` timed runs after one warm-up; ratio = dtp / torch (lower is
better). Not a test: times on a shared CPU are noisy; bytes are exact.
"""

from __future__ import annotations


import torch


def _count_collectives():
    """A context manager counting the bytes sent per rank by the functional collectives
    issued under it (DTensor's path). Built inside the worker (it pickles poorly)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import TorchDispatchMode

    formulas = {"all_gather_into_tensor": lambda nb, n: (n - 1) * nb,
                "all_to_all_single": lambda nb, n: (n - 1) * nb / n,
                "reduce_scatter_tensor": lambda nb, n: (n - 1) * nb / n,
                "all_reduce": lambda nb, n: 2 * (n - 1) * nb / n}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.counts = 0, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and not func._opname.startswith(("wait_tensor", "_")):
                if func._opname not in formulas:
                    raise RuntimeError(f"uncounted collective {func}")
                x = args[0]
                group = _resolve_process_group(args[-1])
                n, nb = dist.get_world_size(group), x.numel() * x.element_size()
                if func._opname == "all_to_all_single" and args[2]:
                    # Uneven splits (torch's ring rotater permutes with all_to_all_single):
                    # what leaves this rank is every split but its own.
                    splits, me = list(args[2]), dist.get_rank(group)
                    self.bytes += nb * (sum(splits) - splits[me]) // max(1, sum(splits))
                else:
                    self.bytes += int(round(formulas[func._opname](nb, n)))
                self.counts[func._opname] = self.counts.get(func._opname, 0) + 1
            return func(*args, **(kwargs or {}))

    return Count()


def _timeit(fn, repeats: int) -> float:
    from _common import median_time

    return median_time(fn, repeats)


def _ulysses(seq: int, heads: int, dim: int, repeats: int, head_chunks: int | None) -> list[dict]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard

    import dtp
    from dtp import P
    from dtp.ops import context as C
    from dtp.redistribute import to_local

    world = dist.get_world_size()
    mesh = dtp.make_mesh(cp=world)
    g = torch.Generator().manual_seed(0)
    glob = [torch.randn(1, heads, seq, dim, generator=g) for _ in range(3)]
    x = dtp.shard(glob[0], mesh, P(None, None, "cp"))
    rows = []

    # one reshard S(seq) -> S(heads)
    with dtp.comm_log() as log:
        dtp.reshard(x, P(None, "cp"))
    with _count_collectives() as seen:
        x.redistribute(mesh, [Shard(1)])
    rows.append(dict(op="S(seq)->S(heads)", dtp=_timeit(lambda: dtp.reshard(x, P(None, "cp")), repeats),
                     torch=_timeit(lambda: x.redistribute(mesh, [Shard(1)]), repeats),
                     dtp_bytes=log.bytes(), torch_bytes=seen.bytes, torch_ops=dict(seen.counts)))

    # Ulysses attention forward + backward
    def dtp_once():
        q, k, v = (dtp.shard(t, mesh, P(None, None, "cp")).requires_grad_() for t in glob)
        out = C.context_attention(q, k, v, algo="ulysses", causal=True, load_balance=None, head_chunks=head_chunks)
        to_local(out).sum().backward()

    def torch_once():
        q, k, v = (dtp.shard(t, mesh, P(None, None, "cp")).requires_grad_() for t in glob)
        ql, kl, vl = (t.redistribute(mesh, [Shard(1)]).to_local() for t in (q, k, v))
        o = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        out = DTensor.from_local(o, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Shard(2)])
        out.to_local().sum().backward()

    with dtp.comm_log() as log:
        dtp_once()
    with _count_collectives() as seen:
        torch_once()
    rows.append(dict(op="ulysses fwd+bwd", dtp=_timeit(dtp_once, repeats), torch=_timeit(torch_once, repeats),
                     dtp_bytes=log.bytes(), torch_bytes=seen.bytes, torch_ops=dict(seen.counts)))
    return rows


def _ring(seq: int, heads: int, dim: int, repeats: int, head_chunks: int | None) -> list[dict]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental._context_parallel import _attention as TA

    import dtp
    from dtp import P
    from dtp.core._torch import cpu_flash_attention, cpu_flash_attention_backward
    from dtp.ops import context as C
    from dtp.ops.blockwise import to_cp_order
    from dtp.redistribute import to_local

    world = dist.get_world_size()
    mesh = dtp.make_mesh(cp=world)
    g = torch.Generator().manual_seed(0)
    glob = [torch.randn(1, heads, seq, dim, generator=g) for _ in range(3)]
    # Both sides get the same zigzag shards (torch's head-tail balancing is the same order).
    shards = [to_local(dtp.shard(to_cp_order(t, 2, world), mesh, P(None, None, "cp"))) for t in glob]

    def dtp_once():
        q, k, v = (dtp.from_local(t.clone(), mesh, P(None, None, "cp")).requires_grad_() for t in shards)
        out = C.context_attention(q, k, v, algo="ring", causal=True, load_balance="zigzag", head_chunks=head_chunks)
        to_local(out).sum().backward()
        return to_local(out), [to_local(t.grad) for t in (q, k, v)]

    with dtp.comm_log() as log:
        ref_out, ref_grads = dtp_once()
    rows = []
    base = dict(dtp=_timeit(dtp_once, repeats), dtp_bytes=log.bytes())

    # (1) The public API, as a user would call it.
    def public_once():
        from torch.distributed.tensor.experimental import context_parallel

        q, k, v = bufs = [t.clone() for t in glob]  # sharded in place: no grad until inside
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(bufs)):
            for t in bufs:
                t.requires_grad_()
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    try:
        public_once()
        rows.append(dict(base, op="ring: context_parallel", torch=_timeit(public_once, repeats)))
    except Exception as e:  # noqa: BLE001 - report exactly what PyTorch raised
        rows.append(dict(base, op="ring: context_parallel",
                         torch_error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"))

    # (2) PyTorch's ring algorithm itself (_templated_ring_attention and its backward, the
    # functions context_parallel dispatches to) with the CPU flash kernel plugged in as
    # the block op -- the kernel dtp uses too. Each rotate method PyTorch offers.
    def cpu_fwd(query, key, value, is_causal, **kw):
        return cpu_flash_attention(query, key, value, is_causal)

    def cpu_bwd(query, key, value, out, logsumexp, is_causal, grad_out, **kw):
        return cpu_flash_attention_backward(grad_out, query, key, value, out, logsumexp, is_causal)

    group = mesh.get_group("cp")
    for method in (TA._RotateMethod.ALL_GATHER, TA._RotateMethod.ALL_TO_ALL):
        def torch_once(method=method):
            previous = TA._cp_options.rotate_method
            TA._cp_options.rotate_method = method
            try:
                q, k, v = (t.clone() for t in shards)
                out, lse = TA._templated_ring_attention(group, 2, cpu_fwd, q, k, v, is_causal=True)[:2]
                grads = TA._templated_ring_attention_backward(
                    group, 2, cpu_bwd, torch.ones_like(out), "grad_out", q, k, v, out, lse, is_causal=True)[:3]
                return out, grads
            finally:
                TA._cp_options.rotate_method = previous

        with _count_collectives() as seen:
            out, grads = torch_once()
        diff = max((a - b).abs().max().item() for a, b in zip([out, *grads], [ref_out, *ref_grads]))
        rows.append(dict(base, op=f"ring: {method.name.lower()}", torch=_timeit(torch_once, repeats),
                         torch_bytes=seen.bytes, torch_ops=dict(seen.counts, max_abs_diff=float(f"{diff:.1e}"))))
    return rows


def main() -> None:
    from _common import attention_parser

    ap = attention_parser(__doc__, seq=[1024, 4096])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--head-chunks", type=int, default=None,
                    help="dtp's head_chunks (default: dtp.ops.context.default_chunks; 1: torch's schedule)")
    args = ap.parse_args()

    from dtp.testing import run

    torch.set_num_threads(1)
    mib = 2.0**20
    print(f"gloo, cp = {args.world_size}, heads = {args.heads}, head_dim = {args.dim}, fp32, causal, "
          f"dtp head_chunks = {args.head_chunks or 'default'}; "
          f"median of {args.repeats}; ratio = dtp / torch (lower is better)")
    print(f"{'seq':>6}  {'op':<24}{'dtp ms':>9}{'torch ms':>10}{'time':>7}"
          f"{'dtp MiB':>9}{'torch MiB':>11}{'bytes':>7}  torch collectives")
    for seq in args.seq:
        common = (seq, args.heads, args.dim, args.repeats, args.head_chunks)
        rows = run(_ulysses, *common, world_size=args.world_size, timeout=1200)[0]
        rows += run(_ring, *common, world_size=args.world_size, timeout=1200)[0]
        for r in rows:
            if "torch_error" in r:
                print(f"{seq:>6}  {r['op']:<24}{1e3 * r['dtp']:>9.1f}{'—':>10}{'—':>7}{r['dtp_bytes'] / mib:>9.2f}"
                      f"{'—':>11}{'—':>7}  torch does not run: {r['torch_error']}")
                continue
            print(f"{seq:>6}  {r['op']:<24}{1e3 * r['dtp']:>9.1f}{1e3 * r['torch']:>10.1f}"
                  f"{r['dtp'] / r['torch']:>7.2f}{r['dtp_bytes'] / mib:>9.2f}"
                  + (f"{r['torch_bytes'] / mib:>11.2f}{r['dtp_bytes'] / max(1, r['torch_bytes']):>7.2f}  "
                     f"{r['torch_ops']}" if "torch_bytes" in r else f"{'?':>11}{'?':>7}"))


if __name__ == "__main__":
    main()
