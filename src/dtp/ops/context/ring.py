"""Ring and double-ring attention: K/V blocks travel round the cp ring (an inner ring
inside windows and an outer ring across them for the double ring), partial outputs
merge by log-sum-exp, dK/dV travel back with the blocks in backward."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...core import comm
from ...layouts import check_window
from ...core.mesh.devices import axis_coordinate, block_index
from ...core.redistribute import local_map
from ...core.spec import P
from ..blockwise import accum_dtype, block_backward, block_forward, merge_into, ring_block_plan, softmax_scale
from ._docs import Docs
from ._common import (
    _check_axis_name,
    _check_chunks,
    _check_inputs,
    _kv_bytes,
    _Layout,
    _traced,
    _unflatten,
)

__all__ = ["ring_attention", "double_ring_attention"]


@dataclass(frozen=True)
class _Ring:
    """A (double) ring: ``n`` ranks, inner rings of ``w`` consecutive ring coordinates on
    mesh axis ``inner``, the ``n // w`` windows in an outer ring on axis ``outer``."""

    mesh: DeviceMesh
    inner: str
    outer: str | None
    n: int
    w: int
    rank: int  # ring coordinate = outer coordinate * w + inner coordinate
    docs: Docs | None = field(default=None, compare=False)  # packed documents: masks per tile

    def tasks(self, src: int, causal: bool, load_balance: str | None, L: int, phase: str) -> list:
        """The blocks to compute against ``src``'s K/V: the zigzag/causal plan, or with
        packed documents the tiles some document spans (each with its mask)."""
        if self.docs is not None:
            return self.docs.tasks(self.rank, src, phase)
        return ring_block_plan(self.rank, src, self.n, causal=causal, load_balance=load_balance, local_len=L)

    @property
    def n_out(self) -> int:
        return self.n // self.w

    def src(self, t: int, s: int) -> int:
        """Ring coordinate whose K/V block this rank holds at outer round t, inner step s."""
        o, i = divmod(self.rank, self.w)
        return ((o - t) % self.n_out) * self.w + (i - s) % self.w


