"""Local batch mode: the model computes on plain tensors, one rank's rows of the batch.

When a layout splits nothing but the batch (data parallel, ZeRO 1/2/3; no tp, cp, ep or
pp on the compute mesh), every parameter is whole on every rank and every activation is
the rank's own rows: DTensor adds nothing to the compute but its per-op dispatch. The
strategy (:mod:`dtp.strategies.local`) then hands ``loss_fn`` plain tensors — the local
parameter tensors (ZeRO-3: the gathered bucket views) and the batch's local rows — and
enters :func:`local_batch` around the call, naming the mesh axes the rows are split over.

**How an op that reduces over the batch knows.** The model never asks (it does not
branch on the parallel config); the few ops whose result is a sum over the *global*
batch consult this context when they meet a plain tensor, and reduce over its axes
through :func:`batch_sum`:

* :func:`dtp.ops.cross_entropy` — the rank's sum over its valid targets divided by the
  global count (``mean_over``'s divisor, or :func:`dtp.ops.count_targets`, which sums the
  local counts here), then summed over the batch axes: the replicated global mean;
* :func:`dtp.ops.moe.moe_ffn` — the global token count (local tokens × the batch split)
  and its statistics all-reduce (:mod:`dtp.ops.moe_stats`), posted as with DTensors.

:func:`batch_sum` is what ``reshard(Partial → Replicate)`` is on a DTensor: the same
all-reduce forward (same bytes, same tag), and in backward the replicated gradient goes
to each rank's partial term as it is (no collective). Every other op is per token or per
row, so it is right on a rank's rows as it is.

**Which models run here.** One that reduces over the batch only through those ops: an
op of its own that does (a batch norm, a plain ``.mean()`` of a loss, as a user's
``loss_fn`` often is) would see only the local rows — a wrong loss and, once the
strategy sums the gradients, gradients ``dp`` times too large. So local mode is opt-in by
the loss function, never guessed: :func:`batch_local` marks a ``loss_fn`` (``llama.loss``,
``llama.sequential``'s model) as reducing over the batch only through ``dtp.ops``; an
unmarked one runs on DTensors as before. The mark states what the function computes,
not which layout runs it, so the model still never branches on the parallel config.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..core import comm
from ..core.mesh.devices import axis_sizes

__all__ = ["LocalBatch", "local_batch", "active", "batch_sum", "batch_split", "batch_local", "is_batch_local"]

_state = threading.local()  # the step's thread runs the loss
_MARK = "__dtp_batch_local__"
F = TypeVar("F", bound=Callable[..., Any])


def batch_local(fn: F) -> F:
    """Mark ``fn`` (a ``loss_fn(params, batch)``) as reducing over the batch only through
    ``dtp.ops`` (:func:`dtp.ops.cross_entropy`, MoE statistics): where the layout splits
    only the batch, ``train_step`` may run it on plain local tensors (module docstring).

    >>> is_batch_local(batch_local(lambda params, batch: 0.0))
    True
    """
    setattr(fn, _MARK, True)
    return fn


def is_batch_local(fn: Any) -> bool:
    """Whether ``fn`` (or the function a ``functools.partial`` calls) is :func:`batch_local`.

    >>> is_batch_local(functools.partial(batch_local(lambda p, b, cfg: 0.0), cfg=1)), is_batch_local(len)
    (True, False)
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    return bool(getattr(fn, _MARK, False))


@dataclass(frozen=True)
class LocalBatch:
    """The batch is split over ``axes`` of ``mesh`` (the batch dim's split, major → minor) and a rank computes on its rows."""

    mesh: DeviceMesh
    axes: tuple[str, ...]

    @property
    def split(self) -> int:
        """How many ranks share the batch (the product of the axes' sizes)."""
        sizes = axis_sizes(self.mesh)
        return math.prod(sizes[a] for a in self.axes)


@contextlib.contextmanager
def local_batch(ctx: LocalBatch | None) -> Iterator[None]:
    """Inside, plain tensors are one rank's rows of a batch split as ``ctx`` says (``None``:
    not split, as outside).

    >>> with local_batch(None):
    ...     active() is None
    True
    """
    previous = active()
    _state.value = ctx
    try:
        yield
    finally:
        _state.value = previous


def active() -> LocalBatch | None:
    """The :class:`LocalBatch` entered in this thread (``None``: plain tensors are whole)."""
    return getattr(_state, "value", None)


def batch_split() -> int:
    """How many ranks share the batch of the plain tensors here (1 outside local mode).

    >>> batch_split()
    1
    """
    ctx = active()
    return 1 if ctx is None else ctx.split


class _BatchSum(torch.autograd.Function):
    """Forward: the all-reduce over the batch axes; backward: the gradient as it is
    (each rank's term receives the replicated gradient, as ``Partial → Replicate``'s)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, batch: LocalBatch, tag: str) -> torch.Tensor:  # type: ignore[override]
        total = x.detach()
        for axis in batch.axes:
            total = comm.all_reduce(total, batch.mesh, axis, tag=tag)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None


def batch_sum(x: torch.Tensor, tag: str) -> torch.Tensor:
    """``x`` (this rank's term) summed over the ranks sharing the batch: one all-reduce per
    batch axis (tag ``tag``), identity backward; ``x`` itself outside local mode.

    >>> batch_sum(torch.tensor(2.0), "loss")
    tensor(2.)
    """
    ctx = active()
    if ctx is None or not ctx.axes:
        return x
    return _BatchSum.apply(x, ctx, tag)
