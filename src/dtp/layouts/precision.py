"""The mixed-precision preset (Megatron's recipe) and its options.

``layouts.mixed_precision()`` keeps, beside low-precision (bf16/fp16) parameters that
forward and backward compute in, **master weights** in the accumulation dtype
(:func:`dtp.core._rules.accum_dtype`: fp32) that the optimizer updates, with its moments in
the same dtype; each microbatch's gradient is added into a gradient accumulator of that
dtype, and the accumulated gradient is reduced in it (Megatron forces
``--accumulate-allreduce-grads-in-fp32`` for bf16). After the update the parameters are
the master weights rounded. fp32/fp64 parameters are their own master weights: nothing
changes for them.

Under ``layouts.zero`` this is what ZeRO always does with its fp32 master slices and
fp32 gradient buckets; this preset brings the same to every other layout (replicated,
dp, tp, cp, pp). Without it, parameters are updated in their own dtype ("pure").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .core import Layout
from .option import Option

__all__ = ["PRECISIONS", "PrecisionOptions", "mixed_precision"]

Precision = Literal["pure", "mixed"]
# What dtp train's --precision picks from: parameters updated in their own dtype, or
# fp32 master weights and gradient accumulation beside them.
PRECISIONS: tuple[Precision, ...] = ("pure", "mixed")


@dataclass(frozen=True, kw_only=True)
class PrecisionOptions(Option):
    """Mixed precision as Megatron's: master weights, optimizer state and gradient
    accumulators in :func:`~dtp.core._rules.accum_dtype` of each parameter's dtype (fp32 for
    bf16/fp16), the parameters the master weights rounded. No choices yet: the one rule
    ZeRO's master slices follow too.

    >>> PrecisionOptions().name
    'mixed'
    """

    family = "precision"

    @property
    def name(self) -> Precision:
        """The :data:`PRECISIONS` entry these options stand for."""
        return "mixed"


def mixed_precision() -> Layout:
    """Megatron's mixed precision under any layout: fp32 master weights, optimizer state
    and gradient accumulation beside bf16 parameters (module docstring). Composes with
    every preset; under ``zero`` it changes nothing (ZeRO's slices already are).

    >>> from dtp.layouts import data
    >>> (data() + mixed_precision()).precision.name
    'mixed'
    """
    return Layout({}, {}, precision=PrecisionOptions(), name="mixed_precision")
