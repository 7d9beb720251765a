"""A model as an ordered sequence of layers — what a pipeline splits into stages.

A :class:`Layer` is a function ``fn(params, x, batch) -> x`` with the parameter paths it
reads: the first layer gets ``x=None`` and reads the batch, the last returns the scalar
loss (or ``(loss, aux)``). :class:`Sequential` runs them in order, so the same object is
an ordinary ``loss_fn(params, batch)`` and, under ``layouts.pipeline``, the thing
``train_step`` cuts into stages. Any model can be written this way; nothing in it knows
about stages.

>>> import torch
>>> model = Sequential([
...     Layer(lambda p, x, b: b["x"] @ p["w1"], ("w1",), "in"),
...     Layer(lambda p, x, b: torch.relu(x) @ p["w2"], ("w2",), "hidden"),
...     Layer(lambda p, x, b: ((x - b["y"]) ** 2).mean(), (), "loss"),
... ])
>>> params = {"w1": torch.ones(3, 4), "w2": torch.ones(4, 1)}
>>> model(params, {"x": torch.ones(2, 3), "y": torch.zeros(2, 1)})
tensor(144.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Layer", "Sequential", "select"]

PyTree = Any


@dataclass(frozen=True)
class Layer:
    """One layer: ``fn(params, x, batch)`` and the parameter paths it reads (top-level
    keys, or dotted paths such as ``"layers.3"``)."""

    fn: Callable[[PyTree, Any, Mapping[str, Any]], Any]
    params: tuple[str, ...] = ()
    name: str = ""


class Sequential:
    """Layers run in order; callable as ``loss_fn(params, batch)``: each layer takes the
    previous one's output (the first gets ``None``) and the batch; the last returns the loss.

    >>> import torch
    >>> from dtp import Layer, Sequential
    >>> model = Sequential([Layer(lambda p, x, b: b["x"] @ p["w"], ("w",), "linear"),
    ...                     Layer(lambda p, y, b: ((y - b["y"]) ** 2).mean(), (), "loss")])
    >>> float(model({"w": torch.eye(2)}, {"x": torch.ones(3, 2), "y": torch.zeros(3, 2)}))
    1.0
    """

    def __init__(self, layers: Sequence[Layer], *, carry: str = "tensor"):
        self.layers = tuple(layers)
        if not self.layers or not all(isinstance(layer, Layer) for layer in self.layers):
            raise TypeError("Sequential: give a non-empty sequence of dtp.Layer")
        if carry not in ("tensor", "tree"):
            raise ValueError(f"Sequential: carry must be 'tensor' or 'tree', got {carry!r}")
        # What passes between layers: one tensor, or a tree of them (an MoE model's (h, aux
        # losses)); a pipeline sends either between stages, and with a tree it also shares
        # the head's aux over pp (the model's statistics, wanted on every rank).
        self.carry = carry

    def __len__(self) -> int:
        return len(self.layers)

    def run(self, params: PyTree, x: Any, batch: Mapping[str, Any], first: int = 0, stop: int | None = None) -> Any:
        """Layers ``first … stop−1`` on ``x`` (a stage's share)."""
        for layer in self.layers[first:stop]:
            x = layer.fn(params, x, batch)
        return x

    def __call__(self, params: PyTree, batch: Mapping[str, Any]) -> Any:
        return self.run(params, None, batch)

    def paths(self, first: int = 0, stop: int | None = None) -> tuple[str, ...]:
        """The parameter paths layers ``first … stop−1`` read, in first-use order."""
        return tuple(dict.fromkeys(p for layer in self.layers[first:stop] for p in layer.params))


def select(params: PyTree, path: str) -> Any:
    """The subtree at a dotted ``path`` (``"layers.3"``: key ``layers``, index 3).

    >>> select({"layers": [{"w": 1}, {"w": 2}]}, "layers.1")
    {'w': 2}
    """
    node = params
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
    return node
