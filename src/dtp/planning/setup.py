"""What a plan is of: the model, the batch and the parallel configuration, checked, and
the per-rank parameter shapes derived from the real model code and the real layout.

Nothing here allocates a parameter: shapes come from :func:`dtp.models.llama.param_shapes`-like
arithmetic on the config (the same ``_shapes`` the model's ``init`` uses) and placements
from :meth:`dtp.Layout.param_spec` on a stand-in mesh that has only names and sizes.

The layout is ``dtp train``'s own: :func:`dtp.cli.flags.build_layout` of the flags, which
``dtp plan`` / ``dtp train`` pass in (``Setup(layout=...)``); for a :func:`dtp.plan` call
with keywords only, :func:`layout_for` builds it by that same function, so the two
cannot drift apart. The context-parallel options (algorithm, window, Ulysses degree, head
chunks) are read from the layout (:attr:`Setup.context`), never from the keywords.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .. import schedules
from .._mesh_shape import MeshShape
from ..config import DTYPES as config_dtypes
from ..config import RECOMPUTE, RunConfig, mesh_axes_of
from ..models.config import n_sequential_layers, param_shapes
from .._rules import accum_dtype
from ..layouts import ContextOptions, Layout, check_divisible
from ..layouts.pipeline import assign
from ..models import llama
from ..spec import P

__all__ = ["Setup", "Leaf", "DTYPES", "layout_for", "leaves", "stage_leaves", "rank_chunks", "rank_stages"]

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in config_dtypes}  # RunConfig's names


#: The backends a plan models: gloo (CPU) and the in-place reduce-scatters of nccl and hccl.
BACKENDS = ("gloo", "nccl", "hccl")


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One training configuration, as ``dtp train``'s flags state it (global batch in sequences)."""

    model: str = "tiny"
    cfg: llama.LlamaConfig = field(default_factory=llama.LlamaConfig)
    batch: int = 8  # global batch, sequences
    seq: int = 64
    dp: int = 1
    tp: int = 1
    sp: bool = False  # Megatron sequence parallel (with tp > 1)
    async_tp: bool = False  # SP's collectives as send/recv rings (dtp.ops.collective_matmul; with sp)
    cp: int = 1
    # --cp-algo, --cp-window, --ulysses-degree, --cp-head-chunks: what layout_for builds the
    # context preset from when no layout is given (None: layouts.context's defaults). The
    # plan itself reads them from the layout (Setup.context).
    cp_algo: str | None = None
    cp_window: int | None = None
    ulysses_degree: int | None = None
    cp_head_chunks: int | None = None
    pp: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    ep: int = 1
    zero: Literal[0, 1, 2, 3] = 0
    bucket_mb: float = 40.0
    reshard_after_forward: bool = True
    microbatches: int | None = None  # None: dtp train's default (1; under pp schedules.default_microbatches)
    recompute: Literal["none", "full", "selective"] = "none"
    dtype: str = "float32"
    precision: str | None = None  # RunConfig's (None: mixed for bfloat16): fp32 master weights beside bf16
    # The collectives' backend: gloo runs ZeRO's reduce-scatter as an all-to-all whose receive
    # buffers hold whole buckets (dtp.comm); nccl and hccl reduce-scatter in place.
    backend: str = "gloo"
    # The layout planned (dtp.cli.flags.build_layout's); None: layout_for(self). Filled in
    # by __post_init__, so after construction it is always a Layout.
    layout: Layout | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "dp", "tp", "cp", "pp", "virtual_stages", "ep", "microbatches"):
            value = getattr(self, name)
            if name == "microbatches" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"dtp.plan: {name} must be an int >= 1, got {value!r}")
        if self.microbatches is None:  # dtp train's default, so plan("tiny", pp=2) plans what `--pp 2` runs
            object.__setattr__(self, "microbatches", schedules.default_microbatches(
                self.pp_schedule, self.pp, self.virtual_stages, self.batch, self.dp * self.ep))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtp.plan: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"dtp.plan: backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"dtp.plan: recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        data = self.dp * self.ep * self.microbatches
        if self.batch % data:
            raise ValueError(f"dtp.plan: batch {self.batch} must be divisible by dp × ep × microbatches = {data}")
        if self.seq % (self.cp * (self.tp if self.sp else 1)):
            raise ValueError(f"dtp.plan: seq {self.seq} must be divisible by cp{' × tp' if self.sp else ''}")
        # A V schedule holds two chunks per rank: the default 1 reads as its 2.
        object.__setattr__(self, "virtual_stages", schedules.chunks_per_rank(self.pp_schedule, self.virtual_stages))
        if self.pp > 1:
            schedules.check(self.pp_schedule, p=self.pp, v=self.virtual_stages, m=self.microbatches)
        self._resolve_layout()
        self._check_context()

    @staticmethod
    def arguments_of(config: RunConfig) -> tuple[llama.LlamaConfig, int, int, Layout, dict[str, Any]]:
        """What :func:`dtp.plan` reads of a :class:`dtp.RunConfig`: the model, batch, sequence,
        the run's own layout, and the other fields the plan models.

        >>> Setup.arguments_of(RunConfig(dp=2, zero=1))[4]["zero"]
        1
        """
        cfg = llama.config_for(config.model, init_from=config.init_from, **config.model_overrides())
        fields = ("dp", "tp", "cp", "pp", "pp_schedule", "virtual_stages", "ep", "zero", "bucket_mb",
                  "reshard_after_forward", "microbatches", "recompute", "dtype", "precision")
        parallel = {k: getattr(config, k) for k in fields}
        parallel["sp"] = config.sp and config.tp > 1
        parallel["async_tp"] = config.async_tp and parallel["sp"]
        return cfg, config.batch, config.seq, config.layout(), parallel

    def _context_keywords(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("cp_algo", "cp_window", "ulysses_degree", "cp_head_chunks")
                if getattr(self, k) is not None}

    def _resolve_layout(self) -> None:
        """Fill in ``layout`` (frozen: set once, here), or check that a given one agrees
        with context keywords also given (``dataclasses.replace`` passes both back)."""
        try:
            built = layout_for(self) if self.layout is None or self._context_keywords() else None
        except ValueError as e:  # the presets' own checks (a double ring without a window, ...)
            raise ValueError(f"dtp.plan: {e}") from None
        if self.layout is None:
            object.__setattr__(self, "layout", built)
        elif built is not None and self.cp > 1 and built.context != self.layout.context:
            raise ValueError(f"dtp.plan: the context keywords {self._context_keywords()} disagree with "
                             f"layout={self.layout.name}'s {self.layout.context}; give them in one place")

    def _check_context(self) -> None:
        """What ``dtp train``'s preflight checks of context parallel, on the stand-in mesh:
        the algorithm's rules against the model's heads, and the sequence against the split."""
        if self.cp == 1:
            return
        assert self.layout is not None
        ctx = self.layout.context
        if ctx is None or ctx.axis != "cp":
            raise ValueError(f"dtp.plan: cp={self.cp} but the layout {self.layout.name} has no context parallel "
                             f"over 'cp' (layouts.context): the plan would not know how attention runs")
        mesh = MeshShape(self.axes)
        ctx.check(llama.axis_sizes(self.cfg), mesh, tp=self.layout.degree("heads", mesh), what="dtp.plan")
        check_divisible(self.seq, self.cp, ctx.load_balance, what=f"dtp.plan: seq {self.seq}")

    @property
    def context(self) -> ContextOptions | None:
        """How attention runs over cp: the layout's context options (``None`` at cp = 1)."""
        return self.layout.context if self.cp > 1 and self.layout is not None else None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def axes(self) -> dict[str, int]:
        """The mesh ``dtp train`` builds (:func:`dtp.config.mesh_axes_of`)."""
        return mesh_axes_of(pp=self.pp, dp=self.dp, ep=self.ep, cp=self.cp, tp=self.tp)

    @property
    def world(self) -> int:
        return math.prod(self.axes.values())

    @property
    def microbatch(self) -> int:
        """Sequences per rank per microbatch (ep is a data axis too)."""
        return self.batch // (self.dp * self.ep * self.microbatches)

    @property
    def tokens(self) -> int:
        """Tokens a rank computes per microbatch in attention and the MLP (sequence over cp)."""
        return self.microbatch * self.seq // self.cp

    @property
    def residual_tokens(self) -> int:
        """Tokens a rank holds in the residual stream (sequence over cp, and tp with SP)."""
        return self.tokens // (self.tp if self.sp and self.tp > 1 else 1)


