"""What a checkpoint is on disk, read without trusting it: every file's size and CRC32,
DCP's ``.metadata`` unpickled by an unpickler that resolves only DCP's metadata classes;
the manifest and the ``step_*`` directories come from the torch-free
:mod:`dtp.checkpoint.dirs` (names re-exported here). :mod:`dtp.checkpoint` saves and
loads states with it; ``dtp export`` reads parameters one at a time with it."""

from __future__ import annotations

import io
import json
import os
import pickle
import zlib
from pathlib import Path
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from .dirs import FORMAT, MANIFEST, STEP_DIR, checkpoints, latest, open_checkpoint, read_manifest

__all__ = ["FORMAT", "MANIFEST", "STEP_DIR", "file_crc", "file_sums", "verify_files", "atomic_json", "checkpoints",
           "latest", "MetadataUnpickler", "SafeReader", "read_manifest", "open_checkpoint", "read_metadata"]


def file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_sums(directory: Path, prefix: str) -> dict[str, list[int]]:
    """``{file name: [bytes, crc32]}`` of the files in ``directory`` starting with ``prefix``."""
    return {p.name: [p.stat().st_size, file_crc(p)] for p in sorted(directory.iterdir()) if p.name.startswith(prefix)}


def verify_files(path: Path, manifest: Mapping[str, Any], rank: int, world: int, *, sums: bool = True) -> None:
    """Every file the manifest lists is there with its size (each rank checks all: a
    stat each); this rank checks the CRC32 of every ``world``-th file (the reads shared)
    and of ``.metadata``, which every rank unpickles (``sums=False``: sizes only)."""
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise ValueError(f"checkpoint {path}: the manifest lists no files (not written by dtp.checkpoint.save?)")
    for i, (name, (size, crc)) in enumerate(sorted(files.items())):
        f = path / name
        if not f.is_file():
            raise ValueError(f"checkpoint {path}: file {name} is missing")
        if f.stat().st_size != size:
            raise ValueError(f"checkpoint {path}: file {name} has {f.stat().st_size} bytes, {size} were written "
                             f"(truncated or replaced)")
        if sums and (i % world == rank or name == ".metadata") and file_crc(f) != crc:  # every rank reads .metadata
            raise ValueError(f"checkpoint {path}: file {name} is corrupt (CRC32 {file_crc(f):08x}, written {crc:08x})")


def atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


class MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: resolve only the names a DCP metadata file is
    made of (listed from what torch 2.13 writes), so a crafted checkpoint cannot run
    code when it is opened. ``torch.load`` of the data files is ``weights_only`` already."""

    _METADATA = "torch.distributed.checkpoint.metadata"
    _NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
              ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in self._NAMES:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if module == self._METADATA:
                found = super().find_class(module, name)
                if isinstance(found, type):  # dataclasses and enums, never a function
                    return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP metadata file")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        metadata = MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: Path) -> Metadata:
    try:
        return SafeReader(path).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError, TypeError, IndexError) as e:
        raise ValueError(f"checkpoint: {path / '.metadata'} is missing or corrupt ({type(e).__name__}: {e})") from None


