"""Checkpoints of the *logical* training state on ``torch.distributed.checkpoint`` (DCP).

What is saved does not depend on the mesh, the layout or ZeRO's buckets: every parameter
as one global tensor (``param/<path>``), every buffer (``buffer/<path>``: the state no
gradient trains, :mod:`dtp.buffers`), its optimizer state per parameter
(``opt/<field>/<path>``: Adam's moments, momentum), the optimizer's scalars
(``opt/<field>``: the update count), the fp32 master weights where they differ from the
parameters' dtype (``master/<path>``: ZeRO's slices or ``layouts.mixed_precision``'s tree,
either loads into the other; a state without master weights loads without them, one with
them starts them from the parameters when the checkpoint has none), and in a plain-JSON ``manifest.json`` the step,
the RNG state, the caller's ``extra`` (a data loader's position, the model config) and
the versions. So a checkpoint saved under one layout loads into any other: DCP reads
each rank's block of each global tensor from whichever files hold it.

Every rank writes only what it holds. A replicated block is written once (DCP keeps one
copy). Under ZeRO a rank holds flat slices of buckets; the part of a parameter inside
a slice is a contiguous run of its row-major elements, which is a few rectangles of the
global tensor (:func:`_boxes`) — written straight from the slice, so no rank ever
gathers a parameter or a moment (Megatron's "flattened range", made rectangular).

On disk, ``save(state, root)`` writes ``root/step_00000012``: into a ``.partial``
directory first, renamed by rank 0 once every rank has finished, so a crash mid-save
never leaves a checkpoint that looks complete; ``keep`` prunes the older ones. Loading
never unpickles arbitrary objects (DCP's metadata file is read with an unpickler that
only knows DCP's own metadata classes) and checks every tensor's shape and dtype
against the state it loads into before reading a byte of tensor data.

>>> import tempfile
>>> mesh = dtp.make_mesh(dp=1)                  # one process: a mesh of one device
>>> state = dtp.TrainState.create({"w": torch.ones(2)}, dtp.optim.adamw(0.1), mesh=mesh,
...                               layout=dtp.layouts.data(), axes={"w": ("embed",)})
>>> root = tempfile.mkdtemp()
>>> path = dtp.checkpoint.save(state, root, extra={"note": "hi"})
>>> restored, extra = dtp.checkpoint.load(root, like=state)
>>> restored.step, extra, restored.params["w"].tolist()
(0, {'note': 'hi'}, [1.0, 1.0])
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from .. import __version__
from ..training import guard
from ..core._rules import accum_dtype
from ..training.optim import map_param_trees
from ..core.spec import spec_of, wrap_local
from ..training.state import TrainState, wait
from ..training.strategies.state import empty_like, tensor_paths
from .commit import Commit, SaveFailed, Writer, complete, first_line, prune
from .fallback import newest_sound, warn_skip
from .pieces import LoadPlanner, Pieces, SavePlanner
from .files import (FORMAT, MANIFEST, SafeReader, atomic_json, file_sums, latest, open_checkpoint,
                    read_manifest, read_metadata, verify_files)

__all__ = ["save", "load", "latest", "read_manifest", "AsyncSave", "SaveFailed", "ParamReader", "FORMAT"]

PyTree = Any


# --------------------------------------------------------------------------- the logical state


def _logical(state: TrainState) -> dict[str, Any]:
    """``name -> tensor`` (DTensor, tensor or :class:`Pieces`) of what ``state`` holds: its
    buffers, and what its strategy says it saves (parameters, master weights, optimizer
    state: :meth:`dtp.strategies.StrategyState.saved`)."""
    out: dict[str, Any] = {}
    if state.buffers:  # the non-trainable collection (dtp.buffers): replicated, whole
        for path, x in zip(tensor_paths(state.buffers), optree.tree_leaves(state.buffers)):
            out[f"buffer/{path}"] = x.detach()
    out.update(state.strategy.saved(state.params, state.opt_state))
    return out


# --------------------------------------------------------------------------- save


@dataclasses.dataclass
class AsyncSave:
    """A save still being written (``save(..., async_save=True)``). ``wait()`` on every
    rank finishes it: waits for this rank's files, then rank 0 renames the checkpoint
    into place once every rank's are written.

    >>> state = dtp.TrainState.create({"w": torch.ones(2)}, dtp.optim.sgd(0.1), mesh=make_mesh(dp=1),
    ...                               layout=dtp.layouts.data(), axes={"w": (None,)})
    >>> pending = save(state, "ckpt", async_save=True)  # returns once the tensors are copied
    >>> pending.wait().name                              # the files written, the directory renamed
    'step_00000000'
    """

    path: Path
    _future: Any
    _finish: Any
    _failed: Any

    def wait(self) -> Path:
        """The checkpoint's path once it is complete; :class:`SaveFailed` on every rank if
        any rank's write failed (the directory is removed, the checkpoints before it kept)."""
        if self._future is not None:
            future, self._future = self._future, None
            try:
                future.result()
            except CheckpointException as e:  # DCP's, on every rank: each rank's result is gathered
                self._failed(e)
            self._finish()
        return self.path

    def done(self) -> bool:
        return self._future is None or self._future.done()