def layout_for(s: Setup) -> Layout:
    """The layout ``dtp train`` builds from the same options: :meth:`dtp.RunConfig.layout`
    (one place builds it; options ``Setup`` has no field for, such as the expert ones, keep
    their defaults).

    >>> layout_for(Setup(cp=4, cp_algo="double_ring", cp_window=2, seq=16)).context.window
    2
    """
    return RunConfig(sp=s.sp and s.tp > 1, async_tp=s.async_tp and s.sp and s.tp > 1, cp=s.cp, cp_algo=s.cp_algo,
                     cp_window=s.cp_window,
                     ulysses_degree=s.ulysses_degree, cp_head_chunks=s.cp_head_chunks, zero=s.zero,
                     bucket_mb=s.bucket_mb, reshard_after_forward=s.reshard_after_forward, ep=s.ep, pp=s.pp,
                     pp_schedule=s.pp_schedule, virtual_stages=s.virtual_stages, dp=s.dp, tp=s.tp,
                     microbatches=s.microbatches, batch=s.batch, seq=s.seq, dtype=s.dtype,
                     precision=s.precision).layout()


@dataclass(frozen=True)
class Leaf:
    """One parameter as a rank holds it."""

    path: str
    shape: tuple[int, ...]  # global
    local: tuple[int, ...]  # this rank's shard
    spec: P
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.local)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def splits(self, axis: str) -> bool:
        return axis in self.spec.used_axes()


