"""Padded vocabulary rows: their logits pinned to the dtype's lowest value.

A vocabulary padded so it splits over tp (Megatron's ``--make-vocab-size-divisible-by``)
has rows no token uses. Megatron leaves their logits free, so they take part in the
softmax; here they are pinned to ``finfo.min`` instead: ``exp`` of them is 0 in every
cross-entropy (the vocab-parallel one included, where a rank may hold only padded
columns: its local max is then ``finfo.min``, below the global max, and the product with
its not-mine mask stays finite, where ``-inf`` would give ``-inf · 0 = nan``), they never
win an argmax, and their gradients are 0. No collective: each rank masks its own columns.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..core.mesh.devices import block_index
from ..core.redistribute import local_map
from ..core.spec import spec_of

__all__ = ["mask_padded_vocab"]


def _masked(local: torch.Tensor, offset: int, valid: int) -> torch.Tensor:
    cols = torch.arange(offset, offset + local.shape[-1], device=local.device)
    return torch.where(cols < valid, local, torch.finfo(local.dtype).min)


def mask_padded_vocab(logits: torch.Tensor, valid: int) -> torch.Tensor:
    """``logits`` (..., vocab) with every column ``>= valid`` set to the dtype's lowest
    value, wherever the layout puts the vocab columns.

    >>> mask_padded_vocab(torch.zeros(1, 4), 3)[0, 3] == torch.finfo(torch.float32).min
    tensor(True)
    """
    if valid >= logits.shape[-1]:
        return logits
    if not isinstance(logits, DTensor):
        return _masked(logits, 0, valid)
    spec = spec_of(logits)
    if spec.partial:
        raise ValueError(f"mask_padded_vocab: the logits must not hold a pending sum (spec {spec})")
    axes = spec.axes_of(logits.dim() - 1)
    mesh = logits.device_mesh

    def mask(local: torch.Tensor) -> torch.Tensor:
        return _masked(local, block_index(mesh, axes) * local.shape[-1], valid)

    return local_map(mask, (None,), spec, check_shapes=False)(logits)
