"""What a plan is of (:class:`Target`): a :class:`dtp.RunConfig`, the model it builds, the
backend it runs on and its layout, checked against the model; and the per-rank parameter
shapes derived from the real model code and the real layout.

Nothing here allocates a parameter: shapes come from :func:`dtp.models.config.param_shapes`
arithmetic on the config (the same ``_shapes`` the model's ``init`` uses) and placements
from :meth:`dtp.Layout.param_spec` on a stand-in mesh that has only names and sizes.

The run is ``dtp train``'s own description of itself: every field the plan reads (mesh
degrees, ZeRO, microbatches, recompute, dtype, ...) is the :class:`~dtp.RunConfig`'s, read
as ``target.run.<field>`` and restated nowhere, and so are the checks the run config makes
when built. The layout is the run's own (:meth:`dtp.RunConfig.layout`, the function
``dtp train`` builds it by) unless one is given; how attention runs over cp is read from it
(:attr:`Target.context`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

from .. import schedules
from ..core.mesh.shape import MeshShape
from ..config import DTYPES as config_dtypes
from ..config import CONTEXT_FIELDS, RunConfig
from ..models.config import n_sequential_layers, param_shapes
from ..core._rules import accum_dtype
from ..layouts import ContextOptions, Layout, check_divisible
from ..layouts.pipeline import FLAG_NAMES, assign
from ..models import llama
from ..core.spec import P

T = TypeVar("T")

__all__ = ["Target", "Leaf", "DTYPES", "BACKENDS", "leaves", "stage_leaves", "rank_chunks", "rank_stages",
           "schedule", "stage_ranges"]

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in config_dtypes}  # RunConfig's names


#: The backends a plan models: gloo (CPU) and the in-place reduce-scatters of nccl and hccl.
BACKENDS = ("gloo", "nccl", "hccl")

@dataclass(frozen=True, kw_only=True)
class Target:
    """One planned run: :meth:`Target.of` fills in what is not given. Checked when built
    against what only the model and the layout know (the run config has checked itself).

    - `run`: the run; every field the plan reads is its.
    - `cfg`: the model it builds (``dtp train``'s may differ from the preset: a vocabulary
      grown to the data's ids; :func:`dtp.plan` of a ``LlamaConfig`` plans that one).
    - `backend`: where it runs (``"gloo"``, ``"nccl"``, ``"hccl"``): gloo runs ZeRO's
      reduce-scatter as an all-to-all whose receive buffers hold whole buckets
      (:mod:`dtp.comm`); nccl and hccl reduce-scatter in place. Not a run field: the
      same run plans differently on another machine.
    - `layout`: the layout planned: ``run.layout()``, or one given to :func:`dtp.plan`.
    - `name`: the model's label in the table (preset, Hugging Face directory, ``"custom"``).

    >>> t = Target.of(RunConfig(dp=2, tp=2, sp=True, batch=8, seq=16))
    >>> t.name, t.axes, t.world, t.tokens, t.residual_tokens, t.layout == t.run.layout()
    ('tiny', {'dp': 2, 'tp': 2}, 4, 64, 32, True)
    >>> Target.of(RunConfig(cp=2, seq=18))
    Traceback (most recent call last):
    ...
    ValueError: dtp.plan: seq 18: zigzag load balancing cuts the sequence into 2*cp chunks, ...
    """

    run: RunConfig
    cfg: llama.LlamaConfig
    backend: str = "gloo"
    layout: Layout
    name: str

    @classmethod
    def of(cls, run: RunConfig, *, cfg: llama.LlamaConfig | None = None, backend: str = "gloo",
           layout: Layout | None = None, name: str | None = None) -> "Target":
        """``run`` planned on ``backend``: the model ``cfg`` (default: the run's, its preset or
        Hugging Face directory with its MoE fields), ``layout`` (default ``run.layout()``),
        ``name`` (default the run's Hugging Face directory, else its preset).

        >>> Target.of(RunConfig(model="tiny-moe", num_experts=8), backend="nccl").cfg.num_experts
        8
        """
        if cfg is None:
            cfg = llama.config_for(run.model, init_from=run.init_from, **run.model_overrides())
        return cls(run=run, cfg=cfg, backend=backend, layout=run.layout() if layout is None else layout,
                   name=(run.init_from or run.model) if name is None else name)

    def __post_init__(self) -> None:
        run = self.run
        if self.backend not in BACKENDS:
            raise ValueError(f"dtp.plan: backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        # A run config needs no model to check itself, so the splits of the sequence the
        # model's activations take are checked here.
        if run.seq % (run.cp * (run.tp if run.sp else 1)):
            raise ValueError(f"dtp.plan: seq {run.seq} must be divisible by cp{' × tp' if run.sp else ''}")
        context = {k: getattr(run, k) for k in CONTEXT_FIELDS.values() if getattr(run, k) is not None}
        # A layout given beside context fields (dtp.plan("tiny", cp=4, layout=..., cp_algo=...)):
        # the two must not say different things about how attention runs.
        if context and run.cp > 1 and run.layout().context != self.layout.context:
            raise ValueError(f"dtp.plan: the context keywords {context} disagree with "
                             f"layout={self.layout.name}'s {self.layout.context}; give them in one place")
        self._check_context()
        if self.layout.pipeline is not None:  # what a pipeline does not compose with: the rules train_step applies
            self.layout.pipeline.check_composition(self.layout, MeshShape(self.axes), what=f"--pp {run.pp}",
                                                   shared=("embed",) if self.cfg.tie_embeddings else (),
                                                   names=FLAG_NAMES)

    def _check_context(self) -> None:
        """What ``dtp train``'s preflight checks of context parallel, on the stand-in mesh:
        the algorithm's rules against the model's heads, and the sequence against the split."""
        run = self.run
        if run.cp == 1:
            return
        ctx = self.layout.context
        if ctx is None or ctx.axis != "cp":
            raise ValueError(f"dtp.plan: cp={run.cp} but the layout {self.layout.name} has no context parallel "
                             f"over 'cp' (layouts.context): the plan would not know how attention runs")
        mesh = MeshShape(self.axes)
        ctx.check(llama.axis_sizes(self.cfg), mesh, tp=self.layout.degree("heads", mesh), what="dtp.plan")
        check_divisible(run.seq, run.cp, ctx.load_balance, what=f"dtp.plan: seq {run.seq}")

    @property
    def context(self) -> ContextOptions | None:
        """How attention runs over cp: the layout's context options (``None`` at cp = 1)."""
        return self.layout.context if self.run.cp > 1 else None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.run.dtype]

    @functools.cached_property
    def axes(self) -> dict[str, int]:
        """The mesh ``dtp train`` builds (:meth:`dtp.RunConfig.mesh_axes`): ep kept at 1
        under ``expert_tp``, where ZeRO buckets the experts apart from the other tp-split
        parameters. (Before the plan read a RunConfig it dropped that axis: tiny-moe dp2 ×
        tp2 ``expert_tp`` ZeRO-3 at ``bucket_mb=0.05`` planned 494,848 B of dp all-gather
        against 482,560 measured; it now plans 482,560.)"""
        return self.run.mesh_axes()

    @property
    def world(self) -> int:
        return math.prod(self.axes.values())

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank: a V schedule's 2 (:func:`dtp.schedules.chunks_per_rank`)."""
        return schedules.chunks_per_rank(self.run.pp_schedule, self.run.virtual_stages)

    @property
    def microbatch(self) -> int:
        """Sequences per rank per microbatch (ep is a data axis too)."""
        run = self.run
        return run.batch // (run.dp * run.ep * run.microbatches)

    @property
    def tokens(self) -> int:
        """Tokens a rank computes per microbatch in attention and the MLP (sequence over cp)."""
        return self.microbatch * self.run.seq // self.run.cp

    @property
    def residual_tokens(self) -> int:
        """Tokens a rank holds in the residual stream (sequence over cp, and tp with SP)."""
        return self.tokens // (self.run.tp if self.run.sp else 1)


@dataclass(frozen=True)
class Leaf:
    """One parameter as a rank holds it."""

    path: str
    shape: tuple[int, ...]  # global
    local: tuple[int, ...]  # this rank's shard
    spec: P
    dtype: torch.dtype

    # cached: a search asks each leaf's size and block millions of times
    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.local)

    @functools.cached_property
    def block(self) -> int | None:
        """The transformer block it belongs to (``layers.<i>.…``), else ``None``."""
        return int(self.path.split(".")[1]) if self.path.startswith("layers.") else None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @functools.cached_property
    def used_axes(self) -> frozenset[str]:
        """The mesh axes this parameter is split on (its spec's; read once: the plan asks per collective)."""
        return frozenset(self.spec.used_axes())

    def splits(self, axis: str) -> bool:
        return axis in self.used_axes