_SAVE_GROUP: list[tuple[Any, Any]] = []  # (the world it belongs to, the group)


def _save_group() -> Any:
    """A process group of its own for DCP's background collectives (async save): they
    must not interleave with training's on the same group. Made once per world, on every
    rank (a process that tears its world down and starts another — ``dtp train`` then
    ``dtp export`` from Python — must not reuse the dead world's group)."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if not _SAVE_GROUP or _SAVE_GROUP[0][0] is not world:
        _SAVE_GROUP[:] = [(world, dist.new_group(backend="gloo"))]
    return _SAVE_GROUP[0][1]


def save(state: TrainState, root: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None,
         keep: int | None = None, async_save: bool = False) -> Path | AsyncSave:
    """Write ``state`` to ``root/step_<step>`` (a collective: call it on every rank).

    ``extra``: JSON-able data saved in the manifest and returned by :func:`load` (a data
    loader's ``state_dict()``, the model config). ``keep``: afterwards, only this one and
    the newest ``keep`` − 1 others in ``root`` remain. ``async_save=True`` copies this rank's
    tensors to staging memory and returns an :class:`AsyncSave` at once; the files are
    written while training goes on, and ``wait()`` (on every rank) completes it.
    Returns the checkpoint's path.

    >>> from dtp import checkpoint, layouts
    >>> state = dtp.TrainState.create({"w": torch.ones(2)}, dtp.optim.sgd(0.1), mesh=make_mesh(dp=1),
    ...                               layout=layouts.data(), axes={"w": (None,)})
    >>> checkpoint.save(state, "ckpt", extra={"batches_read": 3}).name
    'step_00000000'
    >>> state, extra = checkpoint.load("ckpt", like=state)  # the newest under ckpt/, into like's layout
    >>> state.step, extra, checkpoint.read_manifest("ckpt")["mesh"]
    (0, {'batches_read': 3}, {'dp': 1})
    """
    root = Path(root)
    if extra is not None:
        try:
            json.dumps(extra)
        except TypeError as e:
            raise ValueError(f"checkpoint.save: extra must be JSON-able ({e})") from None
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(f"checkpoint.save: keep must be an int >= 1 (or None: keep all), got {keep!r}")
    wait(state)  # the slices and buffers must be final
    final = root / f"step_{state.step:08d}"
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK):
            raise PermissionError(f"{root} is not writable")
    except OSError as e:
        error = ValueError(f"checkpoint.save: cannot write to {root} ({e})")
    # Every rank alike, before the first barrier: a node without the shared mount failed
    # alone, and the others waited in that barrier until the process-group timeout.
    guard.check_together("checkpoint.save", state.mesh, {"step": str(state.step)}, error)
    error = None
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a crashed save's leftovers
        try:
            partial.mkdir()
        except OSError as e:
            error = e
    failed = Commit(state, root, final, partial, rank)
    failed.together("checkpoint mkdir", error)
    tensors = _logical(state)
    manifest = _manifest(state, extra)

    def finish() -> None:
        # Each rank checksums the files it wrote (read back from the page cache): DCP
        # reads a flipped byte silently (measured on torch 2.13), so load checks them.
        error = None
        try:
            atomic_json(partial / f".files_rank{rank}.json", file_sums(partial, f"__{rank}_"))
        except OSError as e:  # a disk that filled after DCP's files
            error = e
        failed.together("checkpoint written", error)  # every rank's files are in partial/
        if rank == 0:
            try:
                complete(partial, final, manifest)
            except OSError as e:
                error = e
            else:
                if keep is not None:
                    prune(root, final, keep)
        failed.together("checkpoint renamed", error)

    writer = Writer(partial)
    if async_save:
        future = dcp.async_save(_staged(tensors), storage_writer=writer, planner=SavePlanner(),
                                process_group=_save_group(), async_stager=_Staged())
        return AsyncSave(final, future, finish, functools.partial(failed.dcp, writer=writer))
    try:
        dcp.save(tensors, storage_writer=writer, planner=SavePlanner(), process_group=_save_group())
    except CheckpointException as e:  # on every rank (DCP gathers each rank's write result)
        failed.dcp(e, writer)
    finish()
    return final


def _staged(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of this rank's tensors that training cannot change while they are written.
    Each ZeRO piece gets a compact storage of its own: DCP's default staging deep-copies
    a piece's whole bucket slice per view (measured: an async save blocked the loop 2×
    longer than a sync one), and the writer would clone the views once more."""
    out: dict[str, Any] = {}
    for name, x in tensors.items():
        if isinstance(x, Pieces):
            out[name] = Pieces(x.shape, x.dtype, [(o, t.clone()) for o, t in x.pieces])
        elif isinstance(x, DTensor):
            out[name] = wrap_local(x.to_local().clone(), x.device_mesh, spec_of(x), tuple(x.shape))
        else:
            out[name] = x.clone()
    return out


class _Staged:
    """DCP's stager interface for a state dict :func:`_staged` already copied."""

    should_synchronize_after_execute = True

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _manifest(state: TrainState, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "step": state.step,
        "dtp": __version__,
        "torch": torch.__version__,
        "mesh": dict(zip(state.mesh.mesh_dim_names or (), state.mesh.mesh.shape)),
        "layout": state.layout.name or "custom",
        **state.strategy.manifest(),  # zero_stage
        "rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "extra": extra,
    }


# --------------------------------------------------------------------------- load


def load(path: str | os.PathLike[str], like: TrainState, *, restore_rng: bool = True, fallback: bool = False,
         on_skip: Callable[[Path, str, Path | None], None] | None = None) -> tuple[TrainState, Any]:
    """Load the checkpoint at ``path`` (or the newest under it) into the layout of ``like``;
    returns ``(state, extra)``. A collective: call it on every rank.

    Any layout loads any other: each rank reads its blocks of the global tensors. First,
    on every rank and before any tensor data is read: the files are there with the
    sizes and CRC32s that were written, the parameters are ``like``'s (none missing or
    extra), and every tensor's shape and dtype match. A failure (a missing or corrupt
    checkpoint, another model's) is a ``ValueError`` naming the file or tensor, raised
    on every rank alike (the ranks agree first: one small all-gather); ``like`` itself
    is never modified. Under ZeRO the loaded state is per parameter, as before step
    one; step one cuts it into buckets. ``restore_rng`` sets torch's CPU RNG to the
    saved one (bit-exact resume).

    ``fallback=True`` with ``path`` a root of checkpoints (not one checkpoint, which is
    never fallen back from): the newest that verifies loads. A damaged newer one (a file
    missing, truncated or corrupt, an unreadable manifest or metadata: what a crash or a
    lost node mid-save leaves) is renamed ``step_N.corrupt`` (kept, out of ``latest``'s
    and ``keep``'s way), and ``on_skip(path, why, renamed_to)`` is called on every rank
    (``renamed_to``: rank 0's rename, ``None`` on the others; default: a ``RuntimeWarning`` on
    the first). When none verifies nothing is moved, and the newest one's error is raised. A checkpoint of another model is no
    damage: it is refused, as without ``fallback``.

    >>> import tempfile, warnings
    >>> root = Path(tempfile.mkdtemp())
    >>> state = dtp.TrainState.create({"w": torch.ones(2)}, dtp.optim.sgd(0.1), mesh=make_mesh(dp=1),
    ...                               layout=dtp.layouts.data(), axes={"w": (None,)})
    >>> older = save(state, root)
    >>> state, _ = dtp.train_step(lambda p, b: (p["w"] * b["x"]).sum(), state, {"x": torch.ones(2)})
    >>> newer = save(state, root)
    >>> _ = (newer / ".metadata").write_bytes(b"cut sh")             # damaged after it was saved
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     loaded, _ = load(root, like=state, fallback=True)
    >>> loaded.step, sorted(p.name for p in root.iterdir())
    (0, ['step_00000000', 'step_00000001.corrupt'])
    >>> print(seen[0].message)
    checkpoint: skipped step_00000001 (file .metadata has 6 bytes, ... were written (truncated or replaced)), renamed step_00000001.corrupt
    """
    error, found = None, Path(path)
    verified = False
    if fallback and not (found / MANIFEST).is_file():
        found, verified = newest_sound(found, like, on_skip or warn_skip), True
    try:
        found, manifest = open_checkpoint(found)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if not verified:
            verify_files(found, manifest, rank, world)
        metadata = read_metadata(found)
        targets, build, model = _targets(like, manifest)
        _check(found, manifest["tensors"], targets, metadata, model)
    except ValueError as e:
        error = e
    guard.check_together("checkpoint.load", like.mesh, {"checkpoint": str(found)}, error)
    try:
        dcp.load(targets, storage_reader=SafeReader(found), planner=LoadPlanner(), process_group=_save_group())
    except BaseException as e:  # DCP wraps rank failures in CheckpointException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(f"checkpoint: reading {found} failed: {first_line(e)}") from None
    new = build(int(manifest["step"]))
    if restore_rng and manifest.get("rng"):
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(manifest["rng"])), dtype=torch.uint8))
    return new, manifest.get("extra")