def _send(x: torch.Tensor, ring: _Ring, axis: str | None, tag: str) -> comm.CommHandle:
    assert axis is not None
    return comm.send_recv(x, ring.mesh, axis, shift=1, async_op=True, tag=tag)


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring, causal: bool,
                  load_balance: str | None, scale: float, out_to: torch.Tensor, lse_to: torch.Tensor,
                  first: int = 0) -> None:
    """One ring over one head chunk, writing the output into ``out_to`` (like ``q``) and
    the LSE into ``lse_to`` (accumulation dtype). When ``q``'s dtype is the accumulation
    dtype the merge runs in ``out_to`` itself: no chunk-sized accumulator. ``first`` is
    this chunk's first step number, so tags and trace steps stay unique across chunks."""
    L = q.shape[2]
    acc = accum_dtype(q.dtype)
    out: torch.Tensor | None = None  # the accumulators start as the diagonal block's result
    block: torch.Tensor | None = torch.stack([k, v])  # one buffer per transfer: (2, b, h_kv, L, d)
    step = first
    for t in range(ring.n_out):
        assert block is not None
        # Outer ring: this round's first block goes on to the next window while the whole
        # inner round computes (prefetch), arriving as the next round's first block.
        tag_t = first // ring.w + t
        outer = _send(block, ring, ring.outer, f"ring fwd outer {tag_t}") if t + 1 < ring.n_out else None
        cur, block = block, None  # the transfers hold what they send; keep no stale block
        for s in range(ring.w):
            nxt = _send(cur, ring, ring.inner, f"ring fwd step {step}") if s + 1 < ring.w else None
            src = ring.src(t, s)
            tasks = ring.tasks(src, causal, load_balance, L, "fwd")
            with _traced("fwd", step, src, tasks):
                for task in tasks:
                    qs, ks, rb = task.q_slice, task.k_slice, task.rows
                    ob, lb = block_forward(q[rb, :, qs], cur[0][rb, :, ks], cur[1][rb, :, ks], scale=scale,
                                           mask=task.mask)  # type: ignore[arg-type]
                    if out is None:
                        # Step 0 is this rank's own block: one task over every row (causal
                        # or not), so every accumulator row is non-empty from here on. With
                        # packed documents its diagonal tiles come first instead, each of
                        # whose rows sees itself: merged into an empty accumulator (w = 1).
                        assert src == ring.rank
                        out = out_to if out_to.dtype == acc else torch.empty(q.shape, dtype=acc, device=q.device)
                        if qs == slice(0, L) and rb == slice(None):
                            out.copy_(ob)
                            lse_to.copy_(lb)
                        else:
                            out.zero_()
                            lse_to.fill_(float("-inf"))
                            merge_into(out[rb, :, qs], lse_to[rb, :, qs], ob, lb)
                    else:
                        merge_into(out[rb, :, qs], lse_to[rb, :, qs], ob, lb)
                    del ob, lb
            if nxt is not None:
                cur = nxt.wait()
            step += 1
        del cur
        if outer is not None:
            block = outer.wait()
    assert out is not None
    if out is not out_to:
        out_to.copy_(out)


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, ring: _Ring, causal: bool, load_balance: str | None,
                   scale: float, dq_to: torch.Tensor, first: int = 0) -> torch.Tensor:
    """ring-flash-attention's scheme, generalised to the double ring.

    K/V recirculate exactly as in forward. The gradient of a block travels one step
    behind it: after computing block ``src`` a rank adds its dK/dV contribution to the
    partial it received (from the rank that had ``src`` one step earlier) and sends the
    sum on to the rank that has ``src`` next. After a full inner round the partial is back
    at the rank that held the block at the round's start; the outer ring then carries it
    (prefetched over the next round) to the next window, and after the last round one
    more outer hop brings it home. Partials are in the accumulation dtype (fp32, or
    fp64 for fp64).

    Memory: this is where a ring rank peaks, so buffers are few and short-lived. The
    received partial is the next partial (the step's dK/dV are added into it in place,
    no fresh buffer per step); each block-kernel result is added and dropped at once;
    no reference keeps a K/V block alive after its transfer and compute are done. Live
    at a step: 2 received K/V blocks (computing, arriving; the rank's own stacked copy
    goes after the first step) and 2 dK/dV partials (leaving, arriving) plus one block's
    kernel outputs, all of one head chunk.

    dQ accumulates into ``dq_to`` (zeroed here; a chunk-sized accumulator only when
    ``q``'s dtype is not the accumulation dtype); returns this rank's own ``(dK, dV)``
    stacked, in the accumulation dtype.
    """
    L = q.shape[2]
    acc = accum_dtype(q.dtype)
    dq = dq_to.zero_() if dq_to.dtype == acc else torch.zeros(q.shape, dtype=acc, device=q.device)
    block: torch.Tensor | None = torch.stack([k, v])
    step = first
    carried: comm.CommHandle | None = None  # dK/dV partial on the outer ring
    dkv: torch.Tensor | None = None
    for t in range(ring.n_out):
        assert block is not None
        tag_t = first // ring.w + t
        outer = _send(block, ring, ring.outer, f"ring bwd outer {tag_t}") if t + 1 < ring.n_out else None
        cur, block = block, None
        partial: comm.CommHandle | None = None  # dK/dV partial on the inner ring
        for s in range(ring.w):
            nxt = _send(cur, ring, ring.inner, f"ring bwd step {step}") if s + 1 < ring.w else None
            src = ring.src(t, s)
            tasks = ring.tasks(src, causal, load_balance, L, "bwd")
            # The first step of an inner round starts a partial; later steps hold their
            # block's (few) kernel results until the incoming partial lands, then add.
            grad = torch.zeros(cur.shape, dtype=acc, device=cur.device) if partial is None else None
            pending: list[tuple[slice, slice, torch.Tensor, torch.Tensor]] = []
            with _traced("bwd", step, src, tasks):
                for task in tasks:
                    qs, ks, rb = task.q_slice, task.k_slice, task.rows
                    gq, gk, gv = block_backward(dout[rb, :, qs], q[rb, :, qs], cur[0][rb, :, ks], cur[1][rb, :, ks],
                                                out[rb, :, qs], lse[rb, :, qs], scale=scale,
                                                mask=task.mask)  # type: ignore[arg-type]
                    dq[rb, :, qs] += gq
                    del gq
                    if grad is not None:
                        grad[0][rb, :, ks] += gk
                        grad[1][rb, :, ks] += gv
                    else:
                        pending.append((rb, ks, gk, gv))
                    del gk, gv
            if grad is None:
                assert partial is not None
                grad = partial.wait()  # also completes our previous send: that buffer is free
                for rb, ks, gk, gv in pending:
                    grad[0][rb, :, ks] += gk
                    grad[1][rb, :, ks] += gv
                pending.clear()
            # A ring of one (packed documents' tiles over a Ulysses-gathered sequence) keeps it.
            partial = _send(grad, ring, ring.inner, f"ring bwd dkv step {step}") if ring.w > 1 \
                else comm.CommHandle(None, None, lambda g=grad: g)
            del grad
            if nxt is not None:
                cur = nxt.wait()
            step += 1
        del cur
        assert partial is not None
        round_grad = partial.wait()  # this round's first block, summed over the window
        del partial
        if carried is not None:
            round_grad += carried.wait()
        if ring.outer is None:
            carried = None
            dkv = round_grad
        else:
            carried = _send(round_grad, ring, ring.outer, f"ring bwd dkv outer {tag_t}")
        del round_grad
        if outer is not None:
            block = outer.wait()
    if carried is not None:
        dkv = carried.wait()  # the last outer hop brings this rank's own block home
    assert dkv is not None
    if dq is not dq_to:
        dq_to.copy_(dq)
    return dkv


