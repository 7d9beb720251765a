"""Checkpoints: the logical training state on ``torch.distributed.checkpoint``, saved and
loaded under any layout (:mod:`.store`), where they are and what their manifests say
(:mod:`.dirs`, torch-free), every file verified before it is trusted (:mod:`.files`), and
DCP's planners taught a strategy's own tensors (:mod:`.pieces`), how a save completes or
fails on every rank alike (:mod:`.commit`), and how a load falls back past a damaged
newest checkpoint (:mod:`.fallback`).

``dtp.checkpoint.save`` / ``load`` / ``latest`` are :mod:`.store`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.lazy import names_of

__all__ = ['save', 'load', 'latest', 'read_manifest', 'AsyncSave', 'SaveFailed', 'ParamReader', 'FORMAT']


__getattr__ = names_of(__name__, ".store")  # the torch-free modules beside it stay light


if TYPE_CHECKING:
    from .store import save, load, latest, read_manifest, AsyncSave, SaveFailed, ParamReader, FORMAT
