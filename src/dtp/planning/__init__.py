"""``dtp.plan``: per-rank memory, bytes per mesh axis and collective, and the pipeline
bubble of a training configuration, predicted without allocating the model.

Parameter shapes come from the model's own code (``llama.block_shapes``, ``llama.param_axes``)
and their placements from the same :class:`~dtp.Layout` ``dtp train`` builds, resolved on
a stand-in mesh of names and sizes; bytes follow :mod:`dtp.comm`'s formulas; the bubble
is :func:`dtp.schedules.simulate`'s. A 70B model plans in milliseconds.

Modules: :mod:`.setup` (the configuration, per-rank shapes), :mod:`.traffic` (collectives),
:mod:`.memory` (rest, backward and update peaks), :mod:`.report` (the table, the verdict).

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

from dataclasses import dataclass
from typing import Any

from .. import schedules
from ..config import RunConfig
from ..layouts import Layout
from ..models import llama
from .memory import Memory, memory
from .report import check_fits, format_plan
from .setup import Setup, layout_for, leaves, stage_leaves
from .traffic import Traffic, summary, traffic

__all__ = ["Plan", "Setup", "plan", "check_fits", "format_plan", "Memory", "Traffic", "layout_for"]

GIB = 2**30


@dataclass(frozen=True)
class Plan:
    """What one step costs each rank (pipeline ranks listed; the others are alike).

    - `setup`: the configuration planned.
    - `params`: total parameter count of the model.
    - `memory`: one :class:`Memory` per pipeline rank.
    - `traffic`: per pipeline rank, the :class:`Traffic` rows of a step.
    - `bubble`: the schedule's idle fraction (0 without a pipeline), ``1 - busy / (p·makespan)``.
    """

    setup: Setup
    params: int
    memory: tuple[Memory, ...]
    traffic: tuple[tuple[Traffic, ...], ...]
    bubble: float

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

    def fits(self, memory_gb: float) -> bool:
        """Whether the fullest rank's peak fits ``memory_gb`` GiB."""
        return self.peak <= memory_gb * GIB

    def __str__(self) -> str:
        return format_plan(self)


def plan(model: str | llama.LlamaConfig | RunConfig = "tiny", *, batch: int = 8, seq: int = 64,
         layout: Layout | None = None, **parallel: Any) -> Plan:
    """Predict one training step of ``model`` per rank, allocating nothing.

    - `model`: a :class:`dtp.RunConfig` (the whole run: model, batch, mesh, strategies,
      its layout; nothing else may be given), or a preset name (``llama.CONFIGS``) or a
      :class:`~dtp.models.llama.LlamaConfig` described by the keywords below.
    - `batch`, `seq`: global batch in sequences, sequence length.
    - `layout`: the :class:`~dtp.Layout` to plan (``dtp train``'s is
      :func:`dtp.cli.flags.build_layout` of its flags); the plan reads how attention runs
      over cp from it. Default: :func:`layout_for` the keywords, the one ``dtp train``
      builds from the same flags.
    - `parallel`: the fields of :class:`Setup`: ``dp, tp, sp, async_tp, cp, cp_algo, cp_window,
      ulysses_degree, cp_head_chunks, pp, pp_schedule, virtual_stages, ep, zero, bucket_mb,
      reshard_after_forward, microbatches, recompute, dtype, precision`` (``dtp train``'s flags, same
      defaults), and ``backend`` (default ``"gloo"``; ``"nccl"`` / ``"hccl"`` reduce-scatter in
      place, without gloo's whole-bucket receive buffers; also beside a RunConfig). With a `layout`, the mesh sizes and ZeRO / pipeline fields must describe
      the same run; context options given here too must agree with its.

    Raises: ``ValueError`` for a configuration ``dtp train`` would refuse (batch not divisible,
    a schedule that cannot run, a dimension that does not split).

    >>> p = plan("llama3-70b", batch=128, seq=8192, dp=8, tp=8, sp=True, pp=4, microbatches=16,
    ...          zero=1, recompute="full", dtype="bfloat16")
    >>> round(p.bubble, 3), p.params // 10**9
    (0.158, 70)
    >>> p = plan(RunConfig(model="tiny", batch=8, seq=16, dp=2))
    >>> p.setup.model, p.bytes
    ('tiny', {'dp': {'all_reduce': 427276}})
    """
    if isinstance(model, RunConfig):
        machine = {k: parallel.pop(k) for k in ("backend",) if k in parallel}  # not the run's: where it runs
        if parallel or layout is not None:
            raise TypeError(f"dtp.plan: a RunConfig is the whole run (backend= may be given beside it); got "
                            f"keywords {sorted(parallel)} beside it")
        name = model.init_from or model.model  # the preset, or the Hugging Face directory
        model, batch, seq, layout, parallel = Setup.arguments_of(model)
        parallel.update(machine)
    else:
        name = model if isinstance(model, str) else "custom"
    cfg = llama.config(model) if isinstance(model, str) else model
    s = Setup(model=name, cfg=cfg, batch=batch, seq=seq, layout=layout, **parallel)
    per_stage = stage_leaves(s, leaves(s))
    mems = tuple(memory(s, lv, stage) for stage, lv in enumerate(per_stage))
    rows = tuple(tuple(traffic(s, lv, stage)) for stage, lv in enumerate(per_stage))
    bubble = 0.0
    if s.pp > 1:
        sched = schedules.make(s.pp_schedule, p=s.pp, v=s.virtual_stages, m=s.microbatches)
        bubble = schedules.simulate(sched, p=s.pp, v=s.virtual_stages, m=s.microbatches).bubble_fraction
    return Plan(s, llama.param_count(cfg), mems, rows, bubble)
