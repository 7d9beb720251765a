"""Zero bubble's split backward for one stage: ``I`` (input gradient) then ``W`` (weights).

``I`` differentiates the stage's output only with respect to its input, as the previous
stage needs, and keeps what ``W`` needs: the gradients arriving at the *boundary nodes*,
the nodes of the autograd graph on the input's path (they run in ``I`` anyway) that also
lead to a weight (typically the matmul or multiply that reads it). ``W`` then starts the
backward at those nodes with those gradients and runs only down to the weights, so the
chain from the output to the input is not traversed twice: in FLOPs ``I + W = B``
(``tests/test_pipeline_v.py`` counts them with ``FlopCounterMode``). The idea is zero
bubble's (Qi et al. 2023; torch 2.13's ``stage_backward_input`` / ``stage_backward_weight``
do the same on ``nn.Module`` stages); the code is dtp's.

``W`` runs one backward per group of weights sharing boundary nodes, asking for that
group's weights only, so the engine runs nothing of the input chain below the group's
nodes. Where a weight reaches two boundary nodes one of which lies below the other, the
lower node's gradient would arrive twice (once from its own start, once through the
upper node): a pre-hook replaces what reaches it by what ``I`` saw there, so each weight's
gradient counts once (that group then pays for the chain between the two). Under ZeRO
the weight is one anchor every parameter view hangs from: W groups by view, asks for the
gradient arriving at each view, then runs that view's backward (its bucket's add).

A stage with no input gradient to compute (the first: token ids) keeps the whole graph
and ``W`` is its full backward.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from ...core._torch import run_backward

__all__ = ["WeightGrad", "backward_input", "grads_for", "differentiate"]


def grads_for(outs: Sequence[torch.Tensor], grad: Any) -> list[torch.Tensor]:
    """The gradients ``outs`` are differentiated with: ``grad`` (one per output), or
    ones for a scalar loss, as ``torch.autograd.grad`` makes them for ``None``."""
    if grad is None:
        return [torch.ones_like(o, memory_format=torch.preserve_format) for o in outs]
    return [grad] if isinstance(grad, torch.Tensor) else list(grad)


def differentiate(outs: Sequence[torch.Tensor], grad: Any, inputs: Sequence[Any], *,
                  retain_graph: bool = False) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outs, inputs, grad, allow_unused=True)`` through the engine
    directly (:func:`dtp.core._torch.run_backward`): a backward action calls it one to three
    times, and ``autograd.grad``'s Python checks cost about as much as the engine's own
    setup (35 of 65 µs a call, measured on a 1-layer graph)."""
    if not outs:
        return (None,) * len(inputs)
    return run_backward(outs, grads_for(outs, grad), inputs, retain_graph=retain_graph)


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Each node of the graph below ``roots`` and the nodes that feed it gradients."""
    parents: dict[Node, list[Node]] = {root: [] for root in roots}
    stack = list(parents)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _above(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> set[Node]:
    """The nodes reached from ``starts`` walking towards the root; a node in ``stop`` is
    collected but not walked past."""
    seen, stack = set(starts), list(starts)
    while stack:
        node = stack.pop()
        if node in stop:
            continue
        for parent in parents.get(node, ()):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


class WeightGrad:
    """What ``I`` kept for ``W``: per group of weights, the boundary nodes they lead from
    and the gradients that reached those nodes (or, where there was no input gradient,
    the output and its gradient: ``whole``), and each weight's gradient edge (looked up
    once, in ``I``)."""

    def __init__(self, groups: list[tuple[list[Node], list[Node | int]]], grads: dict[Node, tuple],
                 whole: tuple[Any, Any] | None, edges: Sequence[GradientEdge | None] = ()):
        self.groups, self.grads, self.whole, self.edges = groups, grads, whole, list(edges)

    def run(self, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """The weights' gradients (``None`` for one this stage does not read); ``weights``
        as :func:`backward_input` was given them."""
        if self.whole is not None:
            out, grad = self.whole
            self.whole = None
            return differentiate(out, grad, list(weights))
        edges = self.edges or [get_gradient_edge(w) if w.requires_grad else None for w in weights]
        result: list[torch.Tensor | None] = [None] * len(weights)
        for boundary, members in self.groups:
            # One backward per group: starting at a group's nodes and asking for only its
            # weights (or views), the engine runs nothing of the input chain below them.
            starts = [(GradientEdge(node, k), g) for node in boundary for k, g in enumerate(self.grads.get(node, ()))
                      if g is not None]
            if not starts:
                continue
            handles = [node.register_prehook(lambda grad_outputs, saved=self.grads[node]: saved)
                       for node in boundary if len(boundary) > 1 and node in self.grads]
            try:
                targets = [GradientEdge(m, 0) if isinstance(m, Node) else edges[m] for m in members]
                got = run_backward([e for e, _ in starts], [g for _, g in starts], targets, retain_graph=True)
            finally:
                for h in handles:
                    h.remove()
            views = [(m, g) for m, g in zip(members, got) if isinstance(m, Node) and g is not None]
            if views:  # each view's own backward (ZeRO's: it adds into its bucket), down to its anchor
                run_backward([GradientEdge(m, 0) for m, _ in views], [g for _, g in views],
                             [e for e in edges if e is not None])
            for m, g in zip(members, got):
                if not isinstance(m, Node):
                    result[m] = g
        self.groups, self.grads = [], {}
        return tuple(result)


def backward_input(out: torch.Tensor | Sequence[torch.Tensor], grad: Any,
                   x: torch.Tensor | Sequence[torch.Tensor] | None,
                   weights: Sequence[torch.Tensor], *, views: bool = False) -> tuple[Any, WeightGrad]:
    """``(d out / d x, what W needs)``: ``I`` of the module docstring. ``x`` is the stage's
    input leaf (``None`` on the first stage: then ``W`` does the whole backward), or a
    list of them (a carry's tree: the hidden state and the aux losses; ``out`` and
    ``grad`` then are lists too, and so is the result's first item).
    ``views``: the weights are anchors the parameters hang from as views (ZeRO's), each
    view's backward doing the work; W groups by view, and runs each view's backward."""
    many = not isinstance(x, torch.Tensor) and x is not None
    xs = list(x) if many else ([] if x is None else [x])
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    if not xs or all(o.grad_fn is None for o in outs):
        return ([None] * len(xs) if many else None), WeightGrad([], {}, (outs, grad))
    roots = [get_gradient_edge(o).node for o in outs if o.requires_grad]
    parents = _parents(roots)
    x_nodes = [n for n in (get_gradient_edge(v).node for v in xs) if n in parents]
    on_path = _above(x_nodes, parents, set())
    # Weights whose boundary nodes overlap share one group (union by shared node).
    groups: list[tuple[set[Node], list[Node | int]]] = []
    units: list[tuple[Node, Node | int]] = []  # (node to walk up from, what W asks for)
    edges = [get_gradient_edge(w) if w.requires_grad else None for w in weights]
    for j, edge in enumerate(edges):
        node = edge.node if edge is not None else None
        if node not in parents:
            continue  # not read by this stage: its gradient is None
        units += [(v, v) for v in parents[node]] if views else [(node, j)]
    for node, unit in units:
        mine, members = _above([node], parents, on_path) & on_path, [unit]
        for group in [g for g in groups if g[0] & mine]:
            groups.remove(group)
            mine, members = mine | group[0], group[1] + members
        groups.append((mine, members))
    boundary = {node for nodes, _ in groups for node in nodes}
    grads: dict[Node, tuple] = {}

    def keeper(node: Node):
        def hook(grad_outputs: tuple) -> None:
            grads[node] = tuple(grad_outputs)
        return hook

    handles = [node.register_prehook(keeper(node)) for node in boundary]
    try:
        dxs = differentiate(outs, grad, xs, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    kept = WeightGrad([(sorted(nodes, key=id), members) for nodes, members in groups], grads, None, edges)
    return (list(dxs) if many else dxs[0]), kept
