"""The local experts on a GPU: ``torch._grouped_mm`` (one grouped-GEMM kernel per
projection over the ragged groups, what :func:`dtp.ops.moe.experts` uses on Hopper in
bf16) against the padded ``torch.bmm`` it uses elsewhere — same numbers, time.

    python benchmarks/moe_grouped_gemm.py        # needs a CUDA GPU of compute capability 9.0+

Checks forward and backward against a per-expert loop in fp32 (bf16 tolerance), then
times forward+backward of the SwiGLU experts, medians of CUDA-event timings, for
DeepSeek/Mixtral-like shapes with skewed routing (the padded form pays for the largest
group on every expert).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from dtp.core import _torch
from dtp.ops import moe


def _loop(x, counts, wg, wu, wd):
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n].float()
        out.append((F.silu(xe @ wg[e].float()) * (xe @ wu[e].float())) @ wd[e].float())
        start += n
    return torch.cat(out)


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'tokens×k':>9} {'E':>3} {'d':>5} {'f':>5} {'skew':>5} | {'grouped ms':>10} {'padded ms':>9} {'ratio':>6} | max err fwd / grad")
    for rows, e, d, f, skew in ((16384, 8, 2048, 1408, 1.0), (16384, 8, 2048, 1408, 4.0), (32768, 64, 2048, 1408, 1.0),
                                (32768, 64, 2048, 1408, 4.0), (8192, 8, 4096, 14336, 1.0)):
        share = torch.linspace(1.0, skew, e)
        counts = (share / share.sum() * rows).long()
        counts[-1] += rows - counts.sum()
        counts = counts.cuda()
        x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ws = [(torch.randn(e, a, b, device="cuda", dtype=torch.bfloat16) / a ** 0.5).requires_grad_()
              for a, b in ((d, f), (d, f), (f, d))]
        assert _torch.grouped_mm_usable(x, *ws)
        y = moe.experts(x, counts, *ws)
        ref = _loop(x, counts, *ws)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        g = torch.randn_like(y)
        gx = torch.autograd.grad(y, x, g)[0]
        gx_ref = torch.autograd.grad(ref, x, g.float())[0]
        gerr = ((gx.float() - gx_ref).abs().max() / gx_ref.abs().max()).item()

        def grouped():
            torch.autograd.grad(moe.experts(x, counts, *ws), [x, *ws], g)

        def padded():
            torch.autograd.grad(moe.padded_experts(x, counts, *ws), [x, *ws], g)

        tg, tp = _time(grouped, args.repeats), _time(padded, args.repeats)
        print(f"{rows:>9} {e:>3} {d:>5} {f:>5} {skew:>5.1f} | {tg:>10.2f} {tp:>9.2f} {tp / tg:>5.2f}x | {err:.1e} / {gerr:.1e}")


if __name__ == "__main__":
    main()
