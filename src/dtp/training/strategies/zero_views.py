"""ZeRO's forward view of the parameters: leaves that materialise from their bucket on
read, and whose backward feeds their gradient to the bucket (:class:`dtp.strategies.zero.Run`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ...core._torch import current_graph_task_id
from ...core.spec import wrap_local

if TYPE_CHECKING:
    from .zero import Run

__all__ = ["ParamView", "in_backward", "LazyMapping", "LazySequence"]


class ParamView(torch.autograd.Function):
    """A parameter leaf for the forward; its backward feeds the gradient to its bucket."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, local: torch.Tensor, step: "Run", i: int) -> torch.Tensor:  # type: ignore[override]
        ctx.step, ctx.i = step, i
        if step.local is not None:  # local batch mode: the plain view (no DTensor per op)
            return local.view_as(local)
        leaf = step.z.leaves[i]
        return wrap_local(local, leaf.mesh, leaf.spec, leaf.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.step.add_grad(ctx.i, grad)
        return None, None, None, None


def in_backward() -> bool:
    """True while the autograd engine runs backward — a checkpointed block being
    recomputed reads its parameters then, and those reads are no forward uses."""
    return current_graph_task_id() != -1


class LazyMapping(Mapping):
    """A read-only mirror of a dict of parameters; leaves materialise on read."""

    def __init__(self, node: Mapping, step: "Run"):
        self._node, self._step = node, step

    def __getitem__(self, key: Any) -> Any:
        return self._step.resolve(self._node[key])

    def __contains__(self, key: object) -> bool:  # a membership test is no parameter read
        return key in self._node

    def __iter__(self) -> Iterator[Any]:
        return iter(self._node)

    def __len__(self) -> int:
        return len(self._node)

    def __repr__(self) -> str:
        return f"<dtp ZeRO parameter view of {list(self._node)}>"


class LazySequence(Sequence):
    """A read-only mirror of a list/tuple of parameters; leaves materialise on read."""

    def __init__(self, node: Sequence, step: "Run"):
        self._node, self._step = node, step

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._step.resolve(v) for v in self._node[index]]
        return self._step.resolve(self._node[index])

    def __len__(self) -> int:
        return len(self._node)
