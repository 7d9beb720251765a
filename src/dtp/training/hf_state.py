"""A :class:`~dtp.TrainState` straight from a Hugging Face directory, each rank reading
only what it will hold (``TrainState.from_hf``).

:func:`dtp.models.hf.from_hf` gives every rank the whole model, which
``TrainState.create`` then cuts. Here the layout's placement of each parameter is worked
out first (the same :meth:`~dtp.Layout.param_spec` ``create`` uses), and each rank asks
the safetensors files for its part only (``get_slice``: memory-mapped, the other bytes
never read), then wraps it as its piece of the DTensor:

* tp / cp / ep: a rank reads its block of each split tensor (1/tp of a split matrix); a
  parameter replicated over dp is read by each dp rank (its own copy).
* ZeRO (stage 1, 2 or 3 over dp): the bucket plan is made before any weight is read
  (:func:`dtp.strategies.zero_plan.make_plan`: the one rule step one uses), in the order the
  model declares its layers read their parameters (``llama.sequential(cfg)``; within a
  block, tree order) instead of step one's recorded order. A rank reads only the element
  runs of its slice of every bucket — 1/(dp·tp) of the file — as its fp32 master slices;
  the optimizer state is built over them at once. Stage 3 keeps only those; stage 1/2
  all-gather each bucket over dp into the parameters' buffers (as after every step).
* pipeline: a rank reads only the parameters its stages read (the schedule's stage-to-rank
  map, interleaved and V placements included); the others are ``None`` in its tree, as
  after a step. (ZeRO under the stages is cut at step one from the stage's blocks.)
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Callable

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh

from . import guard
from . import strategies
from ..core._rules import accum_dtype
from ..layouts import Layout
from ..core.mesh.devices import axis_sizes, block_index
from ..models.hf import convert as hf
from ..models import llama
from ..models.config import LlamaConfig
from .optim import GradientTransformation
from ..core.spec import P, check_spec, wrap_local
from .strategies import pipeline, zero, zero_plan

if TYPE_CHECKING:
    from .state import TrainState  # TrainState.from_hf calls in here with its class

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


def _shapes(cfg: LlamaConfig) -> dict[str, Any]:
    """Every parameter's global shape, in :func:`dtp.models.llama.init`'s tree."""
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, cfg.dim),
                              "layers": [llama.block_shapes(cfg, i) for i in range(cfg.n_layers)],
                              "final_norm": (cfg.dim,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.dim, cfg.vocab_size)
    return shapes


def _paths(tree: Any) -> list[str]:
    return [".".join(map(str, p)) for p in optree.tree_paths(tree, is_leaf=lambda x: isinstance(x, tuple))]


def _declared_use(cfg: LlamaConfig, paths: list[str]) -> list[int]:
    """Leaf indices in the order the model's layers declare they read them (a layer's
    subtree in tree order; a parameter two layers read, the tied embedding, twice)."""
    used = []
    for layer in llama.sequential(cfg).layers:
        for prefix in layer.params:
            used += [i for i, p in enumerate(paths) if p == prefix or p.startswith(prefix + ".")]
    return used


def _zero_parts(cfg: LlamaConfig, paths: list[str], specs: list[P], shapes: list[tuple[int, ...]],
                dtypes: list[torch.dtype], mesh: DeviceMesh, opts: Any
                ) -> tuple[zero_plan.ZeroPlan, list[zero_plan.Leaf], Callable[[str, tuple[int, ...]], list]]:
    """The bucket plan and, per parameter, the global boxes of its elements in this
    rank's bucket slices (in slice order)."""
    leaves = [zero_plan.leaf(p, mesh, s, shape, d, opts.axis) for p, s, shape, d in zip(paths, specs, shapes, dtypes)]
    plan = zero_plan.make_plan(leaves, opts, _declared_use(cfg, paths))
    parts = dict(zip(paths, zero_plan.local_parts(plan, leaves)))
    where = {p: (leaf, tuple(a for a, _ in _box(leaf.spec, mesh, leaf.shape))) for p, leaf in zip(paths, leaves)}

    def block(name: str, shape: tuple[int, ...]) -> list[hf.Box]:
        leaf, base = where[name]
        _, _, start, stop = parts[name]
        return [tuple((b + o, b + o + n) for b, o, n in zip(base, offs, sizes))
                for offs, sizes in zero_plan.boxes(leaf.local_shape, start, stop)]

    return plan, leaves, block


