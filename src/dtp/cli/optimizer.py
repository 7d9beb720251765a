"""``dtp train``'s optimizer: AdamW (:data:`dtp._rules.TRAIN_ADAMW`) on a warm-up + cosine
schedule, with ``--weight-decay`` on the weight matrices only; and what a run directory
recorded before either rule changed keeps (its ``dtp check`` retrains it as it ran)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from .. import optim
from .._rules import TRAIN_ADAMW
from .parser import PROG

__all__ = ["train_optimizer", "lr_schedule", "weight_decay", "decay_changes"]


def train_optimizer(args: Mapping[str, Any]) -> optim.GradientTransformation:
    """The optimizer of a run (its config as a mapping: ``lr``, ``warmup``, ``steps``,
    ``weight_decay`` and the records of older rules).

    >>> train_optimizer({"lr": 1e-3, "warmup": 2, "steps": 10, "weight_decay": 0.1,
    ...                  "warmup_from_step_one": True}).schedule(1)
    0.001
    """
    if args.get("warmup_from_step_one"):
        schedule = lr_schedule(args["lr"], args["warmup"], args["steps"])
    else:  # a run directory from before: the schedule it ran (lr 0 at step 1), so dtp check agrees
        schedule = optim.warmup_cosine(args["lr"], args["warmup"], args["steps"])
    return optim.adamw(schedule, **TRAIN_ADAMW, **weight_decay(args))


def lr_schedule(peak: float, warmup: int, steps: int) -> optim.Schedule:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay, over ``steps``.

    The optimizer's count is 0 at step 1, where :func:`dtp.optim.warmup_cosine` gives lr 0
    after a warm-up: a step that moves nothing. So the schedule is read one count ahead
    over ``steps + 1``: step 1 runs at ``peak / warmup``, step ``warmup`` at the peak, and
    the last step still above the final lr. Without warm-up it is the cosine as it was.

    >>> [round(lr_schedule(1.0, 2, 4)(count), 3) for count in range(4)]
    [0.5, 1.0, 0.75, 0.25]
    """
    if warmup == 0:
        return optim.warmup_cosine(peak, 0, steps)
    ahead = optim.warmup_cosine(peak, warmup, steps + 1)
    return lambda count: ahead(count + 1)


def weight_decay(args: dict[str, Any]) -> dict[str, Any]:
    """AdamW's weight decay of a run: ``--weight-decay`` on the matrices only
    (:func:`dtp.optim.decay_matrices`, Megatron's rule); a run directory from before the
    flag, whose config has no ``weight_decay``, decayed every parameter by 0.1, and its
    ``dtp check`` retrains it so.

    >>> weight_decay({"weight_decay": 0.05})["weight_decay"], weight_decay({})
    (0.05, {'weight_decay': 0.1, 'mask': None})
    """
    if "weight_decay" not in args:
        return {"weight_decay": 0.1, "mask": None}
    return {"weight_decay": args["weight_decay"], "mask": optim.decay_matrices}


def decay_changes(out: Path, done: int) -> str | None:
    """A note for a resume of a run recorded before ``--weight-decay`` (:func:`weight_decay`):
    its steps decayed every parameter, the ones from here decay only the matrices."""
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if weight_decay(saved)["mask"] is not None:  # recorded under today's rule
        return None
    return (f"{PROG} train: note: steps 1-{done} decayed every parameter (dtp before --weight-decay); from step "
            f"{done + 1} only the weight matrices and embeddings are decayed (Megatron's rule), so dtp check cannot "
            f"check this run")
