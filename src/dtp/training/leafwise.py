"""The optimizer's work over a tree's leaves, as lists of local shards.

An update flattens the gradient tree once, checks that every other tree (moments,
parameters) is laid out like it, hands the kernel one list of local tensors per tree
(so it can run ``torch._foreach_*`` kernels: one call for all leaves instead of one per
leaf, as ``torch.optim``'s ``foreach=True``), and wraps the results back where the
gradients' shards live. Local math on shards laid out alike is the global math, so no
update ever communicates.

>>> grads, params = {"a": torch.ones(2), "b": torch.ones(3)}, {"a": torch.zeros(2), "b": torch.ones(3)}
>>> out, = map_local(lambda g, p: (torch._foreach_add(p, g),), grads, [("param", params)], 1)
>>> out["a"].tolist(), out["b"].tolist()
([1.0, 1.0], [2.0, 2.0, 2.0])
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optree
import torch
from torch.distributed.tensor import DTensor, Partial

from ..core.spec import spec_of, wrap_like

__all__ = ["map_local", "zeros_like_tree", "paths", "local_of"]

PyTree = Any
Kernel = Callable[..., Sequence[list[torch.Tensor]]]


def paths(tree: PyTree) -> list[str]:
    """Each leaf's path as ``['key'][0]`` (``<root>`` for a bare leaf), for error messages.

    >>> paths({"a": [torch.ones(1)], "b": torch.ones(1)})
    ["['a'][0]", "['b']"]
    """
    return ["".join(f"[{k!r}]" for k in path) or "<root>" for path in optree.tree_paths(tree)]


def local_of(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, a plain tensor itself.

    >>> local_of(torch.ones(2)).shape
    torch.Size([2])
    """
    return x.to_local() if isinstance(x, DTensor) else x


def _like(local: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Wrap a local result with ``ref``'s mesh, placements and global shape (no communication)."""
    return wrap_like(local, ref) if isinstance(ref, DTensor) else local


def _layout_error(ref: torch.Tensor, what: str, x: torch.Tensor) -> str | None:
    """Why ``x`` (the ``what``) is not laid out like the gradient ``ref`` (``None``: it is).

    All leaves of one position must be laid out alike, so local math is global math.
    Mismatched placements would make DTensor redistribute implicitly (unrecorded
    communication) or, on local tensors, silently compute garbage: refused instead."""
    if isinstance(ref, DTensor):
        if not isinstance(x, DTensor):
            return f"gradient is a DTensor but the {what} is a plain {type(x).__name__}"
        if x.device_mesh != ref.device_mesh or tuple(x.placements) != tuple(ref.placements) or x.shape != ref.shape:
            return (f"{what} is laid out as {spec_of(x)} {tuple(x.shape)} but the gradient as "
                    f"{spec_of(ref)} {tuple(ref.shape)}; dtp.reshard one of them first")
        return None
    if isinstance(x, DTensor):
        return f"the {what} is a DTensor but the gradient is a plain tensor"
    if x.shape != ref.shape:
        return f"{what} has shape {tuple(x.shape)} but the gradient {tuple(ref.shape)}"
    return None


def _check(grads: PyTree, leaves: list[torch.Tensor], others: Sequence[tuple[str, list[torch.Tensor] | None]]) -> None:
    # Paths are built only to name a failure: on the steady path they cost more than the check.
    for i, g in enumerate(leaves):
        if isinstance(g, DTensor) and any(isinstance(p, Partial) for p in g.placements):
            raise ValueError(f"{paths(grads)[i]}: gradient has pending sums (spec {spec_of(g)}); reduce it "
                             f"first, e.g. dtp.reshard(grad, spec_of(param))")
        for what, xs in others:
            if xs is not None:
                why = _layout_error(g, what, xs[i])
                if why:
                    raise ValueError(f"{paths(grads)[i]}: {why}")


def map_local(kernel: Kernel, grads: PyTree, others: Sequence[tuple[str, PyTree | None]],
              n_out: int, *, params_of: str | None = None) -> list[PyTree]:
    """``kernel(gs, *others)`` over the local shards, all leaves at once; ``n_out`` trees
    shaped and laid out like ``grads`` come back.

    ``others`` are ``(name, tree)`` pairs, each tree shaped and laid out like ``grads``
    (checked: a mismatch names the leaf and the tree); the kernel gets one list of local
    tensors per tree, ``None`` for a ``None`` tree, and returns ``n_out`` lists in leaf
    order. It runs under ``torch.no_grad``; a tree without leaves never calls it.
    ``params_of`` names the tree of ``others`` the first output replaces (an optimizer's
    new parameters): each of its leaves then requires grad where that tree's leaf does,
    set on the leaves in hand rather than by flattening the result again.

    >>> g = {"w": torch.ones(2)}
    >>> doubled, = map_local(lambda gs: (torch._foreach_mul(gs, 2.0),), g, [], 1)
    >>> doubled["w"].tolist()
    [2.0, 2.0]
    """
    leaves, treedef = optree.tree_flatten(grads)
    other_leaves = [(name, None if t is None else treedef.flatten_up_to(t)) for name, t in others]
    if not leaves:
        return [treedef.unflatten([]) for _ in range(n_out)]
    if _all_plain(leaves, other_leaves):  # one device: nothing to unwrap, check or wrap back
        with torch.no_grad():
            outs = kernel(leaves, *(xs for _, xs in other_leaves))
        wrap = False
    else:
        _check(grads, leaves, other_leaves)
        with torch.no_grad():
            outs = kernel([local_of(g) for g in leaves],
                          *(None if xs is None else [local_of(x) for x in xs] for _, xs in other_leaves))
        wrap = True
    if len(outs) != n_out:
        raise ValueError(f"map_local: the kernel returned {len(outs)} lists, expected {n_out}")
    if wrap:
        outs = [[_like(r, g) for r, g in zip(out, leaves)] for out in outs]
    if params_of is not None:
        for new, p in zip(outs[0], dict(other_leaves)[params_of]):  # a loop: no Python call per leaf
            if p.requires_grad:
                new.requires_grad_(True)  # a leaf made under no_grad: in place
    return [treedef.unflatten(out) for out in outs]


def _all_plain(leaves: list[torch.Tensor], others: Sequence[tuple[str, list[torch.Tensor] | None]]) -> bool:
    """Every leaf of every tree a plain tensor, each of the gradient's shape: the common
    one-device case, proved in one pass per tree (any mismatch: the full check names it)."""
    # Loops, not any()/all() over generators: each resumption of a generator is a Python
    # call, one per leaf, and this runs every step (world 1, llama "tiny": ~50 of the ~660
    # Python-level calls sys.setprofile counted in a step).
    for g in leaves:
        if isinstance(g, DTensor):
            return False
    for _, xs in others:
        if xs is not None:
            for x, g in zip(xs, leaves):
                if isinstance(x, DTensor) or x.shape != g.shape:
                    return False
    return True


def zeros_like_tree(params: PyTree) -> PyTree:
    """Zeros laid out like ``params`` (contiguous, each leaf's dtype): moments, momentum.

    >>> zeros_like_tree({"w": torch.ones(2)})
    {'w': tensor([0., 0.])}
    """
    def zeros(p: torch.Tensor) -> torch.Tensor:
        return _like(torch.zeros_like(local_of(p), memory_format=torch.contiguous_format), p)

    with torch.no_grad():
        return optree.tree_map(zeros, params)
