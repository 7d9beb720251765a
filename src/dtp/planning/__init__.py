"""``dtp.plan``: per-rank memory, bytes per mesh axis and collective, and the pipeline
bubble of a training configuration, predicted without allocating the model.

Parameter shapes come from the model's own code (``llama.block_shapes``, ``llama.param_axes``)
and their placements from the same :class:`~dtp.Layout` ``dtp train`` builds, resolved on
a stand-in mesh of names and sizes; bytes follow :mod:`dtp.comm`'s formulas; the bubble
is :func:`dtp.schedules.simulate`'s. A 70B model plans in milliseconds.

Modules: :mod:`.target` (what is planned: a :class:`dtp.RunConfig`, its model, backend and
layout; per-rank shapes), :mod:`.traffic` (collectives), :mod:`.memory` (rest, backward and
update peaks), :mod:`.report` (the table, the verdict).

>>> p = plan("tiny", batch=8, seq=16, dp=2)
>>> p.bytes
{'dp': {'all_reduce': 427276}}
>>> p.fits(1.0)
True

Context parallel follows the layout's algorithm; the comm log names the sub-axes its
rings and all-to-alls run on (here USP: Ulysses over pairs, a ring over the rest):

>>> sorted(plan("tiny", batch=8, seq=16, cp=4, cp_algo="hybrid", ulysses_degree=2).bytes)
['cp', 'cp_ring', 'cp_uly']
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from ..config import RunConfig
from ..layouts import Layout
from ..models import llama
from .memory import Memory, memory
from .report import check_fits, format_plan
from .target import Target, leaves, schedule, stage_leaves
from .time import StepTime, step_time
from .traffic import Traffic, summary, traffic

if TYPE_CHECKING:
    from .hardware import Hardware

__all__ = ["Plan", "Target", "plan", "check_fits", "format_plan", "Memory", "Traffic", "StepTime"]

GIB = 2**30

# Names this package had, and what replaced them: said instead of a bare AttributeError
# (no alias: a second way to describe a run is what they were).
_REMOVED = {
    "Setup": "dtp.planning.Setup was removed: plan a dtp.RunConfig (dtp.plan(RunConfig(...), backend=...)); a "
             "plan's target is Plan.target (a dtp.planning.Target: the run, its model, backend and layout)",
    "layout_for": "dtp.planning.layout_for was removed: a run's layout is its RunConfig's (RunConfig(...).layout()); "
                  "the layout a plan planned is Plan.target.layout",
    "setup": "dtp.planning.setup was renamed dtp.planning.target (Setup is gone: plan a dtp.RunConfig)",
}


# Hidden from type checkers, which would otherwise take any name as found here.
if not TYPE_CHECKING:
    def __getattr__(name: str) -> NoReturn:
        """What replaced a removed name (module ``__getattr__``: only names not found).

        >>> dtp.planning.Setup
        Traceback (most recent call last):
        ...
        AttributeError: dtp.planning.Setup was removed: plan a dtp.RunConfig (dtp.plan(RunConfig(...), ...
        """
        if name in _REMOVED:
            raise AttributeError(_REMOVED[name])
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Plan:
    """What one step costs each rank (pipeline ranks listed; the others are alike).

    - `target`: what was planned (:class:`Target`: the run, the model, the backend, the layout).
    - `params`: total parameter count of the model.
    - `memory`: one :class:`Memory` per pipeline rank.
    - `traffic`: per pipeline rank, the :class:`Traffic` rows of a step.
    - `bubble`: the schedule's idle fraction (0 without a pipeline), ``1 - busy / (p·makespan)``.
    """

    target: Target
    params: int
    memory: tuple[Memory, ...]
    traffic: tuple[tuple[Traffic, ...], ...]
    bubble: float

    @property
    def run(self) -> RunConfig:
        """The run planned (``target.run``).

        >>> plan("tiny", batch=8, seq=16, pp=2).run.microbatches   # RunConfig's default under pp 2
        2
        """
        return self.target.run

    @property
    def worst(self) -> Memory:
        """The pipeline rank with the highest peak."""
        return max(self.memory, key=lambda m: m.peak)

    @property
    def peak(self) -> int:
        """Peak bytes of the fullest rank."""
        return self.worst.peak

    @property
    def bytes(self) -> dict[str, dict[str, int]]:
        """``{axis: {collective: bytes}}`` one step sends from the fullest rank (as
        :meth:`dtp.CommLog.summary` of that rank's step)."""
        return summary(list(self.traffic[self.worst.stage]))

    def rank_bytes(self, pipeline_rank: int = 0) -> dict[str, dict[str, int]]:
        """``{axis: {collective: bytes}}`` one step sends from ``pipeline_rank`` (default 0:
        global rank 0's, whose step metrics ``dtp train`` logs). Pipeline ranks differ by
        the stages they hold: under zbv / dualpipev rank 0 holds the embedding and the
        head and no block (:func:`dtp.schedules.global_stage`).

        >>> p = plan("tiny", batch=8, seq=32, pp=2, tp=2, sp=True, pp_schedule="zbv", microbatches=4)
        >>> p.rank_bytes(0)["tp"]["all_gather"], p.rank_bytes(1)["tp"]["all_gather"], p.worst.stage
        (65536, 262144, 1)
        """
        return summary(list(self.traffic[pipeline_rank]))

    def time(self, hardware: "Hardware | str") -> StepTime:
        """The step's predicted time on ``hardware`` (a :class:`~.hardware.Hardware`, or a
        preset name or TOML path :func:`.hardware.hardware` reads): :mod:`.time`'s model.

        >>> t = plan("llama3-8b", batch=64, seq=8192, dp=8, tp=8, sp=True, zero=1, recompute="full",
        ...          dtype="bfloat16", backend="nccl").time("h100-sxm")
        >>> t.total > t.compute > 0, 0 < t.mfu < 1, sorted(t.exposed)
        (True, True, ['dp', 'tp'])
        """
        if isinstance(hardware, str):
            from .hardware import hardware as read_hardware  # torch-free, as this module

            hardware = read_hardware(hardware)
        return step_time(self.target, stage_leaves(self.target, leaves(self.target)), self.traffic, hardware)

    def fits(self, memory_gb: float) -> bool:
        """Whether the fullest rank's peak fits ``memory_gb`` GiB."""
        return self.peak <= memory_gb * GIB

    def __str__(self) -> str:
        return format_plan(self)


def plan(model: str | llama.LlamaConfig | RunConfig | Target = "tiny", *, batch: int | None = None,
         seq: int | None = None, layout: Layout | None = None, **parallel: Any) -> Plan:
    """Predict one training step of ``model`` per rank, allocating nothing.

    - `model`: a :class:`dtp.RunConfig` (the whole run: model, batch, mesh, strategies,
      its layout; only ``backend`` may be given beside it), a :class:`Target` (planned as
      it is, nothing beside it), or a preset name (``llama.CONFIGS``) or a
      :class:`~dtp.models.llama.LlamaConfig` run as the keywords below describe.
    - `batch`, `seq`: global batch in sequences (default 8), sequence length (default 64).
    - `layout`: the :class:`~dtp.Layout` to plan; the plan reads how attention runs over cp
      from it. Default: the run's (:meth:`dtp.RunConfig.layout`, the one ``dtp train``
      builds from the same flags). With a `layout`, the mesh sizes and ZeRO / pipeline
      fields must describe the same run; context options given too must agree with its.
    - `parallel`: the fields of a :class:`dtp.RunConfig` (``dp, tp, sp, cp, cp_algo, pp,
      pp_schedule, ep, zero, microbatches, recompute, dtype, precision, ...``: ``dtp train``'s
      flags, same defaults, same checks; MoE fields such as ``num_experts`` set the model's),
      and ``backend`` (default ``"gloo"``; ``"nccl"`` / ``"hccl"`` reduce-scatter in
      place, without gloo's whole-bucket receive buffers; also beside a RunConfig).

    Raises: ``ValueError`` for a configuration ``dtp train`` would refuse (batch not divisible,
    a schedule that cannot run, a dimension that does not split).

    >>> p = plan("llama3-70b", batch=128, seq=8192, dp=8, tp=8, sp=True, pp=4, microbatches=16,
    ...          zero=1, recompute="full", dtype="bfloat16")
    >>> round(p.bubble, 3), p.params // 10**9
    (0.158, 70)
    >>> p = plan(RunConfig(model="tiny", batch=8, seq=16, dp=2))
    >>> p.target.name, p.bytes
    ('tiny', {'dp': {'all_reduce': 427276}})
    >>> plan("tiny", batch=6, dp=4)
    Traceback (most recent call last):
    ...
    ValueError: dtp.plan: batch 6 must be divisible by dp × microbatches = 4 × 1: every rank gets equal microbatches
    """
    if isinstance(model, (RunConfig, Target)):
        # A RunConfig is the whole run, a Target the whole plan; a RunConfig's machine is not its.
        allowed = ("backend",) if isinstance(model, RunConfig) else ()
        extra = sorted([k for k in parallel if k not in allowed] +
                       [k for k, v in (("batch", batch), ("seq", seq), ("layout", layout)) if v is not None])
        if extra:
            what = "a RunConfig is the whole run (backend= may be given beside it)" if allowed else \
                "a Target is the whole plan"
            raise TypeError(f"dtp.plan: {what}; got keywords {extra} beside it")
        s = model if isinstance(model, Target) else Target.of(model, **parallel)
    else:
        backend = parallel.pop("backend", "gloo")  # not the run's: where it runs
        fields = {"model": model} if isinstance(model, str) else {}  # a LlamaConfig: RunConfig's default preset
        try:
            given = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None}  # else RunConfig's defaults
            run = RunConfig(**fields, **given, **parallel)
        except ValueError as e:  # the run's own checks, said as the plan's
            raise ValueError(f"dtp.plan: {str(e).removeprefix('RunConfig: ')}") from None
        if isinstance(model, str):
            s = Target.of(run, backend=backend, layout=layout)
        else:  # the model given, with the MoE fields given beside it on top (as a preset takes them)
            cfg = dataclasses.replace(model, **run.model_overrides()) if run.model_overrides() else model
            s = Target.of(run, cfg=cfg, backend=backend, layout=layout, name="custom")
    per_stage = stage_leaves(s, leaves(s))
    mems = tuple(memory(s, lv, stage) for stage, lv in enumerate(per_stage))
    rows = tuple(tuple(traffic(s, lv, stage)) for stage, lv in enumerate(per_stage))
    bubble = schedule(s)[1].bubble_fraction if s.run.pp > 1 else 0.0
    return Plan(s, llama.param_count(s.cfg), mems, rows, bubble)
