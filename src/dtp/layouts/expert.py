"""The expert-parallel preset: experts ``Shard(0)`` over an ``ep`` mesh axis.

``layouts.expert(axis="ep")`` puts the ``expert`` logical axis (dim 0 of an MoE block's
``w_gate`` / ``w_up`` / ``w_down``) on ``axis``: coordinate c holds experts
``[c·L, (c+1)·L)``, ``L = experts / ep``. As in Megatron's expert-data-parallel, ``axis``
is *also* a data axis for everything else: the batch is split over it (over
``(dp, ep)`` with :func:`~dtp.layouts.data`), dense parameters (attention, norms,
router, embeddings) are replicated over it and their gradients are reduced over
``dp × ep`` like any data-parallel gradient. Inside an MoE block each rank's tokens go
to the ranks that hold their experts and back (:mod:`dtp.ops.moe_dispatch`), so an
expert's gradient is already complete for ``ep`` on its owner — it comes from the
tokens of every ``ep`` rank — and only pending over the remaining data axes (``dp``):
expert gradients are reduced only over the ranks that hold the same experts.

``axis`` may also be several mesh axes that already split the tokens — ep *folded out
of* dp × cp, Megatron's other expert-data-parallel arrangement: ``expert(axis=("dp",
"cp"))`` with :func:`~dtp.layouts.data` and :func:`~dtp.layouts.context` puts experts
``Shard(0)`` over ``dp × cp`` (dp major) and dispatches over the flattened view of
those axes (:func:`dtp.mesh.flatten_axes`); it adds no data axis, since its axes are
data axes already.

**With tensor parallel** there are two arrangements. By default experts are whole on
every tp rank: the block's input is gathered over tp (sequence parallel's all-gather at
the block's entry, as for the dense MLP), every tp rank routes the same tokens and runs
its ep group's experts on them — tp-fold redundant expert compute, no tp collective in
the expert path. With ``tp_axis="tp"`` each expert's hidden width is split over tp
(Megatron's expert tensor parallel; ``expert_mlp`` on tp): each tp rank sends a 1/tp
slice of the routed rows, the expert's rank all-gathers its tp peers' slices, runs its
column/row-parallel share of the expert, and reduce-scatters the partial sums back; the
block's output is then a pending sum over tp, reduced (scattered under SP) at the
block's exit like the dense MLP's. No redundant compute and 1/tp of the expert weights
per rank, for an all-gather and a reduce-scatter per chunk — the tp traffic that
``multi_stream`` keeps apart from the ep all-to-alls. On an ep axis of size 1 nothing is
dispatched: each tp rank runs its share of every expert on the tokens it has, a dense
MLP's column/row split (``dtp train --tp N --expert-tp`` at ``--ep 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the CLI checks layouts before torch loads (core.py)
    from torch.distributed.device_mesh import DeviceMesh

from ..core.mesh.shape import axis_names
from .core import Layout, split_in_words
from .option import Option, said, setting

__all__ = ["ExpertOptions", "expert", "EP_OVERLAP_SCHEDULES", "NO_PAIRS", "OVERLAP_NAMES"]

#: The pipeline schedules ``ep_overlap`` runs under (pp > 1): an F and a B of other
#: microbatches side by side where that cannot deadlock (dtp.schedules.lane_pairs). Not
#: gpipe, zb-h1, zbv (:data:`NO_PAIRS`).
EP_OVERLAP_SCHEDULES = ("1f1b", "interleaved", "dualpipev")
#: Why the other schedules are refused (the refusals' text).
NO_PAIRS = ("gpipe runs every F before any B (one F beside a B at most: nothing to hide under); zb-h1 "
            "and zbv split each B into I and W, which the lanes do not pair")
#: How :meth:`ExpertOptions.check_overlap` names what it refuses together (``dtp.RunConfig``
#: passes its fields' names, which the CLI shows as flags).
OVERLAP_NAMES = {"ep_overlap": "layouts.expert(ep_overlap=True)", "pipeline": "layouts.pipeline",
                 "pp_schedule": "schedule", "zero12": "layouts.zero(1 or 2)",
                 "overlap_grad_reduce": "overlap_grad_reduce", "microbatches": "microbatches", "pp": "pp"}


@dataclass(frozen=True, kw_only=True)
class ExpertOptions(Option):
    """What :func:`expert` was asked for; checked when built.

    >>> ExpertOptions().axis
    'ep'
    """

    # the mesh axis experts are split over (and the batch, as a data axis); or a tuple of
    # token axes (mesh order) that ep is folded out of
    family = "expert"
    requires_axes = True

    axis: str | tuple[str, ...] = "ep"
    # MindSpeed's pipe-experts (dtp.ops.moe_pipe): the dispatched rows move and compute in
    # chunks, one per local expert (× multi_data), so a chunk's all-to-all is in flight
    # while the one before computes, forward and backward
    pipe_experts: bool = False
    multi_data: int = 1  # split each local expert's rows into this many chunks (for 1 local expert)
    # put the ep all-to-alls and the tp all-gathers / reduce-scatters of the expert path on
    # one communication stream, so they never run at the same time (needs sequence parallel)
    multi_stream: bool = False
    # split each expert's hidden width over this axis (Megatron's expert tensor parallel),
    # e.g. layouts.megatron's "tp"; None: experts whole on every rank of it
    tp_axis: str | None = None
    # hide one microbatch's expert all-to-alls under another's compute (dtp.strategies.ep_overlap:
    # microbatches in pairs of cooperative lanes, the turn passed at each all-to-all)
    ep_overlap: bool = False

    def __post_init__(self) -> None:
        for name in ("pipe_experts", "multi_stream", "ep_overlap"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"layouts.expert: {name} must be a bool, got {getattr(self, name)!r}")
        if self.tp_axis is not None and (not isinstance(self.tp_axis, str) or not self.tp_axis):
            raise TypeError(f"layouts.expert: tp_axis must be a mesh axis name or None, got {self.tp_axis!r}")
        if isinstance(self.multi_data, bool) or not isinstance(self.multi_data, int) or self.multi_data < 1:
            raise ValueError(f"layouts.expert: multi_data must be an int >= 1, got {self.multi_data!r}")
        if not self.pipe_experts and (self.multi_data > 1 or self.multi_stream):
            on = "multi_data" if self.multi_data > 1 else "multi_stream"
            raise ValueError(f"layouts.expert: {on} splits the pipe-experts schedule; it needs pipe_experts=True")
        axes = (self.axis,) if isinstance(self.axis, str) else self.axis
        if (not isinstance(axes, (tuple, list)) or not axes or not all(isinstance(a, str) and a for a in axes)
                or len(set(axes)) != len(axes)):
            raise TypeError(f"layouts.expert: axis must be a mesh axis name or a tuple of distinct names, "
                            f"got {self.axis!r}")
        object.__setattr__(self, "axis", axes[0] if len(axes) == 1 else tuple(axes))  # canonical: "ep", not ("ep",)

    def check_tokens(self, tokens: int, what: str) -> None:
        """``ValueError`` when pipe-experts would cut each local expert's rows into more
        ``multi_data`` pieces than a rank has ``tokens``; ``what`` starts the message."""
        if self.pipe_experts and self.multi_data > tokens:
            raise ValueError(f"{what} gives each rank {tokens} tokens, fewer than layouts.expert(multi_data="
                             f"{self.multi_data}) pieces per local expert; use multi_data <= {tokens} or a larger "
                             f"batch")

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes experts are split over (one, or the folded ones)."""
        return (self.axis,) if isinstance(self.axis, str) else self.axis

    @property
    def label(self) -> str:
        """The axes as a message names them: ``ep``, or ``dp×cp`` when folded."""
        return "×".join(self.axes)

    def degree(self, mesh: DeviceMesh) -> int:
        """The expert-parallel degree on ``mesh`` (axes the mesh lacks count 1)."""
        names = axis_names(mesh)
        return math.prod(mesh.size(names.index(a)) for a in self.axes if a in names)

    def check_sizes(self, sizes: Mapping[str, int], mesh: DeviceMesh, layout: Layout, *, what: str,
                    names: Mapping[str, str] | None) -> None:
        sp = layout.megatron is not None and layout.megatron.sequence_parallel
        self.check(sizes, mesh, sequence_parallel=sp, what=what, names=names)

    def check_batch(self, what: str, key: str, shape: Sequence[int], layout: Layout, mesh: DeviceMesh, *,
                    microbatches: int = 1) -> None:
        """pipe-experts needs a rank to hold at least ``multi_data`` tokens in each
        microbatch: said where every rank sees the batch alike, not in ``moe_ffn`` on the
        ranks, where a pipeline's peers would wait for it (:meth:`check_tokens`). A batch
        that does not split evenly is left to its placement's own error."""
        if not self.pipe_experts or len(shape) < 2:
            return
        rows, seq = layout.splits(("batch", "seq"), mesh)  # as shard_batch's spec splits the entry
        if shape[0] % rows or shape[1] % seq:
            return  # not even: the placement refuses it, naming the split
        self.check_tokens(shape[0] // rows // microbatches * (shape[1] // seq),
                          f"{what}: batch[{key!r}] of shape {tuple(shape)}"
                          + (f" in {microbatches} microbatches" if microbatches > 1 else ""))

    def check_overlap(self, layout: Layout, mesh: DeviceMesh, microbatches: int, *, what: str = "",
                      names: Mapping[str, str] | None = None) -> None:
        """``ep_overlap``'s rules for a step on ``mesh`` (nothing without it), every rank
        alike and before any collective: an expert axis of more than one device, a pipeline
        schedule it pairs (:data:`EP_OVERLAP_SCHEDULES`), ZeRO 1/2 without
        ``overlap_grad_reduce``, ``microbatches >= 2`` at pp 1. The one place they live:
        ``train_step`` asks (``dtp.strategies.ep_overlap.check``), and so does
        ``dtp.RunConfig`` with its fields' names (``names``: :data:`OVERLAP_NAMES`' keys).

        >>> from dtp import layouts
        >>> from dtp.core.mesh.shape import MeshShape
        >>> layout = layouts.expert(ep_overlap=True)
        >>> layout.expert.check_overlap(layout, MeshShape({"ep": 2}), 1, what="train_step")
        Traceback (most recent call last):
        ValueError: train_step: layouts.expert(ep_overlap=True) hides one microbatch's all-to-all under another microbatch's compute: at pp 1 it needs microbatches >= 2, got 1
        """
        if not self.ep_overlap:
            return
        n, start = {**OVERLAP_NAMES, **(names or {})}, f"{what}: " if what else ""
        if self.degree(mesh) == 1:
            raise ValueError(f"{start}{n['ep_overlap']} hides the expert all-to-alls, but the expert axis "
                             f"{self.label} has size 1 on this mesh: there is none; drop ep_overlap")
        pipe = layout.pipeline if layout.pipeline is not None and layout.pipeline.active(mesh) else None
        if pipe is not None and pipe.schedule not in EP_OVERLAP_SCHEDULES:
            raise ValueError(f"{start}{n['ep_overlap']} under {n['pipeline']} runs an F and a B of two microbatches "
                             f"side by side ({'/'.join(EP_OVERLAP_SCHEDULES)}); not for {n['pp_schedule']} "
                             f"{pipe.schedule}: {NO_PAIRS}")
        z = layout.zero if layout.zero is not None and layout.zero.active(mesh) else None
        if z is not None and (z.stage == 3 or z.overlap_grad_reduce):
            # ZeRO 1/2 compose: their buckets add each backward's gradients in any order and are
            # reduce-scattered after the step's backwards; these count one microbatch at a time.
            why = "3 gathers and frees each bucket per forward / backward" if z.stage == 3 else \
                f"with {n['overlap_grad_reduce']} reduce-scatters each bucket when the last backward fills it"
            raise ValueError(f"{start}{n['ep_overlap']} runs two microbatches' forwards and backwards side by side, "
                             f"and ZeRO {why}, counting one microbatch at a time; use {n['zero12']} without "
                             f"{n['overlap_grad_reduce']} (reduced after the step's backwards), or drop "
                             f"{n['ep_overlap']}")
        if pipe is None and microbatches < 2:
            raise ValueError(f"{start}{n['ep_overlap']} hides one microbatch's all-to-all under another "
                             f"microbatch's compute: at {n['pp']} 1 it needs {n['microbatches']} >= 2, got "
                             f"{microbatches}")

    def check(self, sizes: Mapping[str, int], mesh: DeviceMesh, *, sequence_parallel: bool = False,
              what: str = "model", names: Mapping[str, str] | None = None) -> None:
        """``ValueError`` (every rank alike, before any collective) when the model's
        ``expert`` count does not divide by the ``axis`` size on ``mesh``, pipe-experts or a
        tp split of the experts is asked of a model without experts, or multi_stream without
        sequence parallel. ``names``: what the count's message calls the mesh axes
        (:meth:`~dtp.layouts.Layout.check_sizes`)."""
        ep, experts = self.degree(mesh), sizes.get("expert")
        for option, on in (("pipe_experts=True", self.pipe_experts), (f"tp_axis={self.tp_axis!r}", self.tp_axis)):
            if on and not experts:
                raise ValueError(f"{what}: layouts.expert({option}) needs a mixture-of-experts model "
                                 f"({said(names, 'num_experts')} > 0); this one has no experts")
        if self.multi_stream and not sequence_parallel:
            raise ValueError(f"{what}: layouts.expert(multi_stream=True) orders the ep all-to-alls against the "
                             f"tp all-gathers / reduce-scatters of sequence parallel; it needs "
                             f"layouts.megatron(sequence_parallel=True)")
        if experts is not None and experts % ep:
            why, smaller = (f"layouts.expert puts experts Shard(0) on {self.axis!r}", self.label) if names is None \
                else split_in_words(names, self.axes, "experts")
            raise ValueError(f"{what}: {setting(names, 'num_experts', experts)} is not divisible by {self.label}={ep} "
                             f"({why}); choose {said(names, 'num_experts')} a multiple of {ep}, or a smaller {smaller}")


