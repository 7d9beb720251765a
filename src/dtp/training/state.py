"""``TrainState``: step, parameters, optimizer state and the static layout context —
plain data that never communicates — and the two calls that reach what it holds
(:func:`gather_params`, :func:`wait`)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import guard
from . import strategies
from .buffers import lay_out as lay_out_buffers
from ..layouts import Layout
from ..core.mesh.devices import mesh_device
from .optim import GradientTransformation
from ..core.spec import P, shard, spec_of
from .strategies import PLAIN, StrategyState

__all__ = ["TrainState", "gather_params", "wait"]

PyTree = Any


def _is_axes(x: object) -> bool:
    # None names no logical axis: that dim is replicated (JAX / Flax's logical partitioning;
    # Layout.param_spec maps it to no mesh axis).
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


@dataclass(frozen=True, repr=False, eq=False)
class TrainState:
    """Step, parameters and optimizer state (a pytree), plus the static layout context.

    Plain data: reading a field returns what is stored and never communicates.
    ``params``/``opt_state`` are pytrees of DTensors laid out as ``layout`` says on
    ``mesh``; ``axes`` holds each parameter's logical axis names. Functions take a state
    and return a new one; nothing is modified in place.

    ``strategy`` is what the step's strategy keeps between steps, an object that answers
    for itself (:class:`dtp.strategies.StrategyState`: what it owns, gathers, waits for,
    saves and loads). Under ``layouts.zero(stage)`` (see :mod:`dtp.strategies.zero`) it
    holds the buckets, this rank's fp32 master-weight slices and (stage 1/2) the gathered parameter
    buffers; ``opt_state`` covers the master slices. Both come with the first step,
    which orders the buckets by first use: before it ``opt_state`` is ``None``
    (``optimizer.init(state.params)`` is the state it starts from), or the per-parameter
    state :func:`dtp.checkpoint.load` brought, which step one cuts into the buckets. Stage 1/2 ``params``
    are views of buffers that ``overlap_param_gather`` may still be filling, and stage 3
    keeps no whole parameters at all (``params`` is ``None`` after the first step):
    :func:`gather_params` is the one call that waits for, or gathers, them.

    ``buffers`` is the non-trainable collection (:mod:`dtp.buffers`: aux-loss-free
    balancing's router bias): ``loss_fn`` reads it laid over the parameters, the
    optimizer never sees it, and ``buffer_update`` renews it after each applied step.

    >>> import functools
    >>> from dtp.models import llama
    >>> cfg = llama.config("tiny", n_layers=1)
    >>> with dtp.testing.simulate(2):
    ...     mesh = dtp.make_mesh(tp=2)
    ...     state = TrainState.create(llama.init(cfg), dtp.optim.adamw(1e-3), mesh=mesh,
    ...                               layout=dtp.layouts.megatron(), axes=llama.param_axes(cfg))
    ...     print(state.step, dtp.spec_of(state.params["layers"][0]["wq"]))
    0 P(None, 'tp')
    """

    step: int
    params: PyTree
    opt_state: PyTree
    optimizer: GradientTransformation
    mesh: DeviceMesh
    layout: Layout
    axes: PyTree
    strategy: StrategyState = PLAIN  # the strategy's own state: ZeRO's buckets, master weights, or PLAIN
    checks: guard.Agreements = dataclasses.field(default_factory=guard.Agreements)  # what the ranks agreed on
    buffers: PyTree = None  # state no gradient trains (dtp.buffers), or None
    buffer_update: Callable[[PyTree, Any], PyTree] | None = None  # (buffers, aux) -> buffers after each step

    def __post_init__(self) -> None:
        if self.strategy is None:  # a run's finish() with nothing to keep
            object.__setattr__(self, "strategy", PLAIN)

    @property
    def zero(self) -> StrategyState:
        """Deprecated alias of :attr:`strategy` (its name until dtp 0.1; removed in the next release)."""
        warnings.warn("TrainState.zero is now TrainState.strategy (the strategy's state, ZeRO's or another's)",
                      DeprecationWarning, stacklevel=2)
        return self.strategy

    @classmethod
    def create(cls, params: PyTree, optimizer: GradientTransformation, *, mesh: DeviceMesh, layout: Layout,
               axes: PyTree, axis_sizes: Mapping[str, int] | None = None, buffers: PyTree = None,
               buffer_update: Callable[[PyTree, Any], PyTree] | None = None) -> "TrainState":
        """Lay global ``params`` (identical on every rank) out as ``layout`` says.

        ``axes`` mirrors ``params``: per parameter a tuple of logical axis names, one per
        dim (``None`` for a dim no axis splits, as in Flax).

        ``axis_sizes`` (e.g. ``llama.axis_sizes(cfg)``: heads, kv_heads, vocab …) are
        checked against the layout first, so a bad split is a clear ``ValueError`` on
        every rank before any collective runs. Then the ranks agree (:mod:`dtp.guard`:
        one small all-gather) that they were given the same mesh, layout and parameters,
        and any rank's validation error is raised on every rank.

        ``buffers`` (whole tensors, e.g. ``llama.init_buffers(cfg)``) are replicated on
        the mesh; ``buffer_update`` (e.g. ``llama.buffer_update(cfg)``) renews them after
        each step from the step's aux (:mod:`dtp.buffers`).

        >>> from dtp import layouts
        >>> with simulate(2):
        ...     state = dtp.TrainState.create({"w": torch.arange(4.0)}, dtp.optim.sgd(0.1),
        ...                                   mesh=make_mesh(tp=2), layout=layouts.megatron(), axes={"w": ("mlp",)})
        ...     state.step, state.param_specs()["w"], rank_values(state.params["w"].to_local())
        (0, P('tp'), [tensor([0., 1.]), tensor([2., 3.])])
        """
        leaves, treedef = optree.tree_flatten(params)
        paths = [".".join(map(str, p)) for p in optree.tree_paths(params)]
        error, sharded, axes_leaves = None, [], [None] * len(leaves)
        try:
            axes_leaves = treedef.flatten_up_to(axes)
            layout.check_mesh(mesh)
            buffers = lay_out_buffers(buffers, mesh)
            if axis_sizes:
                layout.check_sizes(axis_sizes, mesh, what="TrainState.create")
            sharded = _lay_out(paths, leaves, axes_leaves, mesh, layout)
        except (ValueError, TypeError) as e:
            error = e
        guard.check_state(mesh, layout, dict(zip(paths, leaves)), dict(zip(paths, axes_leaves)), error)
        checks = _agreements(leaves, axes_leaves)
        params = optree.tree_unflatten(treedef, sharded)
        opt_state, strategy = strategies.create(params, optimizer, layout, mesh)
        return cls(0, params, opt_state, optimizer, mesh, layout, axes, strategy, checks, buffers or None,
                   buffer_update)

    @classmethod
    def from_hf(cls, path: str, optimizer: GradientTransformation, *, mesh: DeviceMesh, layout: Layout,
                dtype: torch.dtype = torch.float32, vocab_multiple: int = 1, weights: bool = True) -> "TrainState":
        """The state of a Hugging Face directory's model, each rank reading only what it
        holds (blocks, ZeRO slices, stages: :func:`dtp.hf_state.state_from_hf`); it trains
        as ``create(models.hf.from_hf(path, dtype, vocab_multiple)[1], ...)`` does.
        ``weights=False``: zeros in its place, only ``config.json`` read (a state that
        :func:`dtp.checkpoint.load` then fills, ``like=`` it)."""
        # Here, not at the top: only a from_hf pays for the Hugging Face readers (models.hf).
        from .hf_state import state_from_hf

        return state_from_hf(cls, path, optimizer, mesh=mesh, layout=layout, dtype=dtype, vocab_multiple=vocab_multiple,
                             weights=weights)

    def replace(self, **changes: Any) -> "TrainState":
        if "zero" in changes:  # the field's name until dtp 0.1 (TrainState.zero)
            if "strategy" in changes:
                raise TypeError("TrainState.replace: zero= is the old name of strategy=; give one of them")
            warnings.warn("TrainState.replace(zero=...) is now replace(strategy=...)", DeprecationWarning, stacklevel=2)
            changes["strategy"] = changes.pop("zero")
        if "params" in changes and "strategy" not in changes and self.strategy.owns_params:
            raise ValueError("TrainState.replace: the parameters derive from the master weights (ZeRO's buckets "
                             "and slices, or mixed precision's); new parameters need a new state (TrainState.create)")
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        extra = self.strategy.describe()
        return f"TrainState(step={self.step}, layout={self.layout.name or 'custom'!r}, mesh={self.mesh}{extra})"

    def param_specs(self) -> PyTree:
        """Each parameter's spec at rest (``None`` for the plain tensors of a 1-device mesh)."""
        return optree.tree_map(_spec, self.params, none_is_leaf=True)


_CHILDREN = ("params", "opt_state", "strategy", "buffers")  # the tensors; the rest is static
_STATIC = ("step", "optimizer", "mesh", "layout", "axes", "checks", "buffer_update")


def _lay_out(paths: list[str], leaves: list[torch.Tensor], axes_leaves: list[Any], mesh: DeviceMesh,
             layout: Layout) -> list[torch.Tensor]:
    sharded = []
    for path, x, ax in zip(paths, leaves, axes_leaves):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"TrainState.create: param {path} must be a tensor, got {type(x).__name__}")
        if not x.is_floating_point():  # was torch's RuntimeError, past the guard: the other ranks hung in it
            raise TypeError(f"TrainState.create: param {path} is {x.dtype}; parameters are floating point (an "
                            f"integer table that does not train goes in buffers=)")
        if not _is_axes(ax) or len(ax) != x.dim():
            raise ValueError(f"param {path}: logical axes {ax!r} do not match its shape {tuple(x.shape)}; give a "
                             f"tuple of {x.dim()} logical axis names (str, or None for a dim no axis splits)")
        if _single_device(mesh):
            # One device: nothing to distribute, so no DTensor dispatch either. Every
            # dtp function takes plain tensors; the model runs as eager PyTorch, on the
            # mesh's device (a one-GPU run computes on the GPU, not where init made them).
            sharded.append(x.detach().to(mesh_device(mesh), copy=True).requires_grad_(True))
            continue
        spec = layout.param_spec(ax, mesh, name=f"param {path}")
        sharded.append(shard(x.detach(), mesh, spec, name=f"param {path}").requires_grad_(True))
    return sharded