class ParamReader:
    """A checkpoint's parameters read one at a time on one process, each as its global
    tensor, never the optimizer state — what ``dtp export`` streams.

    Opening it checks the files' sizes and CRC32s (streamed, 16 MiB at a time) and reads
    the metadata; :meth:`read` then asks DCP for one tensor, whose saved chunks are read
    and copied in (a chunk at a time; no other tensor is touched).

    Raises: ``ValueError`` for a missing, corrupt or foreign checkpoint, naming the file.

    >>> import tempfile
    >>> state = dtp.TrainState.create({"w": torch.arange(6.).view(2, 3)}, dtp.optim.adamw(0.1),
    ...                               mesh=dtp.make_mesh(dp=1), layout=dtp.layouts.data(), axes={"w": ("embed", "mlp")})
    >>> reader = ParamReader(dtp.checkpoint.save(state, tempfile.mkdtemp()))
    >>> reader.names(), reader.read("w")[1].tolist()
    (['w'], [3.0, 4.0, 5.0])
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path, self.manifest = open_checkpoint(Path(path))
        verify_files(self.path, self.manifest, 0, 1)
        self.metadata = read_metadata(self.path)

    def names(self) -> list[str]:
        """The parameters' dotted paths (``layers.0.wq``), sorted."""
        return sorted(k[len("param/"):] for k in self.metadata.state_dict_metadata if k.startswith("param/"))

    def read(self, name: str) -> torch.Tensor:
        """Parameter ``name`` (a dotted path), whole, in the dtype it was saved in."""
        md = self.metadata.state_dict_metadata.get(f"param/{name}")
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"checkpoint {self.path}: has no parameter {name!r}")
        target = {f"param/{name}": torch.empty(tuple(md.size), dtype=md.properties.dtype)}
        try:
            with warnings.catch_warnings():
                # DCP warns that it "assumes the intent is to load in a single process" even
                # when no_dist says so (measured, torch 2.13): every `dtp export` printed it.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                dcp.load(target, storage_reader=SafeReader(self.path), planner=LoadPlanner(),
                         no_dist=not dist.is_initialized())
        except BaseException as e:  # DCP wraps failures in CheckpointException, a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise ValueError(f"checkpoint: reading {name} from {self.path} failed: {first_line(e)}") from None
        return target[f"param/{name}"]


