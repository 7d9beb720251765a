"""MoE's token statistics across ranks: the all-reduce posted when a block has routed its
tokens, waited where the aux loss is read.

Each MoE block's aux losses need *global* sums over the token axes (``Σ_t p``, the counts,
``Σ lse²``, the kept choices: ``2E + 2`` numbers). The block posts their all-reduce
(``async_op=True`` through :mod:`dtp.comm`, tag ``moe stats``) and returns an
:class:`Aux` whose entries are computed on first read: the Llama reads them at the head,
so the reduction travels under every later block's compute. Bytes, order and axes are
those of ``reshard(stats, P(None))``: one all-reduce per pending axis, in the spec's
order. With two or more token axes (dp × ep, dp × cp) each all-reduce needs the one
before it: the next axis's is posted when the next MoE block posts its own (by then the
previous one has long landed; every rank does it at the same point of the program, so
the ranks' collective order agrees — a completion callback would not), and what is
left when the aux loss is read runs there.

Autograd is ``reshard``'s: the summed statistics' gradient is replicated, so every rank's
partial sums receive it as is (no collective in backward). A block recomputed in
backward (full recompute) reduces synchronously, as nothing will read its aux there.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from ..core import comm
from ..core._torch import current_graph_task_id, local_tensor
from ..core.redistribute import reshard
from ..core.spec import P, spec_of, wrap_local
from .local_batch import active

__all__ = ["PendingStats", "Aux"]

TAG = "moe stats"
_chains = threading.local()  # this thread's PendingStats with axes left to post, oldest first


class _Reduced(torch.autograd.Function):
    """``x`` (pending sums) → its reduced value ``total`` (replicated), with reshard's backward."""

    @staticmethod
    def forward(ctx, x: DTensor, total: torch.Tensor) -> DTensor:  # type: ignore[override]
        ctx.src = spec_of(x)
        return wrap_local(total, x.device_mesh, P(*ctx.src.dims), tuple(x.shape))

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        target = P(*ctx.src.dims)  # pending sums receive the replicated gradient
        return (grad if spec_of(grad) == target else reshard(grad, target, tag=f"{TAG} backward")), None


class _Summed(torch.autograd.Function):
    """Local batch mode's :class:`_Reduced`: plain ``x`` (this rank's sums) → ``total``,
    the gradient passed to ``x`` as it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class PendingStats:
    """A block's statistics with their all-reduce in flight; :meth:`wait` returns them
    summed over every pending axis (a replicated DTensor, in the autograd graph).
    A plain tensor (one device) is its own total; in local batch mode
    (:mod:`dtp.ops.local_batch`) it is one rank's sums, pending over the batch axes.

    >>> PendingStats(torch.ones(3)).wait().tolist()
    [1.0, 1.0, 1.0]
    """

    def __init__(self, stats: torch.Tensor):
        self._stats, self._total = stats, None
        self._axes: tuple[str, ...] = ()
        self._handle = None
        batch = active()
        if not isinstance(stats, DTensor) and (batch is None or not batch.axes):
            self._total = stats
            return
        if isinstance(stats, DTensor):
            self._mesh, self._axes = stats.device_mesh, spec_of(stats).partial
        else:  # one rank's rows in local batch mode: the sums are pending over its axes
            self._mesh, self._axes = batch.mesh, batch.axes
        local = (local_tensor(stats) if isinstance(stats, DTensor) else stats).detach()
        if not self._axes:
            self._handle = comm.CommHandle(None, None, lambda: local)
        elif current_graph_task_id() != -1:  # recomputed in backward: nobody reads this aux
            total = self._rest(local, self._axes)
            self._handle, self._axes = comm.CommHandle(None, None, lambda: total), ()
        else:
            _advance()  # the blocks before: each one's next axis, posted here, in program order
            self._handle = comm.all_reduce(local, self._mesh, self._axes[0], async_op=True, tag=TAG)
            self._axes = self._axes[1:]
            if self._axes:
                _chains.pending = [*getattr(_chains, "pending", []), self]

    def _post_next(self) -> None:
        if self._total is None and self._axes:
            total = self._handle.wait()
            self._handle = comm.all_reduce(total, self._mesh, self._axes[0], async_op=True, tag=TAG)
            self._axes = self._axes[1:]

    def _rest(self, total: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        for axis in axes:
            total = comm.all_reduce(total, self._mesh, axis, tag=TAG)
        return total

    def wait(self) -> torch.Tensor:
        if self._total is None:
            total = self._rest(self._handle.wait(), self._axes)
            self._axes = ()
            summed = _Reduced if isinstance(self._stats, DTensor) else _Summed
            self._total = summed.apply(self._stats, total)
            self._stats = self._handle = None  # the graph holds what backward needs
        return self._total


def _advance() -> None:
    """Post the next axis of every earlier block's reduction that has one left."""
    pending = getattr(_chains, "pending", [])
    for p in pending:
        p._post_next()
    _chains.pending = [p for p in pending if p._axes and p._total is None]


class Aux(Mapping):
    """A block's aux metrics, computed from its :class:`PendingStats` on the first read
    of any entry (which waits for the reduction)."""

    def __init__(self, keys: tuple[str, ...], pending: PendingStats,
                 compute: Callable[[torch.Tensor], dict[str, torch.Tensor]]):
        self._keys, self._pending, self._compute = keys, pending, compute
        self._values: dict[str, torch.Tensor] | None = None

    def _read(self) -> dict[str, torch.Tensor]:
        if self._values is None:
            self._values = self._compute(self._pending.wait())
            self._pending = self._compute = None  # type: ignore[assignment]
        return self._values

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"<MoE aux {list(self._keys)}{'' if self._values is not None else ', reduction in flight'}>"