# Figures of one tuple of leaves, memoised by (its identity, what else they depend on): a
# search asks them of each stage's leaves thousands of times (each ZeRO variant's memory
# plan, traffic and compute). A tuple of frozen leaves cannot change, and the tuple is held
# in its entry, so its id is not reused while the entry lives. Lists are not memoised.
_BY_LEAVES: dict[tuple, tuple[tuple[Leaf, ...], object]] = {}
_BY_LEAVES_KEPT = 8192


def by_leaves(what: str, rank_leaves: Sequence[Leaf], key: tuple, make: Callable[[], T]) -> T:
    """``make()``, memoised for ``rank_leaves`` when it is a tuple, under ``(what, key)``:
    ``key`` holds what else ``make``'s figure depends on.

    >>> lv = (Leaf("w", (2, 2), (2, 2), P(), torch.float32),)
    >>> by_leaves("numel", lv, (), lambda: sum(l.numel for l in lv)), by_leaves("numel", lv, (), lambda: 0)
    (4, 4)
    """
    if not isinstance(rank_leaves, tuple):
        return make()
    full = (what, id(rank_leaves), key)
    hit = _BY_LEAVES.get(full)
    if hit is None or hit[0] is not rank_leaves:
        if len(_BY_LEAVES) >= _BY_LEAVES_KEPT:
            _BY_LEAVES.clear()
        hit = _BY_LEAVES[full] = (rank_leaves, make())
    return hit[1]  # type: ignore[return-value]


