"""CPU a pipeline step costs per rank, all threads and the main thread: what the
schedules spend beyond the same FLOPs (the runner's fixed cost per action, the split
backward, gloo's transport threads), load-robust where wall time is not.

    python benchmarks/pipeline_cpu.py --schedules 1f1b interleaved zbv

``pipeline.py``'s model and mesh (pp=2 gloo ranks); every schedule runs one step in
turn (so load drift hits all alike), ``--steps`` rounds after 2 of warm-up. Per rank and
step: ``time.process_time`` (every thread of the rank: the main thread and gloo's
transport threads) and ``time.thread_time`` (the main thread); medians. On 2 cores
with 2 computing ranks, CPU spent on any thread of either rank is taken from compute,
so a schedule beats 1F1B only if its simulated gain exceeds its extra CPU.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _steps(schedules, m: int, rows: int, dim: int, layers: int, steps: int) -> dict:
    import torch.distributed as dist

    import dtp
    import pipeline as bench

    torch.set_num_threads(1)
    params, model = bench.make_params(layers, dim), bench.make_model(layers)
    batch = bench.make_batch(m * rows, dim)
    configs = []
    for schedule, v in schedules:
        state = bench._dtp_state(params, schedule, v, 2)
        configs.append([schedule, state, dtp.shard_batch(batch, state), []])
    for k in range(2 + steps):
        for c in configs:
            dist.barrier()
            p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
            c[1], _ = dtp.train_step(model, c[1], c[2], microbatches=m)
            if k >= 2:
                c[3].append((time.process_time() - p0, time.thread_time() - t0, time.perf_counter() - w0))
    return {c[0]: c[3] for c in configs}


def main() -> None:
    import pipeline as bench

    ap = bench.step_parser(__doc__, steps=7)
    args = ap.parse_args()

    from dtp.testing import run

    chosen = [(s, v) for s, v in bench.SCHEDULES if s in args.schedules]
    before = os.getloadavg()[0]
    res = run(_steps, chosen, args.m, args.rows, args.dim, args.layers, args.steps, world_size=2, timeout=1200)
    print(f"pp=2, {args.layers} layers tanh(x @ w), w {args.dim}x{args.dim}, {args.rows} rows per microbatch, "
          f"m={args.m}; ms per step, median of {args.steps}")
    print(f"{'schedule':<14}{'all r0':>9}{'r1':>9}{'sum':>9}{'main r0':>9}{'r1':>9}{'others r0':>11}{'r1':>8}"
          f"{'wall':>9}")
    for schedule, _ in chosen:
        def med(rank: int, j: int) -> float:
            return 1e3 * statistics.median(x[j] for x in res[rank][schedule])
        wall = 1e3 * statistics.median(max(a[2], b[2]) for a, b in zip(res[0][schedule], res[1][schedule]))
        print(f"{schedule:<14}{med(0, 0):9.1f}{med(1, 0):9.1f}{med(0, 0) + med(1, 0):9.1f}{med(0, 1):9.1f}"
              f"{med(1, 1):9.1f}{med(0, 0) - med(0, 1):11.1f}{med(1, 0) - med(1, 1):8.1f}{wall:9.1f}")
    print("all = process CPU (every thread); main = the rank's main thread; others = all - main (gloo's transport "
          "threads); wall = the slower rank's train_step")
    print(f"load average: {before:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
