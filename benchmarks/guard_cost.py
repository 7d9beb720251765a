"""The cross-rank consistency guard's cost in a steady-state step (dtp.guard).

    python benchmarks/guard_cost.py --config tiny --steps 40

Two gloo ranks, tp=2 + sequence parallel, the given Llama config. After warm-up, steps
alternate ``DTP_CHECKS=1`` (the default: the signature was agreed in the first step, so a
step pays a set lookup) and ``DTP_CHECKS=0`` (guard off), a barrier before each; prints
the median step time of each and their ratio. Both kinds run in one process on the same
state, so the machine's noise falls on both alike.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import warnings

import torch

import dtp
from dtp.models import llama
from dtp.testing import run


def _steps(config: str, steps: int, seq: int, batch: int) -> dict[str, float]:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # DTP_CHECKS=0 warns once; expected here
    cfg = llama.config(config)
    mesh = dtp.make_mesh(tp=2)
    layout = dtp.layouts.data() + dtp.layouts.megatron(sequence_parallel=True)
    state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.sgd(0.1), mesh=mesh, layout=layout,
                                  axes=llama.param_axes(cfg))
    tok = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    placed = dtp.shard_batch({"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}, state)
    loss = functools.partial(llama.loss, cfg=cfg)
    for _ in range(3):
        state, _ = dtp.train_step(loss, state, placed)
    times: dict[str, list[float]] = {"1": [], "0": []}
    for i in range(steps):
        mode = "1" if i % 2 else "0"
        os.environ["DTP_CHECKS"] = mode
        torch.distributed.barrier()
        t0 = time.perf_counter()
        state, _ = dtp.train_step(loss, state, placed)
        times[mode].append(time.perf_counter() - t0)
    os.environ.pop("DTP_CHECKS")
    dtp.wait(state)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", help="llama.config name")
    ap.add_argument("--steps", type=int, default=40, help="measured steps (half with the guard on)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    slower = max(run(_steps, args.config, args.steps, args.seq, args.batch, world_size=2),
                 key=lambda r: r["1"] + r["0"])
    print(f"{args.config}, tp=2 + SP on 2 gloo ranks, batch {args.batch}, seq {args.seq}; median of "
          f"{args.steps // 2} alternated steps each, slower rank")
    print(f"guard on {slower['1']:.1f} ms   off {slower['0']:.1f} ms   on/off {slower['1'] / slower['0']:.3f}")


if __name__ == "__main__":
    main()
