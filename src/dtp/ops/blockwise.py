"""Local numerics of context-parallel attention: one (Q block, K/V block) pair at a time.

Ring, double-ring and hybrid (Ulysses x ring) attention move K/V blocks between ranks;
whatever moves where, each rank ends up doing the same three local things, which live here
and involve no collectives at all:

* :func:`block_forward` -- attention of a Q block against one K/V block, returning the
  partial output *and* its log-sum-exp (LSE) so partials can be combined later;
* :func:`merge_into` -- the numerically stable LSE merge of a partial into an accumulator
  over disjoint key sets (in place);
* :func:`block_backward` -- the flash-attention backward of one block, given the *global*
  (already merged) output and LSE, so per-block gradients simply add up.

Plus the bookkeeping for causal load balancing (:func:`zigzag_permutation`,
:func:`to_cp_order`, :func:`from_cp_order`, :func:`ring_block_plan`). The reference
oracles built only from these pieces -- the allocating :func:`dtp.testing.merge`,
:func:`dtp.testing.causal_work` and :func:`dtp.testing.simulate_ring_attention`, a
single-process executable specification of ring attention that the distributed ring
must match in structure (and to rounding in value) -- live in :mod:`dtp.testing`.

Conventions
-----------
* Layout is SDPA's ``(batch, heads, seq, head_dim)``.
* GQA: ``k``/``v`` may have fewer heads than ``q`` (``heads_q % heads_kv == 0``); query
  head ``i`` uses kv head ``i // (heads_q // heads_kv)``, as ``enable_gqa=True`` in
  :func:`torch.nn.functional.scaled_dot_product_attention`. The math path never
  materialises repeated K/V: the query groups are folded into the sequence dimension.
* ``mask="causal"`` is aligned at the *top-left*: query ``i`` sees key ``j`` iff
  ``j <= i`` (local indices), for any ``s_q``/``s_k`` -- the same convention as SDPA's
  ``is_causal=True``. For the square diagonal blocks of a ring this is the usual causal
  mask; with top-left alignment no query row is ever fully masked (row 0 sees key 0).
* LSE is the natural-log ``logsumexp(scale * q @ k^T)`` per query row, shape
  ``(batch, heads_q, s_q)``, in the *accumulation dtype*: fp64 for fp64 inputs, fp32 for
  everything else (fp32/bf16/fp16).

Kernel selection (:func:`select_impl`)
--------------------------------------
``block_forward``/``block_backward`` run either a fused PyTorch SDPA kernel that returns
the LSE, or one plain-torch "math" path that runs on any device (CPU/CUDA/NPU):

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ its ``_backward``),
  fp64/fp32/bf16/fp16, GQA native, top-left causal, and its backward takes the given
  out/LSE (so the global ones work). It crashes (SIGFPE) on an empty K block, so empty
  blocks always take the math path.
* CUDA: forward via ``aten._scaled_dot_product_efficient_attention`` (fp32/bf16/fp16,
  K/V heads repeated for GQA, causal only on square blocks since the fused kernels'
  non-square causal alignment differs between backends); backward uses the math path.
* Everything else (other devices, empty blocks, dtype mismatches): math.

``impl="math"`` (or the environment variable ``DTP_BLOCKWISE_IMPL=math``) forces the math
path everywhere; ``impl="fused"`` raises if no fused kernel applies.
"""

from __future__ import annotations

import math
import os
from typing import Literal, NamedTuple

import torch

# The sequence-order helpers live with the layout, which owns the permutation
# (``Layout.to_cp_order``); re-exported here for the block-level code and its tests.
from ..core._rules import accum_dtype  # re-exported: the block kernels' accumulation dtype
from ..core._torch import cpu_flash_attention, cpu_flash_attention_backward, cuda_efficient_attention
from ..layouts import (
    check_cp,
    check_load_balance,
    cp_permutation,
    from_cp_order,
    to_cp_order,
    zigzag_permutation,
)

__all__ = [
    "accum_dtype",
    "softmax_scale",
    "select_impl",
    "block_forward",
    "block_backward",
    "merge_into",
    "zigzag_permutation",
    "cp_permutation",
    "to_cp_order",
    "from_cp_order",
    "BlockTask",
    "ring_block_plan",
]

Mask = Literal["full", "causal"] | torch.Tensor  # a tensor: bool (batch, s_q, s_k), True = attend
Impl = Literal["auto", "math", "fused"]

#: Environment variable that overrides ``impl="auto"`` (values: auto, math, fused).
IMPL_ENV = "DTP_BLOCKWISE_IMPL"

