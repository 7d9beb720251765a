"""Hugging Face's weight files: which file holds which tensor, and a writer that
streams one tensor at a time into sharded ``.safetensors`` files with their index.

The safetensors layout is small enough to write directly (8-byte little-endian header
length, a JSON header of ``{name: {dtype, shape, data_offsets}}``, then the raw bytes),
so the writer needs no package and never holds more than the tensor it is writing;
reading goes through the ``safetensors`` package (``pip install dtp[hf]``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import INDEX, SINGLE, weight_files  # torch-free: dtp train's preflight reads them too

__all__ = ["Entry", "weight_files", "open_weights", "bytes_read", "write_sharded", "INDEX", "SINGLE"]

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def _safetensors() -> Any:
    try:
        import safetensors
    except ImportError as e:  # an optional extra
        raise ImportError("reading Hugging Face weights needs safetensors: pip install 'dtp[hf]'") from e
    return safetensors


_READ = [0]  # tensor bytes this process asked the files for (bytes_read)


def bytes_read() -> int:
    """Tensor bytes this process has read from Hugging Face weight files so far (what a
    sharded load's test counts).

    >>> isinstance(bytes_read(), int)
    True
    """
    return _READ[0]


@contextmanager
def open_weights(path: str | os.PathLike[str]) -> Iterator[Callable[..., torch.Tensor]]:
    """``get(name, shape, box)``: the block ``box`` (``[start, stop)`` per dim) of tensor
    ``name``, which must have ``shape``, read with ``get_slice`` (each file opened once,
    memory-mapped: only the block's bytes are read).

    Raises: ``ValueError`` naming the directory for a tensor it does not hold, naming
    the file for one that safetensors cannot read (truncated, corrupt, missing), and for
    a tensor of another shape.
    """
    safetensors = _safetensors()
    safe_open = safetensors.safe_open
    where = weight_files(path)
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def get(name: str, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> torch.Tensor:
            if name not in where:
                raise ValueError(f"from_hf: {path} has no tensor {name!r}")
            file = where[name]
            try:
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
                piece = handles[file].get_slice(name)
            except (safetensors.SafetensorError, OSError) as e:
                # safetensors' own error is no ValueError: TrainState.from_hf would not agree
                # on it across ranks, and a rank would crash instead of naming the file.
                raise ValueError(f"from_hf: {file} cannot be read as a .safetensors file (truncated or "
                                 f"corrupt?): {e}") from None
            found = tuple(piece.get_shape())
            if found != tuple(shape):
                raise ValueError(f"from_hf: {name} has shape {found}, config.json implies {tuple(shape)}")
            t = piece[tuple(slice(a, b) for a, b in box)]
            _READ[0] += t.numel() * t.element_size()
            return t

        yield get


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its name, shape and dtype, and how to make it (called once,
    when its turn comes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def _shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _write_file(file: Path, entries: list[Entry]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        if e.dtype not in _DTYPES:
            raise ValueError(f"to_hf: safetensors has no dtype for {e.name} ({e.dtype})")
        header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned (the format's recommendation)
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for e in entries:
            t = e.make()
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise ValueError(f"to_hf: {e.name} came out {tuple(t.shape)} {t.dtype}, "
                                 f"expected {e.shape} {e.dtype}")
            f.write(memoryview(t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()))
            del t
    os.replace(tmp, file)


def write_sharded(path: str | os.PathLike[str], entries: list[Entry], max_shard_bytes: int) -> list[Path]:
    """Write ``entries`` in order into ``model-0000i-of-0000n.safetensors`` files of at
    most ``max_shard_bytes`` each (a larger tensor gets a file of its own) plus
    ``model.safetensors.index.json``, or into one ``model.safetensors`` when they fit.
    Returns the files written. Into an empty directory: :func:`~.hf_config.staged` puts them
    where another model's files are.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    shards = _shards(entries, max_shard_bytes)
    if len(shards) == 1:
        _write_file(root / SINGLE, shards[0])
        return [root / SINGLE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = root / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_file(file, shard)
        files.append(file)
        weight_map.update((e.name, file.name) for e in shard)
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
    (root / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files
