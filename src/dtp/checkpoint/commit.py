"""How a save ends: rank 0's manifest and rename once every rank's files are written,
the older checkpoints pruned only once the new one reads back; or, when a write failed on
any rank (a full disk), :class:`SaveFailed` raised on every rank alike, the partial
directory removed and the checkpoints before it untouched."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..core import comm
from ..training import guard
from ..training.state import TrainState
from .files import MANIFEST, atomic_json, checkpoints, file_sums, open_checkpoint, read_metadata, verify_files

__all__ = ["SaveFailed", "Commit", "Writer", "complete", "prune", "first_line"]


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class SaveFailed(RuntimeError):
    """A save that did not complete (a disk full, a write error on some rank), raised on
    every rank alike. Its directory is removed; the checkpoints before it are untouched
    (``keep`` prunes only after a save completed)."""


@dataclasses.dataclass
class Commit:
    """One save's ending (:func:`dtp.checkpoint.save`). How a save that failed on some rank ends on every rank: :class:`SaveFailed`, one line
    naming the checkpoint, the rank and the error, and the newest checkpoint still there."""

    state: TrainState
    root: Path
    final: Path
    partial: Path
    rank: int

    def together(self, stage: str, error: BaseException | None) -> None:
        """A barrier; raises on every rank when ``error`` is some rank's (``None``: none here)."""
        line = None if error is None else SaveFailed(self._line(f"rank {self.rank}: {_os_error(error)}"))
        try:
            guard.fail_together(f"checkpoint.save ({stage})", self.state.mesh, line, raise_as=SaveFailed)
        except SaveFailed:
            self._remove()
            raise
        if not guard.active(self.state.mesh):
            comm.barrier(tag=stage)  # a world of one, or a fake group: nothing to agree

    def dcp(self, e: CheckpointException, writer: "Writer") -> None:
        """DCP's own failure (every rank has it): the first failing rank's error, as its
        file stream met it (torch's serializer reports a disk full as "unexpected pos")."""
        mine = e.failures.get(self.rank)
        error = writer.error or (mine[0] if mine else None)
        self.together("checkpoint write", error)
        rank, (exc, _) = min(e.failures.items())  # no rank had a word for it (not reached: DCP names one)
        self._remove()
        raise SaveFailed(self._line(f"rank {rank}: {_os_error(exc)}")) from None

    def _line(self, why: str) -> str:
        before = [c.name for c in checkpoints(self.root) if c.name != self.final.name]
        kept = f"{before[-1]} before it is intact" if before else "no checkpoint before it"
        return f"checkpoint.save: {self.final} was not saved ({why}); {kept}"

    def _remove(self) -> None:
        if self.rank == 0:  # the space it took, back (every rank has stopped writing to it)
            shutil.rmtree(self.partial, ignore_errors=True)


def _os_error(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    return first_line(e)


def complete(partial: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Rank 0, every rank's files written: the manifest (the files' sums and the tensors),
    then ``partial`` renamed to ``final``."""
    manifest["files"] = {}
    for part in sorted(partial.glob(".files_rank*.json")):
        manifest["files"].update(json.loads(part.read_text()))
        part.unlink()
    manifest["files"][".metadata"] = file_sums(partial, ".metadata")[".metadata"]
    # Every rank's tensors (a pipeline rank holds only its stages'): from DCP's plan.
    manifest["tensors"] = {name: {"shape": list(md.size), "dtype": str(md.properties.dtype).removeprefix("torch.")}
                           for name, md in sorted(read_metadata(partial).state_dict_metadata.items())
                           if isinstance(md, TensorStorageMetadata)}
    atomic_json(partial / MANIFEST, manifest)
    # A checkpoint of this step already there (a save after a skipped step reuses
    # the name: names count updates) is renamed aside, not deleted first: deleting
    # a large one takes seconds, during which a crash left neither.
    aside = final.with_name(final.name + ".replaced")
    shutil.rmtree(aside, ignore_errors=True)
    if final.exists():
        os.replace(final, aside)
    os.replace(partial, final)
    shutil.rmtree(aside, ignore_errors=True)


def prune(root: Path, final: Path, keep: int) -> None:
    """Rank 0, once ``final`` is in place and reads back (its manifest, every file it lists
    there with its size; the sums were taken from the files as read back): all but the
    newest ``keep`` − 1 others go. Never the one just written: after a run went back to an
    older step, the newest by step were an abandoned run's, and this save was deleted at once."""
    try:
        verify_files(final, open_checkpoint(final)[1], 0, 1, sums=False)
    except ValueError:
        return  # nothing is deleted for a checkpoint that does not read back; load will say why
    others = [c for c in checkpoints(root) if c.name != final.name]
    for old in others[:max(0, len(others) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


class _Stream:
    """A file stream that remembers the ``OSError`` its writes met (the first), for
    :class:`Writer`; otherwise the stream itself."""

    def __init__(self, stream: Any, errors: list[OSError]) -> None:
        self._stream, self._errors = stream, errors

    def write(self, data: Any) -> Any:
        try:
            return self._stream.write(data)
        except OSError as e:
            self._errors.append(e)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _FileSystem(FileSystem):
    def __init__(self, errors: list[OSError]) -> None:
        super().__init__()
        self._errors = errors

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield _Stream(stream, self._errors) if "w" in mode else stream
        except OSError as e:  # the open, or the close's flush and fsync
            self._errors.append(e)
            raise


class Writer(FileSystemWriter):
    """DCP's file writer, keeping the ``OSError`` a write met (:attr:`error`). Measured on
    torch 2.13 (a 600 kB tmpfs): a disk full mid-file reaches DCP as torch's serializer's
    ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598``,
    the ``No space left on device`` under it lost."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, thread_count=1, sync_files=True)
        self._errors: list[OSError] = []
        self.fs = _FileSystem(self._errors)

    @property
    def error(self) -> OSError | None:
        return self._errors[0] if self._errors else None
