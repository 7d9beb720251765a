"""Torch's side of ``benchmarks/pipeline.py``: the same tanh-MLP chunk as an ``nn.Module`` for
``torch.distributed.pipelining``, a timer of its stages' compute, and the rotating step timer
both sides share (split out so the benchmark stays under 600 lines)."""

from __future__ import annotations

import time

import torch


def torch_chunk(weights: list[torch.Tensor]) -> torch.nn.Module:
    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.ParameterList([torch.nn.Parameter(w.detach().clone()) for w in weights])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for w in self.w:
                x = torch.tanh(x @ w)
            return x

    return Chunk()


class StageTimer:
    """Wraps ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``
    of torch's pipeline stages (their compute: torch's schedules wait for a stage's input
    before calling them) and ``schedules._batch_p2p``, where torch posts its sends and
    receives as actions of their own. ``busy`` is both, as dtp's, whose F/B post their
    sends inside the action: leaving torch's posting out made its busy column lighter
    exactly on the schedule with the most messages (interleaved: 3× the hand-overs)."""

    NAMES = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self):
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.cls = _PipelineStageBase
        self.saved = {name: getattr(self.cls, name) for name in self.NAMES}
        self.busy, self.depth = 0.0, 0
        timer = self

        def timed(fn):
            def wrapper(*args, **kwargs):
                if timer.depth:
                    return fn(*args, **kwargs)
                timer.depth += 1
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timer.depth -= 1
                    timer.busy += time.perf_counter() - t0
            return wrapper

        for name, fn in self.saved.items():
            setattr(self.cls, name, timed(fn))
        from torch.distributed.pipelining import schedules

        self.schedules, self.batch_p2p = schedules, schedules._batch_p2p
        schedules._batch_p2p = timed(self.batch_p2p)  # looked up by name at each call

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.cls, name, fn)
        self.schedules._batch_p2p = self.batch_p2p


def rotating_times(steps: dict, repeats: int) -> dict[str, list[float]]:
    """``_common.alternating_times`` for any number of steps: each round runs every step
    once, the order rotated every round, every rank starting each call together."""
    import torch.distributed as dist

    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return times
