"""Hugging Face models in and out: weights and configs converted (:mod:`.convert`), the
``config.json`` reader and the weight files' checks without torch (:mod:`.config`), the
safetensors files read a block at a time (:mod:`.files`), and a :class:`~dtp.TrainState`
built straight from a directory, each rank reading only what it holds (:mod:`.state`).

``dtp.models.hf.from_hf`` / ``to_hf`` are :mod:`.convert`'s."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ['from_hf', 'to_hf', 'read_blocks', 'bytes_read', 'config_from_hf', 'hf_config', 'padded_vocab', 'INIT_VOCAB_MULTIPLE', 'Box']


def __getattr__(name: str) -> Any:
    """A name of :mod:`dtp.models.hf.convert`, imported on first use (PEP 562): the package stays light for
    the torch-free callers of its other modules (the CLI's checks)."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".convert", __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .convert import from_hf, to_hf, read_blocks, bytes_read, config_from_hf, hf_config, padded_vocab, INIT_VOCAB_MULTIPLE, Box
