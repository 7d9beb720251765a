"""Functional optimizers (optax style) over pytrees of Tensors or DTensors.

An optimizer is a :class:`GradientTransformation`: a pair of pure functions

* ``init(params) -> state``
* ``update(grads, state, params) -> (updates, new_state)``

and training applies ``params = apply_updates(params, updates)`` — or, in one pass,
``params, state = step(opt, grads, state, params)``, which ``train_step`` uses: sgd and
adamw then write the new parameter with their last op, as torch.optim does (bit for bit
its single-tensor step), instead of an update tensor that a second pass adds. Nothing is
mutated: each function returns new tensors (a step is a pure function of its inputs).

Trees are anything :mod:`optree` flattens (dicts, lists, tuples, NamedTuples …) with
``torch.Tensor`` or ``DTensor`` leaves. Each DTensor leaf is updated shard by shard on
its local tensor, and the result (and the optimizer state) is laid out exactly like
the parameter, so an update never communicates. The one reduction, the gradient norm
in :func:`global_norm`, goes through :func:`dtp.reshard` and is therefore recorded in
:func:`dtp.comm_log`.

>>> params = {"w": torch.ones(3)}
>>> opt = chain(clip(1.0), adamw(warmup_cosine(1e-3, 10, 100), weight_decay=0.1))
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": torch.full((3,), 2.0)}, state, params)
>>> params = apply_updates(params, updates)

Step numbering follows optax: the k-th call of ``update`` (k = 0, 1, …) uses the
learning rate ``lr(k)``; Adam's bias correction uses ``k + 1`` like ``torch.optim``.
Updates are computed without autograd (under ``torch.no_grad``): these optimizers are
not meant to be differentiated through.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator, NamedTuple, Union

import optree
import torch
from torch.distributed.tensor import DTensor

from ._rules import accum_dtype
from .leafwise import local_of, map_local, paths, zeros_like_tree
from .redistribute import from_local, reshard
from .spec import P, spec_of

__all__ = ["state_part", "state_join", "GradientTransformation", "Schedule", "ScalarOrSchedule", "SGDState",
           "AdamWState", "sgd", "adamw", "clip", "chain", "constant", "warmup_cosine", "apply_updates", "step",
           "global_norm", "clip_by_global_norm", "map_param_trees", "measured_by"]

PyTree = Any
Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]


class GradientTransformation(NamedTuple):
    """An optimizer as two pure functions (optax's interface).

    ``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``;
    ``params`` may be ``None`` for transformations that do not read them.

    >>> opt = sgd(0.1)
    >>> state = opt.init({"w": torch.zeros(2)})
    >>> updates, state = opt.update({"w": torch.ones(2)}, state, {"w": torch.zeros(2)})
    >>> updates["w"]
    tensor([-0.1000, -0.1000])
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree | None], tuple[PyTree, PyTree]]
    # The learning-rate schedule, when the transformation has one (train_step reports it).
    schedule: Schedule | None = None
    # True when ``update`` treats every leaf on its own: applied to a sub-list of the
    # leaves (the state's per-leaf lists cut alike, shared scalars such as the count as
    # they are) it gives those leaves' part of the whole update. ZeRO then updates each
    # bucket as soon as its gradient arrives. sgd/adamw are; clip (a global norm) is not.
    elementwise: bool = False
    # ``apply(grads, state, params) -> (new_params, state)``: the update added to the
    # params in the same pass, where the transformation can (sgd, adamw): the last op
    # writes the new parameter instead of an update that a second pass adds, as
    # torch.optim does it (``p.add_(d, alpha=-lr)``, AdamW's ``p.mul_(1 - lr·wd)`` +
    # ``p.addcdiv_``). ``None``: :func:`step` runs ``update`` and :func:`apply_updates`.
    apply: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]] | None = None


class SGDState(NamedTuple):
    """State of :func:`sgd`: the update count and the momentum buffers (``None`` without momentum)."""
    count: torch.Tensor
    momentum: PyTree


class AdamWState(NamedTuple):
    """State of :func:`adamw`: the update count, first moments ``mu`` and second moments ``nu``."""
    count: torch.Tensor
    mu: PyTree
    nu: PyTree