def _head_chunks(hq: int, hkv: int, chunks: int) -> list[tuple[slice, slice]]:
    """``chunks`` groups of whole GQA groups: (query-head slice, kv-head slice) pairs."""
    gk, g = hkv // chunks, hq // hkv
    return [(slice(c * gk * g, (c + 1) * gk * g), slice(c * gk, (c + 1) * gk)) for c in range(chunks)]


class _RingAttention(torch.autograd.Function):
    """Ring attention on local tensors, one ring per head chunk (attention is independent
    per head, so each chunk's ring is exact on its own). Only a chunk's K/V blocks,
    partials and kernel results are live at a time, which is what bounds a rank's memory
    above its inputs, output and gradients; every chunk moves 1/chunks of the bytes."""

    @staticmethod
    def forward(ctx, q, k, v, ring, causal, load_balance, scale, chunks):  # type: ignore[override]
        b, hq, L, _ = q.shape
        out = torch.empty_like(q)
        lse = torch.empty((b, hq, L), dtype=accum_dtype(q.dtype), device=q.device)
        for c, (qh, kh) in enumerate(_head_chunks(hq, k.shape[1], chunks)):
            _ring_forward(q[:, qh], k[:, kh], v[:, kh], ring, causal, load_balance, scale, out[:, qh], lse[:, qh],
                          first=c * ring.n)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (ring, causal, load_balance, scale, chunks)
        return out

    @staticmethod
    @once_differentiable  # the collectives inside are not differentiable: say so, not a silent zero
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, load_balance, scale, chunks = ctx.cfg
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for c, (qh, kh) in enumerate(_head_chunks(q.shape[1], k.shape[1], chunks)):
            dkv = _ring_backward(dout[:, qh], q[:, qh], k[:, kh], v[:, kh], out[:, qh], lse[:, qh], ring, causal,
                                 load_balance, scale, dq[:, qh], first=c * ring.n)
            dk[:, kh], dv[:, kh] = dkv[0], dkv[1]
            del dkv
        return dq, dk, dv, None, None, None, None, None


