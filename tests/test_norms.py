"""ops.rms_norm on local shards equals the same ops through DTensor's dispatch, bit for bit
(values, and the input's and weight's gradients), on a sequence-split input (tp=2 + SP)."""

from __future__ import annotations

import torch

from dtp.testing import run


def _dtensor_ops(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm as llama wrote it before ops.rms_norm: each op dispatched by DTensor."""
    xf = x.to(torch.float64)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _both() -> list[bool]:
    import dtp
    from dtp import P
    from dtp.ops import norms

    mesh = dtp.make_mesh(tp=2)
    gen = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(2, 8, 6, dtype=torch.float64, generator=gen), torch.randn(6, dtype=torch.float64, generator=gen)
    out = []
    for fn in (norms.rms_norm, _dtensor_ops):  # local_map path; DTensor's ops
        x = dtp.shard(x0, mesh, P(None, "tp")).requires_grad_(True)
        w = dtp.shard(w0, mesh, P()).requires_grad_(True)
        y = fn(x, w, 1e-6)
        gx, gw = torch.autograd.grad((y * y).sum(), (x, w))
        out.append((dtp.spec_of(y), y.full_tensor(), gx.full_tensor(), dtp.reshard(gw, P()).full_tensor()))
    (s1, *a), (s2, *b) = out
    return [s1 == s2] + [torch.equal(u, v) for u, v in zip(a, b)]


def test_rms_norm_on_local_shards_is_dtensors_result_bit_for_bit() -> None:
    assert run(_both, world_size=2)[0] == [True, True, True, True]
