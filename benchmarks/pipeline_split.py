"""Zero bubble's split backward against the full one, one process, no pipeline:
``pipeline_split.backward_input`` (I) then ``WeightGrad.run`` (W) beside one
``torch.autograd.grad`` over the input and the weights (B), on one chunk of
``pipeline.py``'s model (``--layers`` layers ``tanh(x @ w)``, ``--rows`` × ``--dim``).

    python benchmarks/pipeline_split.py                        # 2 layers: a V / interleaved chunk
    python benchmarks/pipeline_split.py --layers 4             # a pp=2 stage
    python benchmarks/pipeline_split.py --rows 4 --dim 8       # compute nil: the fixed cost alone

Also a lower bound with no autograd at all: the same aten ops by hand, fused (per layer
``tanh_backward``, ``dy @ w.T``, ``x.T @ dy``) and split (every ``dy @ w.T`` first, then
every ``x.T @ dy``). Thread CPU (``time.thread_time``), medians of ``--repeats``, the
variants alternated within each repeat so load drift hits all alike. What a pipeline
schedule's I + W costs beyond its B is this ratio's excess, paid once per microbatch
and chunk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dtp.strategies import pipeline_split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ws = [(torch.randn(args.dim, args.dim) / args.dim ** 0.5).requires_grad_() for _ in range(args.layers)]
    x0, g = torch.randn(args.rows, args.dim), torch.randn(args.rows, args.dim)

    def forward(grad: bool):
        with torch.set_grad_enabled(grad):
            x = x0.clone().requires_grad_(grad)
            ins, outs = [], []
            for w in ws:
                ins.append(outs[-1] if outs else x)
                outs.append(torch.tanh(ins[-1] @ w))
        return x, ins, outs

    def full() -> float:
        x, _, outs = forward(True)
        t = time.thread_time()
        torch.autograd.grad([outs[-1]], [x, *ws], grad_outputs=[g])
        return time.thread_time() - t

    def split() -> float:
        x, _, outs = forward(True)
        t = time.thread_time()
        _, kept = pipeline_split.backward_input([outs[-1]], [g], [x], ws)
        kept.run(ws)
        return time.thread_time() - t

    def by_hand(fused: bool) -> float:
        _, ins, outs = forward(False)
        t = time.thread_time()
        d, dys = g, []
        for k in reversed(range(len(ws))):
            dy = torch.ops.aten.tanh_backward(d, outs[k])
            d = dy.mm(ws[k].t())
            if fused:
                ins[k].t().mm(dy)
            else:
                dys.append((k, dy))
        for k, dy in dys:
            ins[k].t().mm(dy)
        return time.thread_time() - t

    variants = {"B (autograd.grad)": full, "I + W (pipeline_split)": split,
                "by hand, fused": lambda: by_hand(True), "by hand, split": lambda: by_hand(False)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for k in range(args.repeats + 5):
        for name, fn in variants.items():
            dt = fn()
            if k >= 5:
                times[name].append(dt)
    base = statistics.median(times["B (autograd.grad)"])
    print(f"{args.layers} layers tanh(x @ w), {args.rows} x {args.dim}, fp32, 1 thread; thread CPU, median of "
          f"{args.repeats}")
    for name, ts in times.items():
        print(f"{name:<24}{1e3 * statistics.median(ts):9.3f} ms  {statistics.median(ts) / base:6.3f} x B")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
