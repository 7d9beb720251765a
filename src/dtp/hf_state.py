"""A :class:`~dtp.TrainState` straight from a Hugging Face directory, each rank reading
only its own blocks (``TrainState.from_hf``).

:func:`dtp.models.hf.from_hf` gives every rank the whole model, which
``TrainState.create`` then cuts. Here the layout's placement of each parameter is worked
out first (the same :meth:`~dtp.Layout.param_spec` ``create`` uses), and each rank asks
the safetensors files for its block only (``get_slice``: memory-mapped, the other bytes
never read), then wraps it as its piece of the DTensor. Under tp a rank reads 1/tp of
each split matrix; a parameter replicated over dp is read by each dp rank (its own copy).
ZeRO's buckets are cut from these pieces at step one, as after ``create``; a stage-3
rank therefore holds its tp block whole until then.
"""

from __future__ import annotations

import os
from typing import Any

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh

from . import guard, strategies
from .layouts import Layout
from .mesh import axis_sizes, block_index
from .models import hf, llama
from .optim import GradientTransformation
from .spec import P, check_spec, wrap_local
from .step import TrainState

__all__ = ["state_from_hf"]


def _box(spec: P, mesh: DeviceMesh, shape: tuple[int, ...]) -> hf.Box:
    """This rank's block of a ``shape`` tensor laid out as ``spec`` (what ``dtp.shard`` keeps)."""
    sizes, box = axis_sizes(mesh), []
    for d, n in enumerate(shape):
        axes = spec.axes_of(d)
        count = 1
        for a in axes:
            count *= sizes[a]
        step = n // count
        start = block_index(mesh, axes) * step if count > 1 else 0
        box.append((start, start + step))
    return tuple(box)


def state_from_hf(path: str | os.PathLike[str], optimizer: GradientTransformation, *, mesh: DeviceMesh,
                  layout: Layout, dtype: torch.dtype = torch.float32, vocab_multiple: int = 1) -> TrainState:
    """``TrainState.from_hf``: the state ``TrainState.create(from_hf(path)[1], ...)`` builds,
    each rank reading only its blocks (module docstring). The model's config is
    ``dtp.models.hf.config_from_hf(path, vocab_multiple)``.

    Collectives: one small all-gather (the ranks agree on the directory and options, and
    raise any rank's error on all). Raises: ``ValueError`` for a layout that does not fit
    the model or an unsupported / inconsistent directory, on every rank.
    """
    error, params, checks = None, None, guard.Agreements()
    cfg = None
    try:
        cfg = hf.config_from_hf(path, vocab_multiple)
        layout.check_mesh(mesh)
        layout.check_sizes(llama.axis_sizes(cfg), mesh, what="TrainState.from_hf")
        axes = llama.param_axes(cfg)
        one = mesh.size() == 1
        placed: dict[str, tuple[P, tuple[int, ...]]] = {}  # leaf path -> (spec, global shape)

        def block(name: str, shape: tuple[int, ...]) -> hf.Box | None:
            if one:
                return None
            spec = layout.param_spec(_leaf(axes, name), mesh, name=f"param {name}")
            check_spec(spec, mesh, shape, f"param {name}")
            placed[name] = (spec, shape)
            return _box(spec, mesh, shape)

        local = hf.read_blocks(path, cfg, dtype, block)
        paths = [".".join(map(str, p)) for p in optree.tree_paths(local)]
        leaves = [x.requires_grad_(True) if one else wrap_local(x, mesh, *placed[p]).requires_grad_(True)
                  for p, x in zip(paths, optree.tree_leaves(local))]
        params = optree.tree_unflatten(optree.tree_structure(local), leaves)
        floats = {x.dtype for x in leaves}
        checks = guard.Agreements(vocab=cfg.vocab_size, param_dtype=floats.pop() if len(floats) == 1 else None)
    except (ValueError, TypeError, KeyError, OSError) as e:
        error = e if isinstance(e, ValueError) else ValueError(f"TrainState.from_hf: {e}")
    guard.check_together("TrainState.from_hf", mesh, {"directory": str(path), "dtype": str(dtype),
                                                      "vocab_multiple": str(vocab_multiple),
                                                      "layout": layout.name or "custom"}, error)
    opt_state, strategy = strategies.create(params, optimizer, layout, mesh)
    return TrainState(0, params, opt_state, optimizer, mesh, layout, llama.param_axes(cfg), strategy, checks)


def _leaf(tree: Any, name: str) -> Any:
    for part in name.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree

