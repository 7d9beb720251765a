"""``TrainState`` and ``train_step``: training as a pure function over placements.

>>> mesh = dtp.make_mesh(dp=2, tp=2)                                       # doctest: +SKIP
>>> state = dtp.TrainState.create(llama.init(cfg), dtp.optim.adamw(3e-3), mesh=mesh,
...                               layout=layouts.data() + layouts.megatron(True), axes=llama.param_axes(cfg))
>>> state, metrics = dtp.train_step(partial(llama.loss, cfg=cfg), state, dtp.shard_batch(batch, state))
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import zero as zero_mod
from .comm import comm_log, span
from .layouts import Layout, use_layout
from .optim import GradientTransformation, apply_updates, clip_by_global_norm, global_norm
from .ops.recompute import POLICIES, recompute as recompute_policy
from .redistribute import from_local, reshard
from .spec import P, shard, spec_of

__all__ = ["TrainState", "train_step", "value_and_grad", "shard_batch"]

PyTree = Any
_BATCH_AXES = ("batch", "seq")


def _is_axes(x: object) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


@dataclass(frozen=True, repr=False, eq=False)
class TrainState:
    """Step, parameters and optimizer state (a pytree), plus the static layout context.

    ``params``/``opt_state`` are pytrees of DTensors laid out as ``layout`` says on
    ``mesh``; ``axes`` holds each parameter's logical axis names. Functions take a state
    and return a new one; nothing is modified in place.

    Under ``layouts.zero(stage)`` (see :mod:`dtp.zero`), ``opt_state`` holds the
    optimizer state of this rank's flat bucket slices (built in the first step, ``None``
    before), ``zero`` the master-weight slices and any parameter all-gathers still in
    flight. Reading ``state.params`` is always safe: it waits for those gathers (no new
    collective); under stage 3, whose parameters rest as slices, it all-gathers them — a
    collective, so read it on every rank (for a checkpoint, say).
    """

    step: int
    params: PyTree
    opt_state: PyTree
    optimizer: GradientTransformation
    mesh: DeviceMesh
    layout: Layout
    axes: PyTree
    zero: "zero_mod.ZeroState | None" = None

    def __getattribute__(self, name: str) -> Any:
        if name == "params":
            z = object.__getattribute__(self, "zero")
            if z is not None:
                return z.full_params(object.__getattribute__(self, "params"))
        return object.__getattribute__(self, name)

    @classmethod
    def create(cls, params: PyTree, optimizer: GradientTransformation, *, mesh: DeviceMesh, layout: Layout,
               axes: PyTree, axis_sizes: Mapping[str, int] | None = None) -> "TrainState":
        """Lay global ``params`` (identical on every rank) out as ``layout`` says.

        ``axis_sizes`` (e.g. ``llama.axis_sizes(cfg)``: heads, kv_heads, vocab …) are
        checked against the layout first, so a bad split is a clear ``ValueError`` on
        every rank before any collective runs.
        """
        if axis_sizes:
            layout.check_sizes(axis_sizes, mesh)
        leaves, treedef = optree.tree_flatten(params)
        axes_leaves = treedef.flatten_up_to(axes)
        paths = [".".join(map(str, p)) for p in optree.tree_paths(params)]
        sharded = []
        for path, x, ax in zip(paths, leaves, axes_leaves):
            if not _is_axes(ax) or len(ax) != x.dim():
                raise ValueError(f"param {path}: logical axes {ax!r} do not match its shape {tuple(x.shape)}")
            if _single_device(mesh):
                # One device: nothing to distribute, so no DTensor dispatch either. Every
                # dtp function takes plain tensors; the model runs as eager PyTorch.
                sharded.append(x.detach().clone().requires_grad_(True))
                continue
            spec = layout.param_spec(ax, mesh)
            sharded.append(shard(x.detach(), mesh, spec, name=f"param {path}").requires_grad_(True))
        params = optree.tree_unflatten(treedef, sharded)
        zero_opts = None if _single_device(mesh) else zero_mod.options(layout, mesh)
        if zero_opts is not None:  # buckets (and the sharded optimizer state) come in step one
            return cls(0, params, None, optimizer, mesh, layout, axes, zero_mod.create(params, zero_opts))
        return cls(0, params, optimizer.init(params), optimizer, mesh, layout, axes)

    def replace(self, **changes: Any) -> "TrainState":
        # Field by field as stored: copying a state must not wait for, or gather, params.
        values = {f.name: object.__getattribute__(self, f.name) for f in dataclasses.fields(self)}
        zero = changes.get("zero", values["zero"])
        if "params" in changes and "zero" not in changes and zero is not None and zero.plan is not None:
            raise ValueError("TrainState.replace: under ZeRO the parameters live in the buckets and master "
                             "slices; new parameters need a new state (TrainState.create)")
        return TrainState(**{**values, **changes})

    def __repr__(self) -> str:  # never reads params (under ZeRO-3 that is a collective)
        zero = object.__getattribute__(self, "zero")
        extra = f", zero=stage {zero.stage}" if zero is not None else ""
        return f"TrainState(step={self.step}, layout={self.layout.name or 'custom'!r}, mesh={self.mesh}{extra})"

    def param_specs(self) -> PyTree:
        """Each parameter's spec at rest (``None`` for the plain tensors of a 1-device mesh)."""
        return optree.tree_map(_spec, self.params, none_is_leaf=True)