# --------------------------------------------------------------------------- schedules


def constant(lr: float) -> Schedule:
    """A schedule that is ``lr`` at every step.

    >>> constant(3e-4)(1000)
    0.0003
    """
    value = float(lr)

    def schedule(step: int) -> float:
        return value

    return schedule


def warmup_cosine(peak_lr: float, warmup_steps: int, total_steps: int, final_lr: float = 0.0) -> Schedule:
    """Linear warm-up from 0 to ``peak_lr`` over ``warmup_steps``, then cosine decay to
    ``final_lr`` at ``total_steps``, constant ``final_lr`` after that.

    Like optax's ``warmup_cosine_decay_schedule`` (and Megatron's scheduler), step 0 has
    lr 0 when there is a warm-up; ``total_steps`` counts the warm-up steps too.

    >>> s = warmup_cosine(1.0, warmup_steps=10, total_steps=110, final_lr=0.1)
    >>> s(0), s(5), s(10), s(60), s(110), s(500)
    (0.0, 0.5, 1.0, 0.55, 0.1, 0.1)
    """
    if warmup_steps < 0 or total_steps < warmup_steps:
        raise ValueError(
            f"warmup_cosine: need 0 <= warmup_steps <= total_steps, got warmup_steps={warmup_steps}, "
            f"total_steps={total_steps}"
        )
    peak, final = float(peak_lr), float(final_lr)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return peak * step / warmup_steps
        if step >= total_steps:
            return final
        progress = (step - warmup_steps) / (total_steps - warmup_steps)
        return final + 0.5 * (peak - final) * (1.0 + math.cos(math.pi * progress))

    return schedule


def _as_schedule(lr: ScalarOrSchedule, name: str) -> Schedule:
    if callable(lr):
        return lr
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr < 0:
        raise ValueError(f"{name}: lr must be a non-negative number or a schedule step -> lr, got {lr!r}")
    return constant(lr)


# --------------------------------------------------------------------------- counts


def _next_count(count: torch.Tensor) -> tuple[torch.Tensor, int]:
    step = int(count) + 1
    return torch.tensor(step, dtype=torch.int64), step


# --------------------------------------------------------------------------- optimizers


def sgd(lr: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0) -> GradientTransformation:
    """Stochastic gradient descent with ``torch.optim.SGD`` semantics (no dampening).

    ``d = g + wd·p``; with momentum ``b = μ·b + d`` (``b = d`` on the first step) and
    ``d = b`` or, Nesterov, ``d = d + μ·b``; the update is ``-lr·d``.

    >>> opt = sgd(0.1, momentum=0.9, nesterov=True)
    >>> p = {"w": torch.ones(2)}
    >>> u, s = opt.update({"w": torch.ones(2)}, opt.init(p), p)
    >>> u["w"]
    tensor([-0.1900, -0.1900])
    """
    schedule = _as_schedule(lr, "sgd")
    if momentum < 0 or weight_decay < 0:
        raise ValueError(f"sgd: momentum and weight_decay must be >= 0, got {momentum}, {weight_decay}")
    if nesterov and momentum <= 0:
        raise ValueError("sgd: nesterov momentum needs momentum > 0")

    def init(params: PyTree) -> SGDState:
        buf = zeros_like_tree(params) if momentum else None
        return SGDState(torch.zeros((), dtype=torch.int64), buf)

    def run(grads: PyTree, state: SGDState, params: PyTree | None, apply: bool) -> tuple[PyTree, SGDState]:
        if (weight_decay or apply) and params is None:
            raise ValueError(f"sgd: {'weight_decay' if weight_decay else 'apply'} needs the params; "
                             f"call {'apply' if apply else 'update'}(grads, state, params)")
        count, step = _next_count(state.count)
        rate = float(schedule(step - 1))

        def kernel(gs, bufs, ps):
            # torch.optim.SGD's ops (its foreach path is its single-tensor one, op for op):
            # one call per op for every leaf instead of one per leaf.
            ds = torch._foreach_add(gs, ps, alpha=weight_decay) if weight_decay else gs
            if momentum:
                # A zero buffer makes the first step buf = d, as torch's lazy clone does.
                bufs = torch._foreach_mul(bufs, momentum)
                torch._foreach_add_(bufs, ds)
                ds = torch._foreach_add(ds, bufs, alpha=momentum) if nesterov else bufs
            # ``apply``: torch's ``p.add_(d, alpha=-lr)``, one pass; else the update -lr·d.
            out = torch._foreach_add(ps, ds, alpha=-rate) if apply else torch._foreach_mul(ds, -rate)
            return (out, bufs) if momentum else (out,)

        others = [("momentum buffer", state.momentum), ("param", params if weight_decay or apply else None)]
        if momentum:
            out, buf = map_local(kernel, grads, others, 2)
        else:
            out, = map_local(kernel, grads, others, 1)
            buf = None
        return (_as_params(out, params) if apply else out), SGDState(count, buf)

    def update(grads: PyTree, state: SGDState, params: PyTree | None = None) -> tuple[PyTree, SGDState]:
        return run(grads, state, params, apply=False)

    def apply(grads: PyTree, state: SGDState, params: PyTree) -> tuple[PyTree, SGDState]:
        return run(grads, state, params, apply=True)

    return GradientTransformation(init, update, schedule, elementwise=True, apply=apply)


