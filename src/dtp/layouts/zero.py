"""The ZeRO preset (Megatron's distributed optimizer) and its options.

Stages over the data-parallel ``axis`` (Ψ: the parameter bytes of a rank's model shard):

* ``stage=1``: optimizer state and master weights (fp32 for bf16/fp16 parameters) live
  only on their owner: 1/dp of them per rank. Gradients are reduce-scattered per bucket,
  each rank updates its slice, parameters are all-gathered — 2Ψ of traffic.
* ``stage=2``: as 1, and a bucket's full gradient buffer is released as soon as its
  reduce-scatter is done, so only gradient slices outlive backward.
* ``stage=3``: parameters too rest as slices; forward all-gathers a bucket right before
  its first use (always prefetching the next; ``overlap_param_gather`` posts the first
  ones in the step before, during its update), backward gathers it again for the saved
  activations that need it, then frees it — 3Ψ of traffic. ``reshard_after_forward=False``
  (FSDP2's option of that name) keeps every bucket forward gathered until backward is
  done with it: parameters still rest as slices between steps, but a step holds them
  whole from forward to backward, and traffic is 2Ψ. ``prefetch`` is how many buckets
  are gathered ahead of the one in use: more keeps a slow link busy (the FIFO link of
  ``benchmarks/zero_overlap.py`` needs 2-3) at the cost of that many more whole buckets
  in memory.

The first step reads the parameters as ``TrainState.create`` laid them out (whole on
every dp rank) and records their use order; buckets, master slices and optimizer state
exist from the end of that step on (``state.opt_state`` is ``None`` before; a state from
``TrainState.from_hf`` has them from the start, each rank reading only its slices). Buckets
follow the parameters' real use order, recorded in the first step's forward (MindSpeed's
``--reset-bucket-group-order``), not the order they were created in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Literal, Mapping, Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the CLI checks layouts before torch loads (core.py)
    from torch.distributed.device_mesh import DeviceMesh

from ..core._rules import is_positive_int
from ..core.mesh.shape import axis_names
from .core import Layout
from .option import Option
from .megatron import data

__all__ = ["ZERO_STAGES", "STAGE_RULES", "ZeroOptions", "misplaced_options", "zero", "bucket_groups",
           "padded_numel"]

ZeroStage = Literal[0, 1, 2, 3]
ZERO_STAGES: tuple[ZeroStage, ...] = (0, 1, 2, 3)


# Which options only some stages use, and why; stated once (ZeroOptions and the CLI phrase it).
STAGE_RULES: tuple[tuple[str, tuple[int, ...], str], ...] = (
    ("overlap_grad_reduce", (1, 2, 3), "it overlaps ZeRO's collectives"),
    ("overlap_param_gather", (1, 2, 3), "it overlaps ZeRO's collectives"),
    ("prefetch", (3,), "stages 1/2 gather every bucket after the update"),
    ("reshard_after_forward", (3,), "stages 1/2 keep parameters whole anyway"),
)


@dataclass(frozen=True, kw_only=True)
class ZeroOptions(Option):
    """What ``dtp.zero`` does over ``axis``; checked when built, canonical afterwards
    (``bucket_mb`` a float, the flags bools).

    >>> ZeroOptions(stage=3, prefetch=2).bucket_mb
    40.0
    >>> ZeroOptions(stage=1, prefetch=2)
    Traceback (most recent call last):
    ...
    ValueError: layouts.zero: prefetch is a stage-3 option (stages 1/2 gather every bucket after the update), got stage=1
    """

    family = "zero"
    requires_axes = True

    stage: ZeroStage = 1  # 1: optimizer state sharded; 2: + gradients; 3: + parameters; 0: plain data parallel
    bucket_mb: float = 40.0  # flat bucket size in MiB, padded so each splits evenly over axis
    overlap_grad_reduce: bool = False  # reduce-scatter each bucket in backward once its last gradient is in
    overlap_param_gather: bool = False  # leave the update's all-gathers in flight until next forward's first use
    reshard_after_forward: bool = True  # stage 3: free gathered buckets after forward, re-gather in backward
    prefetch: int = 1  # stage 3: buckets gathered ahead of the one in use
    axis: str = "dp"  # the mesh axis the optimizer state (and more, by stage) is split over

    def __post_init__(self) -> None:
        if self.stage not in ZERO_STAGES or isinstance(self.stage, bool):
            stages = ", ".join(map(str, ZERO_STAGES[:-1])) + f" or {ZERO_STAGES[-1]}"
            raise ValueError(f"layouts.zero: stage must be {stages}, got {self.stage!r}")
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"layouts.zero: axis must be a mesh axis name (a str), got {self.axis!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"layouts.zero: bucket_mb must be > 0, got {self.bucket_mb!r}")
        if not is_positive_int(self.prefetch):
            raise ValueError(f"layouts.zero: prefetch must be an int >= 1, got {self.prefetch!r}")
        for option, stages, why in self.misplaced():
            if stages == (3,):
                raise ValueError(f"layouts.zero: {option}{'=False' if option == 'reshard_after_forward' else ''} "
                                 f"is a stage-3 option ({why}), got stage={self.stage}")
            raise ValueError("layouts.zero: overlap_grad_reduce / overlap_param_gather overlap ZeRO's collectives; "
                             "they need stage 1, 2 or 3")
        # Canonical once, so equal options compare equal (8 vs 8.0, 1 vs True); frozen, hence object.__setattr__.
        object.__setattr__(self, "bucket_mb", float(self.bucket_mb))
        for flag in ("overlap_grad_reduce", "overlap_param_gather", "reshard_after_forward"):
            object.__setattr__(self, flag, bool(getattr(self, flag)))

    def misplaced(self) -> list[tuple[str, tuple[int, ...], str]]:
        """:func:`misplaced_options` of these options."""
        return misplaced_options(self.stage, **{option: getattr(self, option) for option, _, _ in STAGE_RULES})

    def active(self, mesh: DeviceMesh) -> bool:
        """Whether ZeRO applies on ``mesh``: a stage >= 1 and ``axis`` on the mesh with size > 1."""
        names = axis_names(mesh)
        return self.stage > 0 and self.axis in names and mesh.size(names.index(self.axis)) > 1

    def check_sizes(self, sizes: Mapping[str, int], mesh: DeviceMesh, layout: Layout, *, what: str,
                    names: Mapping[str, str] | None) -> None:
        self.check(sizes, mesh, what=what)

    def check(self, sizes: Mapping[str, int], mesh: DeviceMesh, *, what: str = "model") -> None:
        """Nothing about ZeRO depends on the model's sizes: buckets are padded to split
        evenly over ``axis``. (Parameters already split over ``axis`` are refused by
        ``dtp.zero`` when it builds its plan.)"""


def zero(stage: ZeroStage = ZeroOptions.stage, **options: object) -> Layout:
    """Data parallel with ZeRO over ``axis`` — Megatron's distributed optimizer.

    Parameters (each rank's tensor/sequence-parallel shard of them) are packed into
    contiguous flat buckets of about ``bucket_mb`` MiB; rank r owns slice r of every
    bucket. What each stage shards and moves: this module's docstring.

    * ``overlap_grad_reduce``: start each bucket's reduce-scatter during backward as soon
      as its last gradient is in (on the last microbatch only);
    * ``overlap_param_gather``: leave the all-gathers of the update in flight in the
      returned state; the next forward waits on each bucket right before its first use
      (stage 3: the update gathers the next forward's first ``prefetch`` + 1 buckets,
      which the state then holds whole until that forward takes them);
    * ``reshard_after_forward``, ``prefetch``: stage-3 options; ``axis``: the mesh axis.

    Defaults: :class:`ZeroOptions`. ``stage=0`` is :func:`data` over ``axis``. Raises
    ``ValueError`` for an option outside its range or used with the wrong stage.

    >>> from dtp.layouts import data
    >>> layout = data() + zero(2, overlap_grad_reduce=True, overlap_param_gather=True)
    >>> layout.zero.stage
    2
    """
    opts = ZeroOptions(stage=stage, **options)
    if opts.stage == 0:  # plain data parallel: gradients all-reduced, everything replicated
        return data(opts.axis)
    return Layout({}, {"batch": (opts.axis,)}, zero=opts, name=f"zero({opts.stage})")


_DEFAULTS = {f: getattr(ZeroOptions, f) for f in ("overlap_grad_reduce", "overlap_param_gather", "prefetch",
                                                   "reshard_after_forward")}


def misplaced_options(stage: int, **values: object) -> list[tuple[str, tuple[int, ...], str]]:
    """``(option, stages it needs, why)`` for each option in ``values`` set away from its
    default under a ``stage`` that ignores it (:data:`STAGE_RULES`).

    >>> misplaced_options(2, prefetch=2, overlap_grad_reduce=True)
    [('prefetch', (3,), 'stages 1/2 gather every bucket after the update')]
    """
    return [(option, stages, why) for option, stages, why in STAGE_RULES
            if option in values and values[option] != _DEFAULTS[option] and stage not in stages]


def bucket_groups(keys: Sequence[Hashable], numels: Sequence[int], itemsizes: Sequence[int],
                  bucket_mb: float) -> list[tuple[Hashable, list[int]]]:
    """ZeRO's bucket plan, the one rule the strategy, :func:`dtp.plan` and checkpoints share:
    the leaves (given in use order) go into one open bucket per key (dtype, mesh axes the
    parameter is split on), which closes once it holds ``bucket_mb`` MiB. Returns
    ``(key, member indices)`` in bucket order. Pure, torch-free.

    >>> bucket_groups(["a", "b", "a", "a"], [3, 5, 2, 4], [4, 4, 4, 4], bucket_mb=16 / 2**20)
    [('a', [0, 2]), ('b', [1]), ('a', [3])]
    """
    open_: dict[Hashable, list[int]] = {}
    groups: list[tuple[Hashable, list[int]]] = []
    for i, (key, itemsize) in enumerate(zip(keys, itemsizes)):
        cap = max(1, int(bucket_mb * 2**20) // itemsize)
        if key not in open_:
            open_[key] = []
            groups.append((key, open_[key]))
        open_[key].append(i)
        if sum(numels[j] for j in open_[key]) >= cap:
            del open_[key]
    return groups


def padded_numel(total: int, ways: int) -> int:
    """A bucket's length: ``total`` elements padded to split ``ways`` (dp) evenly.

    >>> padded_numel(10, 4)
    12
    """
    return -(-total // ways) * ways