_MASKS = ("full", "causal")
_CPU_FUSED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_CUDA_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- helpers


def _check_mask(mask: object) -> None:
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool or mask.dim() != 3:
            raise ValueError(f"a mask tensor must be bool (batch, s_q, s_k), got {mask.dtype} {tuple(mask.shape)}")
        return
    if mask not in _MASKS:
        raise ValueError(f"mask must be one of {_MASKS}, got {mask!r}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """Validate SDPA-layout shapes; returns (b, hq, hkv, s_q, s_k, d)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, heads, seq, head_dim); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, hq, sq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    hkv, sk = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"heads_q ({hq}) must be a multiple of heads_kv ({hkv}) for GQA")
    return b, hq, hkv, sq, sk, d


def softmax_scale(scale: float | None, d: int) -> float:
    """``scale``, or SDPA's default ``1/sqrt(head_dim)`` when it is ``None``."""
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _causal_keep(rows: range, sk: int, device: torch.device) -> torch.Tensor:
    """Boolean (len(rows), s_k) matrix, True where query i of ``rows`` may see key j
    (j <= i, top-left aligned)."""
    return torch.arange(rows.start, rows.stop, device=device)[:, None] >= torch.arange(sk, device=device)[None, :]


# ---------------------------------------------------------------- kernel selection


def _fused_unavailable(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, backward: bool
) -> str | None:
    """Why no fused kernel applies to this block (None when one does)."""
    if isinstance(mask, torch.Tensor):
        return "an explicit mask (packed documents): the math path"
    if not (q.dtype == k.dtype == v.dtype):
        return f"mixed dtypes {q.dtype}/{k.dtype}/{v.dtype}"
    if q.shape[2] == 0 or k.shape[2] == 0:
        # The CPU flash kernel dies with SIGFPE on an empty key block; nothing to gain anyway.
        return "empty block"
    dev = q.device.type
    if dev == "cpu":
        if q.dtype not in _CPU_FUSED_DTYPES:
            return f"CPU flash kernel does not support {q.dtype}"
        return None
    if dev == "cuda":
        if backward:
            # The CUDA fused backwards need the forward's philox/cum_seq bookkeeping; the
            # math path is exact and device-agnostic (and tiled over query rows, so its
            # memory is O(tile x s_k), see MATH_TILE_ELEMENTS), so use it.
            return "no fused CUDA block backward"
        if q.dtype not in _CUDA_FUSED_DTYPES:
            return f"CUDA efficient attention does not support {q.dtype}"
        if mask == "causal" and q.shape[2] != k.shape[2]:
            return "fused causal only for square blocks on CUDA (top-left vs bottom-right)"
        return None
    return f"no fused kernel returning LSE for device {dev!r}"


def select_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask = "full",
    *,
    backward: bool = False,
    impl: Impl = "auto",
) -> str:
    """Pick the kernel for one block: ``"cpu_flash"``, ``"cuda_efficient"`` or ``"math"``.

    ``impl="auto"`` (overridable by ``$DTP_BLOCKWISE_IMPL``) uses a fused kernel when one
    applies and the math path otherwise; ``"math"`` always uses the math path; ``"fused"``
    raises :class:`RuntimeError` with the reason when no fused kernel applies.

    >>> q = torch.randn(1, 2, 4, 8)
    >>> select_impl(q, q, q, "causal"), select_impl(q, q, q, impl="math")
    ('cpu_flash', 'math')
    """
    if impl not in ("auto", "math", "fused"):
        raise ValueError(f"impl must be 'auto', 'math' or 'fused', got {impl!r}")
    if impl == "auto":
        impl = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"  # type: ignore[assignment]
        if impl not in ("auto", "math", "fused"):
            raise ValueError(f"${IMPL_ENV} must be auto, math or fused, got {impl!r}")
    if impl == "math":
        return "math"
    reason = _fused_unavailable(q, k, v, mask, backward)
    if reason is None:
        return "cpu_flash" if q.device.type == "cpu" else "cuda_efficient"
    if impl == "fused":
        raise RuntimeError(f"no fused attention kernel for this block: {reason}")
    return "math"


# ------------------------------------------------------------------------ forward


