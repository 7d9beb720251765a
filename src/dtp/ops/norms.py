"""RMSNorm over the last dim, on plain tensors or on the shards of a DTensor.

The norm reduces over the embedding dim, which no layout splits: each rank normalizes
the rows it holds, so the whole op runs on local shards in one :func:`dtp.local_map`
instead of a DTensor dispatch per elementwise op (about eight forward and ten backward
ops per norm, each a Python wrap). Same ops on the same local numbers: the results
equal the DTensor path's bit for bit.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..core._rules import accum_dtype
from ..core.redistribute import local_map
from ..core.spec import spec_of

__all__ = ["rms_norm"]


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    acc = accum_dtype(x.dtype)
    xf = x.to(acc)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) · w`` over ``x``'s last dim, computed in the accumulation dtype (fp32
    for bf16) and returned in ``x``'s.

    On DTensors whose last dim is whole (``x`` not split on it and with no pending sum,
    ``w`` replicated) it runs on the local shards: the result keeps ``x``'s spec and
    ``w``'s gradient is a pending sum over the axes that split ``x`` (what DTensor's own
    ops give). Any other layout takes DTensor's ops.

    >>> rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), 0.0)
    tensor([[0.8485, 1.1314]])
    """
    if not isinstance(x, DTensor) or not isinstance(w, DTensor):
        return _rms_norm(x, w, eps)
    xs, ws = spec_of(x), spec_of(w)
    if xs.partial or xs.axes_of(x.dim() - 1) or ws.used_axes():
        return _rms_norm(x, w, eps)
    return local_map(lambda a, b: _rms_norm(a, b, eps), (None, None), xs, check_shapes=False)(x, w)
