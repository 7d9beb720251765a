"""What one pipeline action costs the runner, counted: Python calls, aten ops, tensors
allocated, autograd inputs, gloo messages posted and waited for, and thread CPU — per
action kind, mean over ranks, p=2.

    python benchmarks/pipeline_counts.py                      # 256 rows, dim 512 (pipeline.py's size)
    python benchmarks/pipeline_counts.py --rows 4 --dim 8     # compute nil: the fixed cost alone

Counts do not depend on the machine's load, so they are the evidence to compare runners by
on a shared machine; ``cpu µs`` (``time.thread_time`` of the rank's main thread inside the
action) moves a little with load, wall time a lot (not shown). The model and mesh are
``benchmarks/pipeline.py``'s (``--layers`` tanh layers, ``dtp.make_mesh(pp=2)``). Each
schedule runs ``--warmup`` steps, then one pass per counter of ``--steps`` steps (the
counters slow what they count, so the CPU pass runs without them):

* ``py calls``: Python and C function calls (``sys.setprofile``) inside the action;
* ``aten ops`` / ``allocs``: aten calls (a ``TorchDispatchMode``), and of their outputs
  those whose storage is none of the op's inputs' (a new tensor);
* ``grad inputs``: tensors (or gradient edges) an action asks the autograd engine for
  (input and weights; the runner calls it through ``pipeline_split``'s ``run_backward``);
* ``posted`` / ``waits``: gloo sends and receives posted (``dtp.comm`` records) and
  ``CommHandle.wait`` calls inside the action (its own receive included).
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COUNTERS = ("cpu", "calls", "ops")


class _Ops(TorchDispatchMode):
    """Counts aten calls and the new tensors they return."""

    def __init__(self, box: dict):
        super().__init__()
        self.box = box

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        self.box["aten ops"] += 1
        self.box["allocs"] += sum(1 for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                                  and t.untyped_storage().data_ptr() not in ins and t.numel())
        return out


def _count(schedules, m: int, rows: int, dim: int, layers: int, warmup: int, steps: int) -> dict:
    import torch.distributed as dist

    import dtp
    import pipeline as bench
    from dtp import comm
    from dtp.strategies import pipeline as pl
    from dtp.strategies import pipeline_split as split

    torch.set_num_threads(1)
    params, model = bench.make_params(layers, dim), bench.make_model(layers)
    batch = bench.make_batch(m * rows, dim)
    kinds = ("_F", "_B", "_I", "_W")
    saved = {k: getattr(pl.Run, k) for k in kinds}
    grad, wait = split.run_backward, comm.CommHandle.wait
    out = {}
    try:
        for schedule, v in schedules:
            state = bench._dtp_state(params, schedule, v, 2)
            placed = dtp.shard_batch(batch, state)
            for _ in range(warmup):
                state, _ = dtp.train_step(model, state, placed, microbatches=m)
            stats: dict = collections.defaultdict(collections.Counter)
            inside = [None]  # the action kind being counted (the outer one: _B calls _I), in the CPU pass

            def counted_grad(outputs, grad_outputs, inputs, *a, **k):
                if inside[0] and counting[0] == "cpu":
                    stats[inside[0]]["grad inputs"] += len(inputs)
                return grad(outputs, grad_outputs, inputs, *a, **k)

            def counted_wait(handle):
                if inside[0] and counting[0] == "cpu":
                    stats[inside[0]]["waits"] += 1
                return wait(handle)

            split.run_backward, comm.CommHandle.wait = counted_grad, counted_wait
            counting = [None]
            for counter in COUNTERS:
                counting[0] = counter
                def action(kind, fn, counter=counter):
                    def run(self, chunk, i, *a, **k):
                        if inside[0]:
                            return fn(self, chunk, i, *a, **k)
                        inside[0] = kind
                        box = stats[kind]
                        box[f"n {counter}"] += 1
                        calls = [0]
                        with comm.comm_log() as log:
                            c0 = time.thread_time()
                            if counter == "ops":
                                with _Ops(box):
                                    fn(self, chunk, i, *a, **k)
                            elif counter == "calls":
                                def prof(frame, event, arg):
                                    if event in ("call", "c_call"):
                                        calls[0] += 1
                                sys.setprofile(prof)
                                try:
                                    fn(self, chunk, i, *a, **k)
                                finally:
                                    sys.setprofile(None)
                            else:
                                fn(self, chunk, i, *a, **k)
                            dt = time.thread_time() - c0
                        inside[0] = None
                        if counter == "cpu":
                            box["cpu µs"] += 1e6 * dt
                            box["posted"] += sum(r.kind in ("send", "recv") for r in log.records)
                        elif counter == "calls":
                            box["py calls"] += calls[0]
                        return None
                    return run

                for k in kinds:
                    setattr(pl.Run, k, action(k[1], saved[k]))
                for _ in range(steps):
                    dist.barrier()
                    state, _ = dtp.train_step(model, state, placed, microbatches=m)
                for k in kinds:
                    setattr(pl.Run, k, saved[k])
            per = {}
            for kind, box in stats.items():
                n = {c: box[f"n {c}"] for c in COUNTERS}
                per[kind] = {name: box[name] / n[src] for name, src in
                             (("cpu µs", "cpu"), ("posted", "cpu"), ("waits", "cpu"), ("grad inputs", "cpu"),
                              ("py calls", "calls"), ("aten ops", "ops"), ("allocs", "ops")) if n[src]}
                per[kind]["count"] = n["cpu"] / steps
            out[schedule] = per
    finally:
        split.run_backward, comm.CommHandle.wait = grad, wait
        for k in kinds:
            setattr(pl.Run, k, saved[k])
    return out


def main() -> None:
    import pipeline as bench

    ap = bench.step_parser(__doc__, steps=3)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    from dtp.testing import run

    chosen = [(s, v) for s, v in bench.SCHEDULES if s in args.schedules]
    res = run(_count, chosen, args.m, args.rows, args.dim, args.layers, args.warmup, args.steps, world_size=2,
              timeout=1200)
    cols = ("count", "cpu µs", "py calls", "aten ops", "allocs", "grad inputs", "posted", "waits")
    print(f"per action, mean over the 2 ranks; {args.layers} layers tanh(x @ w), w {args.dim}x{args.dim}, "
          f"{args.rows} rows per microbatch, m={args.m}; {args.steps} steps per counter")
    print(f"{'schedule':<14}{'action':<7}" + "".join(f"{c:>12}" for c in cols))
    for schedule, _ in chosen:
        for kind in "FBIW":
            rows = [rk[schedule][kind] for rk in res if kind in rk[schedule]]
            if not rows:
                continue
            vals = {c: statistics.mean(r.get(c, 0.0) for r in rows) for c in cols}
            print(f"{schedule:<14}{kind:<7}" + "".join(f"{vals[c]:>12.1f}" for c in cols))
    print("count = actions of that kind per rank and step; cpu µs = thread CPU; posted = gloo sends and receives "
          "posted inside the action; waits = CommHandle.wait calls inside it")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
