"""Checkpoints: the logical training state on ``torch.distributed.checkpoint``, saved and
loaded under any layout (:mod:`.store`), where they are and what their manifests say
(:mod:`.dirs`, torch-free), every file verified before it is trusted (:mod:`.files`), and
DCP's planners taught a strategy's own tensors (:mod:`.pieces`).

``dtp.checkpoint.save`` / ``load`` / ``latest`` are :mod:`.store`'s."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ['save', 'load', 'latest', 'read_manifest', 'AsyncSave', 'ParamReader', 'FORMAT']


def __getattr__(name: str) -> Any:
    """A name of :mod:`dtp.checkpoint.store`, imported on first use (PEP 562): the package stays light for
    the torch-free callers of its other modules (the CLI's checks)."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".store", __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .store import save, load, latest, read_manifest, AsyncSave, ParamReader, FORMAT