def _stored_params(s: TrainState) -> PyTree:
    """The params as stored: in-flight gathers waited for (local), never gathered anew —
    under ZeRO-3 that is ``None`` and the state's leaves are its master slices."""
    zero = object.__getattribute__(s, "zero")
    if zero is not None:
        zero.wait()
    return object.__getattribute__(s, "params")


optree.register_pytree_node(
    TrainState,
    lambda s: ((_stored_params(s), s.opt_state, s.zero), (s.step, s.optimizer, s.mesh, s.layout, s.axes),
               ("params", "opt_state", "zero")),
    lambda aux, children: TrainState(aux[0], children[0], children[1], *aux[1:], children[2]),
    namespace="dtp",
)


def shard_batch(batch: Mapping[str, torch.Tensor], state: TrainState) -> dict[str, DTensor]:
    """Place global (batch, seq) tensors where the layout computes them (batch on dp …).

    Every rank passes the same global batch (the loader is deterministic).
    """
    if _single_device(state.mesh):
        return dict(batch)
    out = {}
    for k, v in batch.items():
        spec = state.layout.activation_spec(_BATCH_AXES[: v.dim()], state.mesh)
        if v.dim() > 1:
            # The layout owns the sequence order (zigzag: rank r's chunks r and 2·cp−1−r
            # side by side). Tokens and targets move together, so the mean loss is unchanged.
            v = state.layout.to_cp_order(v, 1, state.mesh)
        out[k] = shard(v, state.mesh, spec, name=f"batch[{k!r}]")
    return out


def _single_device(mesh: DeviceMesh) -> bool:
    return mesh.size() == 1


def _spec(x: torch.Tensor) -> P | None:
    return spec_of(x) if isinstance(x, DTensor) else None


