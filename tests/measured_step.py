"""One rank's measured step for the tests that hold ``dtp.plan`` against reality: the
state ``dtp train`` builds for a :class:`dtp.RunConfig`, a warm-up step (ZeRO plans
its buckets there), then a second step whose comm log is returned."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

import dtp
from dtp.models import llama


def second_step_comm(kw: dict, model: str = "tiny", batch: int = 8, seq: int = 16,
                     step_context: Callable[[int], ContextManager] = lambda step: contextlib.nullcontext(),
                     layout: dtp.Layout | None = None, **overrides) -> dict:
    """The comm log summary of the second of two steps of ``model`` (``llama.config``
    ``overrides`` applied) under the RunConfig fields ``kw`` (and ``layout``, default the
    run's); ``step_context(step)`` wraps each step (the plan's memory test names the steps
    for the profiler). The state dies on return, inside whatever context the caller holds."""
    cfg = llama.config(model, **overrides)
    run = dtp.RunConfig(model=model, batch=batch, seq=seq, **kw)
    tok = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    data = {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=getattr(torch, run.dtype)),
                                  dtp.optim.adamw(1e-3, weight_decay=0.1), mesh=dtp.make_mesh(**run.mesh_axes()),
                                  layout=run.layout() if layout is None else layout, axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    loss_fn = llama.sequential(cfg)  # what dtp train runs
    recompute = None if run.recompute == "none" else run.recompute
    for step in range(2):
        with step_context(step), dtp.comm_log() as log:
            state, _out = dtp.train_step(loss_fn, state, dtp.shard_batch(data, state), clip_norm=1.0,
                                         microbatches=run.microbatches, recompute=recompute)
            dtp.wait(state)
    return log.summary()
