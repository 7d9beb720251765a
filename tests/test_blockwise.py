"""Tests for dtp.ops.blockwise: the local numerics of context-parallel attention.

Everything is proven against full ``scaled_dot_product_attention`` in fp64 (rel 1e-10),
for both the fused CPU kernel and the plain-torch math path; low precision is checked
against the fp64 reference with dtype-appropriate tolerances.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dtp.ops.blockwise import (
    BlockTask,
    accum_dtype,
    block_backward,
    block_forward,
    cp_permutation,
    from_cp_order,
    ring_block_plan,
    select_impl,
    to_cp_order,
    zigzag_permutation,
)
from dtp.testing import causal_work, merge, simulate_ring_attention

F64 = torch.float64
IMPLS = ["math", "auto"]  # "auto" is the fused CPU flash kernel for every float dtype


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs error over max(|b|, 1): relative for O(1)+ tensors, absolute below.

    The floor matters: e.g. a query row that sees a single key has dq = 0 analytically and
    the reference holds only rounding noise there, so a pure relative error is meaningless.
    """
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def qkv(b, hq, hkv, sq, sk, d, *, dtype=F64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g, dtype=F64)
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=F64)
    v = torch.randn(b, hkv, sk, d, generator=g, dtype=F64)
    return tuple(t.to(dtype).requires_grad_(grad) for t in (q, k, v))


def ref_attention(q, k, v, mask, scale):
    """Full SDPA with an explicit top-left causal mask, plus the fp64 reference LSE."""
    sq, sk = q.shape[2], k.shape[2]
    keep = torch.ones(sq, sk, dtype=torch.bool).tril() if mask == "causal" else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=True)
    g = q.shape[1] // k.shape[1]
    s = q.detach().double() @ k.detach().double().repeat_interleave(g, 1).transpose(-1, -2) * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return out, s.logsumexp(-1)


# ---------------------------------------------------------------- block forward/backward

block_shapes = st.tuples(
    st.integers(1, 2),  # batch
    st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1), (6, 3)]),  # (heads_q, heads_kv)
    st.integers(1, 9),  # s_q
    st.integers(1, 9),  # s_k
    st.sampled_from([1, 4, 8]),  # head_dim
)


@settings(max_examples=25, deadline=None)
@given(shape=block_shapes, mask=st.sampled_from(["full", "causal"]), impl=st.sampled_from(IMPLS),
       scale=st.floats(0.05, 2.0), seed=st.integers(0, 2**16))
def test_block_forward_backward_match_sdpa_fp64(shape, mask, impl, scale, seed):
    b, (hq, hkv), sq, sk, d = shape
    q, k, v = qkv(b, hq, hkv, sq, sk, d, seed=seed, grad=True)
    ref, ref_lse = ref_attention(q, k, v, mask, scale)
    out, lse = block_forward(q.detach(), k.detach(), v.detach(), scale=scale, mask=mask, impl=impl)
    assert out.dtype == F64 and lse.dtype == F64 and lse.shape == (b, hq, sq)
    assert rel_err(out, ref) < 1e-10
    assert rel_err(lse, ref_lse) < 1e-10

    dout = torch.randn(ref.shape, dtype=F64, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    mine = block_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, scale=scale, mask=mask, impl=impl)
    for g_mine, g_ref, t in zip(mine, grads, (q, k, v)):
        assert g_mine.shape == t.shape and g_mine.dtype == F64
        assert rel_err(g_mine, g_ref) < 1e-10


@pytest.mark.parametrize("mask", ["full", "causal"])
def test_fused_and_math_paths_agree(mask):
    q, k, v = qkv(2, 4, 2, 12, 12, 8, seed=3)
    o1, l1 = block_forward(q, k, v, mask=mask, impl="fused")
    o2, l2 = block_forward(q, k, v, mask=mask, impl="math")
    assert rel_err(o1, o2) < 1e-12 and rel_err(l1, l2) < 1e-12
    dout = torch.randn_like(o1)
    for a, b in zip(block_backward(dout, q, k, v, o1, l1, mask=mask, impl="fused"),
                    block_backward(dout, q, k, v, o1, l1, mask=mask, impl="math")):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_fused_backward_reads_strided_slices_like_dense_copies(mask, dtype):
    # The ring passes sequence slices of (b, h, L, d) tensors -- strided -- straight to
    # the kernel (copies would sit in memory at the ring's peak): same bits as dense.
    q, k, v = qkv(2, 4, 2, 16, 16, 8, dtype=dtype, seed=5)
    qs, ks = slice(8, 16), slice(0, 8)
    dout = torch.randn(q.shape, dtype=F64).to(dtype)
    out, lse = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], mask=mask, impl="fused")
    strided = block_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out, lse, mask=mask, impl="fused")
    dense = block_backward(*(t.contiguous() for t in (dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks])),
                           out, lse, mask=mask, impl="fused")
    assert not q[:, :, qs].is_contiguous()
    for a, b in zip(strided, dense):
        assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["q", "k", "v", "out", "dout"])
