"""Training data: the byte tokenizer and the resumable batch loader (:mod:`.loader`), and
token files read without torch, memory-mapped (:mod:`.token_files`: what ``--data``
accepts, checked before any rank starts). The bundled corpus is in ``assets/``.

``dtp.data.TokenLoader`` and the other names are :mod:`.loader`'s."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ['ByteTokenizer', 'load_tokens', 'open_tokens', 'Tokens', 'TokenLoader', 'document_eos']


def __getattr__(name: str) -> Any:
    """A name of :mod:`dtp.data.loader`, imported on first use (PEP 562): the package stays light for
    the torch-free callers of its other modules (the CLI's checks)."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".loader", __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .loader import ByteTokenizer, load_tokens, open_tokens, Tokens, TokenLoader, document_eos
