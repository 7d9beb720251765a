"""The global gradient norm over DTensor pytrees, and clipping by it.

:func:`global_norm` is the optimizers' one reduction: it goes through :func:`dtp.reshard`
and is therefore recorded in :func:`dtp.comm_log`. Every other step of an update is
shard-local.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import optree
import torch
from torch.distributed.tensor import DTensor

from ...core._rules import accum_dtype
from ..leafwise import local_of, map_local, paths
from ...core.redistribute import from_local, reshard
from ...core.spec import P, spec_of

__all__ = ["global_norm", "clip_by_global_norm", "measured_by"]

PyTree = Any


def _sum_squares(xs: list[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
    """Σ x² over every tensor of ``xs``, in ``acc``: one foreach call for the leaves."""
    norms = torch.stack(torch._foreach_norm(xs, 2, acc))
    return torch.sum(norms * norms)


def global_norm(grads: PyTree, *, leaves: list[torch.Tensor] | None = None) -> torch.Tensor:
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
    norm of a sum is not the sum of norms. ``leaves``: ``grads``' leaves in tree order,
    where the caller holds them already (a step's run made ``grads`` from them), so the
    tree is not flattened again.

    >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
    tensor(5.)
    """
    if leaves is None:
        leaves = optree.tree_leaves(grads)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    acc = accum_dtype(*{x.dtype for x in leaves})  # a set, not a generator: one call, not one per leaf
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


# The norm clip_by_global_norm takes inside measured_by: train_step's strategy's (a pipeline
# rank holds its stages' gradients only; that norm sums every stage's over pp).
_measure: contextvars.ContextVar[Any] = contextvars.ContextVar("measure", default=None)


@contextlib.contextmanager
def measured_by(norm: Callable[[PyTree], torch.Tensor]) -> Iterator[None]:
    """Inside, :func:`clip` (:func:`clip_by_global_norm` without ``norm``) measures the
    gradients with ``norm`` instead of :func:`global_norm` (called on every rank):
    ``train_step`` runs the optimizer inside the norm of the whole model, where a pipeline
    stage's own :func:`global_norm` would see only its stage's gradients.

    >>> g = {"w": torch.full((4,), 3.0)}       # norm 6; say the whole model's is 12
    >>> with measured_by(lambda grads: torch.tensor(12.0)):
    ...     clipped, norm = clip_by_global_norm(g, 6.0)
    >>> float(norm), [round(x, 4) for x in clipped["w"].tolist()]   # scaled by 6 / 12, not 6 / 6
    (12.0, [1.5, 1.5, 1.5, 1.5])
    """
    token = _measure.set(norm)
    try:
        yield
    finally:
        _measure.reset(token)
