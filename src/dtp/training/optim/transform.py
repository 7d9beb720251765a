"""Optimizers as :class:`GradientTransformation` values (optax's interface): sgd and adamw,
clipping, :func:`chain`, and applying the updates (:func:`apply_updates`, :func:`step`).

Each DTensor leaf is updated shard by shard on its local tensor, and the result (and the
state) is laid out exactly like the parameter, so an update never communicates; only
:func:`clip` does, through :func:`dtp.optim.global_norm`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator, NamedTuple, Union

import optree
import torch

from ..leafwise import map_local, zeros_like_tree
from .norm import clip_by_global_norm
from .schedules import ScalarOrSchedule, Schedule, _as_schedule

__all__ = ["GradientTransformation", "SGDState", "AdamWState", "sgd", "adamw", "clip", "chain", "apply_updates",
           "step", "decay_matrices", "mask_flags_by"]

PyTree = Any
# Which parameters weight decay applies to: a tree of bools shaped like the params (True:
# decay), or a function of the params that gives one (optax's ``mask``).
Mask = Union[PyTree, Callable[[PyTree], PyTree]]
# A mask as one leaf sees it: decay all of it, none of it, or the ``(start, stop)`` ranges
# of its flat local tensor (a ZeRO bucket slice holds several parameters).
Flag = Union[bool, tuple[tuple[int, int], ...]]


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


# --------------------------------------------------------------------------- counts


def _next_count(name: str, count: torch.Tensor, schedule: Schedule, decays: bool, apply: bool,
                params: PyTree | None) -> tuple[torch.Tensor, int, float]:
    """The next step's count, its number (1-based) and learning rate; ``params`` are
    needed to decay or to apply (``name``: the optimizer, for the error)."""
    if (decays or apply) and params is None:
        raise ValueError(f"{name}: {'weight_decay' if decays else 'apply'} needs the params; "
                         f"call {'apply' if apply else 'update'}(grads, state, params)")
    step = int(count) + 1
    rate = float(schedule(step - 1))
    if not 0 <= rate < math.inf:  # a schedule's value, checked where it is read: -lr is gradient ascent
        raise ValueError(f"{name}: the lr schedule gave {rate} at step {step - 1}; a learning rate is finite and >= 0")
    return torch.tensor(step, dtype=torch.int64), step, rate


# --------------------------------------------------------------------------- decay masks


def decay_matrices(params: PyTree) -> PyTree:
    """The mask of Megatron's default ``no_weight_decay_cond`` (and nanoGPT's, and the
    Hugging Face Trainer's in effect): decay the parameters of two or more dimensions
    (weight matrices, embeddings, expert stacks), not the 1-D ones (norm scales, biases,
    per-head q/k norms). Pass it as ``mask`` to :func:`adamw` or :func:`sgd`.

    >>> decay_matrices({"w": torch.ones(2, 3), "norm": torch.ones(3)})
    {'w': True, 'norm': False}
    """
    return optree.tree_map(lambda p: p.ndim >= 2, params)


# Set by train_step around each optimizer call whose params are not the parameters
# themselves (ZeRO's flat bucket slices): how the optimizer's mask falls on them.
_FLAGS_BY: contextvars.ContextVar[Callable[[str, Mask], list[Flag] | None] | None] = contextvars.ContextVar(
    "dtp_mask_flags", default=None)


@contextlib.contextmanager
def mask_flags_by(flags: Callable[[str, Mask], list[Flag] | None] | None) -> Iterator[None]:
    """Inside, an optimizer's ``mask`` is turned into per-leaf flags by ``flags(name,
    mask)`` (one per leaf of the params it is called with; ``name``: the optimizer's, for
    errors) instead of being read off the params: ``train_step`` sets it where the params
    are ZeRO's bucket slices, each holding several parameters, which the mask (a function
    of the parameters) cannot see. ``None`` (set, or returned) leaves the mask as it is.

    >>> opt = sgd(1.0, weight_decay=0.5, mask={"w": True})
    >>> with mask_flags_by(lambda name, mask: [((1, 2),)]):  # decay only the 2nd element
    ...     u, _ = opt.update({"w": torch.zeros(2)}, opt.init({"w": torch.ones(2)}), {"w": torch.ones(2)})
    >>> u["w"]
    tensor([-0.0000, -0.5000])
    """
    token = _FLAGS_BY.set(flags)
    try:
        yield
    finally:
        _FLAGS_BY.reset(token)


def mask_leaves(name: str, mask: Mask, params: PyTree) -> list[bool]:
    """``mask`` (a tree or a function of ``params``) as one bool per leaf of ``params``
    (``name``: the optimizer, for the error). ``params`` may hold ``None`` where a
    parameter lives elsewhere (a pipeline stage's tree): the mask may say anything there,
    a bool (a tree of bools made for the whole model) or ``None`` (a function mapped over
    the leaves) — the same on every rank, so no rank refuses a mask another takes.

    >>> mask_leaves("adamw", decay_matrices, {"w": torch.ones(2, 2), "b": torch.ones(2), "far": None})
    [False, True]
    """
    tree = mask(params) if callable(mask) else mask
    leaves, treedef = optree.tree_flatten(params, none_is_leaf=True)
    try:
        flags = treedef.flatten_up_to(tree)
    except ValueError as e:
        raise ValueError(f"{name}: the weight-decay mask is not shaped like the params: {e}") from None
    bad = [f for f, p in zip(flags, leaves) if not (isinstance(f, bool) or (p is None and f is None))]
    if bad:
        raise TypeError(f"{name}: a weight-decay mask's leaves are bools (True: decay the parameter), got "
                        f"{type(bad[0]).__name__}")
    return [f for f, p in zip(flags, leaves) if p is not None]


def _flags(name: str, mask: Mask | None, params: PyTree) -> list[Flag] | None:
    """The mask as one flag per leaf of ``params`` (``None``: no mask, decay every leaf)."""
    if mask is None:
        return None
    by = _FLAGS_BY.get()
    flags = by(name, mask) if by is not None else None
    return mask_leaves(name, mask, params) if flags is None else flags


def _scaled(ps: list[torch.Tensor], flags: list[Flag], factor: float, other: float) -> list[torch.Tensor]:
    """Each ``p·factor`` where its flag decays it and ``p·other`` elsewhere (``other`` 1
    or 0), as new tensors. A bucket slice with ranges is scaled whole, then its few
    undecayed ranges (norms, biases) set back: one pass over it, not two."""
    out = torch._foreach_mul(ps, [other if f is False else factor for f in flags])
    for o, p, f in zip(out, ps, flags):
        if isinstance(f, bool):
            continue
        for a, b in _gaps(f, o.numel()):
            if other:
                o.view(-1)[a:b].copy_(p.view(-1)[a:b])  # p·1 is p
            else:
                o.view(-1)[a:b].zero_()
    return out


def _gaps(ranges: tuple[tuple[int, int], ...], n: int) -> list[tuple[int, int]]:
    """The stretches of ``[0, n)`` that ``ranges`` (sorted, disjoint) leave out.

    >>> _gaps(((1, 3), (5, 6)), 8)
    [(0, 1), (3, 5), (6, 8)]
    """
    out, at = [], 0
    for a, b in ranges:
        if a > at:
            out.append((at, a))
        at = b
    return out + [(at, n)] * (n > at)


def _plus_decay(gs: list[torch.Tensor], ps: list[torch.Tensor], flags: list[Flag], wd: float) -> list[torch.Tensor]:
    """``g + wd·p`` where the flag decays (``torch.add(g, p, alpha=wd)``, as torch's SGD), ``g`` elsewhere."""
    whole = [j for j, f in enumerate(flags) if f is True]
    out = list(gs)
    if whole:
        for j, d in zip(whole, torch._foreach_add([gs[j] for j in whole], [ps[j] for j in whole], alpha=wd)):
            out[j] = d
    for j, f in enumerate(flags):
        if not isinstance(f, bool):
            out[j] = d = gs[j].clone()
            for a, b in f:
                d.view(-1)[a:b].add_(ps[j].view(-1)[a:b], alpha=wd)
    return out


# --------------------------------------------------------------------------- optimizers


def sgd(lr: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, mask: Mask | None = None) -> GradientTransformation:
    """Stochastic gradient descent with ``torch.optim.SGD`` semantics (no dampening).

    ``d = g + wd·p`` (only where ``mask`` says, e.g. :func:`decay_matrices`; ``None``:
    every parameter, as torch; see :func:`adamw` for what a mask may read); with momentum ``b = μ·b + d`` (``b = d`` on the first step) and
    ``d = b`` or, Nesterov, ``d = d + μ·b``; the update is ``-lr·d``.

    >>> opt = sgd(0.1, momentum=0.9, nesterov=True)
    >>> p = {"w": torch.ones(2)}
    >>> u, s = opt.update({"w": torch.ones(2)}, opt.init(p), p)
    >>> u["w"]
    tensor([-0.1900, -0.1900])
    """
    schedule = _as_schedule(lr, "sgd")
    if not (0 <= momentum < math.inf and 0 <= weight_decay < math.inf):  # NaN fails both
        raise ValueError(f"sgd: momentum and weight_decay must be finite and >= 0, got {momentum}, {weight_decay}")
    if nesterov and momentum <= 0:
        raise ValueError("sgd: nesterov momentum needs momentum > 0")

    def init(params: PyTree) -> SGDState:
        buf = zeros_like_tree(params) if momentum else None
        return SGDState(torch.zeros((), dtype=torch.int64), buf)

    def run(grads: PyTree, state: SGDState, params: PyTree | None, apply: bool) -> tuple[PyTree, SGDState]:
        count, step, rate = _next_count("sgd", state.count, schedule, bool(weight_decay), apply, params)
        flags = _flags("sgd", mask, params) if weight_decay else None

        def kernel(gs, bufs, ps):
            # torch.optim.SGD's ops (its foreach path is its single-tensor one, op for op):
            # one call per op for every leaf instead of one per leaf.
            if flags is not None:
                ds = _plus_decay(gs, ps, flags, weight_decay)
            else:
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
            out, buf = map_local(kernel, grads, others, 2, params_of="param" if apply else None)
        else:
            out, = map_local(kernel, grads, others, 1, params_of="param" if apply else None)
            buf = None
        return out, SGDState(count, buf)

    def update(grads: PyTree, state: SGDState, params: PyTree | None = None) -> tuple[PyTree, SGDState]:
        return run(grads, state, params, apply=False)

    def apply(grads: PyTree, state: SGDState, params: PyTree) -> tuple[PyTree, SGDState]:
        return run(grads, state, params, apply=True)

    return GradientTransformation(init, update, schedule, elementwise=True, apply=apply)


def adamw(lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.0, mask: Mask | None = None) -> GradientTransformation:
    """Adam with decoupled weight decay, step for step ``torch.optim.AdamW``.

    At step ``t`` (1-based): ``m = lerp(m, g, 1-b1)``, ``v = b2·v + (1-b2)·g²``,
    ``p ← p·(1 - lr·wd) - lr/(1-b1^t) · m / (√v / √(1-b2^t) + eps)``; the update returned
    is the difference to ``p``. ``mask`` (a tree of bools or a function of the params,
    e.g. :func:`decay_matrices`, Megatron's choice) says which parameters decay; ``None``:
    all, as torch's AdamW (one param group). A mask function must map over the tree it
    is given and read only paths, shapes and ``ndim``: under ZeRO it is given meta tensors
    (no values), under a pipeline a stage's tree (``None`` for other stages' parameters),
    under mixed precision the fp32 master weights. State ``mu``/``nu`` has the params' dtype and placements,
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
    # eps = 0: 0 / 0 wherever a gradient is 0 (an unused embedding row); NaN fails both
    if not (0 < eps < math.inf and 0 <= weight_decay < math.inf):
        raise ValueError(f"adamw: eps must be finite and > 0, weight_decay finite and >= 0, got {eps}, {weight_decay}")

    def init(params: PyTree) -> AdamWState:
        _check_moments_hold(eps, b2, params)
        return AdamWState(torch.zeros((), dtype=torch.int64), zeros_like_tree(params), zeros_like_tree(params))

    def run(grads: PyTree, state: AdamWState, params: PyTree | None, apply: bool) -> tuple[PyTree, AdamWState]:
        count, step, rate = _next_count("adamw", state.count, schedule, bool(weight_decay), apply, params)
        flags = _flags("adamw", mask, params) if weight_decay else None
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
                    # Undecayed leaves: p·1 is p, so they match a run without decay bit for bit.
                    out = (torch._foreach_mul(ps, 1.0 - rate * weight_decay) if flags is None
                           else _scaled(ps, flags, 1.0 - rate * weight_decay, 1.0))
                    torch._foreach_addcdiv_(out, ms, denom, value=-step_size)
                else:
                    out = torch._foreach_addcdiv(ps, ms, denom, value=-step_size)
            elif weight_decay:
                # p·(1 - lr·wd) - p = -lr·wd·p: decoupled decay, not added to the gradient.
                out = (torch._foreach_mul(ps, -rate * weight_decay) if flags is None
                       else _scaled(ps, flags, -rate * weight_decay, 0.0))
                torch._foreach_addcdiv_(out, ms, denom, value=-step_size)
            else:
                out = torch._foreach_div(ms, denom)
                torch._foreach_mul_(out, -step_size)
            return out, ms, vs

        others = [("first moment", state.mu), ("second moment", state.nu),
                  ("param", params if weight_decay or apply else None)]
        out, mu, nu = map_local(kernel, grads, others, 3, params_of="param" if apply else None)
        return out, AdamWState(count, mu, nu)

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
    new, = map_local(lambda us, ps: (torch._foreach_add(ps, us),), updates, [("param", params)], 1,
                     params_of="param")
    return new


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