def _targets(like: TrainState, manifest: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], Any, set[str]]:
    """Fresh tensors laid out as ``like`` says for every saved name it has, the function
    that makes the new state of them once DCP has filled them, and the names of the whole
    model's parameters (a pipeline rank's stepped state holds its stages' only: the
    others are ``None``, and stay so)."""
    strategy = like.strategy
    params = strategy.empty_params(like.params)
    model = {f"param/{'.'.join(map(str, p))}" for p in optree.tree_paths(params, none_is_leaf=True)}
    saved = manifest["tensors"]
    targets: dict[str, torch.Tensor] = {}
    for p, x in zip(tensor_paths(params), optree.tree_leaves(params)):
        targets[f"param/{p}"] = x
    buffers = optree.tree_map(empty_like, like.buffers) if like.buffers else like.buffers
    for p, x in zip(tensor_paths(buffers), optree.tree_leaves(buffers)):
        targets[f"buffer/{p}"] = x
    own = strategy.own_targets()  # what the strategy saved of its own (names as its saved() wrote them)
    targets.update(own)
    loaded_master = None
    if strategy.keeps_master and any(k.startswith("master/") for k in saved):
        loaded_master = optree.tree_map(lambda x: empty_like(x, accum_dtype(x.dtype)), params)
        for p, x, param in zip(tensor_paths(params), optree.tree_leaves(loaded_master), optree.tree_leaves(params)):
            if x.dtype != param.dtype:  # the others are their parameters (filled in by build)
                targets[f"master/{p}"] = x
    opt_state = None
    if any(k.startswith("opt/") for k in saved):
        shaped = optree.tree_map(lambda x: empty_like(x, accum_dtype(x.dtype)), params) if strategy.keeps_master \
            else params

        def mirror(name: str, tree: PyTree) -> PyTree:  # init's fresh zeros are the targets
            for p, x in zip(tensor_paths(params), optree.tree_leaves(tree)):
                targets[f"opt/{name}/{p}"] = x
            return tree

        def scalar(name: str, x: Any) -> Any:
            targets[f"opt/{name}"] = x
            return x

        opt_state = map_param_trees(like.optimizer.init(shaped), params, mirror, scalar)

    def build(step: int) -> TrainState:
        loaded = optree.tree_map(lambda x: x.requires_grad_(True), params)
        master = None if loaded_master is None else optree.tree_map(
            lambda m, p: m if m.dtype != p.dtype else p.detach(), loaded_master, loaded)
        opt, restored = strategy.restored(loaded, master, opt_state, like.optimizer, own)
        return dataclasses.replace(like, step=step, params=loaded, opt_state=opt, strategy=restored, buffers=buffers)

    return targets, build, model


def _check(path: Path, saved: Mapping[str, Any], targets: Mapping[str, torch.Tensor], metadata: Metadata,
           model: set[str]) -> None:
    """The checkpoint has ``model``'s parameters (all of them, held here or not), and every
    target tensor with the same global shape and a dtype it may take (DCP itself would
    cast silently); checked on every rank alike, before any tensor data is read."""
    saved_params = {k for k in saved if k.startswith("param/")}
    our_params = model
    if saved_params != our_params:  # another model: said before its optimizer state differs too
        sides = [f"{len(names)} only in {where} (e.g. {', '.join(sorted(names)[:3])})"
                 for names, where in ((saved_params - our_params, "the checkpoint"),
                                      (our_params - saved_params, "this state")) if names]
        raise ValueError(f"checkpoint {path}: its parameters are not this state's: {'; '.join(sides)}; it was saved "
                         f"from another model (another n_layers?): load it into a state of that model")
    held = {k.removeprefix("param/") for k in targets if k.startswith("param/")}
    # opt/<field> (a scalar: the count) or opt/<field>/<path>: only the held parameters' count
    theirs = {k for k in saved if k.startswith("opt/") and (k.count("/") == 1 or k.split("/", 2)[2] in held)}
    ours = {k for k in targets if k.startswith("opt/")}
    if ours and theirs != ours:
        odd = sorted(theirs ^ ours)[:3]
        raise ValueError(f"checkpoint {path}: its optimizer state does not match this state's optimizer "
                         f"(e.g. {', '.join(odd)} in only one of them); load it with the optimizer it was saved with")
    for name, x in targets.items():
        md = metadata.state_dict_metadata.get(name)
        if name not in saved or not isinstance(md, TensorStorageMetadata):
            kind = name.split("/")[0]
            raise ValueError(f"checkpoint {path}: has no {kind} tensor {name!r} (this state has it; the checkpoint "
                             f"was saved from another model or optimizer)")
        if tuple(md.size) != tuple(x.shape):
            raise ValueError(f"checkpoint {path}: tensor {name!r} has shape {tuple(md.size)} in the checkpoint, "
                             f"{tuple(x.shape)} in this state (another model config?)")
        have, want = md.properties.dtype, x.dtype
        # Master weights and moments may come from a layout with the other convention
        # (ZeRO keeps fp32 moments of bf16 parameters); parameters must match exactly.
        widened = not name.startswith("param/") and want in (accum_dtype(have),) or have == accum_dtype(want)
        if have != want and (name.startswith("param/") or not widened):
            raise ValueError(f"checkpoint {path}: tensor {name!r} is {md.properties.dtype} in the checkpoint, "
                             f"{x.dtype} in this state; cast the model (dtp does not cast silently)")
