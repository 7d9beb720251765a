"""Reference oracles for the tests and benchmarks of context-parallel attention.

Executable specifications built only from :mod:`dtp.ops.blockwise`'s pieces, which the
library itself never calls: the allocating LSE :func:`merge` (the ring merges in place
with :func:`~dtp.ops.blockwise.merge_into`), :func:`causal_work` (score blocks per rank,
the measure zigzag balances) and :func:`simulate_ring_attention`, a single-process ring
the distributed one must match in structure (and to rounding in value). Re-exported by
:mod:`dtp.testing`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401 (the doctest uses it)

from ..layouts import check_cp, check_divisible, check_load_balance
from ..ops.blockwise import (Impl, _check_qkv, softmax_scale, accum_dtype, block_backward, block_forward,
                             from_cp_order, merge_into, ring_block_plan, to_cp_order)

__all__ = ["merge", "causal_work", "simulate_ring_attention"]


def merge(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets (LSE merge).

    ``out = out - sigmoid(lse_b - lse) * (out - out_b)`` and
    ``lse = logaddexp(lse, lse_b)`` (= ``lse - logsigmoid(lse - lse_b)``), computed in
    the accumulation dtype (fp32, or fp64 when either input is fp64) -- the sigmoid form
    never exponentiates a large positive number. An empty side (``lse = -inf``) contributes
    nothing and never produces NaN, whatever its ``out`` holds; ``out=None`` (with
    ``lse=None``) is the empty accumulator to start a ring from.

    Shapes: ``out`` ``(..., s, d)``, ``lse`` ``(..., s)``. Returns accumulation-dtype
    tensors (cast ``out`` back to the model dtype once, after the last merge); with
    ``out=None`` the result may alias ``out_b``/``lse_b``.

    >>> q, k, v = torch.randn(3, 1, 1, 4, 8, dtype=torch.float64).unbind(0)
    >>> o1, l1 = block_forward(q, k[:, :, :2], v[:, :, :2])
    >>> o2, l2 = block_forward(q, k[:, :, 2:], v[:, :, 2:])
    >>> o, l = merge(*merge(None, None, o1, l1), o2, l2)
    >>> torch.allclose(o, block_forward(q, k, v)[0])
    True
    """
    if out is None or lse is None:
        if not (out is None and lse is None):
            raise ValueError("out and lse must both be None (empty accumulator) or both tensors")
        acc = accum_dtype(out_b.dtype, lse_b.dtype)
        return out_b.to(acc), lse_b.to(acc)
    acc = accum_dtype(out.dtype, lse.dtype, out_b.dtype, lse_b.dtype)
    out, lse, out_b, lse_b = out.to(acc), lse.to(acc), out_b.to(acc), lse_b.to(acc)
    empty_a, empty_b = torch.isneginf(lse), torch.isneginf(lse_b)
    # lse_b - lse is NaN when both are -inf; any finite value works there (both empty).
    diff = torch.where(empty_a & empty_b, torch.zeros_like(lse), lse_b - lse)
    w = torch.sigmoid(diff).unsqueeze(-1)  # share of block b in the merged softmax
    new_out = out - w * (out - out_b)
    # Exactly take the other side when one is empty (its out may be garbage, e.g. NaN).
    new_out = torch.where(empty_a.unsqueeze(-1), out_b, new_out)
    new_out = torch.where(empty_b.unsqueeze(-1), out, new_out)
    new_lse = torch.logaddexp(lse, lse_b)  # -inf when both are -inf, never NaN
    return new_out, new_lse


def causal_work(rank: int, cp: int, load_balance: str | None) -> int:
    """Score blocks rank ``rank`` computes over a whole causal ring.

    The unit is a ``(seq_len/(2cp)) x (seq_len/(2cp))`` score block (a zigzag chunk
    squared) for both layouts, so numbers are comparable; a block counts when it has at
    least one unmasked entry (a flash kernel skips the fully masked ones). Zigzag gives
    every rank ``2cp + 1``; contiguous gives rank ``r`` ``4r + 3``.

    >>> [causal_work(r, 4, "zigzag") for r in range(4)], [causal_work(r, 4, None) for r in range(4)]
    ([9, 9, 9, 9], [3, 7, 11, 15])
    """
    total = 0
    for src in range(cp):
        for t in ring_block_plan(rank, src, cp, causal=True, load_balance=load_balance, local_len=2):
            nq, nk = t.q_slice.stop - t.q_slice.start, t.k_slice.stop - t.k_slice.start
            if t.mask == "full":
                total += nq * nk
            else:  # top-left causal: unit row a sees unit columns 0..a
                total += sum(min(a + 1, nk) for a in range(nq))
    return total