def _math_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Mask
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, hkv, sq, sk, d = _check_qkv(q, k, v)
    g = hq // hkv
    acc = accum_dtype(q.dtype)
    # GQA without repeating K/V: the g query heads sharing a kv head are folded into the
    # query-sequence dimension, so one (g*s_q, s_k) score matrix per kv head is exactly
    # the s_q x s_k score matrices of its g query heads -- no extra memory.
    qa = q.to(acc).reshape(b, hkv, g * sq, d)
    s = torch.matmul(qa, k.to(acc).transpose(-1, -2)).mul_(scale).view(b, hkv, g, sq, sk)
    if isinstance(mask, torch.Tensor):
        s.masked_fill_(~mask[:, None, None], float("-inf"))
    elif mask == "causal":
        s.masked_fill_(~_causal_keep(range(sq), sk, s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see no key (only if s_k == 0)
    # exp(s - lse) in place (p reuses the score buffer); a -inf row would give
    # -inf - -inf = NaN, so subtract 0 there instead and get p = exp(-inf) = 0.
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = s.sub_(safe.unsqueeze(-1)).exp_()
    out = torch.matmul(p.view(b, hkv, g * sq, sk), v.to(acc)).view(b, hq, sq, d)
    return out.to(q.dtype), lse.reshape(b, hq, sq)


def _dense_rows(x: torch.Tensor, broadcast_ok: bool = False) -> torch.Tensor:
    """``x`` with a unit-stride last dim (copied only when it has not): the CPU flash
    kernels read any batch/head/sequence strides but give wrong numbers, without an
    error, for a strided head_dim (measured, torch 2.13). ``broadcast_ok``: a stride-0
    (expanded) dout is read correctly (measured), and is what ``out.sum().backward()``
    passes; copying it would cost a whole block at the ring's peak."""
    if x.stride(-1) == 1 or x.shape[-1] <= 1 or (broadcast_ok and x.stride(-1) == 0):
        return x
    return x.contiguous()


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    mask: Mask = "full",
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one Q block against one K/V block, with its log-sum-exp.

    Args:
        q: ``(b, h_q, s_q, d)``.
        k, v: ``(b, h_kv, s_k, d)`` with ``h_q % h_kv == 0``.
        scale: softmax scale; ``None`` means ``1/sqrt(d)``.
        mask: ``"full"`` (every key visible), ``"causal"`` (top-left aligned: query ``i``
            sees keys ``j <= i``; the diagonal block of a ring) or a bool ``(b, s_q, s_k)``
            tensor, True where a query sees a key (packed documents; the math path).
        impl: see :func:`select_impl`.

    Returns:
        ``(out, lse)``: ``out`` ``(b, h_q, s_q, d)`` in ``q.dtype``; ``lse``
        ``(b, h_q, s_q)`` in :func:`accum_dtype` (fp32, or fp64 for fp64 inputs).
        An empty K block gives ``out = 0`` and ``lse = -inf``, which the LSE merge
        (:func:`merge_into`, :func:`dtp.testing.merge`) treats as "no contribution".

    >>> q, k, v = torch.randn(3, 1, 2, 4, 8, dtype=torch.float64).unbind(0)
    >>> out, lse = block_forward(q, k, v, scale=0.5, mask="causal")
    >>> out.shape, lse.shape, lse.dtype
    (torch.Size([1, 2, 4, 8]), torch.Size([1, 2, 4]), torch.float64)
    """
    _check_mask(mask)
    b, hq, hkv, sq, sk, d = _check_qkv(q, k, v)
    scale = softmax_scale(scale, d)
    kind = select_impl(q, k, v, mask, impl=impl)
    acc = accum_dtype(q.dtype)
    if kind == "cpu_flash":
        q, k, v = _dense_rows(q), _dense_rows(k), _dense_rows(v)
        out, lse = cpu_flash_attention(q, k, v, mask == "causal", scale)
        return out, lse.to(acc)
    if kind == "cuda_efficient":
        g = hq // hkv
        if g > 1:  # the efficient kernel wants equal head counts
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        out, lse = cuda_efficient_attention(q, k, v, mask == "causal", scale)[:2]
        # Some versions pad the LSE's sequence dim to a multiple of 32.
        return out, lse[..., :sq].to(acc)
    return _math_forward(q, k, v, scale, mask)


# ----------------------------------------------------------------------- backward


#: The math backward works through the query rows in tiles whose score matrix
#: (b × h_q × rows × s_k) stays under this many elements; two such buffers (P and dS)
#: are live at once, about 512 MiB in fp32. On devices without a fused block backward
#: (CUDA) a long block never holds s_q × s_k scores.
MATH_TILE_ELEMENTS = 1 << 26


def _math_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: Mask,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, hq, hkv, sq, sk, d = _check_qkv(q, k, v)
    g = hq // hkv
    acc = accum_dtype(q.dtype)
    ka, va = k.to(acc), v.to(acc)
    dq = torch.empty(b, hq, sq, d, dtype=acc, device=q.device)
    dk = torch.zeros(b, hkv, sk, d, dtype=acc, device=q.device)
    dv = torch.zeros(b, hkv, sk, d, dtype=acc, device=q.device)
    rows = max(1, MATH_TILE_ELEMENTS // max(1, b * hq * sk))
    for i0 in range(0, sq, rows):
        i1 = min(sq, i0 + rows)
        t = i1 - i0
        # GQA: the g query heads of a kv head folded into the row dimension, as in forward.
        qa = q[:, :, i0:i1].to(acc).reshape(b, hkv, g * t, d)
        do = dout[:, :, i0:i1].to(acc).reshape(b, hkv, g * t, d)
        # D_i = sum_d dO_i * O_i with the GLOBAL output: that is what makes per-block
        # gradient contributions additive (softmax Jacobian uses the full-row normaliser).
        delta = (dout[:, :, i0:i1].to(acc) * out[:, :, i0:i1].to(acc)).sum(-1).reshape(b, hkv, g * t, 1)
        lt = lse[:, :, i0:i1].to(acc).reshape(b, hkv, g, t, 1)
        lt = torch.where(torch.isneginf(lt), torch.zeros_like(lt), lt)  # no NaN rows
        s = torch.matmul(qa, ka.transpose(-1, -2)).mul_(scale).view(b, hkv, g, t, sk)
        if isinstance(mask, torch.Tensor):
            s.masked_fill_(~mask[:, None, None, i0:i1], float("-inf"))
        elif mask == "causal":
            s.masked_fill_(~_causal_keep(range(i0, i1), sk, s.device), float("-inf"))
        p = s.sub_(lt).exp_().view(b, hkv, g * t, sk)  # P = exp(S*scale - lse_global)
        # dV = P^T dO; the contraction over g*rows also sums the GQA query groups.
        dv += torch.matmul(p.transpose(-1, -2), do)
        # dS = P * (dP - D) with dP = dO V^T, built in place in the dP buffer.
        ds = torch.matmul(do, va.transpose(-1, -2)).sub_(delta).mul_(p)
        del p, s
        dq[:, :, i0:i1] = torch.matmul(ds, ka).mul_(scale).view(b, hq, t, d)
        dk += torch.matmul(ds.transpose(-1, -2), qa).mul_(scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float | None = None,
    mask: Mask = "full",
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-attention backward of one block, given the GLOBAL output and LSE.

    With ``out``/``lse`` the merged result over *all* key blocks, the gradients of the
    different K/V blocks are independent and add up::

        D  = rowsum(dO * O)            P  = exp(scale * Q K^T - lse)
        dV = P^T dO                    dP = dO V^T
        dS = P * (dP - D)              dQ = scale * dS K     dK = scale * dS^T Q

    Computed in :func:`accum_dtype` (fp32 for low precision, fp64 for fp64) and returned
    in the input dtypes (``dq`` like ``q``, ``dk`` like ``k``, ...): callers that add many
    blocks should accumulate the returned values in fp32 themselves. For GQA ``dk``/``dv``
    have ``h_kv`` heads (summed over the query group).

    >>> q, k, v = torch.randn(3, 1, 2, 4, 8, dtype=torch.float64).unbind(0)
    >>> out, lse = block_forward(q, k, v, mask="causal")
    >>> dq, dk, dv = block_backward(torch.ones_like(out), q, k, v, out, lse, mask="causal")
    >>> dq.shape == q.shape and dk.shape == k.shape
    True
    """
    _check_mask(mask)
    b, hq, hkv, sq, sk, d = _check_qkv(q, k, v)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (b, hq, sq):
        raise ValueError(
            f"dout/out must be {tuple(q.shape)} and lse {(b, hq, sq)}; got "
            f"{tuple(dout.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}"
        )
    scale = softmax_scale(scale, d)
    kind = select_impl(q, k, v, mask, backward=True, impl=impl)
    if kind == "cpu_flash":
        # Sequence slices go in as they are: the CPU kernel reads them by stride and gives
        # bitwise the results of dense copies (tested), and copies would sit in memory
        # exactly where a ring rank peaks. Rows (head_dim) must be dense, though: with a
        # strided last dim the kernel is silently wrong. The LSE is made dense anyway
        # (tiny): torch's own context-parallel code needed that on CUDA.
        dq, dk, dv = cpu_flash_attention_backward(
            _dense_rows(dout.to(q.dtype), broadcast_ok=True),
            _dense_rows(q),
            _dense_rows(k),
            _dense_rows(v),
            _dense_rows(out.to(q.dtype)),
            lse.to(accum_dtype(q.dtype)).contiguous(),
            mask == "causal",
            scale,
        )
        return dq, dk, dv
    return _math_backward(dout, q, k, v, out, lse, scale, mask)


# -------------------------------------------------------------------------- merge


def merge_into(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """:func:`dtp.testing.merge` in place, for accumulators whose rows have all seen a key already.

    ``out``/``lse`` (accumulation dtype, possibly views into a larger accumulator) become
    the merge with block ``out_b``/``lse_b``: ``out.lerp_(out_b, sigmoid(lse_b - lse))``
    and ``lse = logaddexp(lse, lse_b)`` -- the same stable sigmoid form as ``merge``,
    one fused kernel on the big tensor and no temporaries of its size. It skips
    ``merge``'s empty-side handling, so ``lse`` must be finite (``lse_b = -inf``
    with a finite ``out_b``, an empty block's zeros, weighs 0). A ring starts its
    accumulator from the diagonal block, which covers every row, so this holds there.

    >>> q, k, v = torch.randn(3, 1, 1, 4, 8, dtype=torch.float64).unbind(0)
    >>> o, l = block_forward(q, k[:, :, :2], v[:, :, :2])
    >>> merge_into(o, l, *block_forward(q, k[:, :, 2:], v[:, :, 2:]))
    >>> torch.allclose(o, block_forward(q, k, v)[0])
    True
    """
    w = torch.sigmoid(lse_b.to(lse.dtype) - lse)
    out.lerp_(out_b.to(out.dtype), w.unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, lse_b.to(lse.dtype)))


# ------------------------------------------------------------------ load balancing


class BlockTask(NamedTuple):
    """One block of work: ``q_local[q_slice]`` against ``kv_block[k_slice]`` with ``mask``,
    for the batch rows ``rows`` (all of them but with packed documents, whose tiles a
    run of rows may skip)."""

    q_slice: slice
    k_slice: slice
    mask: "Mask"
    rows: slice = slice(None)


def ring_block_plan(
    rank: int,
    src_rank: int,
    cp: int,
    *,
    causal: bool,
    load_balance: str | None,
    local_len: int | None = None,
) -> list[BlockTask]:
    """Which sub-blocks rank ``rank`` computes against the K/V block from ``src_rank``.

    Slices index the *local* sequence of the rank's Q and of the received K/V block. With
    ``local_len=None`` they are in chunk units (2 chunks per rank for zigzag, 1 otherwise);
    with ``local_len`` (tokens per rank) they are token slices.

    * not causal: everything, unmasked.
    * causal, contiguous (``None``): ``src < rank`` full, ``src == rank`` causal (the
      diagonal), ``src > rank`` nothing (future tokens).
    * causal, zigzag (rank ``r`` holds chunks ``r`` and ``2cp-1-r``): ``src == r`` one
      causal call on the whole local block (its global positions are increasing, so the
      local top-left causal mask is exactly the global one); ``src < r`` all of Q against
      the first K chunk (chunk ``src`` precedes both of ours; chunk ``2cp-1-src`` follows
      both); ``src > r`` Q's second chunk against all of K (both of its chunks precede
      chunk ``2cp-1-r`` and follow chunk ``r``).

    An empty list means "skip this step" (no compute; the K/V block still travels on).

    >>> ring_block_plan(1, 0, 2, causal=True, load_balance="zigzag")
    [BlockTask(q_slice=slice(0, 2, None), k_slice=slice(0, 1, None), mask='full', rows=slice(None, None, None))]
    >>> ring_block_plan(0, 1, 2, causal=True, load_balance=None, local_len=4)
    []
    """
    check_cp(cp)
    check_load_balance(load_balance)
    if not (0 <= rank < cp and 0 <= src_rank < cp):
        raise ValueError(f"rank ({rank}) and src_rank ({src_rank}) must be in [0, cp={cp})")
    n = 2 if load_balance == "zigzag" else 1  # chunks per rank
    if local_len is None:
        unit = 1
    else:
        if local_len % n != 0:
            raise ValueError(f"local_len={local_len} must be divisible by {n} chunks per rank ({load_balance=})")
        unit = local_len // n

    def sl(a: int, b: int) -> slice:
        return slice(a * unit, b * unit)

    whole = sl(0, n)
    if not causal:
        return [BlockTask(whole, whole, "full")]
    if src_rank == rank:
        return [BlockTask(whole, whole, "causal")]
    if load_balance is None:
        return [BlockTask(whole, whole, "full")] if src_rank < rank else []
    if src_rank < rank:
        return [BlockTask(whole, sl(0, 1), "full")]
    return [BlockTask(sl(1, 2), whole, "full")]