def state_from_hf(cls: type[TrainState], path: str | os.PathLike[str], optimizer: GradientTransformation, *,
                  mesh: DeviceMesh, layout: Layout, dtype: torch.dtype = torch.float32, vocab_multiple: int = 1,
                  weights: bool = True) -> TrainState:
    """``TrainState.from_hf``: the state ``TrainState.create(from_hf(path)[1], ...)`` builds
    (under ZeRO: the state after step one's bucketing, at step 0), each rank reading only
    its part (module docstring). The model's config is
    ``dtp.models.hf.config_from_hf(path, vocab_multiple)``. ``weights=False``: its parts
    are zeros, no weight file is opened (only ``config.json``), for a state a checkpoint
    loads into (``dtp train --resume`` of an ``--init-from`` run).

    Collectives: one small all-gather (the ranks agree on the directory and options, and
    raise any rank's error on all); under ZeRO stage 1/2 one all-gather per bucket.
    Raises: ``ValueError`` for a layout that does not fit the model or an unsupported /
    inconsistent directory, on every rank.
    """
    error, params, checks, cfg = None, None, guard.Agreements(), None
    zero_state, plan = None, None
    try:
        cfg = hf.config_from_hf(path, vocab_multiple)
        layout.check_mesh(mesh)
        layout.check_sizes(llama.axis_sizes(cfg), mesh, what="TrainState.from_hf")
        axes = llama.param_axes(cfg)
        shape_tree = _shapes(cfg)
        paths = _paths(shape_tree)
        shapes = optree.tree_leaves(shape_tree, is_leaf=lambda x: isinstance(x, tuple))
        dtypes = [accum_dtype(dtype) if p.endswith(".router") else dtype for p in paths]
        pp = layout.pipeline if layout.pipeline is not None and layout.pipeline.active(mesh) else None
        # Where the parameters live: the stage mesh under a pipeline (None: one device a stage).
        home = (mesh if mesh.size() > 1 else None) if pp is None else pipeline.stage_mesh(mesh, pp.axis)
        keep = (lambda p: True) if pp is None else pipeline.held(llama.sequential(cfg), layout, mesh)
        specs = [None if home is None else layout.param_spec(_leaf(axes, p), home, name=f"param {p}")
                 for p in paths]
        for p, s, shape in zip(paths, specs, shapes):
            if s is not None:
                check_spec(s, home, shape, f"param {p}")
        opts = None if mesh.size() == 1 or pp is not None else zero.options(layout, mesh)
        if opts is not None:
            plan, metas, block = _zero_parts(cfg, paths, specs, shapes, dtypes, mesh, opts)
        else:
            spec_of_path = dict(zip(paths, specs))

            def block(name: str, shape: tuple[int, ...]) -> hf.Box | list[hf.Box] | None:
                if not keep(name):
                    return []  # another stage's: nothing read
                return None if home is None else _box(spec_of_path[name], home, shape)

        if weights:
            local = hf.read_blocks(path, cfg, dtype, block)
        else:  # the parts read_blocks would read, as zeros: the same shapes, dtypes and tree
            structure = optree.tree_structure(shape_tree, is_leaf=lambda x: isinstance(x, tuple))
            local = optree.tree_unflatten(structure, [_zeros(block(p, shape), shape, d)
                                                      for p, shape, d in zip(paths, shapes, dtypes)])
        pieces = optree.tree_leaves(local)
        if opts is not None:
            zero_state = zero.from_parts(opts, metas, optree.tree_structure(local), pieces, plan, mesh)
        else:
            leaves = [None if not keep(p) else x.requires_grad_(True) if home is None else
                      wrap_local(x, home, s, shape).requires_grad_(True)
                      for p, x, s, shape in zip(paths, pieces, specs, shapes)]
            params = optree.tree_unflatten(optree.tree_structure(local), leaves)
        floats = set(dtypes)
        checks = guard.Agreements(vocab=cfg.vocab_size, param_dtype=floats.pop() if len(floats) == 1 else None)
    except (ValueError, TypeError, KeyError, OSError) as e:
        error = e if isinstance(e, ValueError) else ValueError(f"TrainState.from_hf: {e}")
    guard.check_together("TrainState.from_hf", mesh, {"directory": str(path), "dtype": str(dtype),
                                                      "vocab_multiple": str(vocab_multiple),
                                                      "layout": layout.name or "custom"}, error)
    if zero_state is not None:  # the state after step one's bucketing: its parameters gathered (a collective)
        params, zero_state = zero.at_rest(zero_state, zero_state.master)
        opt_state = optimizer.init(list(zero_state.master))
        return cls(0, params, opt_state, optimizer, mesh, layout, llama.param_axes(cfg), zero_state, checks)
    opt_state, strategy = strategies.create(params, optimizer, layout, mesh)
    return cls(0, params, opt_state, optimizer, mesh, layout, llama.param_axes(cfg), strategy, checks)


def _zeros(want: hf.Box | list[hf.Box] | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of the part :func:`dtp.models.hf.read_blocks` returns for ``want`` (a
    :data:`~dtp.models.hf.BlockFn`'s answer) of a ``shape`` parameter."""
    if want is None:
        return torch.zeros(shape, dtype=dtype)
    if isinstance(want, list):  # elements of the boxes, flattened and joined
        return torch.zeros(sum(math.prod(b - a for a, b in box) for box in want), dtype=dtype)
    return torch.zeros(tuple(b - a for a, b in want), dtype=dtype)


def _leaf(tree: Any, name: str) -> Any:
    for part in name.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree
