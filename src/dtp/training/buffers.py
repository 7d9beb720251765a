"""Non-trainable state: the :class:`dtp.TrainState` collection no gradient trains.

Flax keeps such state in its own collection beside ``params`` (``batch_stats``);
Megatron-core keeps aux-loss-free balancing's expert bias as a module buffer that the
optimizer skips. Here ``TrainState.buffers`` is a pytree that mirrors part of the
parameter tree (``{"layers": [{}, {"router_bias": b}]}``: block 1's router bias). It is

- **read** by the model as if it were among the parameters: ``train_step`` hands
  ``loss_fn`` :func:`with_buffers` ``(params, buffers)``, a read-only view in which
  ``params["layers"][1]["router_bias"]`` is the buffer (the parameters' own views, ZeRO's
  lazy leaves included, are untouched). No gradient is taken for it;
- **never seen** by the optimizer, the gradient norm, clipping or ZeRO's buckets, which
  all work on ``params``;
- **updated** after each applied step by the state's rule ``update(buffers, aux)``
  (``aux``: what ``loss_fn`` returned, one per microbatch when there are several) on
  whole plain tensors, laid out again by :func:`lay_out`; a skipped step keeps them;
- **saved and loaded** by :mod:`dtp.checkpoint` as ``buffer/<path>``, any layout into any other.

Buffers are small (a bias per expert): they are replicated over the whole mesh.

>>> view = with_buffers({"layers": [{"w": 1}, {"w": 2}]}, {"layers": [{}, {"b": 3}]})
>>> view["layers"][1]["b"], view["layers"][1]["w"], "b" in view["layers"][0]
(3, 2, False)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterator

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..core.spec import P, shard

__all__ = ["with_buffers", "reading", "lay_out", "apply_update", "plain"]

PyTree = Any


class _MappingView(Mapping):
    """A dict of parameters with the buffers at the same level laid over it."""

    def __init__(self, params: Mapping, buffers: Mapping):
        self._params, self._buffers = params, buffers

    def __getitem__(self, key: Any) -> Any:
        if key in self._buffers:
            mine = self._buffers[key]
            return with_buffers(self._params[key], mine) if key in self._params else mine
        return self._params[key]

    def __contains__(self, key: object) -> bool:  # no read: ZeRO's leaves stay where they are
        return key in self._buffers or key in self._params

    def __iter__(self) -> Iterator[Any]:
        yield from self._params
        yield from (k for k in self._buffers if k not in self._params)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _SequenceView(Sequence):
    """A list of parameter subtrees with the buffers' list laid over it item by item."""

    def __init__(self, params: Sequence, buffers: Sequence):
        self._params, self._buffers = params, buffers

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        return with_buffers(self._params[index], self._buffers[index])

    def __len__(self) -> int:
        return len(self._params)


def with_buffers(params: PyTree, buffers: PyTree) -> PyTree:
    """``params`` with ``buffers`` laid over it: a read-only view (nothing is copied, and
    no parameter is read until the model reads it). ``buffers`` mirrors part of
    ``params``: dicts by key, lists by position (the same length); an empty or ``None``
    ``buffers`` gives ``params`` itself.

    Raises: ``ValueError`` when a list of buffers does not match its list of parameters.

    >>> with_buffers({"w": 1}, None)
    {'w': 1}
    """
    if not buffers:
        return params
    if isinstance(buffers, Mapping) and isinstance(params, Mapping):
        return _MappingView(params, buffers)
    if isinstance(buffers, Sequence) and isinstance(params, Sequence):
        if len(buffers) != len(params):
            raise ValueError(f"with_buffers: a list of {len(buffers)} buffer subtrees lies over {len(params)} "
                             f"parameter subtrees; give one (maybe empty) per item")
        return _SequenceView(params, buffers)
    raise ValueError(f"with_buffers: buffers ({type(buffers).__name__}) do not mirror the parameters here "
                     f"({type(params).__name__}); nest them as the parameters are nested")


def reading(loss_fn: Callable[[Any, Any], Any], buffers: Any) -> Callable[[Any, Any], Any]:
    """``loss_fn`` reading ``buffers`` laid over its parameters (:func:`with_buffers`);
    ``loss_fn`` itself when there are none.

    >>> f = reading(lambda params, batch: params["bias"] + batch, {"bias": 10})
    >>> f({"w": 1}, 5)
    15
    """
    if not buffers:
        return loss_fn
    return lambda params, batch: loss_fn(with_buffers(params, buffers), batch)


def plain(x: torch.Tensor) -> torch.Tensor:
    """A buffer's whole value as a plain tensor (a replicated DTensor's local copy).

    >>> plain(torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    return x.to_local() if isinstance(x, DTensor) else x


def lay_out(buffers: PyTree, mesh: DeviceMesh | None) -> PyTree:
    """Whole ``buffers`` (identical on every rank) replicated on ``mesh``, no gradient;
    plain tensors on a one-device mesh (as the parameters are there).

    Raises: ``TypeError`` for a leaf that is not a tensor.

    >>> lay_out({"b": torch.zeros(2)}, None)["b"].requires_grad
    False
    """
    def place(path: tuple, x: Any) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"buffer {'.'.join(map(str, path))} must be a tensor, got {type(x).__name__}")
        x = plain(x).detach()
        if mesh is None or mesh.size() == 1:
            return x.clone()
        return shard(x, mesh, P(), name=f"buffer {'.'.join(map(str, path))}")

    return optree.tree_map_with_path(place, buffers)


def apply_update(update: Callable[[PyTree, Any], PyTree], buffers: PyTree, aux: Any,
                 mesh: DeviceMesh | None) -> PyTree:
    """The rule's new buffers from the step's ``aux``, laid out again: ``update`` sees
    whole plain tensors under no_grad and returns the same tree.

    Raises: ``ValueError`` when the rule returns another tree.

    >>> apply_update(lambda b, aux: {"b": b["b"] + aux}, {"b": torch.zeros(2)}, 1.0, None)["b"].tolist()
    [1.0, 1.0]
    """
    with torch.no_grad():
        new = update(optree.tree_map(plain, buffers), aux)
    if optree.tree_structure(new) != optree.tree_structure(buffers):
        raise ValueError("TrainState.buffer_update must return a tree shaped as the buffers it was given")
    return lay_out(new, mesh)
