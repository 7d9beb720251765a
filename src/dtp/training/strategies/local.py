"""When and how a step runs its forward and backward on plain local tensors.

A layout that splits only the batch (data parallel, ZeRO 1/2/3; nothing over tp, cp, ep
or pp) leaves every parameter whole on every rank: the replicated and ZeRO runs then
hand ``loss_fn`` their local parameter tensors (ZeRO-3: the gathered bucket views) and
the batch's local rows, under :func:`dtp.ops.local_batch.local_batch` — the ops that sum
over the batch (the loss, MoE statistics) reduce over its axes, the rest is per row
(the module docstring there says why that is exact, and which ``loss_fn`` may run so).
FSDP2 and DDP compute the same way: no DTensor dispatch per activation op.

Each gradient then leaves backward as this rank's term, a plain tensor: :func:`pending`
lays it out as the pending sum over the batch axes that a DTensor backward would have
produced, so the strategy's reduction (all-reduce, ZeRO's reduce-scatter) is unchanged —
the same collectives, the same bytes.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...layouts import Layout
from ...ops.local_batch import LocalBatch, is_batch_local, local_batch
from ...core.redistribute import reshard
from ...core.spec import P, spec_of, wrap_local

__all__ = ["decide", "wrap", "pending"]

PyTree = Any


def decide(specs: Iterable[P | None], loss_fn: Any, layout: Layout | None, mesh: DeviceMesh | None, *,
           buffers: PyTree = None) -> LocalBatch | None:
    """The batch split a step may compute under on plain tensors (``None``: DTensors).

    Local when all hold: ``loss_fn`` is :func:`dtp.ops.local_batch.batch_local`; the
    mesh has more than one device; no buffers laid over the parameters; every parameter's spec
    (``specs``; ``None``: a plain tensor) is replicated on the mesh (so nothing splits it:
    no tp / ep); the layout's ``(batch, seq)`` activations split only the batch dim, over
    at least one axis. A compiled step computes so too: its regions are then whole blocks
    on plain tensors, as on one device (:mod:`dtp.compiled`).

    >>> decide([P()], lambda p, b: 0.0, dtp.layouts.data(), dtp.make_mesh(dp=1)) is None
    True
    """
    if layout is None or mesh is None or mesh.size() == 1 or not is_batch_local(loss_fn):
        return None
    if buffers or any(s is None or s != P() for s in specs):
        return None
    spec = layout.activation_spec(("batch", "seq"), mesh)
    if spec.partial or spec.axes_of(1) or not spec.axes_of(0):
        return None
    return LocalBatch(mesh, spec.axes_of(0))  # the layout's order: the batch's dim-0 split


def _rows(v: Any, batch: LocalBatch) -> Any:
    """A batch entry as this rank's rows (placed on the batch axes first if it is not)."""
    if not isinstance(v, DTensor):
        return v
    want = P(batch.axes)
    if spec_of(v) != want:
        v = reshard(v, want, name="local batch rows")
    return v.to_local()


def wrap(loss_fn: Callable[[PyTree, Mapping[str, Any]], Any], batch: LocalBatch | None
         ) -> Callable[[PyTree, Mapping[str, Any]], Any]:
    """``loss_fn`` called on this rank's rows of each batch entry inside
    :func:`~dtp.ops.local_batch.local_batch` (``loss_fn`` itself for ``None``)."""
    if batch is None:
        return loss_fn

    def local(params: PyTree, mb: Mapping[str, Any]) -> Any:
        with local_batch(batch):
            return loss_fn(params, {k: _rows(v, batch) for k, v in mb.items()})

    return local


def pending(grad: torch.Tensor, like: DTensor, batch: LocalBatch) -> DTensor:
    """This rank's local gradient term of parameter ``like`` as the DTensor a DTensor
    backward would give: ``like``'s spec with a pending sum over the batch axes."""
    spec = spec_of(like)
    return wrap_local(grad, like.device_mesh, P(*spec.dims, partial=batch.axes), tuple(like.shape))
