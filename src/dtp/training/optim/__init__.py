"""Functional optimizers (optax style) over pytrees of Tensors or DTensors.

An optimizer is a :class:`GradientTransformation`: a pair of pure functions

* ``init(params) -> state``
* ``update(grads, state, params) -> (updates, new_state)``

and training applies ``params = apply_updates(params, updates)`` — or, in one pass,
``params, state = step(opt, grads, state, params)``, which ``train_step`` uses: sgd and
adamw then write the new parameter with their last op, as torch.optim does (bit for bit
its single-tensor step), instead of an update tensor that a second pass adds. Nothing is
mutated: each function returns new tensors (a step is a pure function of its inputs).

Trees are anything :mod:`optree` flattens (dicts, lists, tuples, NamedTuples …) with
``torch.Tensor`` or ``DTensor`` leaves. Each DTensor leaf is updated shard by shard on
its local tensor, and the result (and the optimizer state) is laid out exactly like
the parameter, so an update never communicates. The one reduction, the gradient norm
in :func:`global_norm`, goes through :func:`dtp.reshard` and is therefore recorded in
:func:`dtp.comm_log`.

>>> params = {"w": torch.ones(3)}
>>> opt = chain(clip(1.0), adamw(warmup_cosine(1e-3, 10, 100), weight_decay=0.1, mask=decay_matrices))
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": torch.full((3,), 2.0)}, state, params)
>>> params = apply_updates(params, updates)

Step numbering follows optax: the k-th call of ``update`` (k = 0, 1, …) uses the
learning rate ``lr(k)``; Adam's bias correction uses ``k + 1`` like ``torch.optim``.
Updates are computed without autograd (under ``torch.no_grad``): these optimizers are
not meant to be differentiated through.

The package, one job a module: :mod:`~dtp.optim.transform` (the interface, sgd, adamw,
clip, chain, applying updates), :mod:`~dtp.optim.schedules` (learning rates),
:mod:`~dtp.optim.norm` (the global norm and clipping by it) and
:mod:`~dtp.optim.state_trees` (an optimizer state's parameter-shaped subtrees: checkpoint
names, ZeRO's per-bucket parts). This module re-exports their public names.
"""

from __future__ import annotations

from .norm import clip_by_global_norm, global_norm, measured_by
from .schedules import ScalarOrSchedule, Schedule, constant, warmup_cosine
from .state_trees import map_param_trees, state_join, state_part
from .transform import (AdamWState, GradientTransformation, SGDState, adamw, apply_updates, chain, clip,
                        decay_matrices, sgd, step)

__all__ = ["state_part", "state_join", "GradientTransformation", "Schedule", "ScalarOrSchedule", "SGDState",
           "AdamWState", "sgd", "adamw", "clip", "chain", "constant", "warmup_cosine", "apply_updates", "step",
           "global_norm", "clip_by_global_norm", "map_param_trees", "measured_by", "decay_matrices"]