def _ring_local(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, ring: _Ring, causal: bool,
                load_balance: str | None, scale: float | None, chunks: int) -> torch.Tensor:
    if ring.n == 1:
        # A ring of one sends nothing, and its one block is exactly SDPA on the local
        # sequence (cp order of one rank is the identity): the fused kernel, no ring
        # buffers, the same memory as a plain SDPA call. (enable_gqa a branch, not the
        # comparison: see dtp.ops.attention._sdpa.)
        return F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal, scale=scale,
                                              enable_gqa=True if kl.shape[1] != ql.shape[1] else False)
    return _RingAttention.apply(ql, kl, vl, ring, causal, load_balance, softmax_scale(scale, ql.shape[-1]), chunks)


def _ring_dtensor(q: DTensor, k: DTensor, v: DTensor, lay: _Layout, ring: _Ring, causal: bool,
                  load_balance: str | None, scale: float | None, chunks: int,
                  docs: tuple[DTensor, DTensor] | None = None) -> DTensor:
    def local(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, *doc: torch.Tensor) -> torch.Tensor:
        r = ring
        if doc:  # (batch, seq) ids and positions of the whole sequence, data order
            L = ql.shape[2]
            ids, pos = (tuple(t[:, c * L:(c + 1) * L] for c in range(ring.n)) for t in doc)
            r = replace(ring, docs=Docs(ids, pos, causal))
            if ring.n == 1:
                return _RingAttention.apply(ql, kl, vl, r, causal, load_balance,
                                            softmax_scale(scale, ql.shape[-1]), chunks)
        return _ring_local(ql, kl, vl, r, causal, load_balance, scale, chunks)

    # The output is laid out like q (checked inputs, same local shape on every rank).
    if docs is None:
        return local_map(local, (None, None, None), lay.spec, check_shapes=False)(q, k, v)
    whole = P(lay.spec.dims[0] if lay.spec.dims else None)  # batch as q's, the sequence gathered
    return local_map(local, (None, None, None, whole, whole), lay.spec, check_shapes=False)(q, k, v, *docs)