def _agreements(leaves: list[torch.Tensor], axes_leaves: list[Any]) -> guard.Agreements:
    """The static facts later checks need: the vocab size (ids are checked against it)
    and the parameters' floating dtype (a float batch entry must match it)."""
    vocab = next((x.shape[ax.index("vocab")] for x, ax in zip(leaves, axes_leaves) if "vocab" in ax), None)
    floats = {x.dtype for x in leaves if x.is_floating_point()}
    return guard.Agreements(vocab=vocab, param_dtype=floats.pop() if len(floats) == 1 else None)

optree.register_pytree_node(
    TrainState,
    lambda s: (tuple(getattr(s, f) for f in _CHILDREN), tuple(getattr(s, f) for f in _STATIC), _CHILDREN),
    lambda static, children: TrainState(**dict(zip(_STATIC, static)), **dict(zip(_CHILDREN, children))),
    namespace="dtp",
)


def gather_params(state: TrainState) -> PyTree:
    """The whole parameter tree, laid out as the layout says — the explicit call.

    Without ZeRO it is ``state.params``. Under ZeRO stage 1/2 it waits for parameter
    all-gathers still in flight (``overlap_param_gather``; no new collective). Under
    stage 3 it all-gathers every bucket: a collective, so call it on every rank.

    >>> mesh = dtp.make_mesh(dp=1)                  # one process: a mesh of one device
    >>> state = dtp.TrainState.create({"w": torch.ones(2)}, dtp.optim.sgd(0.1), mesh=mesh,
    ...                               layout=dtp.layouts.data(), axes={"w": ("embed",)})
    >>> dtp.gather_params(state)["w"]
    tensor([1., 1.], requires_grad=True)
    """
    return strategies.gather(state.params, state.strategy, state.layout, state.mesh)