def _split_microbatches(batch: Mapping[str, DTensor], n: int) -> list[dict[str, DTensor]]:
    if n == 1:
        return [dict(batch)]
    parts: list[dict[str, DTensor]] = [{} for _ in range(n)]
    for k, v in batch.items():
        if not isinstance(v, DTensor):
            for i, piece in enumerate(v.chunk(n, dim=0)):
                parts[i][k] = piece
            continue
        spec = spec_of(v)
        # Each rank cuts its own rows: microbatch i is every rank's i-th slice (a
        # different grouping of the same global rows, which the mean does not see).
        for i, piece in enumerate(v.to_local().chunk(n, dim=0)):
            shape = (v.shape[0] // n, *v.shape[1:])
            parts[i][k] = from_local(piece, v.device_mesh, spec, shape)
    return parts


def _check_inputs(batch: Mapping[str, torch.Tensor], state: TrainState, microbatches: int,
                  recompute: str | None) -> None:
    if recompute not in POLICIES:
        raise ValueError(f"train_step: recompute must be one of {POLICIES}, got {recompute!r}")
    if microbatches < 1:
        raise ValueError(f"train_step: microbatches must be >= 1, got {microbatches}")
    dp = state.layout.degree("batch", state.mesh)
    for k, v in batch.items():
        if not isinstance(v, DTensor) and not _single_device(state.mesh):
            raise ValueError(f"train_step: batch[{k!r}] is a plain tensor; place it with dtp.shard_batch(batch, state)")
        if v.shape[0] % (dp * microbatches):
            raise ValueError(
                f"train_step: batch[{k!r}] has batch size {v.shape[0]}, not divisible by the batch split "
                f"{dp} × microbatches {microbatches} = {dp * microbatches}"
            )


def _value(x: torch.Tensor) -> float:
    return float(x.to_local() if isinstance(x, DTensor) else x)


def value_and_grad(loss_fn: Callable[[PyTree, Mapping[str, torch.Tensor]], Any], state: TrainState,
                   batch: Mapping[str, torch.Tensor], *, microbatches: int = 1,
                   recompute: str | None = None) -> tuple[float, Any, PyTree]:
    """Mean loss, aux and gradients laid out like the parameters (what ``train_step`` uses).

    Gradient accumulation equals one big batch: each microbatch's mean is weighted 1/m.
    """
    if state.zero is not None:
        raise ValueError("value_and_grad: a ZeRO state's gradients are reduce-scattered into bucket slices "
                         "inside dtp.train_step; call train_step (or drop layouts.zero)")
    _check_inputs(batch, state, microbatches, recompute)
    leaves, treedef = optree.tree_flatten(state.params)
    with use_layout(state.layout, state.mesh), recompute_policy(recompute):
        grads: list[torch.Tensor | None] = [None] * len(leaves)
        total_loss, aux = 0.0, None
        for mb in _split_microbatches(batch, microbatches):
            with span("forward"):
                out = loss_fn(optree.tree_unflatten(treedef, leaves), mb)
            loss, aux = out if isinstance(out, tuple) else (out, None)
            with span("backward"):
                mb_grads = torch.autograd.grad(loss / microbatches, leaves, allow_unused=True)
            for i, g in enumerate(mb_grads):
                if g is None:
                    continue
                if grads[i] is None:
                    grads[i] = g
                else:  # accumulate in the accumulator's layout (pending sums add locally)
                    grads[i] = grads[i] + (g if _spec(g) == _spec(grads[i]) else reshard(g, spec_of(grads[i])))
            total_loss += _value(loss.detach()) / microbatches
        # To the parameters' layout: pending sums over dp become all-reduces (DDP).
        reduced = []
        for g, p in zip(grads, leaves):
            g = torch.zeros_like(p) if g is None else g
            reduced.append(reshard(g, spec_of(p), tag="grad reduce") if _spec(g) != _spec(p) else g)
    return total_loss, aux, optree.tree_unflatten(treedef, reduced)


def train_step(loss_fn: Callable[[PyTree, Mapping[str, torch.Tensor]], Any], state: TrainState,
               batch: Mapping[str, torch.Tensor], *, microbatches: int = 1, recompute: str | None = None,
               clip_norm: float | None = None) -> tuple[TrainState, dict[str, Any]]:
    """One optimizer step: forward/backward over ``microbatches``, gradient reduction to
    the parameters' layout, optional global-norm clipping, the optimizer update.

    ``loss_fn(params, batch)`` returns the mean loss (or ``(loss, aux)``).
    ``recompute`` is ``None``, ``"full"`` (each block) or ``"selective"`` (attention core).

    Metrics: ``loss``, ``grad_norm``, ``lr``, ``tokens``, ``step_time`` (s) and
    ``comm_bytes`` — ``{axis: {collective: bytes sent per rank}}`` from the comm log.
    """
    t0 = time.perf_counter()
    if state.zero is not None:
        return _zero_train_step(loss_fn, state, batch, microbatches, recompute, clip_norm, t0)
    with comm_log() as log:
        loss, aux, grads = value_and_grad(loss_fn, state, batch, microbatches=microbatches, recompute=recompute)
        with torch.no_grad(), span("update"):
            if clip_norm is not None:
                grads, norm = clip_by_global_norm(grads, clip_norm)
            else:
                norm = global_norm(grads)
            updates, opt_state = state.optimizer.update(grads, state.opt_state, state.params)
            params = apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), \
        _metrics(state, batch, loss, aux, norm, t0, log)


def _zero_train_step(loss_fn: Callable, state: TrainState, batch: Mapping[str, torch.Tensor], microbatches: int,
                     recompute: str | None, clip_norm: float | None, t0: float) -> tuple[TrainState, dict[str, Any]]:
    """``train_step`` under ZeRO: the forward reads parameters through the bucket view,
    backward reduce-scatters buckets, each rank updates its slices (see :mod:`dtp.zero`)."""
    _check_inputs(batch, state, microbatches, recompute)
    raw = object.__getattribute__(state, "params")
    with comm_log() as log:
        with use_layout(state.layout, state.mesh), recompute_policy(recompute):
            loss, aux, step = zero_mod.value_and_grad(loss_fn, state.zero, raw,
                                                      _split_microbatches(batch, microbatches))
        with torch.no_grad(), span("update"):
            new_zero, opt_state, norm = zero_mod.update(step, state.optimizer, state.opt_state, clip_norm)
    params = zero_mod.params_tree(new_zero) if new_zero.stage < 3 else None
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, zero=new_zero)
    return new, _metrics(state, batch, loss, aux, norm, t0, log)


def _metrics(state: TrainState, batch: Mapping[str, torch.Tensor], loss: float, aux: Any, norm: torch.Tensor,
             t0: float, log: Any) -> dict[str, Any]:
    tokens = batch["tokens"].numel() if "tokens" in batch else next(iter(batch.values())).numel()
    metrics = {
        "loss": loss,
        "grad_norm": float(norm),
        "lr": state.optimizer.schedule(state.step) if state.optimizer.schedule else float("nan"),
        "tokens": int(tokens),
        "step_time": time.perf_counter() - t0,
        "comm_bytes": log.summary(),
    }
    if aux is not None:
        metrics["aux"] = aux
    return metrics