def test_fused_kernels_get_dense_rows(which):
    # The CPU flash kernels are silently wrong for a strided head_dim: such inputs are
    # copied first, so results equal the dense ones.
    q, k, v = qkv(1, 2, 2, 8, 8, 4, dtype=torch.float32, seed=7)
    out, lse = block_forward(q, k, v, mask="causal", impl="fused")
    dout = torch.randn(out.shape)
    dense = dict(q=q, k=k, v=v, out=out, dout=dout)

    def transposed_copy(t):
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, stride(-1) != 1

    args = dict(dense, **{which: transposed_copy(dense[which])})
    assert args[which].stride(-1) != 1 and torch.equal(args[which], dense[which])
    if which in ("q", "k", "v"):
        o2, l2 = block_forward(args["q"], args["k"], args["v"], mask="causal", impl="fused")
        assert torch.equal(o2, out) and torch.equal(l2, lse)
    got = block_backward(args["dout"], args["q"], args["k"], args["v"], args["out"], lse, mask="causal", impl="fused")
    want = block_backward(dout, q, k, v, out, lse, mask="causal", impl="fused")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = qkv(1, 2, 2, 5, 7, 16)
    out, _ = block_forward(q, k, v)
    assert rel_err(out, F.scaled_dot_product_attention(q, k, v)) < 1e-10


def test_empty_key_block_is_neutral():
    q, k, v = qkv(1, 2, 1, 4, 0, 8)
    out, lse = block_forward(q, k, v, mask="full")  # the fused CPU kernel would SIGFPE here
    assert select_impl(q, k, v) == "math"
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    dq, dk, dv = block_backward(torch.ones_like(q), q, k, v, out, lse)
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape


# ---------------------------------------------------------------------------- merge


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_merge_of_key_split_equals_full_attention(impl, mask):
    """Split the keys into pieces; merged partials = full attention, and per-piece
    backward with the GLOBAL out/lse sums to the full gradient."""
    s, scale = 16, 0.3
    q, k, v = qkv(2, 4, 2, s, s, 8, seed=7, grad=True)
    ref, ref_lse = ref_attention(q, k, v, mask, scale)
    dout = torch.randn_like(ref)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    cuts = [0, 3, 8, 9, 16]
    pieces = []
    for a, b in itertools.pairwise(cuts):
        if mask == "causal":
            # keys [a, b) seen by query i iff j <= i: a full block for rows >= b-1 is not
            # expressible as one top-left mask, so build it from row ranges.
            pieces.append((slice(a, s), slice(a, b), "causal"))  # rows a.. : top-left at (a, a)
        else:
            pieces.append((slice(0, s), slice(a, b), "full"))
    out = lse = None
    for qs, ks, m in pieces:
        ob, lb = block_forward(qd[:, :, qs], kd[:, :, ks], vd[:, :, ks], scale=scale, mask=m, impl=impl)
        # pad rows outside qs as empty (lse=-inf) so every piece covers all rows
        full_o = torch.zeros_like(qd)
        full_l = torch.full(qd.shape[:3], float("-inf"), dtype=F64)
        full_o[:, :, qs], full_l[:, :, qs] = ob, lb
        out, lse = merge(out, lse, full_o, full_l)
    assert rel_err(out, ref) < 1e-10 and rel_err(lse, ref_lse) < 1e-10

    dq, dk, dv = torch.zeros_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)
    for qs, ks, m in pieces:
        gq, gk, gv = block_backward(dout[:, :, qs], qd[:, :, qs], kd[:, :, ks], vd[:, :, ks],
                                    out[:, :, qs], lse[:, :, qs], scale=scale, mask=m, impl=impl)
        dq[:, :, qs] += gq
        dk[:, :, ks] += gk
        dv[:, :, ks] += gv
    for a, b in zip((dq, dk, dv), grads):
        assert rel_err(a, b) < 1e-10