def leaves(s: Setup, layout: Layout | None = None) -> list[Leaf]:
    """Every parameter in forward use order (ZeRO's bucket order), with its local shape.

    >>> [(l.path, l.local) for l in leaves(Setup(cfg=llama.config("tiny"), tp=2))][:3]
    [('embed', (128, 64)), ('layers.0.attn_norm', (64,)), ('layers.0.wq', (64, 32))]
    """
    layout = s.layout if layout is None else layout
    assert layout is not None  # Setup fills it in
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


def rank_chunks(s: Setup, rank: int) -> list[tuple[int, range]]:
    """Per chunk of pipeline ``rank`` (chunk order): its global stage and the layers of
    :func:`dtp.models.llama.sequential` (embedding, blocks, head) it runs, by the
    schedule's own stage map (:func:`dtp.schedules.global_stage`). One chunk of every
    layer without a pipeline.

    >>> s = Setup(cfg=llama.config("tiny"), pp=2, pp_schedule="zbv", microbatches=2, seq=32)
    >>> rank_chunks(s, 0), rank_chunks(s, 1)
    ([(0, range(0, 1)), (3, range(3, 4))], [(1, range(1, 2)), (2, range(2, 3))])
    """
    ranges = assign(n_sequential_layers(s.cfg), s.pp, s.virtual_stages)
    where = schedules.placement(s.pp_schedule)
    stages = [schedules.global_stage(c, rank, s.pp, where) for c in range(s.virtual_stages)]
    return [(g, range(*ranges[g])) for g in stages]


def rank_stages(s: Setup, rank: int) -> str:
    """The global stages pipeline ``rank`` holds and what is in them, in words: the
    schedule's own stage-to-rank map (:func:`dtp.schedules.global_stage`), so a V schedule's
    rank 0 reads as holding the first and the last stage.

    >>> s = Setup(cfg=llama.config("tiny"), pp=2, tp=2, pp_schedule="zbv", microbatches=4, seq=32)
    >>> rank_stages(s, 0), rank_stages(s, 1)
    ('stages 0, 3 of 4: embedding, head', 'stages 1, 2 of 4: blocks 0-1')
    >>> rank_stages(Setup(cfg=llama.config("tiny"), pp=2, microbatches=2, seq=32), 0)
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
    head = f"stage{'s' * (len(stages) > 1)} {', '.join(map(str, sorted(stages)))} of {s.pp * s.virtual_stages}"
    return f"{head}: {', '.join(parts)}"


def stage_leaves(s: Setup, all_leaves: list[Leaf]) -> list[list[Leaf]]:
    """The parameters each pipeline rank holds (one list when pp = 1)."""
    if s.pp == 1:
        return [all_leaves]
    n_seq = n_sequential_layers(s.cfg)  # embed | blocks | head (llama.sequential)
    ranges = assign(n_seq, s.pp, s.virtual_stages, what=f"dtp.plan: pp={s.pp} virtual_stages={s.virtual_stages}")
    out: list[list[Leaf]] = [[] for _ in range(s.pp)]
    for stage, (first, stop) in enumerate(ranges):
        rank = schedules.stage_owner(stage, s.pp, schedules.placement(s.pp_schedule))[0]
        for layer in range(first, stop):
            if layer == 0:
                names = {"embed"}
            elif layer == n_seq - 1:
                names = {"final_norm", "embed" if s.cfg.tie_embeddings else "lm_head"}
            else:
                names = None
            for leaf in all_leaves:
                if (names is not None and leaf.path in names) or \
                        (names is None and leaf.path.startswith(f"layers.{layer - 1}.")):
                    if leaf not in out[rank]:
                        out[rank].append(leaf)
    return out
