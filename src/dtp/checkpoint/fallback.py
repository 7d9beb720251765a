"""``load(root, fallback=True)``: the newest checkpoint that verifies, each damaged newer
one renamed ``step_N.corrupt`` (kept, never deleted) and named."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from ..core import comm
from ..training import guard
from ..training.state import TrainState
from .files import MANIFEST, checkpoints, open_checkpoint, read_metadata, verify_files

__all__ = ["newest_sound", "warn_skip"]


def newest_sound(root: Path, like: TrainState, on_skip: Callable[[Path, str, Path | None], None]) -> Path:
    """The newest checkpoint under ``root`` whose manifest, files and metadata verify (the
    CRC32s read shared by the ranks, the verdict agreed), each damaged newer one then set
    aside. When none verifies nothing is moved, and the newest one's error is raised (what
    a load without fallback says)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    damaged: list[tuple[Path, ValueError]] = []
    for candidate in reversed(checkpoints(root)):
        error = None
        try:
            _, manifest = open_checkpoint(candidate)
            verify_files(candidate, manifest, rank, world)
            read_metadata(candidate)
        except ValueError as e:
            error = e
        try:
            guard.fail_together("checkpoint.load (verify)", like.mesh, error, raise_as=ValueError)
        except ValueError as e:
            damaged.append((candidate, e))
            continue
        for path, e in damaged:
            moved = _set_aside(path) if rank == 0 else None
            comm.barrier(tag="checkpoint set aside")
            on_skip(path, _damage(str(e), path), moved)  # moved: rank 0's rename (None elsewhere)
        return candidate
    if damaged:
        raise damaged[0][1]
    raise ValueError(f"checkpoint: no checkpoint at {root} (no {MANIFEST} there, nor a step_* directory holding one)")


def _damage(message: str, path: Path) -> str:
    """What is wrong with ``path``, from the agreed message: less the ``checkpoint <path>: ``
    or ``checkpoint: `` it starts with (the line it goes into names the checkpoint)."""
    return message.removeprefix(f"checkpoint {path}: ").removeprefix("checkpoint: ")


def _aside_name(path: Path) -> Path:
    """Where :func:`_set_aside` moves ``path``: ``step_N.corrupt`` (``.corrupt.2``, … if taken)."""
    target, n = path.with_name(path.name + ".corrupt"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt.{n}")
    return target


def _set_aside(path: Path) -> Path | None:
    """Rename a damaged checkpoint out of the way, never deleting it (``None``: it could not be)."""
    target = _aside_name(path)
    try:
        os.replace(path, target)
    except OSError:
        return None
    return target


def warn_skip(path: Path, why: str, moved: Path | None) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        where = f", renamed {moved.name}" if moved is not None else " (it could not be renamed)"
        warnings.warn(f"checkpoint: skipped {path.name} ({why}){where}", RuntimeWarning, stacklevel=3)