def expert(axis: str | Sequence[str] = ExpertOptions.axis, *, pipe_experts: bool = ExpertOptions.pipe_experts,
           multi_data: int = ExpertOptions.multi_data, multi_stream: bool = ExpertOptions.multi_stream,
           tp_axis: str | None = ExpertOptions.tp_axis, ep_overlap: bool = ExpertOptions.ep_overlap) -> Layout:
    """Expert parallel over ``axis``: experts ``Shard(0)`` on it, and the batch split over
    it too (it is a data axis for everything else; module docstring). Compose with
    :func:`~dtp.layouts.data` for expert-data-parallel on a ``dp × ep`` mesh. A tuple of
    axes folds ep out of those token axes and adds no batch split.

    ``pipe_experts``, ``multi_data``, ``multi_stream``: MindSpeed's pipe-experts
    (:mod:`dtp.ops.moe_pipe`; ``--use-pipe-experts``, ``--pipe-experts-multi-data N``,
    ``--pipe-experts-multi-stream``). Same numbers as without, the all-to-all hidden
    behind the expert FFN. ``tp_axis``: split each expert's hidden width over that axis
    (``expert_mlp`` on it; Megatron's expert tensor parallel, module docstring).
    ``ep_overlap``: while one microbatch's dispatch / combine all-to-all travels, another
    microbatch computes (Megatron's ``--overlap-moe-expert-parallel-comm``;
    :mod:`dtp.strategies.ep_overlap`); needs ``train_step(microbatches >= 2)``.

    Raises: ``TypeError`` for an ``axis`` that is not a name or names; a model whose
    experts do not divide by the ep degree is refused by ``TrainState.create``
    (:meth:`ExpertOptions.check`).

    >>> layout = expert()
    >>> layout.params["expert"], layout.activations["batch"], layout.expert.axis
    (('ep',), ('ep',), 'ep')
    >>> expert(axis=("dp", "cp")).params["expert"], expert(axis=("dp", "cp")).activations
    (('dp', 'cp'), {})
    >>> expert(multi_data=2)
    Traceback (most recent call last):
    ValueError: layouts.expert: multi_data splits the pipe-experts schedule; it needs pipe_experts=True
    """
    opts = ExpertOptions(axis=tuple(axis) if isinstance(axis, (tuple, list)) else axis, pipe_experts=pipe_experts,
                         multi_data=multi_data, multi_stream=multi_stream, tp_axis=tp_axis, ep_overlap=ep_overlap)
    acts = {"batch": opts.axes} if isinstance(opts.axis, str) else {}
    rules = {"expert": opts.axes, **({"expert_mlp": (opts.tp_axis,)} if opts.tp_axis else {})}
    return Layout(rules, acts, expert=opts, name=f"expert({opts.axis!r})")
