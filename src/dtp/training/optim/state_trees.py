"""An optimizer state's subtrees that mirror the parameters (moments, momentum): found,
named and cut into ZeRO's per-bucket parts, without knowing the optimizer.
"""

from __future__ import annotations

from typing import Any, Callable

import optree

__all__ = ["map_param_trees", "state_part", "state_join"]

PyTree = Any


def map_param_trees(state: PyTree, params: PyTree, on_tree: Callable[[str, PyTree], PyTree],
                    on_leaf: Callable[[str, Any], Any] = lambda name, x: x) -> PyTree:
    """Rebuild an optimizer state, calling ``on_tree(name, subtree)`` on every subtree that
    mirrors ``params`` (same tree structure: Adam's ``mu``/``nu``, momentum) and
    ``on_leaf(name, leaf)`` on everything else (the update count).

    Names are the path of field names, keys and indices joined by ``.`` (``"mu"``,
    ``"1.count"`` inside a :func:`chain`). What :mod:`dtp.checkpoint` names optimizer
    tensors by, and how ZeRO cuts a per-parameter state into its buckets.

    >>> params = {"w": torch.ones(2)}
    >>> state = dtp.optim.adamw(0.1).init(params)
    >>> shapes = map_param_trees(state, params, lambda name, t: (name, t["w"].shape), lambda name, x: name)
    >>> shapes.count, shapes.mu
    ('count', ('mu', torch.Size([2])))
    """
    return _walk_state(state, (), optree.tree_structure(params), on_tree, on_leaf)


# A module function, not a closure over itself: a recursive inner ``walk`` is a reference
# cycle (the function, the cell holding it) that kept ``on_tree`` and all it captured —
# a pipeline step's whole Run, its parameters and gradients: 18 tensors, 218 KB a step on
# rank 0 of tiny Llama at pp2 1f1b — alive until Python's cyclic collector ran
# (measured, torch 2.13).
def _walk_state(node: Any, path: tuple[str, ...], structure: Any, on_tree: Callable[[str, PyTree], PyTree],
                on_leaf: Callable[[str, Any], Any]) -> Any:
    name, rest = ".".join(path), (structure, on_tree, on_leaf)
    if node is not None and optree.tree_structure(node) == structure:
        return on_tree(name, node)
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*(_walk_state(getattr(node, f), path + (f,), *rest) for f in node._fields))
    if isinstance(node, (tuple, list)):
        return type(node)(_walk_state(x, path + (str(i),), *rest) for i, x in enumerate(node))
    if isinstance(node, dict):
        return {k: _walk_state(v, path + (str(k),), *rest) for k, v in node.items()}
    return node if node is None else on_leaf(name, node)


def state_part(state: PyTree, groups: list[PyTree], i: int) -> PyTree:
    """Group ``i``'s part of an elementwise optimizer's state over a list of parameter
    groups (ZeRO's buckets): every subtree that mirrors ``groups``
    (:func:`map_param_trees` knows which from the optimizer's own tree: moments,
    momentum) cut to ``[groups[i]]``'s; the rest (the count) kept.

    >>> groups = [{"w": torch.ones(2)}, {"w": torch.ones(3)}]
    >>> part = state_part(dtp.optim.adamw(0.1).init(groups), groups, 1)
    >>> part.mu[0]["w"].shape, int(part.count)
    (torch.Size([3]), 0)
    """
    return map_param_trees(state, groups, lambda name, tree: [tree[i]])


def state_join(template: PyTree, groups: list[PyTree], parts: list[PyTree]) -> PyTree:
    """Inverse of :func:`state_part`: the per-group states (each over ``[groups[k]]``)
    as one state over ``groups``, shaped like ``template``; the shared leaves (the
    count) from the parts, on which the groups agree.

    >>> groups = [{"w": torch.ones(2)}, {"w": torch.ones(3)}]
    >>> state = dtp.optim.adamw(0.1).init(groups)
    >>> joined = state_join(state, groups, [state_part(state, groups, k) for k in range(2)])
    >>> [m["w"].shape for m in joined.mu]
    [torch.Size([2]), torch.Size([3])]
    """
    trees: dict[str, list[Any]] = {}
    leaves: dict[str, Any] = {}
    for k, part in enumerate(parts):
        map_param_trees(part, [groups[k]], lambda name, tree: trees.setdefault(name, []).append(tree[0]),
                        lambda name, x: leaves.__setitem__(name, x))
    return map_param_trees(template, groups, lambda name, tree: trees[name], lambda name, x: leaves[name])
