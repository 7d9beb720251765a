"""Reference models, written functionally with logical axis names.

Lazy (PEP 562) like :mod:`dtp`: :mod:`.config` (the Llama configuration, no torch) can be
imported without importing torch through :mod:`.llama`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["config", "llama", "hf", "sequential", "Layer", "Sequential"]

_SOURCES = {"llama": ".llama", "hf": ".hf", "sequential": ".sequential", "config": ".config",
            "Layer": ".sequential", "Sequential": ".sequential"}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and cache the name here."""
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(source, __name__)
    value = module if source == f".{name}" else getattr(module, name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from . import config, hf, llama, sequential
    from .sequential import Layer, Sequential
