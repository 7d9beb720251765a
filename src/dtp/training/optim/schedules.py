"""Learning-rate schedules: a schedule is a function ``step -> lr`` (optax's ``schedules``).

The optimizers of :mod:`dtp.optim.transform` take a number or a schedule as ``lr``.
"""

from __future__ import annotations

import math
from typing import Callable, Union

__all__ = ["Schedule", "ScalarOrSchedule", "constant", "warmup_cosine"]

Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]


def constant(lr: float) -> Schedule:
    """A schedule that is ``lr`` at every step.

    >>> constant(3e-4)(1000)
    0.0003
    """
    value = float(lr)

    def schedule(step: int) -> float:
        return value

    return schedule


def warmup_cosine(peak_lr: float, warmup_steps: int, total_steps: int, final_lr: float = 0.0) -> Schedule:
    """Linear warm-up from 0 to ``peak_lr`` over ``warmup_steps``, then cosine decay to
    ``final_lr`` at ``total_steps``, constant ``final_lr`` after that.

    Like optax's ``warmup_cosine_decay_schedule`` (and Megatron's scheduler), step 0 has
    lr 0 when there is a warm-up; ``total_steps`` counts the warm-up steps too.

    >>> s = warmup_cosine(1.0, warmup_steps=10, total_steps=110, final_lr=0.1)
    >>> s(0), s(5), s(10), s(60), s(110), s(500)
    (0.0, 0.5, 1.0, 0.55, 0.1, 0.1)
    """
    if warmup_steps < 0 or total_steps < warmup_steps:
        raise ValueError(
            f"warmup_cosine: need 0 <= warmup_steps <= total_steps, got warmup_steps={warmup_steps}, "
            f"total_steps={total_steps}"
        )
    peak, final = float(peak_lr), float(final_lr)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return peak * step / warmup_steps
        if step >= total_steps:
            return final
        progress = (step - warmup_steps) / (total_steps - warmup_steps)
        return final + 0.5 * (peak - final) * (1.0 + math.cos(math.pi * progress))

    return schedule


def _as_schedule(lr: ScalarOrSchedule, name: str) -> Schedule:
    if callable(lr):
        return lr
    # not (lr >= 0): NaN passes every comparison (sgd(nan) turned every weight NaN at step one)
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not 0 <= lr < math.inf:
        raise ValueError(f"{name}: lr must be a finite number >= 0 or a schedule step -> lr, got {lr!r}")
    return constant(lr)