def test_merge_handles_empty_sides_without_nan():
    ninf = float("-inf")
    o = torch.tensor([[1.0, 2.0], [float("inf"), float("nan")], [5.0, 6.0]], dtype=F64)
    l = torch.tensor([0.5, ninf, ninf], dtype=F64)
    ob = torch.tensor([[float("nan")] * 2, [7.0, 8.0], [0.0, 0.0]], dtype=F64)  # garbage in an empty row
    lb = torch.tensor([ninf, 1.5, ninf], dtype=F64)
    mo, ml = merge(o, l, ob, lb)
    assert not torch.isnan(mo).any() and not torch.isnan(ml).any()
    assert torch.equal(mo[0], o[0]) and torch.equal(mo[1], ob[1])  # the non-empty side, exactly
    assert ml[0] == 0.5 and ml[1] == 1.5 and torch.isneginf(ml[2])
    # empty accumulator start
    mo2, ml2 = merge(None, None, ob[1:2], lb[1:2])
    assert torch.equal(mo2, ob[1:2]) and torch.equal(ml2, lb[1:2])
    with pytest.raises(ValueError):
        merge(o, None, ob, lb)


def test_merge_is_symmetric_and_promotes_low_precision():
    g = torch.Generator().manual_seed(0)
    o1, o2 = torch.randn(2, 3, 5, 4, generator=g).bfloat16().unbind(0)
    l1, l2 = (torch.randn(2, 3, 5, generator=g) * 30).unbind(0)  # large LSE gaps: no overflow
    a, la = merge(o1, l1, o2, l2)
    b, lb = merge(o2, l2, o1, l1)
    assert a.dtype == torch.float32 and la.dtype == torch.float32
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(la, lb)
    w = torch.sigmoid(l2 - l1).unsqueeze(-1)
    assert torch.allclose(a, (1 - w) * o1.float() + w * o2.float(), atol=1e-6)


# --------------------------------------------------------------------- ring simulation


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("load_balance", ["zigzag", None])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_simulated_ring_matches_sdpa_fp64(cp, causal, load_balance, heads, impl):
    hq, hkv = heads
    q, k, v = qkv(2, hq, hkv, 32, 32, 8, seed=cp, grad=True)
    scale = 0.4
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    dout = torch.randn_like(ref)
    grads = torch.autograd.grad(ref, (q, k, v), dout)

    zq, zk, zv = (to_cp_order(t.detach(), 2, cp, load_balance).requires_grad_() for t in (q, k, v))
    out, lse = simulate_ring_attention(zq, zk, zv, cp=cp, causal=causal, load_balance=load_balance,
                                       scale=scale, impl=impl, return_lse=True)
    assert rel_err(from_cp_order(out, 2, cp, load_balance), ref) < 1e-10
    assert torch.isfinite(lse).all()
    out.backward(to_cp_order(dout, 2, cp, load_balance))
    for t, g in zip((zq, zk, zv), grads):
        assert t.grad.shape == g.shape
        assert rel_err(from_cp_order(t.grad, 2, cp, load_balance), g) < 1e-10


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("impl", IMPLS)
def test_low_precision_forward_vs_fp64(dtype, tol, impl):
    q, k, v = qkv(2, 4, 2, 32, 32, 16, seed=11)
    ref, ref_lse = ref_attention(q, k, v, "causal", 0.25)
    lq, lk, lv = (t.to(dtype) for t in (q, k, v))
    out, lse = block_forward(lq, lk, lv, scale=0.25, mask="causal", impl=impl)
    assert out.dtype == dtype and lse.dtype == torch.float32 == accum_dtype(dtype)
    assert rel_err(out, ref) < tol and rel_err(lse, ref_lse) < tol

    # the ring merges partials in fp32, so it is no worse than one fused call
    zq, zk, zv = (to_cp_order(t, 2, 4) for t in (lq, lk, lv))
    rout, rlse = simulate_ring_attention(zq, zk, zv, cp=4, causal=True, load_balance="zigzag",
                                         scale=0.25, impl=impl, return_lse=True)
    assert rout.dtype == dtype and rlse.dtype == torch.float32
    assert rel_err(from_cp_order(rout, 2, 4), ref) < tol
    assert rel_err(from_cp_order(rlse, 2, 4), ref_lse) < tol