def adamw(lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.0) -> GradientTransformation:
    """Adam with decoupled weight decay, step for step ``torch.optim.AdamW``.

    At step ``t`` (1-based): ``m = lerp(m, g, 1-b1)``, ``v = b2·v + (1-b2)·g²``,
    ``p ← p·(1 - lr·wd) - lr/(1-b1^t) · m / (√v / √(1-b2^t) + eps)``; the update returned
    is the difference to ``p``. State ``mu``/``nu`` has the params' dtype and placements,
    so float16 parameters are refused at ``init`` (their moments underflow: keep fp32 ones
    with ``layouts.mixed_precision()``), and so is an eps that rounds to 0 in that dtype.

    >>> opt = adamw(1e-3, weight_decay=0.01)
    >>> p = {"w": torch.ones(2)}
    >>> state = opt.init(p)
    >>> u, state = opt.update({"w": torch.ones(2)}, state, p)
    >>> int(state.count)
    1
    """
    schedule = _as_schedule(lr, "adamw")
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"adamw: betas must lie in [0, 1), got b1={b1}, b2={b2}")
    if eps <= 0 or weight_decay < 0:  # eps = 0: 0 / 0 wherever a gradient is 0 (an unused embedding row)
        raise ValueError(f"adamw: eps must be > 0 and weight_decay >= 0, got {eps}, {weight_decay}")

    def init(params: PyTree) -> AdamWState:
        _check_moments_hold(eps, b2, params)
        return AdamWState(torch.zeros((), dtype=torch.int64), zeros_like_tree(params), zeros_like_tree(params))

    def run(grads: PyTree, state: AdamWState, params: PyTree | None, apply: bool) -> tuple[PyTree, AdamWState]:
        if (weight_decay or apply) and params is None:
            raise ValueError(f"adamw: {'weight_decay' if weight_decay else 'apply'} needs the params; "
                             f"call {'apply' if apply else 'update'}(grads, state, params)")
        count, step = _next_count(state.count)
        rate = float(schedule(step - 1))
        # The same scalar algebra as torch's single-tensor AdamW, so trajectories agree to
        # rounding: step_size = lr / bc1, denom = sqrt(v) / sqrt(bc2) + eps.
        step_size = rate / (1.0 - b1**step)
        bc2_sqrt = (1.0 - b2**step) ** 0.5

        def kernel(gs, ms, vs, ps):
            # The single-tensor ops in the same order, each over every leaf at once.
            ms = torch._foreach_lerp(ms, gs, 1.0 - b1)
            vs = torch._foreach_mul(vs, b2)
            torch._foreach_addcmul_(vs, gs, gs, value=1.0 - b2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            if apply:  # torch's p.mul_(1 - lr·wd); p.addcdiv_(m, denom, value=-step_size)
                if weight_decay:
                    out = torch._foreach_mul(ps, 1.0 - rate * weight_decay)
                    torch._foreach_addcdiv_(out, ms, denom, value=-step_size)
                else:
                    out = torch._foreach_addcdiv(ps, ms, denom, value=-step_size)
            elif weight_decay:
                # p·(1 - lr·wd) - p = -lr·wd·p: decoupled decay, not added to the gradient.
                out = torch._foreach_mul(ps, -rate * weight_decay)
                torch._foreach_addcdiv_(out, ms, denom, value=-step_size)
            else:
                out = torch._foreach_div(ms, denom)
                torch._foreach_mul_(out, -step_size)
            return out, ms, vs

        others = [("first moment", state.mu), ("second moment", state.nu),
                  ("param", params if weight_decay or apply else None)]
        out, mu, nu = map_local(kernel, grads, others, 3)
        return (_as_params(out, params) if apply else out), AdamWState(count, mu, nu)

    def update(grads: PyTree, state: AdamWState, params: PyTree | None = None) -> tuple[PyTree, AdamWState]:
        return run(grads, state, params, apply=False)

    def apply(grads: PyTree, state: AdamWState, params: PyTree) -> tuple[PyTree, AdamWState]:
        return run(grads, state, params, apply=True)

    return GradientTransformation(init, update, schedule, elementwise=True, apply=apply)


def _check_moments_hold(eps: float, b2: float, params: PyTree) -> None:
    """Refuse Adam moments in a dtype where the first step cannot be right (they take the
    parameters' dtype; ``torch.optim.AdamW`` takes these steps, silently):

    * float16: ``(1 - b2)·g²`` underflows to 0 for every ``|g|`` below ~5e-3 (b2 = 0.999) and the default
      eps 1e-8 rounds to 0, so small gradients divide by 0 (NaN, inf); a larger eps keeps
      the division finite but makes the update ``m / eps``, orders of magnitude past lr.
    * any dtype where ``eps`` rounds to 0 (e.g. float32 and 1e-46): 0 / 0 where g = 0.

    >>> _check_moments_hold(1e-8, 0.999, {"w": torch.ones(2, dtype=torch.bfloat16)})  # bf16: float32's range
    >>> _check_moments_hold(1e-8, 0.999, {"w": torch.ones(2, dtype=torch.float16)})
    Traceback (most recent call last):
    ValueError: adamw: float16 parameters make float16 moments, where (1 - b2)·g² underflows to 0 for |g| below 0.005 and eps=1e-08 rounds to 0: the first step's update is NaN or inf, or far past lr. Keep fp32 master weights and moments (+ layouts.mixed_precision()), or use bfloat16
    """
    for dtype in sorted({p.dtype for p in optree.tree_leaves(params)}, key=str):  # the same word on every rank
        if not dtype.is_floating_point:
            continue
        subnormal = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # the smallest one
        lost = float(torch.tensor(eps, dtype=dtype)) == 0.0
        if dtype == torch.float16:
            small = (subnormal / 2 / (1 - b2)) ** 0.5  # below it (1 - b2)·g² is under half a subnormal: 0
            raise ValueError(
                f"adamw: float16 parameters make float16 moments, where (1 - b2)·g² underflows to 0 for |g| below "
                f"{small:.1g}{f' and eps={eps:g} rounds to 0' if lost else ''}: the first step's update is NaN or "
                f"inf, or far past lr. Keep fp32 master weights and moments (+ layouts.mixed_precision()), or use "
                f"bfloat16")
        if lost:
            raise ValueError(f"adamw: eps={eps:g} rounds to 0 in {str(dtype).removeprefix('torch.')}, the moments' "
                             f"dtype: where a gradient is 0 the first step computes 0 / 0 (NaN); give eps >= "
                             f"{subnormal:.3g}")


def clip(max_norm: float) -> GradientTransformation:
    """Clip by global norm as a transformation (stateless), for :func:`chain`.

    >>> opt = chain(clip(1.0), sgd(0.1))
    """
    if max_norm <= 0:
        raise ValueError(f"clip: max_norm must be > 0, got {max_norm}")

    def init(params: PyTree) -> tuple:
        return ()

    def update(grads: PyTree, state: tuple, params: PyTree | None = None) -> tuple[PyTree, tuple]:
        return clip_by_global_norm(grads, max_norm)[0], state

    return GradientTransformation(init, update)


# The norm clip_by_global_norm takes inside measured_by: train_step's strategy's (a pipeline
# rank holds its stages' gradients only; that norm sums every stage's over pp).
_measure: contextvars.ContextVar[Any] = contextvars.ContextVar("measure", default=None)


@contextlib.contextmanager
def measured_by(norm: Callable[[PyTree], torch.Tensor]) -> Iterator[None]:
    """Inside, :func:`clip` (:func:`clip_by_global_norm` without ``norm``) measures the
    gradients with ``norm`` instead of :func:`global_norm` (called on every rank)."""
    token = _measure.set(norm)
    try:
        yield
    finally:
        _measure.reset(token)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Run transformations in order, each on the previous one's updates (optax.chain).

    The state is the tuple of the parts' states; every part sees the same ``params``.

    >>> opt = chain(clip(1.0), adamw(1e-3))
    >>> state = opt.init({"w": torch.zeros(2)})
    >>> len(state)
    2
    """

    def init(params: PyTree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(grads: PyTree, state: tuple, params: PyTree | None = None) -> tuple[PyTree, tuple]:
        if len(state) != len(transforms):
            raise ValueError(f"chain: state has {len(state)} parts for {len(transforms)} transformations")
        new_state = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        return grads, tuple(new_state)

    fusable = bool(transforms) and transforms[-1].apply is not None
    before = chain(*transforms[:-1]) if fusable else None

    def apply(grads: PyTree, state: tuple, params: PyTree) -> tuple[PyTree, tuple]:
        # The parts before the last as ``update``; the last one writes the params.
        if len(state) != len(transforms):
            raise ValueError(f"chain: state has {len(state)} parts for {len(transforms)} transformations")
        grads, head = before.update(grads, state[:-1], params)
        new, last = transforms[-1].apply(grads, state[-1], params)
        return new, (*head, last)

    return GradientTransformation(init, update, next((t.schedule for t in transforms if t.schedule), None),
                                  elementwise=all(t.elementwise for t in transforms),
                                  apply=apply if fusable else None)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates``, leaf by leaf, as a new tree (same placements, no communication).

    A parameter that requires grad gives a new leaf tensor that requires grad, so loops
    that call ``loss.backward()`` on the new params keep working.

    >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
    {'w': tensor([0.5000, 0.5000])}
    """
    new, = map_local(lambda us, ps: (torch._foreach_add(ps, us),), updates, [("param", params)], 1)
    return _as_params(new, params)


def _as_params(new: PyTree, params: PyTree) -> PyTree:
    """``new`` with each leaf requiring grad where the parameter it replaces did."""
    return optree.tree_map(lambda n, p: n.requires_grad_(True) if p.requires_grad else n, new, params)


def step(optimizer: GradientTransformation, grads: PyTree, state: PyTree,
         params: PyTree) -> tuple[PyTree, PyTree]:
    """One optimizer step: the new params and state. ``optimizer.apply`` where it has
    one (one pass fewer over every parameter: sgd, adamw, a chain ending in them), else
    ``update`` then :func:`apply_updates`; the same numbers up to the rounding of that
    last add.

    >>> opt = sgd(0.5)
    >>> params, state = step(opt, {"w": torch.ones(2)}, opt.init({"w": torch.ones(2)}), {"w": torch.ones(2)})
    >>> params["w"], int(state.count)
    (tensor([0.5000, 0.5000]), 1)
    """
    if optimizer.apply is not None:
        return optimizer.apply(grads, state, params)
    updates, state = optimizer.update(grads, state, params)
    return apply_updates(params, updates), state


# --------------------------------------------------------------------------- norms and clipping


def _sum_squares(xs: list[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
    """Σ x² over every tensor of ``xs``, in ``acc``: one foreach call for the leaves."""
    norms = torch.stack(torch._foreach_norm(xs, 2, acc))
    return torch.sum(norms * norms)


def global_norm(grads: PyTree) -> torch.Tensor:
    """The 2-norm of all leaves together, over the *global* tensors; a plain 0-d tensor,
    identical on every rank.

    Each DTensor is sharded over some set S of mesh axes and replicated over the rest, so
    the sum of its local squares is a pending sum over S. Leaves are grouped by S and the
    group sums added into one scalar that is a pending sum over the union U of all the
    S's — each group masked to coordinate 0 on the axes of U it is replicated over, so
    every distinct shard counts once. One :func:`dtp.reshard` to ``P()`` then reduces it:
    one recorded ``all_reduce`` of a single element per mesh axis in U (none when no leaf
    is sharded). Squares are summed in fp32 (fp64 if any leaf is fp64), each group's
    leaves at once (``torch._foreach_norm``, as ``clip_grad_norm_``'s foreach path). Plain tensors
    are taken to be replicated. Leaves with pending sums (``Partial``) are refused: the
    norm of a sum is not the sum of norms.

    >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
    tensor(5.)
    """
    leaves = optree.tree_leaves(grads)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    acc = accum_dtype(*(x.dtype for x in leaves))
    plain: list[torch.Tensor] = []
    # [(mesh, {sharded axes in mesh order: local shards})], in first-seen order so every
    # rank issues the same collectives in the same order.
    per_mesh: list[tuple[Any, dict[tuple[str, ...], list[torch.Tensor]]]] = []
    for i, g in enumerate(leaves):
        if not isinstance(g, DTensor):
            plain.append(g)
            continue
        spec = spec_of(g)
        if spec.partial:
            raise ValueError(
                f"global_norm: {paths(grads)[i]} has pending sums over {spec.partial} (spec {spec}); reduce it "
                f"first (dtp.reshard to a spec without partial)"
            )
        names = g.device_mesh.mesh_dim_names
        sharded = {a for d in spec.dims for a in d}
        key = tuple(a for a in names if a in sharded)
        groups = next((grp for mesh, grp in per_mesh if mesh == g.device_mesh), None)
        if groups is None:
            groups = {}
            per_mesh.append((g.device_mesh, groups))
        groups.setdefault(key, []).append(local_of(g))

    total = _sum_squares(plain, acc) if plain else None
    for mesh, groups in per_mesh:
        union = tuple(a for a in mesh.mesh_dim_names if any(a in key for key in groups))
        local: torch.Tensor | None = None
        for key, xs in groups.items():
            part = from_local(_sum_squares(xs, acc).reshape(1), mesh, P(partial=key), name="global_norm")
            # Widening a pending sum is free: the value stays on coordinate 0 of the new
            # axes, zeros elsewhere (where the grads are replicated copies).
            part = reshard(part, P(partial=union), name="global_norm").to_local()
            local = part if local is None else local + part
        summed = reshard(from_local(local, mesh, P(partial=union), name="global_norm"), P(),
                         name="global_norm", tag="global_norm").to_local()[0]
        total = summed if total is None else total + summed
    return torch.sqrt(total)


def clip_by_global_norm(grads: PyTree, max_norm: float, *, norm: torch.Tensor | None = None
                        ) -> tuple[PyTree, torch.Tensor]:
    """Scale all grads by ``min(1, max_norm / (norm + 1e-6))`` as
    ``torch.nn.utils.clip_grad_norm_`` does; returns ``(clipped, norm)`` with the norm
    before clipping. Same placements out; only :func:`global_norm` communicates. ``norm``:
    the norm already computed (over more than ``grads``: a pipeline's other stages);
    without it, :func:`global_norm` or, inside :func:`measured_by`, its function.

    >>> clipped, norm = clip_by_global_norm({"w": torch.tensor([3.0, 4.0])}, 1.0)
    >>> norm, clipped["w"]
    (tensor(5.), tensor([0.6000, 0.8000]))
    """
    if norm is None:
        norm = global_norm(grads) if (measure := _measure.get()) is None else measure(grads)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    # Scaling unconditionally (by exactly 1.0 when under the limit) keeps the same
    # numbers as torch, which also multiplies always; a 0-d scale keeps each leaf's dtype.
    clipped, = map_local(lambda gs: ([g * scale.to(g.device) for g in gs],), grads, [], 1)
    return clipped, norm


def map_param_trees(state: PyTree, params: PyTree, on_tree: Callable[[str, PyTree], PyTree],
                    on_leaf: Callable[[str, Any], Any] = lambda name, x: x) -> PyTree:
    """Rebuild an optimizer state, calling ``on_tree(name, subtree)`` on every subtree that
    mirrors ``params`` (same tree structure: Adam's ``mu``/``nu``, momentum) and
    ``on_leaf(name, leaf)`` on everything else (the update count).

    Names are the path of field names, keys and indices joined by ``.`` (``"mu"``,
    ``"1.count"`` inside a :func:`chain`). What :mod:`dtp.checkpoint` names optimizer
    tensors by, and how ZeRO cuts a per-parameter state into its buckets.

    >>> params = {"w": torch.ones(2)}
    >>> state = adamw(0.1).init(params)
    >>> shapes = map_param_trees(state, params, lambda name, t: (name, t["w"].shape), lambda name, x: name)
    >>> shapes.count, shapes.mu
    ('count', ('mu', torch.Size([2])))
    """
    return _walk_state(state, (), optree.tree_structure(params), on_tree, on_leaf)


# A module function, not a closure over itself: a recursive inner ``walk`` is a reference
# cycle (the function, the cell holding it) that kept ``on_tree`` and all it captured —
# a pipeline step's whole Run, its parameters and gradients: 18 tensors, 218 KB a step on
# rank 0 of tiny Llama at pp2 1f1b — alive until Python's cyclic collector ran
# (measured, torch 2.13).
def _walk_state(node: Any, path: tuple[str, ...], structure: Any, on_tree: Callable[[str, PyTree], PyTree],
                on_leaf: Callable[[str, Any], Any]) -> Any:
    name, rest = ".".join(path), (structure, on_tree, on_leaf)
    if node is not None and optree.tree_structure(node) == structure:
        return on_tree(name, node)
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*(_walk_state(getattr(node, f), path + (f,), *rest) for f in node._fields))
    if isinstance(node, (tuple, list)):
        return type(node)(_walk_state(x, path + (str(i),), *rest) for i, x in enumerate(node))
    if isinstance(node, dict):
        return {k: _walk_state(v, path + (str(k),), *rest) for k, v in node.items()}
    return node if node is None else on_leaf(name, node)


def state_part(state: PyTree, groups: list[PyTree], i: int) -> PyTree:
    """Group ``i``'s part of an elementwise optimizer's state over a list of parameter
    groups (ZeRO's buckets): every subtree that mirrors ``groups``
    (:func:`map_param_trees` knows which from the optimizer's own tree: moments,
    momentum) cut to ``[groups[i]]``'s; the rest (the count) kept.

    >>> groups = [{"w": torch.ones(2)}, {"w": torch.ones(3)}]
    >>> part = state_part(adamw(0.1).init(groups), groups, 1)
    >>> part.mu[0]["w"].shape, int(part.count)
    (torch.Size([3]), 0)
    """
    return map_param_trees(state, groups, lambda name, tree: [tree[i]])


def state_join(template: PyTree, groups: list[PyTree], parts: list[PyTree]) -> PyTree:
    """Inverse of :func:`state_part`: the per-group states (each over ``[groups[k]]``)
    as one state over ``groups``, shaped like ``template``; the shared leaves (the
    count) from the parts, on which the groups agree.

    >>> groups = [{"w": torch.ones(2)}, {"w": torch.ones(3)}]
    >>> state = adamw(0.1).init(groups)
    >>> joined = state_join(state, groups, [state_part(state, groups, k) for k in range(2)])
    >>> [m["w"].shape for m in joined.mu]
    [torch.Size([2]), torch.Size([3])]
    """
    trees: dict[str, list[Any]] = {}
    leaves: dict[str, Any] = {}
    for k, part in enumerate(parts):
        map_param_trees(part, [groups[k]], lambda name, tree: trees.setdefault(name, []).append(tree[0]),
                        lambda name, x: leaves.__setitem__(name, x))
    return map_param_trees(template, groups, lambda name, tree: trees[name], lambda name, x: leaves[name])
