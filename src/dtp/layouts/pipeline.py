"""The pipeline preset: stages over a ``pp`` mesh axis, a schedule, virtual stages.

``layouts.pipeline(schedule="1f1b", virtual_stages=1)`` splits a model given as a
sequence of layers (:class:`dtp.Sequential`; ``llama.sequential(cfg)`` is the reference
model's: embedding | blocks | final norm + head + loss) into ``pp × virtual_stages``
chunks of consecutive layers. Chunk ``c`` of rank ``r`` is global stage ``c·pp + r``
(Megatron's round-robin for the interleaved schedule); under ``zbv`` / ``dualpipev``
rank ``r`` holds stages ``r`` and ``2·pp−1−r`` (a V: the first and the last stage on
rank 0; ``virtual_stages`` is 2), the schedule's own map (:mod:`dtp.schedules`). Every layer counts as one unless
``layer_split`` gives the number of layers of each stage (uneven splits; e.g. fewer blocks
on the stages that also hold the embedding or the head). The microbatch count is
``train_step``'s ``microbatches`` — one place only. Schedules are data
(:mod:`dtp.schedules`): the action list each rank runs, which tests and
``dtp train --print-schedule`` print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the CLI checks layouts before torch loads (core.py)
    from torch.distributed.device_mesh import DeviceMesh

from .. import schedules
from ..core._rules import is_positive_int
from ..core.mesh.shape import axis_names
from .core import Layout
from .option import Option

__all__ = ["PipelineOptions", "pipeline", "assign"]


@dataclass(frozen=True, kw_only=True)
class PipelineOptions(Option):
    """What the pipeline does over ``axis``; checked when built.

    >>> PipelineOptions(schedule="interleaved", virtual_stages=2).virtual_stages
    2
    """

    family = "pipeline"
    requires_axes = True

    schedule: str = "1f1b"
    virtual_stages: int = 1
    axis: str = "pp"
    layer_split: tuple[int, ...] | None = None  # layers per global stage; None: as even as possible

    def __post_init__(self) -> None:
        if self.schedule not in schedules.SCHEDULES:
            raise ValueError(f"layouts.pipeline: schedule must be one of {schedules.SCHEDULES}, got {self.schedule!r}")
        if not is_positive_int(self.virtual_stages):
            raise ValueError(f"layouts.pipeline: virtual_stages must be an int >= 1, got {self.virtual_stages!r}")
        # A V schedule holds two chunks per rank: the default 1 reads as its 2.
        object.__setattr__(self, "virtual_stages", schedules.chunks_per_rank(self.schedule, self.virtual_stages))
        if self.schedule in schedules.V_SCHEDULES and self.virtual_stages != 2:
            raise ValueError(f"layouts.pipeline: schedule {self.schedule!r} holds two chunks per rank (stages r and "
                             f"2p-1-r), got virtual_stages={self.virtual_stages}; leave it at 1 or 2")
        if self.virtual_stages > 1 and self.schedule not in ("interleaved", *schedules.V_SCHEDULES):
            raise ValueError(f"layouts.pipeline: virtual_stages={self.virtual_stages} needs schedule='interleaved' "
                             f"(got {self.schedule!r}); the other schedules run one chunk per rank")
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"layouts.pipeline: axis must be a mesh axis name, got {self.axis!r}")
        if self.layer_split is not None:
            split = tuple(self.layer_split)
            if not split or not all(is_positive_int(n) for n in split):
                raise ValueError(f"layouts.pipeline: layer_split must be layer counts >= 1 per stage, got "
                                 f"{self.layer_split!r}")
            object.__setattr__(self, "layer_split", split)

    def degree(self, mesh: DeviceMesh) -> int:
        """The number of pipeline ranks on ``mesh`` (1 without the axis)."""
        names = axis_names(mesh)
        return mesh.size(names.index(self.axis)) if self.axis in names else 1

    def active(self, mesh: DeviceMesh) -> bool:
        """Whether the pipeline applies on ``mesh``: the axis there with size > 1."""
        return self.degree(mesh) > 1

    def check(self, *, n_layers: int, mesh: DeviceMesh, microbatches: int, what: str = "train_step",
              layers_said: str | None = None) -> None:
        """``ValueError`` (every rank alike, before any collective) when the model's layers
        (named ``layers_said`` where given: :func:`assign`) or the microbatches do not fit
        this pipeline on ``mesh``."""
        p, v = self.degree(mesh), self.virtual_stages
        try:
            schedules.check(self.schedule, p=p, v=v, m=microbatches)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        assign(n_layers, p, v, self.layer_split, what=what, layers_said=layers_said)

    def check_composition(self, layout: Layout, mesh: DeviceMesh, *, shared: Sequence[str] = (),
                          what: str = "train_step", names: Mapping[str, str] | None = None) -> None:
        """``ValueError`` for what this pipeline does not compose with on ``mesh``: the one
        place these rules live (``train_step`` asks with the model it runs, ``dtp train``'s
        preflight with the model's config, before any rank starts).

        - `shared`: parameters the first and the last stage both read (tied embeddings).
        - `names`: what the messages call the options (:data:`API_NAMES`' keys; ``dtp train``
          passes its flags).

        >>> from dtp import layouts
        >>> from dtp.core.mesh.shape import MeshShape
        >>> opts = layouts.pipeline().pipeline
        >>> opts.check_composition(layouts.zero(3), MeshShape({"pp": 2, "dp": 2}), what="--pp 2")
        Traceback (most recent call last):
        ...
        ValueError: --pp 2: layouts.zero(3) with layouts.pipeline is not supported: ...
        """
        if not self.active(mesh):
            return
        z = layout.zero
        if z is None or not z.active(mesh):
            return
        # ZeRO counts each bucket's gradients per microbatch's backward to know when to post
        # its reduce-scatter or free it; a schedule interleaves microbatches' forwards and
        # backwards, so only the variants that wait for the whole backward compose.
        n = {**API_NAMES, **(names or {})}
        if z.stage == 3:
            raise ValueError(f"{what}: {n['zero3']} with {n['pipeline']} is not supported: stage 3 frees and "
                             "re-gathers buckets by counting reads per microbatch, which a schedule interleaves; "
                             f"use {n['zero12']} (optimizer state and gradients sharded over dp)")
        if z.overlap_grad_reduce:
            raise ValueError(f"{what}: {n['overlap_grad_reduce']} with {n['pipeline']} is not "
                             "supported: a bucket's last gradient is known only when the schedule's last backward "
                             f"ran; drop {n['drop_overlap_grad_reduce']} (the reduce-scatters follow the schedule)")
        if shared:
            raise ValueError(f"{what}: {n['zero']} with {n['pipeline']} and tied embeddings is not supported "
                             f"(the first and last layer both read {sorted(shared)}); untie them or drop "
                             f"{n['zero']}")


#: How :meth:`PipelineOptions.check_composition` names the options it refuses together.
API_NAMES = {"zero3": "layouts.zero(3)", "zero12": "stage 1 or 2", "zero": "layouts.zero",
             "overlap_grad_reduce": "layouts.zero(overlap_grad_reduce=True)",
             "drop_overlap_grad_reduce": "overlap_grad_reduce", "pipeline": "layouts.pipeline"}
#: The same in a run's flags (``dtp train``'s preflight and :func:`dtp.plan` of a RunConfig).
FLAG_NAMES = {"zero3": "--zero 3", "zero12": "--zero 1 or 2", "zero": "--zero",
              "overlap_grad_reduce": "--overlap-grad-reduce", "drop_overlap_grad_reduce": "--overlap-grad-reduce",
              "pipeline": "a pipeline"}


def assign(n_layers: int, p: int, v: int, split: Sequence[int] | None = None, *, what: str = "pipeline",
           layers_said: str | None = None) -> tuple[tuple[int, int], ...]:
    """``(first, stop)`` layer range of each global stage ``0 … p·v−1``: ``split`` layers
    each, or as even as possible (the earlier stages one more). ``ValueError`` for fewer
    layers than stages; ``layers_said`` is how the message names them (``dtp train``: the
    model flag and what its layers are).

    >>> assign(6, 2, 1)
    ((0, 3), (3, 6))
    >>> assign(7, 2, 2)                      # 4 stages: ranks 0, 1, 0, 1 (a V: 0, 1, 1, 0)
    ((0, 2), (2, 4), (4, 6), (6, 7))
    >>> assign(4, 2, 1, (1, 3))
    ((0, 1), (1, 4))
    """
    stages = p * v
    if split is not None:
        if len(split) != stages or sum(split) != n_layers:
            raise ValueError(f"{what}: layer_split {tuple(split)} must give {stages} stages (pp={p} × "
                             f"virtual_stages={v}) whose layers sum to the model's {n_layers}")
        counts = list(split)
    else:
        if n_layers < stages and layers_said is not None:
            raise ValueError(f"{what}: {stages} pipeline stages, but {layers_said} and every stage needs one; use "
                             f"fewer stages")
        if n_layers < stages:
            raise ValueError(f"{what}: the model has {n_layers} layers, fewer than pp={p} × virtual_stages={v} "
                             f"= {stages} stages; use fewer stages (every stage needs a layer)")
        base, extra = divmod(n_layers, stages)
        counts = [base + (s < extra) for s in range(stages)]
    out, first = [], 0
    for n in counts:
        out.append((first, first + n))
        first += n
    return tuple(out)


def pipeline(schedule: str = "1f1b", *, virtual_stages: int = 1, axis: str = "pp",
             layer_split: Sequence[int] | None = None) -> Layout:
    """Pipeline parallel over ``axis`` (see the module docstring).

    >>> pipeline("interleaved", virtual_stages=2).pipeline.schedule
    'interleaved'
    """
    opts = PipelineOptions(schedule=schedule, virtual_stages=virtual_stages, axis=axis,
                           layer_split=tuple(layer_split) if layer_split is not None else None)
    return Layout(pipeline=opts, name=f"pipeline({schedule!r}" + (f", v={virtual_stages})" if virtual_stages > 1 else ")"))