def leaves(s: Target, layout: Layout | None = None) -> list[Leaf]:
    """Every parameter in forward use order (ZeRO's bucket order), with its local shape.

    >>> [(l.path, l.local) for l in leaves(Target.of(RunConfig(tp=2)))][:3]
    [('embed', (128, 64)), ('layers.0.attn_norm', (64,)), ('layers.0.wq', (64, 32))]
    """
    layout = s.layout if layout is None else layout
    mesh, sizes = MeshShape(s.axes), s.axes
    cfg, dtype = s.cfg, s.torch_dtype
    axes = llama.param_axes(cfg)
    out = []
    for path, shape in param_shapes(cfg).items():  # init's order: embed, blocks, final_norm, lm_head
        parts = path.split(".")
        logical = axes["layers"][int(parts[1])][parts[2]] if parts[0] == "layers" else axes[path]
        spec = layout.param_spec(logical, mesh, name=path)
        local = []
        for d, n in enumerate(shape):
            ways = math.prod(sizes[a] for a in spec.axes_of(d))
            if n % ways:
                raise ValueError(f"dtp.plan: param {path} dim {d} of size {n} does not split {ways} ways "
                                 f"({' × '.join(spec.axes_of(d))})")
            local.append(n // ways)
        # The router is kept in fp32 whatever the model's dtype (llama.init).
        out.append(Leaf(path, shape, tuple(local), spec, accum_dtype(dtype) if path.endswith("router") else dtype))
    return out


def schedule(s: Target) -> tuple[schedules.Schedule, schedules.Timeline]:
    """The run's pipeline schedule (:func:`dtp.schedules.make`) and its unit-cost timeline
    (:func:`dtp.schedules.simulate`, F 1 and B 2), made once per (schedule, p, v, m): every
    pipeline rank's memory reads them, and at pp 64, m 512 one make and simulate take
    about a second.

    >>> sched, line = schedule(Target.of(RunConfig(pp=2, microbatches=4, seq=32)))
    >>> len(sched), line.peak_in_flight
    (2, (2, 1))
    """
    return _schedule(s.run.pp_schedule, s.run.pp, s.virtual_stages, s.run.microbatches)


# 512: dtp.planning.search plans thousands of layouts over a few hundred schedules
@functools.lru_cache(maxsize=512)
def _schedule(name: str, p: int, v: int, m: int) -> tuple[schedules.Schedule, schedules.Timeline]:
    sched = schedules.make(name, p=p, v=v, m=m)  # a tuple of tuples, the timeline frozen: safe to share
    return sched, schedules.simulate(sched, p=p, v=v, m=m)


def stage_ranges(s: Target) -> tuple[tuple[int, int], ...]:
    """``(first, stop)`` of each global stage's layers of :func:`dtp.models.llama.sequential`
    (embedding, blocks, head): the layout's ``layer_split`` where it gives one (what
    training runs: :func:`dtp.layouts.pipeline.assign`), else as even as possible.

    >>> from dtp import layouts
    >>> run = RunConfig(pp=2, microbatches=2, seq=32)
    >>> uneven = layouts.data() + layouts.megatron() + layouts.pipeline(layer_split=(1, 3))
    >>> stage_ranges(Target.of(run)), stage_ranges(Target.of(run, layout=uneven))
    (((0, 2), (2, 4)), ((0, 1), (1, 4)))
    """
    opts = s.layout.pipeline
    split = opts.layer_split if opts is not None else None
    return assign(n_sequential_layers(s.cfg), s.run.pp, s.virtual_stages, split,
                  what=f"dtp.plan: pp={s.run.pp} virtual_stages={s.virtual_stages}")


def rank_chunks(s: Target, rank: int) -> list[tuple[int, range]]:
    """Per chunk of pipeline ``rank`` (chunk order): its global stage and the layers of
    :func:`dtp.models.llama.sequential` (embedding, blocks, head) it runs, by the
    schedule's own stage map (:func:`dtp.schedules.global_stage`). One chunk of every
    layer without a pipeline.

    >>> s = Target.of(RunConfig(pp=2, pp_schedule="zbv", microbatches=2, seq=32))
    >>> rank_chunks(s, 0), rank_chunks(s, 1)
    ([(0, range(0, 1)), (3, range(3, 4))], [(1, range(1, 2)), (2, range(2, 3))])
    """
    pp = s.run.pp
    ranges = stage_ranges(s)
    where = schedules.placement(s.run.pp_schedule)
    stages = [schedules.global_stage(c, rank, pp, where) for c in range(s.virtual_stages)]
    return [(g, range(*ranges[g])) for g in stages]


def rank_stages(s: Target, rank: int) -> str:
    """The global stages pipeline ``rank`` holds and what is in them, in words: the
    schedule's own stage-to-rank map (:func:`dtp.schedules.global_stage`), so a V schedule's
    rank 0 reads as holding the first and the last stage.

    >>> s = Target.of(RunConfig(pp=2, tp=2, pp_schedule="zbv", microbatches=4, seq=32))
    >>> rank_stages(s, 0), rank_stages(s, 1)
    ('stages 0, 3 of 4: embedding, head', 'stages 1, 2 of 4: blocks 0-1')
    >>> rank_stages(Target.of(RunConfig(pp=2, microbatches=2, seq=32)), 0)
    'stage 0 of 2: embedding, block 0'
    """
    n_seq = n_sequential_layers(s.cfg)  # embed | blocks | head (llama.sequential)
    chunks = rank_chunks(s, rank)
    stages = [g for g, _ in chunks]
    layers = sorted(layer for _, r in chunks for layer in r)
    blocks = [layer - 1 for layer in layers if 0 < layer < n_seq - 1]
    parts = (["embedding"] if 0 in layers else []) + \
        ([f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"] if blocks else []) + \
        (["head"] if n_seq - 1 in layers else [])
    if blocks and blocks != list(range(blocks[0], blocks[-1] + 1)):  # interleaved: not one run of blocks
        parts[int(0 in layers)] = "blocks " + ", ".join(map(str, blocks))
    head = f"stage{'s' * (len(stages) > 1)} {', '.join(map(str, sorted(stages)))} of {s.run.pp * s.virtual_stages}"
    return f"{head}: {', '.join(parts)}"


def stage_leaves(s: Target, all_leaves: list[Leaf]) -> list[list[Leaf]]:
    """The parameters each pipeline rank holds (one list when pp = 1)."""
    pp = s.run.pp
    if pp == 1:
        return [all_leaves]
    n_seq = n_sequential_layers(s.cfg)  # embed | blocks | head (llama.sequential)
    # Each layer's leaves in use order, found once (a 70B has 723 leaves in 82 layers).
    head = {"final_norm", "embed" if s.cfg.tie_embeddings else "lm_head"}
    by_layer: list[list[int]] = [[] for _ in range(n_seq)]
    for i, leaf in enumerate(all_leaves):
        if leaf.block is not None:
            by_layer[leaf.block + 1].append(i)
        for layer, names in ((0, {"embed"}), (n_seq - 1, head)):
            if leaf.path in names:
                by_layer[layer].append(i)
    out: list[list[Leaf]] = [[] for _ in range(pp)]
    held: list[set[int]] = [set() for _ in range(pp)]
    where = schedules.placement(s.run.pp_schedule)
    for stage, (first, stop) in enumerate(stage_ranges(s)):
        rank = schedules.stage_owner(stage, pp, where)[0]
        for layer in range(first, stop):
            for i in by_layer[layer]:
                if i not in held[rank]:  # a tied embedding: read again by the head
                    held[rank].add(i)
                    out[rank].append(all_leaves[i])
    return out
