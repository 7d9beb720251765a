"""Blockwise attention vs one SDPA call, same total work, on one device.

    python benchmarks/blockwise_efficiency.py --seq 4096 16384 --cps 2 4 8 --repeats 5 [--device cuda --dtype bfloat16]

For each total sequence and each cp, causal attention forward + backward on one device:

* ``SDPA``: one ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` over the whole
  sequence and its backward (the fused kernel: CPU flash, or CUDA flash / efficient /
  cuDNN);
* ``blockwise``: :func:`dtp.testing.simulate_ring_attention` -- every block that
  the cp ranks of a zigzag ring compute, one after the other on this device, with the
  kernels (:func:`~dtp.ops.blockwise.block_forward` / ``block_backward``), the in-place
  log-sum-exp merge and the fp32 accumulation of the distributed path; no transfers.

Efficiency = SDPA time / blockwise time (goal >= 0.9): what splitting the sequence into
``2·cp`` zigzag chunks costs in kernel efficiency alone. Medians of ``--repeats`` runs after
one warm-up, the two timed alternately. On CUDA the block backward has no fused kernel
(it would need the forward's RNG bookkeeping) and takes the math path, tiled over query
rows (O(tile × block) memory, not block²): expect its speed to show here.
"""

from __future__ import annotations

import statistics
import time

import torch


def _timer(device: torch.device):
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()
    return now


def main() -> None:
    from _common import attention_parser

    import torch.nn.functional as F

    from dtp.ops.blockwise import to_cp_order
    from dtp.testing import simulate_ring_attention

    ap = attention_parser(__doc__, seq=[4096])
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    now = _timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}; heads = {args.heads}, head_dim = {args.dim}, {args.dtype}, causal, zigzag; fwd+bwd, "
          f"median of {args.repeats}; efficiency = SDPA / blockwise (goal >= 0.9)")
    print(f"{'seq':>7}{'cp':>4}{'SDPA ms':>10}{'blockwise ms':>14}{'efficiency':>12}")
    for seq in args.seq:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, args.heads, seq, args.dim, generator=g).to(device, dtype) for _ in range(3))
        for cp in args.cps:
            zz = [to_cp_order(t, 2, cp).requires_grad_() for t in (q, k, v)]
            whole = [t.clone().requires_grad_() for t in (q, k, v)]

            def sdpa() -> None:
                F.scaled_dot_product_attention(*whole, is_causal=True).sum().backward()

            def blockwise() -> None:
                simulate_ring_attention(*zz, cp=cp, causal=True, load_balance="zigzag").sum().backward()

            sdpa(), blockwise()  # warm-up
            times: dict[str, list[float]] = {"sdpa": [], "blockwise": []}
            for _ in range(args.repeats):
                for key, fn in (("sdpa", sdpa), ("blockwise", blockwise)):
                    t0 = now()
                    fn()
                    times[key].append(now() - t0)
            a, b = statistics.median(times["sdpa"]), statistics.median(times["blockwise"])
            print(f"{seq:>7}{cp:>4}{1e3 * a:>10.1f}{1e3 * b:>14.1f}{a / b:>12.2f}")


if __name__ == "__main__":
    main()
