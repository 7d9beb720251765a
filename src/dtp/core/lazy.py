"""A package whose names are one of its modules', imported on first use (PEP 562).

``dtp.checkpoint``, ``dtp.data`` and ``dtp.models.hf`` each hold a torch-free module the
CLI's checks read before torch is loaded (``dirs``, ``token_files``, ``config``) beside the
one their names come from (``store``, ``loader``, ``convert``, which import torch): the
package serves those names lazily, so importing the light module does not pay for the
heavy one.

>>> import dtp.checkpoint as checkpoint
>>> checkpoint.save.__module__
'dtp.checkpoint.store'
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["names_of"]


def names_of(package: str, module: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: a name not yet there is ``module``'s (relative to
    the package), imported on first use and kept on the package."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
