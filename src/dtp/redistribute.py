"""``reshard``: move a DTensor from any spec to any spec with the cheapest collectives.

The plan works per mesh axis on the spec algebra of :mod:`dtp.spec`:

1. **Unshard.** Every dim whose current axes are not a prefix of its target axes drops
   its minor-most axis until they are. When the dropped axis is the next one another
   dim needs, that is one **all-to-all** (Shard(i) → Shard(j)); otherwise an
   **all-gather**. (Only the minor-most axis of a dim can be gathered without moving
   data between other ranks, which is why removal goes minor → major.)
2. **Reshard.** Each dim appends its missing target axes in order: a pending-sum axis
   becomes a **reduce-scatter**, any other axis a local slice (free).
3. **Reduce.** Pending sums the target does not keep become an **all-reduce**, done where
   the local tensor is smallest (before step 1 or after step 2).
4. **New pending sums** keep the value on coordinate 0 and zero elsewhere (free).

Torch 2.13 on CPU/gloo turns Shard(i) → Shard(j) into all-gather + chunk (world-size
times the bytes); here it is a real all-to-all on every backend. Every collective goes
through :mod:`dtp.comm`, so it is recorded.

The autograd rule is DTensor's: the backward redistributes the gradient from wherever
it is to the source spec, with the source's pending-sum axes made replicated (the
gradient of each term of a sum is the gradient of the sum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import comm
from .spec import P, _names, _sizes, _wrap, check_spec, maybe_run_for_local_tensor, spec_of

__all__ = ["Step", "plan", "reshard", "redistribute_local", "to_local", "from_local"]


@dataclass(frozen=True)
class Step:
    """One move of a plan: ``kind`` on mesh ``axis`` (``dim``/``to_dim`` are tensor dims)."""

    kind: str  # all_gather | all_to_all | reduce_scatter | all_reduce | slice | zero
    axis: str
    dim: int = -1
    to_dim: int = -1


def plan(src: P, dst: P, ndim: int, sizes: dict[str, int] | None = None) -> list[Step]:
    """The moves that take a tensor of ``ndim`` dims from ``src`` to ``dst``.

    >>> plan(P("tp", None), P(None, "tp"), 2)
    [Step(kind='all_to_all', axis='tp', dim=0, to_dim=1)]
    """
    cur = [list(src.axes_of(d)) for d in range(ndim)]
    tgt = [list(dst.axes_of(d)) for d in range(ndim)]
    partial = [a for a in src.partial]
    keep_partial = set(dst.partial)
    steps: list[Step] = []

    def is_prefix(d: int) -> bool:
        return cur[d] == tgt[d][: len(cur[d])]

    def next_needed(d: int) -> str | None:
        return tgt[d][len(cur[d])] if is_prefix(d) and len(cur[d]) < len(tgt[d]) else None

    needed_in_dims = {a for t in tgt for a in t}
    to_all_reduce = [a for a in partial if a not in keep_partial and a not in needed_in_dims]
    # All-reduce cost is proportional to the local size: reduce before unsharding when
    # unsharding grows the tensor more than resharding shrinks it (needs the sizes).
    if sizes is not None and to_all_reduce:
        before = math.prod(sizes[a] for d in cur for a in d)
        after = math.prod(sizes[a] for d in tgt for a in d)
        if before >= after:
            steps += [Step("all_reduce", a) for a in to_all_reduce]
            partial = [a for a in partial if a not in to_all_reduce]
            to_all_reduce = []

    # 1. unshard: minor-most first; an axis some other dim needs next moves by all-to-all.
    while True:
        pending = [d for d in range(ndim) if not is_prefix(d)]
        if not pending:
            break
        for i in pending:
            a = cur[i][-1]
            j = next((j for j in range(ndim) if j != i and next_needed(j) == a), None)
            if j is not None:
                cur[i].pop()
                cur[j].append(a)
                steps.append(Step("all_to_all", a, i, j))
                break
        else:
            i = pending[0]
            steps.append(Step("all_gather", cur[i].pop(), i))

    # 2. reshard: append missing axes in order; pending sums reduce-scatter into place.
    for d in range(ndim):
        while (a := next_needed(d)) is not None:
            cur[d].append(a)
            if a in partial:
                partial.remove(a)
                steps.append(Step("reduce_scatter", a, d))
            else:
                steps.append(Step("slice", a, d))

    # 3./4. remaining pending sums, then new ones.
    steps += [Step("all_reduce", a) for a in partial if a not in keep_partial]
    steps += [Step("zero", a) for a in dst.partial if a not in src.partial]
    return steps


@maybe_run_for_local_tensor
def _slice(x: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    step = x.shape[dim] // n
    return x.narrow(dim, index * step, step).contiguous()


@maybe_run_for_local_tensor
def _zero_unless_first(x: torch.Tensor, index: int) -> torch.Tensor:
    return x if index == 0 else torch.zeros_like(x)


def redistribute_local(local: torch.Tensor, mesh: DeviceMesh, src: P, dst: P, *, tag: str = "") -> torch.Tensor:
    """Run :func:`plan` on this rank's shard (no autograd); returns the new shard."""
    names, sizes = _names(mesh), _sizes(mesh)
    coord = dict(zip(names, mesh.get_coordinate()))
    x = local
    for s in plan(src, dst, local.dim(), sizes):
        if s.kind == "all_gather":
            x = comm.all_gather(x, mesh, s.axis, dim=s.dim, tag=tag)
        elif s.kind == "all_to_all":
            x = comm.all_to_all(x, mesh, s.axis, split_dim=s.to_dim, concat_dim=s.dim, tag=tag)
        elif s.kind == "reduce_scatter":
            x = comm.reduce_scatter(x, mesh, s.axis, dim=s.dim, tag=tag)
        elif s.kind == "all_reduce":
            x = comm.all_reduce(x, mesh, s.axis, tag=tag)
        elif s.kind == "slice":
            x = _slice(x, s.dim, sizes[s.axis], coord[s.axis])
        elif s.kind == "zero":
            x = _zero_unless_first(x, coord[s.axis])
    return x


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, src: P, dst: P, tag: str) -> DTensor:  # type: ignore[override]
        ctx.src, ctx.dst, ctx.tag = src, dst, tag
        out = redistribute_local(x._local_tensor, x.device_mesh, src, dst, tag=tag)
        return _wrap(out, x.device_mesh, dst, tuple(x.shape))

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        if not isinstance(grad, DTensor):
            raise TypeError("dtp.reshard backward received a plain tensor gradient; expected a DTensor")
        grad_src = spec_of(grad)
        target = P(*ctx.src.dims)  # pending sums in the source receive the replicated grad
        tag = f"{ctx.tag} backward".strip()
        return _Reshard.apply(grad, grad_src, target, tag), None, None, None


