"""Training data: the byte tokenizer and the resumable batch loader (:mod:`.loader`), and
token files read without torch, memory-mapped (:mod:`.token_files`: what ``--data``
accepts, checked before any rank starts). The bundled corpus is in ``assets/``.

``dtp.data.TokenLoader`` and the other names are :mod:`.loader`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.lazy import names_of

__all__ = ['ByteTokenizer', 'load_tokens', 'open_tokens', 'Tokens', 'TokenLoader', 'document_eos']


__getattr__ = names_of(__name__, ".loader")  # the torch-free modules beside it stay light


if TYPE_CHECKING:
    from .loader import ByteTokenizer, load_tokens, open_tokens, Tokens, TokenLoader, document_eos