def test_low_precision_ring_backward_vs_fp64():
    q, k, v = qkv(1, 4, 2, 32, 32, 16, seed=5, grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    dout = torch.randn_like(ref)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)]:
        zs = [to_cp_order(t.detach().to(dtype), 2, 4).requires_grad_() for t in (q, k, v)]
        out = simulate_ring_attention(*zs, cp=4, causal=True, load_balance="zigzag")
        out.backward(to_cp_order(dout.to(dtype), 2, 4))
        for t, g in zip(zs, grads):
            assert t.grad.dtype == dtype
            assert rel_err(from_cp_order(t.grad, 2, 4), g) < tol, dtype


# ---------------------------------------------------------------- zigzag & ring plan


def test_zigzag_permutation_layout():
    assert zigzag_permutation(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_permutation(8, 4).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    assert zigzag_permutation(6, 1).tolist() == list(range(6))
    assert cp_permutation(6, 3, None).tolist() == list(range(6))


@settings(max_examples=30, deadline=None)
@given(cp=st.integers(1, 8), chunk=st.integers(1, 4), dim=st.integers(0, 2), lb=st.sampled_from(["zigzag", None]))
def test_cp_order_round_trips(cp, chunk, dim, lb):
    seq = 2 * cp * chunk
    shape = [3, 2, 2]
    shape[dim] = seq
    x = torch.randn(shape)
    y = to_cp_order(x, dim, cp, lb)
    assert torch.equal(from_cp_order(y, dim, cp, lb), x)
    perm = cp_permutation(seq, cp, lb)
    assert sorted(perm.tolist()) == list(range(seq))
    assert torch.equal(y, x.index_select(dim, perm))
    if lb == "zigzag":  # rank r's local sequence = chunks r and 2cp-1-r, each increasing
        for r, local in enumerate(perm.view(cp, 2 * chunk)):
            assert local.tolist() == [*range(r * chunk, (r + 1) * chunk),
                                      *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zigzag_balances_causal_work(cp):
    zig = [causal_work(r, cp, "zigzag") for r in range(cp)]
    contig = [causal_work(r, cp, None) for r in range(cp)]
    assert max(zig) - min(zig) <= 1
    assert contig == [4 * r + 3 for r in range(cp)]
    # same total useful work (blocks with an unmasked entry) either way
    assert sum(zig) == sum(contig) == cp * (2 * cp + 1)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("load_balance", ["zigzag", None])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_plan_covers_each_visible_pair_exactly_once(cp, load_balance, causal):
    """Token-level: over the whole ring, every (query, key) pair the global mask allows is
    computed exactly once and no disallowed pair is ever left unmasked."""
    chunk = 3
    seq = 2 * cp * chunk
    L = seq // cp
    pos = cp_permutation(seq, cp, load_balance).view(cp, L)  # global position of each local token
    seen = torch.zeros(seq, seq, dtype=torch.int64)
    for r, src in itertools.product(range(cp), range(cp)):
        for t in ring_block_plan(r, src, cp, causal=causal, load_balance=load_balance, local_len=L):
            assert isinstance(t, BlockTask) and t.mask in ("full", "causal")
            qp, kp = pos[r][t.q_slice], pos[src][t.k_slice]
            keep = torch.ones(len(qp), len(kp), dtype=torch.bool)
            if t.mask == "causal":
                keep = keep.tril()
            seen[qp[:, None].expand_as(keep)[keep], kp[None, :].expand_as(keep)[keep]] += 1
    allowed = torch.ones(seq, seq, dtype=torch.int64)
    if causal:
        allowed = allowed.tril()
    assert torch.equal(seen, allowed)


def test_ring_plan_chunk_units():
    z = dict(causal=True, load_balance="zigzag")
    assert ring_block_plan(2, 2, 4, **z) == [BlockTask(slice(0, 2), slice(0, 2), "causal")]
    assert ring_block_plan(2, 1, 4, **z) == [BlockTask(slice(0, 2), slice(0, 1), "full")]
    assert ring_block_plan(1, 3, 4, **z) == [BlockTask(slice(1, 2), slice(0, 2), "full")]
    assert ring_block_plan(1, 3, 4, **z, local_len=10) == [BlockTask(slice(5, 10), slice(0, 10), "full")]
    c = dict(causal=True, load_balance=None)
    assert ring_block_plan(1, 3, 4, **c) == []
    assert ring_block_plan(3, 1, 4, **c) == [BlockTask(slice(0, 1), slice(0, 1), "full")]
    assert ring_block_plan(0, 3, 4, causal=False, load_balance="zigzag", local_len=6) == [
        BlockTask(slice(0, 6), slice(0, 6), "full")]


# ------------------------------------------------------------------ selection & errors


def test_select_impl_cpu_and_env_override(monkeypatch):
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        q = torch.zeros(1, 1, 2, 4, dtype=dtype)
        assert select_impl(q, q, q, "causal") == "cpu_flash"
        assert select_impl(q, q, q, backward=True) == "cpu_flash"
    q = torch.zeros(1, 1, 2, 4)
    assert select_impl(q, q, q, impl="math") == "math"
    monkeypatch.setenv("DTP_BLOCKWISE_IMPL", "math")
    assert select_impl(q, q, q) == "math"
    assert select_impl(q, q, q, impl="fused") == "cpu_flash"  # explicit beats the env
    monkeypatch.setenv("DTP_BLOCKWISE_IMPL", "bogus")
    with pytest.raises(ValueError, match="DTP_BLOCKWISE_IMPL"):
        select_impl(q, q, q)


def test_value_errors():
    # The whole message, anchored: what was wrong, the rule, the values, the remainder and what is valid.
    message = ("zigzag load balancing cuts the sequence into 2*cp chunks, so seq_len must be divisible by 2*cp; "
               "got seq_len=10, cp=3 (seq_len % 6 = 4); valid: seq_len a multiple of 6 "
               "(load_balance=None needs a multiple of 3)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        zigzag_permutation(10, 3)
    with pytest.raises(ValueError, match="seq_len=12") as e:
        to_cp_order(torch.zeros(12), 0, 4, "zigzag")
    assert "cp=4" in str(e.value) and "2*cp" in str(e.value)
    with pytest.raises(ValueError, match="seq_len=10, cp=4"):
        to_cp_order(torch.zeros(10), 0, 4, None)
    with pytest.raises(ValueError, match="load_balance"):
        to_cp_order(torch.zeros(8), 0, 2, "roundrobin")
    with pytest.raises(ValueError, match="cp"):
        zigzag_permutation(8, 0)
    with pytest.raises(ValueError, match="rank"):
        ring_block_plan(2, 0, 2, causal=True, load_balance=None)
    with pytest.raises(ValueError, match="local_len"):
        ring_block_plan(0, 0, 2, causal=True, load_balance="zigzag", local_len=5)
    q, k, v = qkv(1, 3, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        block_forward(q, k, v)
    q, k, v = qkv(1, 2, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="mask"):
        block_forward(q, k, v, mask="sliding")
    with pytest.raises(ValueError, match="impl"):
        block_forward(q, k, v, impl="triton")
    with pytest.raises(RuntimeError, match="empty block"):
        block_forward(q, k[:, :, :0], v[:, :, :0], impl="fused")
    with pytest.raises(ValueError, match="seq_len=12, cp=8"):
        simulate_ring_attention(*qkv(1, 2, 2, 12, 12, 4), cp=8, causal=True, load_balance="zigzag")


@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 7, 7), (1, 6, 3, 5, 9)])  # (b, hq, hkv, sq, sk), GQA
def test_math_backward_tiles_rows_without_changing_the_result(monkeypatch, mask, shape):
    """The math backward (the path where no fused block backward exists, e.g. CUDA) works
    through the query rows in tiles: one row at a time gives the untiled gradients."""
    import dtp.ops.blockwise as B

    b, hq, hkv, sq, sk = shape
    if mask == "causal" and sq != sk:
        sk = sq
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, hq, sq, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, hkv, sk, 8, dtype=torch.float64, generator=g) for _ in range(2))
    out, lse = block_forward(q, k, v, mask=mask, impl="math")
    dout = torch.randn(out.shape, dtype=torch.float64, generator=g)
    whole = block_backward(dout, q, k, v, out, lse, mask=mask, impl="math")
    monkeypatch.setattr(B, "MATH_TILE_ELEMENTS", 1)  # one query row per tile
    tiled = block_backward(dout, q, k, v, out, lse, mask=mask, impl="math")
    for a, t in zip(whole, tiled):
        torch.testing.assert_close(t, a, rtol=1e-12, atol=1e-12)
    # and against autograd through plain SDPA
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qa, ka, va, is_causal=mask == "causal", enable_gqa=True)
    ref.backward(dout)
    for t, r in zip(tiled, (qa.grad, ka.grad, va.grad)):
        torch.testing.assert_close(t, r, rtol=1e-10, atol=1e-10)