def wait(state: TrainState) -> None:
    """Wait for every collective ``state`` still has in flight; starts none.

    Under ZeRO stage 1/2 with ``overlap_param_gather`` a step returns with the next
    step's parameter all-gathers still on the wire (the next forward waits for them
    bucket by bucket). After the last step nothing waits for them: call ``wait(state)``
    on every rank before ``torch.distributed.destroy_process_group()`` or the end of the
    process. Without it, on gloo, a gather that completes during interpreter shutdown
    aborts the process (``terminate called without an active exception``; measured on
    torch 2.13: 3 runs of 3 at dp=4); a process that ends normally has them waited for by
    :mod:`dtp.comm`'s exit handler, the fallback for a loop that forgot this call. Waiting
    twice, or on a state with nothing in flight, is a no-op.

    >>> mesh = dtp.make_mesh(dp=1)                  # one process: a mesh of one device
    >>> state = dtp.TrainState.create({"w": torch.ones(2)}, dtp.optim.sgd(0.1), mesh=mesh,
    ...                               layout=dtp.layouts.data(), axes={"w": ("embed",)})
    >>> dtp.wait(state)                             # nothing in flight: returns at once
    """
    state.strategy.wait()


def _single_device(mesh: DeviceMesh | None) -> bool:
    return mesh is None or mesh.size() == 1


def _spec(x: torch.Tensor) -> P | None:
    return spec_of(x) if isinstance(x, DTensor) else None