def ring_attention(q: DTensor, k: DTensor, v: DTensor, *, axis: str = "cp", causal: bool = True,
                   scale: float | None = None, load_balance: str | None = "zigzag",
                   head_chunks: int | None = None, docs: tuple[DTensor, DTensor] | None = None) -> DTensor:
    """Ring attention over mesh axis ``axis`` (Megatron-CP / ring-flash-attention).

    Each rank keeps its Q block; the K/V blocks (one ``(2, b, h_kv, s/cp, d)`` buffer)
    travel round the ring with :func:`dtp.comm.send_recv`: at step ``i`` the transfer that
    brings step ``i+1``'s block is posted (tag ``"ring fwd step {i}"``) *before* step
    ``i``'s block is computed. Which sub-blocks are computed comes from
    :func:`~dtp.ops.blockwise.ring_block_plan` (causal + zigzag: every rank does the same
    work); partial outputs are merged by log-sum-exp in fp32 (fp64 stays fp64).
    Forward moves ``cp-1`` blocks of K+V per rank; backward ``cp-1`` K/V blocks plus ``cp``
    dK/dV partials (accumulation dtype) that travel with them back to their owner.

    Heads are independent, so the ring runs once per chunk of ``head_chunks`` kv heads
    (with their query heads), one chunk after the other: the same bytes in ``chunks``
    times as many transfers, and a rank's ring buffers (2 K/V blocks, 2 dK/dV partials,
    one block's kernel results at its backward peak) are a chunk's, not all heads'.
    ``None`` is :func:`default_chunks`: the fewest chunks with chunks × cp >= 16 that
    keep each chunk's K+V hop at least 1 MiB (small problems: one chunk); ``1`` is
    Megatron's schedule. Tags and trace steps number on across chunks (chunk ``c``
    starts at step ``c·cp``). A ring of one sends nothing and is one plain SDPA call.

    ``docs``: packed documents, the ``(documents, positions)`` batch entries laid out
    like the tokens (:mod:`dtp.ops.documents`): a query sees the keys of its own
    document only; tiles no document spans are skipped (:func:`block_counts`).

    A ring of more than one rank sends point to point, which needs real ranks
    (``dtp.testing.run``), not ``simulate``: tests/test_context.py runs rings of 2 to 8;
    the example is a ring of one.

    >>> mesh = make_mesh(cp=1)
    >>> q = k = v = dtp.shard(torch.randn(1, 4, 16, 8), mesh, P(None, None, "cp"))  # (batch, heads, seq, dim)
    >>> out = ring_attention(q, k, v, axis="cp", load_balance="zigzag")
    >>> out.shape, dtp.spec_of(out)
    (torch.Size([1, 4, 16, 8]), P(None, None, 'cp'))
    """
    fn = "ring_attention"
    axis = _check_axis_name(fn, axis)
    lay = _check_inputs(fn, q, k, v, (axis,), load_balance)
    chunks = _check_chunks(fn, head_chunks, k.shape[1] // lay.tp, lay.cp, _kv_bytes(k))
    ring = _Ring(lay.mesh, axis, None, lay.cp, lay.cp, axis_coordinate(lay.mesh, axis))
    return _ring_dtensor(q, k, v, lay, ring, causal, load_balance, scale, chunks, docs)


def double_ring_attention(q: DTensor, k: DTensor, v: DTensor, *, window: int, axis: str = "cp",
                          causal: bool = True, scale: float | None = None,
                          load_balance: str | None = "zigzag", head_chunks: int | None = None,
                          docs: tuple[DTensor, DTensor] | None = None) -> DTensor:
    """MindSpeed's double-ring attention over ``axis`` with windows of ``window`` ranks.

    The cp ranks form ``cp / window`` windows of ``window`` consecutive ranks (on one node,
    say). Within a window K/V go round an inner ring; across windows an outer ring moves
    each window's blocks to the next window, the transfer posted at the start of an inner
    round and needed only at its end (prefetched). Results and bytes equal the plain
    ring's (``cp-1`` K/V blocks forward); backward carries dK/dV partials inner round by
    inner round and then across windows (``cp + cp/window`` partial transfers).

    The two rings run on a cached view of the mesh with ``axis`` split into
    ``{axis}_outer`` (size ``cp/window``) and ``{axis}_inner`` (size ``window``), the names
    the comm log shows. Needs ``1 < window < cp`` and ``cp % window == 0``
    (:func:`dtp.layouts.check_window`: cp 2 has no double ring). ``docs`` as for
    :func:`ring_attention`.

    Not run as a doctest: the ring sends point to point, which needs real ranks
    (``dtp.testing.run``), not ``simulate``; tests/test_context.py runs it.

    >>> out = double_ring_attention(q, k, v, window=2)  # doctest: +SKIP
    """
    fn = "double_ring_attention"
    axis = _check_axis_name(fn, axis)
    lay = _check_inputs(fn, q, k, v, (axis,), load_balance)
    w = check_window(window, lay.cp, algo="double_ring", what=fn)
    chunks = _check_chunks(fn, head_chunks, k.shape[1] // lay.tp, lay.cp, _kv_bytes(k))
    view, (outer, inner) = _unflatten(lay.mesh, axis, (lay.cp // w, w), ("outer", "inner"))
    rank = block_index(view, (outer, inner))
    ring = _Ring(view, inner, outer, lay.cp, w, rank)
    return _ring_dtensor(q, k, v, lay, ring, causal, load_balance, scale, chunks, docs)