def reshard(x: DTensor, spec: P, *, name: str = "tensor", tag: str = "") -> DTensor:
    """Move ``x`` to ``spec`` with the cheapest collectives (autograd-correct).

    >>> mesh = make_mesh(dp=1, tp=1)
    >>> x = shard(torch.randn(4, 4), mesh, P("dp", None))
    >>> spec_of(reshard(x, P(None, "tp")))
    P(None, 'tp')
    """
    if not isinstance(x, DTensor):
        raise TypeError(f"{name}: reshard expects a DTensor (got {type(x).__name__}); use dtp.shard first")
    check_spec(spec, x.device_mesh, x.shape, name)
    src = spec_of(x)
    if src == spec:
        return x
    return _Reshard.apply(x, src, spec, tag)


def _without_partial(spec: P) -> P:
    return P(*spec.dims)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, grad_spec: P) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh, ctx.grad_spec, ctx.shape = x.device_mesh, grad_spec, tuple(x.shape)
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _wrap(grad, ctx.mesh, ctx.grad_spec, ctx.shape), None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh: DeviceMesh, spec: P, shape: tuple[int, ...]) -> DTensor:  # type: ignore[override]
        ctx.spec = spec
        return _wrap(local.view_as(local), mesh, spec, shape)

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        # The gradient of every term of a pending sum is the gradient of the sum:
        # bring it to the spec without the partial axes (recorded), then take the shard.
        target = _without_partial(ctx.spec)
        if spec_of(grad) != target:
            grad = _Reshard.apply(grad, spec_of(grad), target, "from_local backward")
        return grad._local_tensor, None, None, None


def to_local(x: DTensor, grad_spec: P | None = None) -> torch.Tensor:
    """This rank's shard of ``x``, differentiable; the shard's gradient is read as a
    DTensor laid out as ``grad_spec`` (default: ``x``'s own spec).

    Use ``grad_spec`` with pending sums when a replicated input meets split data, e.g.
    a replicated weight used on a batch split over ``dp``: its local gradient is a
    partial sum over ``dp``.

    >>> w_local = to_local(w, P(None, "tp", partial=("dp",)))   # doctest: +SKIP
    """
    return _ToLocal.apply(x, spec_of(x) if grad_spec is None else grad_spec)


def from_local(local: torch.Tensor, mesh: DeviceMesh, spec: P, shape: Sequence[int] | None = None, *,
               name: str = "tensor") -> DTensor:
    """Wrap this rank's shard as a DTensor laid out as ``spec`` (the global shape follows
    from the shard's unless given), differentiable, with every backward collective on the
    recorded path (unlike ``DTensor.from_local``).

    >>> x = from_local(torch.ones(2, 3), make_mesh(dp=1), P("dp"))
    >>> tuple(x.shape)
    (2, 3)
    """
    check_spec(spec, mesh, None, name)
    if len(spec.dims) > local.dim():
        raise ValueError(f"{name}: spec {spec} has {len(spec.dims)} dims but the local tensor has shape {tuple(local.shape)}")
    if shape is None:
        sizes = _sizes(mesh)
        shape = [s * math.prod(sizes[a] for a in spec.axes_of(d)) for d, s in enumerate(local.shape)]
    return _FromLocal.apply(local, mesh, spec, tuple(shape))
