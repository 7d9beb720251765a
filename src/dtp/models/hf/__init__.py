"""Hugging Face models in and out: weights and configs converted (:mod:`.convert`), the
``config.json`` reader and the weight files' checks without torch (:mod:`.config`), the
safetensors files read a block at a time (:mod:`.files`), and a :class:`~dtp.TrainState`
built straight from a directory, each rank reading only what it holds (:mod:`.state`).

``dtp.models.hf.from_hf`` / ``to_hf`` are :mod:`.convert`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.lazy import names_of

__all__ = ['from_hf', 'to_hf', 'read_blocks', 'bytes_read', 'config_from_hf', 'hf_config', 'padded_vocab', 'INIT_VOCAB_MULTIPLE', 'Box']


__getattr__ = names_of(__name__, ".convert")  # the torch-free modules beside it stay light


if TYPE_CHECKING:
    from .convert import from_hf, to_hf, read_blocks, bytes_read, config_from_hf, hf_config, padded_vocab, INIT_VOCAB_MULTIPLE, Box