# -------------------------------------------------------------- ring simulation


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: int,
    causal: bool,
    load_balance: str | None,
    scale: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, _, _, _, d = _check_qkv(q, k, v)
    seq = q.shape[2]
    if k.shape[2] != seq:
        raise ValueError(f"ring attention needs equal q/k sequence lengths, got {seq} and {k.shape[2]}")
    check_divisible(seq, cp, load_balance)
    L = seq // cp
    qs, ks, vs = q.split(L, 2), k.split(L, 2), v.split(L, 2)
    acc = accum_dtype(q.dtype)
    out = torch.empty(b, hq, seq, d, dtype=acc, device=q.device)
    lse = torch.empty(b, hq, seq, dtype=acc, device=q.device)
    for r in range(cp):
        o, lo = out[:, :, r * L:(r + 1) * L], lse[:, :, r * L:(r + 1) * L]
        for step in range(cp):
            src = (r - step) % cp  # ring order: own block first, then from rank-1, rank-2, ...
            for t in ring_block_plan(r, src, cp, causal=causal, load_balance=load_balance, local_len=L):
                ob, lb = block_forward(
                    qs[r][:, :, t.q_slice], ks[src][:, :, t.k_slice], vs[src][:, :, t.k_slice],
                    scale=scale, mask=t.mask, impl=impl,  # type: ignore[arg-type]
                )
                if step == 0:
                    # The own block is one task over every row (causal or not), as in the
                    # distributed ring: it starts the accumulators, which are then never
                    # empty, so the rest merge in place (merge_into), exactly that path.
                    o.copy_(ob)
                    lo.copy_(lb)
                else:
                    merge_into(o[:, :, t.q_slice], lo[:, :, t.q_slice], ob, lb)
    return out.to(q.dtype), lse


def _ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cp: int,
    causal: bool,
    load_balance: str | None,
    scale: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    L = q.shape[2] // cp
    acc = accum_dtype(q.dtype)
    # Accumulate in fp32/fp64; the split views below write straight into these buffers.
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    qs, ks, vs = q.split(L, 2), k.split(L, 2), v.split(L, 2)
    dos, os_, ls = dout.split(L, 2), out.split(L, 2), lse.split(L, 2)
    dqs, dks, dvs = dq.split(L, 2), dk.split(L, 2), dv.split(L, 2)
    for r in range(cp):
        for step in range(cp):
            src = (r - step) % cp
            for t in ring_block_plan(r, src, cp, causal=causal, load_balance=load_balance, local_len=L):
                qsl, ksl = t.q_slice, t.k_slice
                gq, gk, gv = block_backward(
                    dos[r][:, :, qsl], qs[r][:, :, qsl], ks[src][:, :, ksl], vs[src][:, :, ksl],
                    os_[r][:, :, qsl], ls[r][:, :, qsl],
                    scale=scale, mask=t.mask, impl=impl,  # type: ignore[arg-type]
                )
                dqs[r][:, :, qsl] += gq
                # In the distributed ring these two travel back to src with the K/V block.
                dks[src][:, :, ksl] += gk
                dvs[src][:, :, ksl] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _SimulatedRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, causal, load_balance, scale, impl):  # type: ignore[override]
        out, lse = _ring_forward(q, k, v, cp, causal, load_balance, scale, impl)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (cp, causal, load_balance, scale, impl)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.cfg)
        return dq, dk, dv, None, None, None, None, None


def simulate_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp: int,
    causal: bool,
    load_balance: str | None = None,
    scale: float | None = None,
    impl: Impl = "auto",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Single-process reference of ring attention over ``cp`` ranks (differentiable).

    ``q``/``k``/``v`` are the *global* tensors already in cp order along the sequence
    (see :func:`to_cp_order`); the sequence is split into ``cp`` contiguous rank blocks.
    Forward: each rank visits source blocks in ring order ``rank, rank-1, ...``, runs
    :func:`ring_block_plan`'s tasks with :func:`block_forward` and folds them in with
    :func:`merge_into`, starting from its own block -- the distributed ring's compute,
    without the transfers (``benchmarks/blockwise_efficiency.py`` times it). Backward: :func:`block_backward` per task with the merged ``out``/``lse``,
    ``dq`` accumulated on the rank, ``dk``/``dv`` on the source block (fp32 accumulation
    for low precision). The output is in cp order too; use :func:`from_cp_order`.

    >>> q, k, v = torch.randn(3, 1, 2, 16, 8, dtype=torch.float64).unbind(0)
    >>> qz, kz, vz = (to_cp_order(t, 2, 4) for t in (q, k, v))
    >>> o = simulate_ring_attention(qz, kz, vz, cp=4, causal=True, load_balance="zigzag")
    >>> ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(from_cp_order(o, 2, 4), ref)
    True
    """
    check_cp(cp)
    check_load_balance(load_balance)
    scale = softmax_scale(scale, q.shape[-1])
    out, lse = _SimulatedRingAttention.apply(q, k, v, cp, causal, load_balance, scale, impl)
    return (out, lse) if return_lse else out
