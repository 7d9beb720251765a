"""Replicated parameters (data parallel, DDP): gradients reduced to the parameters' layout.

A gradient leaves backward as a pending sum over every mesh axis the batch or sequence
is split on (``Partial`` over ``dp``, and over ``cp``/``tp`` for parameters those replicate
over). Microbatches accumulate in that layout — pending sums add locally, no collective —
and after the last one each gradient goes to its parameter's spec: ``Partial →
Replicate`` is the all-reduce (tag ``grad reduce``), once per step whatever ``m``.

With ``accumulate=True`` (mixed precision, :mod:`.precision`) the accumulators are in the
accumulation dtype (fp32 for bf16 gradients: a local cast of the first microbatch's),
so the sum over microbatches and its all-reduce are fp32, as Megatron's main grads.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

import optree
import torch
from torch.distributed.tensor import DTensor

from ...core import comm
from ...core._rules import accum_dtype
from ...core._torch import local_tensor
from ..optim import global_norm
from ...core.redistribute import reshard, reshard_steps
from ...ops.local_batch import LocalBatch
from ...core.spec import P, spec_of, wrap_local
from .local import pending

__all__ = ["Run"]

PyTree = Any


def _spec(x: torch.Tensor) -> P | None:
    return spec_of(x) if isinstance(x, DTensor) else None


def _cast(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g`` in ``dtype``, locally: a pending sum stays pending (each rank casts its part)."""
    if g.dtype == dtype:
        return g
    if not isinstance(g, DTensor):
        return g.to(dtype)
    return wrap_local(g.to_local().to(dtype), g.device_mesh, spec_of(g), tuple(g.shape))


class Run:
    """One step over replicated parameters: the optimizer updates the parameter tree."""

    grouped = False

    def __init__(self, params: PyTree, microbatches: int, *, accumulate: bool = False,
                 local: LocalBatch | None = None):
        self.leaves, self.treedef = optree.tree_flatten(params)
        # Local batch mode (:mod:`.local`): the forward reads plain leaves sharing the
        # parameters' storage; their gradients are laid out as pending sums on arrival.
        self.local = local
        self.inputs = self.leaves if local is None else [
            local_tensor(x).detach().requires_grad_(x.requires_grad) for x in self.leaves]
        self.grads: list[torch.Tensor | None] = [None] * len(self.leaves)
        # An accumulator this run allocated (a sum it made, not autograd's first
        # gradient, which may be a view or expanded): later microbatches add into it in
        # place, one allocation per leaf and step instead of one per microbatch.
        self.owned = [False] * len(self.leaves)
        self.accumulate = accumulate  # accumulate (and reduce) in the accumulation dtype
        self.reduced: tuple[PyTree, list[torch.Tensor]] | None = None  # gradients()' tree and its leaves

    def params(self) -> PyTree:
        return optree.tree_unflatten(self.treedef, self.inputs)

    def forward(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, microbatch: int) -> None:
        grads = torch.autograd.grad(loss, self.inputs, allow_unused=True)
        if self.local is not None:
            grads = [g if g is None else pending(g, p, self.local) for g, p in zip(grads, self.leaves)]
        self.add(grads)

    def add(self, grads: Any) -> None:
        """Add one backward's gradients (one per leaf, ``None`` for unused leaves). The
        caller's tensors are never written to: only a sum this run made is added into.

        >>> run, g = Run({"w": torch.zeros(2)}, 3), torch.ones(2)
        >>> for _ in range(3):
        ...     run.add([g])
        >>> run.grad(0).tolist(), g.tolist()
        ([3.0, 3.0], [1.0, 1.0])
        """
        for i, g in enumerate(grads):
            if g is None:
                continue
            acc = self.grads[i]
            if acc is None:
                self.grads[i] = _cast(g, accum_dtype(g.dtype)) if self.accumulate else g
                continue
            # accumulate in the accumulator's layout (pending sums add locally)
            g = g if _spec(g) == _spec(acc) else reshard(g, spec_of(acc))
            if self.owned[i]:
                (acc.to_local() if isinstance(acc, DTensor) else acc).add_(
                    g.to_local() if isinstance(g, DTensor) else g)
            else:
                self.grads[i], self.owned[i] = acc + g, True

    def grad(self, i: int) -> torch.Tensor | None:
        """Leaf ``i``'s accumulated (not yet reduced) gradient."""
        return self.grads[i]

    def set_grad(self, i: int, g: torch.Tensor) -> None:
        self.grads[i], self.owned[i] = g, False

    def gradients(self) -> Iterator[tuple[int, PyTree]]:
        # To the parameters' layout: pending sums over dp become all-reduces (DDP). A
        # gradient whose move is one all-reduce has it posted without waiting, all of
        # them before the first wait (posted early, waited late: no round trip through
        # Python per leaf); other moves reshard as usual.
        reduced: list[Any] = []
        for g, p in zip(self.grads, self.leaves):
            g = torch.zeros_like(p, dtype=accum_dtype(p.dtype) if self.accumulate else p.dtype) if g is None else g
            if not isinstance(g, DTensor) and not isinstance(p, DTensor):  # one device: where it goes
                reduced.append(g)
                continue
            src, dst = _spec(g), _spec(p)
            if src == dst:
                reduced.append(g)
                continue
            steps = reshard_steps(src, dst, g.dim())
            if len(steps) == 1 and steps[0].kind == "all_reduce":
                handle = comm.all_reduce(local_tensor(g), g.device_mesh, steps[0].axis, async_op=True,
                                         tag="grad reduce")
                reduced.append((handle, g.device_mesh, dst, tuple(g.shape)))
            else:
                reduced.append(reshard(g, dst, tag="grad reduce"))
        self.grads, self.owned = [None] * len(self.leaves), [False] * len(self.leaves)
        reduced = [wrap_local(r[0].wait(), *r[1:]) if type(r) is tuple else r for r in reduced]
        self.reduced = (optree.tree_unflatten(self.treedef, reduced), reduced)  # norm() reads the leaves
        yield 0, self.reduced[0]

    def targets(self) -> list[PyTree]:
        return [optree.tree_unflatten(self.treedef, self.leaves)]

    def mirror(self, tree: PyTree) -> PyTree:
        """A per-parameter tree laid out like the targets: ``tree`` itself."""
        return tree

    def opt_state(self, optimizer: Any, opt_state: PyTree, targets: list[PyTree]) -> PyTree:
        return optimizer.init(targets[0]) if opt_state is None else opt_state

    def norm(self, grads: PyTree) -> torch.Tensor:
        # The tree gradients() handed out (not a clipped copy): its leaves are in hand.
        tree, leaves = self.reduced or (None, None)
        return global_norm(grads, leaves=leaves if grads is tree else None)

    def mask_flags(self, mask: Any, name: str) -> None:
        """``None``: the targets are the parameters, so an optimizer reads its mask off them."""
        return None

    def in_flight(self) -> bool:
        return False  # gradients() has waited for every reduction

    def updated(self, i: int, target: PyTree) -> None:
        """Nothing to post: one group, its result is the parameters."""

    def finish(self, updated: list[PyTree]) -> tuple[PyTree, None]:
        self.reduced = None  # the step's gradients: not kept past it
        return updated[0], None
