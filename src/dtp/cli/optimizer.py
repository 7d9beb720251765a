"""``dtp train``'s optimizer: AdamW (:data:`dtp.core._rules.TRAIN_ADAMW`) on a warm-up + cosine
schedule, with ``--weight-decay`` on the weight matrices only; and what a run directory
recorded before either rule changed keeps (its ``dtp check`` retrains it as it ran)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from ..training import optim
from ..core._rules import TRAIN_ADAMW
from ..config import RunConfig
from .parser import PROG

__all__ = ["OptimizerRules", "train_optimizer", "lr_schedule", "weight_decay", "decay_changes"]

# Every parameter's decay before --weight-decay (the flag's default since: on the matrices only).
_OLDER_DECAY = 0.1


@dataclasses.dataclass(frozen=True)
class OptimizerRules:
    """Which of dtp's optimizer rules a run trained under: today's (the default), or those
    of a run directory an older dtp wrote, which its ``dtp check`` retrains as it ran. A
    :class:`dtp.RunConfig` has no field for them: no flag chooses them.

    >>> OptimizerRules.of_record({"lr": 0.003, "weight_decay": 0.1, "warmup_from_step_one": True}) == OptimizerRules()
    True
    >>> OptimizerRules.of_record({"lr": 0.003})
    OptimizerRules(warmup_from_step_one=False, decay_matrices_only=False)
    """

    warmup_from_step_one: bool = True  # False: the schedule from before (lr 0 at step 1, lr_schedule's note)
    decay_matrices_only: bool = True  # False: before --weight-decay, every parameter decayed by 0.1

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> "OptimizerRules":
        """The rules a run's record (``config.json``, a checkpoint's ``run``) says it trained
        under: a record without ``warmup_from_step_one`` or ``weight_decay`` predates it."""
        return cls(warmup_from_step_one=bool(record.get("warmup_from_step_one")),
                   decay_matrices_only="weight_decay" in record)


def train_optimizer(config: RunConfig, rules: OptimizerRules = OptimizerRules()) -> optim.GradientTransformation:
    """The optimizer of a run: AdamW on its ``lr``, ``warmup`` and ``steps``, with its
    ``weight_decay``, under ``rules`` (an older run directory's, for its ``dtp check``).

    >>> train_optimizer(RunConfig(lr=1e-3, warmup=2, steps=10)).schedule(1)
    0.001
    >>> train_optimizer(RunConfig(lr=1e-3, warmup=2, steps=10), OptimizerRules(warmup_from_step_one=False)).schedule(1)
    0.0005
    """
    if rules.warmup_from_step_one:
        schedule = lr_schedule(config.lr, config.warmup, config.steps)
    else:  # a run directory from before: the schedule it ran (lr 0 at step 1), so dtp check agrees
        schedule = optim.warmup_cosine(config.lr, config.warmup, config.steps)
    return optim.adamw(schedule, **TRAIN_ADAMW, **weight_decay(config.weight_decay, rules))


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


def weight_decay(rate: float, rules: OptimizerRules = OptimizerRules()) -> dict[str, Any]:
    """AdamW's weight decay of a run: ``rate`` (``--weight-decay``) on the matrices only
    (:func:`dtp.optim.decay_matrices`, Megatron's rule); a run directory from before the
    flag (``rules.decay_matrices_only`` false: its config has no ``weight_decay``) decayed
    every parameter by 0.1, and its ``dtp check`` retrains it so.

    >>> weight_decay(0.05)["weight_decay"], weight_decay(0.05, OptimizerRules(decay_matrices_only=False))
    (0.05, {'weight_decay': 0.1, 'mask': None})
    """
    if not rules.decay_matrices_only:
        return {"weight_decay": _OLDER_DECAY, "mask": None}
    return {"weight_decay": rate, "mask": optim.decay_matrices}


def decay_changes(out: Path, done: int) -> str | None:
    """A note for a resume of a run recorded before ``--weight-decay`` (:func:`weight_decay`):
    its steps decayed every parameter, the ones from here decay only the matrices."""
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or OptimizerRules.of_record(saved).decay_matrices_only:  # today's rule
        return None
    return (f"{PROG} train: note: steps 1-{done} decayed every parameter (dtp before --weight-decay); from step "
            f"{done + 1} only the weight matrices and embeddings are decayed (Megatron's rule), so dtp check cannot "
            f"check this run")
