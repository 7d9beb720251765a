"""DeepSpeed-Ulysses attention (and the Ulysses half of the hybrid): all-to-all from a
sequence split to a head split, attention on the gathered sequence (or a ring over it,
for USP), all-to-all back, head chunk by head chunk."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...core import comm
from ...core._torch import make_saved_tensor, unpack_saved
from ...core.redistribute import local_map
from ..blockwise import accum_dtype, block_backward, block_forward, select_impl, softmax_scale
from ...core.spec import P
from ._docs import Docs, gathered
from ._common import _check_axis_name, _check_heads, _check_inputs, _check_ulysses_chunks, _Layout
from .ring import _Ring, _ring_backward, _ring_forward

__all__ = ["ulysses_attention"]


@dataclass(frozen=True)
class _UlyssesPlan:
    """How a Ulysses all-to-all (and the attention behind it) runs on this rank."""

    mesh: DeviceMesh
    axis: str  # the Ulysses axis: sequence pieces gathered, heads split over its u ranks
    u: int
    repeat: int  # each kv head repeated this many times before the split (GQA, kv heads < u)
    chunks: int  # head chunks, one after the other (each needs 1/chunks of the buffers)
    zigzag: bool  # pieces hold zigzag halves: place them by position when gathering
    causal: bool
    scale: float
    ring: _Ring | None  # None: attention on the gathered sequence; else a ring over it (USP)
    load_balance: str | None

    @property
    def mask(self) -> str:
        """The block mask of attention over the whole gathered sequence."""
        return "causal" if self.causal else "full"


def _slots(u: int, L: int, zigzag: bool) -> list[list[tuple[slice, slice]]]:
    """Where each rank's sequence piece (length ``L``) goes in the gathered sequence:
    ``[(gathered slice, piece slice), ...]`` per rank ``j``.

    Contiguous pieces go side by side. With zigzag, piece ``j`` holds chunks ``j`` and
    ``2u-1-j`` of ``2u``: its halves go to slots ``j`` and ``2u-1-j``, which is the
    original order for Ulysses and, inside a hybrid ring group (whose pieces are runs of
    the global zigzag), the zigzag order over the ring degree that the ring expects.
    """
    if not zigzag:
        return [[(slice(j * L, (j + 1) * L), slice(0, L))] for j in range(u)]
    h = L // 2
    return [[(slice(j * h, (j + 1) * h), slice(0, h)), (slice((2 * u - 1 - j) * h, (2 * u - j) * h), slice(h, L))]
            for j in range(u)]


def _post_to_heads(x: torch.Tensor, plan: _UlyssesPlan, c: int, tag: str) -> comm.CommHandle:
    """Post head chunk ``c`` of local ``x`` ``(b, H, L, d)`` to the head split: rank ``j``
    gets heads ``[j·H/u, (j+1)·H/u)`` of the chunk, every rank's sequence piece arrives."""
    send = x.unflatten(1, (plan.u, plan.chunks, -1))[:, :, c].transpose(0, 1).contiguous()  # (u, b, h, L, d)
    return comm.all_to_all(send, plan.mesh, plan.axis, split_dim=0, concat_dim=0, async_op=True, tag=tag)


def _gather_seq(recv: torch.Tensor, plan: _UlyssesPlan) -> torch.Tensor:
    """``(u, b, h, L, d)`` pieces → ``(b, h, u·L, d)`` in the order attention runs in."""
    u, b, h, L, d = recv.shape
    out = recv.new_empty((b, h, u * L, d))
    for j, places in enumerate(_slots(u, L, plan.zigzag)):
        for dst, src in places:
            out[:, :, dst] = recv[j, :, :, src]
    return out


def _post_to_seq(x: torch.Tensor, plan: _UlyssesPlan, tag: str) -> comm.CommHandle:
    """The way back: ``(b, h, u·L, d)`` → each rank's sequence piece of these heads."""
    b, h, S, d = x.shape
    L = S // plan.u
    send = x.new_empty((plan.u, b, h, L, d))
    for j, places in enumerate(_slots(plan.u, L, plan.zigzag)):
        for dst, src in places:
            send[j, :, :, src] = x[:, :, dst]
    return comm.all_to_all(send, plan.mesh, plan.axis, split_dim=0, concat_dim=0, async_op=True, tag=tag)


def _put(into: torch.Tensor, piece: torch.Tensor, plan: _UlyssesPlan, c: int) -> None:
    """Write a ``(u, b, h, L, d)`` piece (rank j's heads of chunk c) into local ``into``."""
    into.unflatten(1, (plan.u, plan.chunks, -1))[:, :, c] = piece.transpose(0, 1)


def _land(handle: comm.CommHandle, into: torch.Tensor, plan: _UlyssesPlan, c: int) -> None:
    """:func:`_put` an all-to-all's result once it has arrived."""
    _put(into, handle.wait(), plan, c)


def _inner_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _UlyssesPlan,
                   c: int) -> tuple[torch.Tensor, torch.Tensor]:
    if plan.ring is None:
        return block_forward(q, k, v, scale=plan.scale, mask=plan.mask)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=accum_dtype(q.dtype), device=q.device)
    _ring_forward(q, k, v, plan.ring, plan.causal, plan.load_balance, plan.scale, out, lse, first=c * plan.ring.n)
    return out, lse


def _recomputes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _UlyssesPlan) -> bool:
    """Whether a Ulysses chunk's backward recomputes its attention under SDPA's autograd:
    where no fused block backward exists (CUDA: it would need the forward's RNG state),
    rather than run the (tiled, but unfused) math backward over the whole gathered
    sequence. Then only q/k/v need saving, not the output and LSE."""
    return plan.ring is None and select_impl(q, k, v, plan.mask, backward=True) == "math"


def _recompute_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        plan: _UlyssesPlan) -> tuple[torch.Tensor, ...]:
    """SDPA forward + its own fused backward (O(S) memory, one extra forward). GQA heads
    are repeated first, as the forward does: SDPA's memory-efficient kernel has no GQA,
    and its math fallback would hold S×S weights; autograd sums the copies' gradients."""
    with torch.enable_grad():
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        g = q.shape[1] // k.shape[1]
        kk, vv = (t.repeat_interleave(g, dim=1) if g > 1 else t for t in qkv[1:])
        o = F.scaled_dot_product_attention(qkv[0], kk, vv, is_causal=plan.causal, scale=plan.scale)
        return torch.autograd.grad(o, qkv, dout)


def _inner_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, plan: _UlyssesPlan, c: int) -> tuple[torch.Tensor, ...]:
    if plan.ring is None:
        return block_backward(dout, q, k, v, out, lse, scale=plan.scale, mask=plan.mask)
    dq = torch.empty_like(q)
    dkv = _ring_backward(dout, q, k, v, out, lse, plan.ring, plan.causal, plan.load_balance, plan.scale, dq,
                         first=c * plan.ring.n)
    return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _save(t: torch.Tensor) -> object:
    """Save ``t`` for backward the way ``ctx.save_for_backward`` does -- through the active
    saved-tensors hooks, so full recompute (non-reentrant checkpoint) and CPU offload see
    it -- but as an object of our own that backward can drop early. Plain tensors when
    this torch has no such constructor."""
    return make_saved_tensor(t)


def _unpack(saved: object) -> torch.Tensor:
    return unpack_saved(saved)


class _UlyssesAttention(torch.autograd.Function):
    """Ulysses (and the hybrid's Ulysses part) on local tensors, head chunk by head chunk.

    Per chunk: all-to-all q/k/v to the head split, attention, all-to-all back. The next
    chunk's all-to-alls are posted before this chunk's attention runs and the output's
    all-to-all is waited for one chunk later, so transfers overlap compute. Backward
    walks the chunks again and drops each chunk's saved tensors as soon as its gradients
    are computed, so the gathered copies shrink while the gradients grow; it keeps its
    kernel, where it peaks, free of buffers in flight (see the comment there).

    Saved tensors go through the saved-tensors hooks like ``save_for_backward``'s (see
    :func:`_save`), so full recompute and offload apply to them; nothing is saved under
    ``no_grad``. Dropping them early means one backward per forward: a second one
    (``retain_graph=True``) raises ``RuntimeError``. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, plan, grad_enabled):  # type: ignore[override]
        r, C = plan.repeat, plan.chunks
        kr, vr = (t.repeat_interleave(r, dim=1) if r > 1 else t for t in (k, v))
        out = torch.empty_like(q)
        # Nothing to save when no gradient is wanted (grad mode as the caller had it:
        # inside forward it is always off).
        keep = grad_enabled and any(ctx.needs_input_grad[:3])
        saved: list[list[object] | None] = []
        recompute = False

        def post(c: int) -> list[comm.CommHandle]:
            return [_post_to_heads(t, plan, c, f"ulysses {n} {c}") for n, t in (("q", q), ("k", kr), ("v", vr))]

        pending, back = post(0), None
        for c in range(C):
            q2, k2, v2 = (_gather_seq(h.wait(), plan) for h in pending)
            pending = post(c + 1) if c + 1 < C else []
            o2, l2 = _inner_forward(q2, k2, v2, plan, c)
            if keep:
                recompute = _recomputes(q2, k2, v2, plan)  # the same for every chunk
                saved.append([_save(t) for t in ((q2, k2, v2) if recompute else (q2, k2, v2, o2, l2))])
            if back is not None:
                _land(back, out, plan, c - 1)
            back = _post_to_seq(o2, plan, f"ulysses out {c}")
            del q2, k2, v2, o2, l2
        del kr, vr
        assert back is not None
        _land(back, out, plan, C - 1)
        ctx.saved_chunks, ctx.plan, ctx.kv, ctx.recompute = saved, plan, (k.shape, k.dtype), recompute
        return out

    @staticmethod
    @once_differentiable  # the collectives inside are not differentiable: say so, not a silent zero
    def backward(ctx, dout):  # type: ignore[override]
        plan, saved = ctx.plan, ctx.saved_chunks
        (b, hk, L, d), kv_dtype = ctx.kv
        r, C = plan.repeat, plan.chunks
        # Each chunk's gradients land as (u, b, h, L, d) pieces; the whole dQ/dK/dV are
        # assembled only at the end, when every chunk's saved tensors are gone.
        landed: list[list[torch.Tensor]] = [[], [], []]
        if any(chunk is None for chunk in saved):  # checked before any collective
            raise RuntimeError(
                "ulysses/hybrid attention: backward through this graph a second time. Its backward "
                "frees each head chunk's saved tensors as soon as that chunk's gradients exist (that is "
                "what keeps its memory near 1/cp), so backward(retain_graph=True) twice is not supported")
        # Backward peaks at the kernel, so nothing else is in flight there: the previous
        # chunk's dQ/dK/dV all-to-alls land before it (they overlap the dO all-to-all and
        # its gather), and the next chunk's dO is posted after it. Forward, which peaks
        # lower, overlaps the next chunk's q/k/v all-to-alls with the kernel instead.
        pending = _post_to_heads(dout, plan, 0, "ulysses dout 0")
        backs: list[comm.CommHandle] = []
        for c in range(C):
            do2 = _gather_seq(pending.wait(), plan)
            del pending  # its receive buffer too: the kernel below is where backward peaks
            for pieces, h in zip(landed, backs):
                pieces.append(h.wait())
            backs = []
            chunk = saved[c]
            assert chunk is not None
            saved[c] = None  # this chunk's gathered q/k/v/out go as soon as its gradients exist
            tensors = [_unpack(t) for t in chunk]
            del chunk
            if ctx.recompute:
                grads = list(_recompute_backward(do2, *tensors, plan))
            else:
                grads = list(_inner_backward(do2, *tensors, plan, c))
            del tensors, do2
            if c + 1 < C:
                pending = _post_to_heads(dout, plan, c + 1, f"ulysses dout {c + 1}")
            for i, n in enumerate("qkv"):
                backs.append(_post_to_seq(grads[i], plan, f"ulysses d{n} {c}"))
                grads[i] = None  # type: ignore[call-overload]
        for pieces, h in zip(landed, backs):
            pieces.append(h.wait())
        del backs
        dq = _assemble(landed[0], (b, dout.shape[1], L, d), dout.dtype, plan)
        dk, dv = (_assemble(landed[i], (b, hk * r, L, d), kv_dtype, plan) for i in (1, 2))
        if r > 1:  # the copies of a repeated kv head sum into it
            dk, dv = (t.unflatten(1, (hk, r)).sum(2) for t in (dk, dv))
        return dq, dk, dv, None, None


def _assemble(pieces: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
              plan: _UlyssesPlan) -> torch.Tensor:
    """Chunk c's landed ``(u, b, h, L, d)`` → heads ``[j, c]`` of a local tensor, each
    piece freed as soon as it is copied."""
    out = torch.empty(shape, dtype=dtype, device=pieces[0].device)
    for c in range(len(pieces)):
        _put(out, pieces[c], plan, c)
        pieces[c] = None  # type: ignore[call-overload]
    return out


def _with_docs(plan: _UlyssesPlan, L: int, ids: torch.Tensor, pos: torch.Tensor) -> _UlyssesPlan:
    """``plan`` with packed documents: the document rows of each ring coordinate's
    gathered sequence (the hybrid), or of the whole gathered sequence (pure Ulysses)."""
    slots = _slots(plan.u, L, plan.zigzag)
    if plan.ring is None:
        # A ring of one over the gathered sequence (it sends nothing): its tiles, 2 per
        # gathered piece, are skipped where no document spans them, as a ring's are.
        gi, gp = (gathered(t, 0, plan.u, L, slots) for t in (ids, pos))
        one = _Ring(plan.mesh, plan.axis, None, 1, 1, 0, Docs((gi,), (gp,), plan.causal, tiles=2 * plan.u))
        return replace(plan, ring=one)
    coords = range(plan.ring.n)  # ring coordinate c gathers cp pieces c·u .. c·u+u-1
    docs = Docs(*(tuple(gathered(t, c * plan.u, plan.u, L, slots) for c in coords) for t in (ids, pos)),
                causal=plan.causal)
    return replace(plan, ring=replace(plan.ring, docs=docs))


def _ulysses_dtensor(q: DTensor, k: DTensor, v: DTensor, lay: _Layout, plan: _UlyssesPlan,
                     docs: tuple[DTensor, DTensor] | None = None) -> DTensor:
    """Ulysses on the local shards of ``q``/``k``/``v`` (laid out as ``lay`` says); the
    collectives run on ``plan.mesh``, which for the hybrid is a view of ``lay.mesh``
    with ``cp`` split into ring and Ulysses sub-axes (the same ranks, the same shards).
    ``docs``: packed documents' ``(documents, positions)``, laid out like the tokens."""
    def local(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, *doc: torch.Tensor) -> torch.Tensor:
        p = _with_docs(plan, ql.shape[2], *doc) if doc else plan
        return _UlyssesAttention.apply(ql, kl, vl, p, torch.is_grad_enabled())

    if docs is None:
        return local_map(local, (None, None, None), lay.spec, check_shapes=False)(q, k, v)
    whole = P(lay.spec.dims[0] if lay.spec.dims else None)  # batch as q's, the sequence gathered
    return local_map(local, (None, None, None, whole, whole), lay.spec, check_shapes=False)(q, k, v, *docs)


def ulysses_attention(q: DTensor, k: DTensor, v: DTensor, *, axis: str = "cp", causal: bool = True,
                      scale: float | None = None, load_balance: str | None = "zigzag",
                      head_chunks: int | None = None, docs: tuple[DTensor, DTensor] | None = None) -> DTensor:
    """DeepSpeed-Ulysses attention: all-to-all over ``axis`` from a sequence split to a
    head split, local attention on the full sequence, all-to-all back.

    ``q``/``k``/``v`` are laid out ``P(batch_axes, head_axes, axis)``; each goes to a
    head split ``P(batch_axes, head_axes + (axis,), None)`` by all-to-all over ``axis``
    (``(cp-1)/cp`` of the local bytes leave the rank) and the output comes back the same
    way: 4 tensors' all-to-alls forward, 4 backward.

    The work runs in ``head_chunks`` chunks of heads (``None``: :func:`default_chunks`,
    the fewest with chunks × cp >= 16 that keep each chunk's K+V at least 1 MiB):
    each chunk's all-to-alls, attention and all-to-all back, the next chunk's
    all-to-alls posted before this chunk's attention so they overlap it.
    The bytes are the same; what a rank holds beyond its inputs, output and gradients is
    one chunk's buffers, plus the gathered q/k/v/out saved for backward (freed chunk by
    chunk as backward goes). ``head_chunks=1`` is the classic 4 all-to-alls.

    The gathered sequence is put in original order as it lands (zigzag pieces' halves
    go to their positions; no index copy), so the causal mask holds for ``"zigzag"`` and
    ``None`` alike; attention is :func:`~dtp.ops.blockwise.block_forward` (the fused SDPA
    kernel that also returns the log-sum-exp, on CPU and CUDA) over the whole sequence,
    and its backward the fused CPU kernel; where no fused block backward exists (CUDA)
    the chunk's attention is recomputed under SDPA's own autograd (fused backward, O(S)
    memory, one extra forward) rather than take the S×S math path.

    Heads must divide by tp × cp (tp: the product of the head axes' sizes). GQA: when the
    kv heads per tp rank (``kv_heads/tp``) divide by cp they are split like the query
    heads. When fewer than cp, each kv head is repeated ``cp / (kv_heads/tp)`` times
    (``repeat_interleave`` on the head dim, before the all-to-all; backward sums the
    copies' gradients) so every rank gets the one kv head its query heads use: rank ``c``
    gets query heads ``[c·hq/cp, (c+1)·hq/cp)``, all in the group of repeated kv head
    ``c``. That needs ``kv_heads/tp`` to divide cp; otherwise ``ValueError``.

    ``docs``: packed documents' ``(documents, positions)`` laid out like the tokens; the
    gathered sequence attends under their mask (:func:`dtp.ops.documents.document_keep`).

    >>> with dtp.testing.simulate(2):
    ...     mesh = make_mesh(cp=2)
    ...     q, k, v = (dtp.shard(torch.randn(1, 4, 16, 8), mesh, P(None, None, "cp")) for _ in range(3))
    ...     out = ulysses_attention(q, k, v, axis="cp")
    >>> tuple(out.shape), dtp.spec_of(out)
    ((1, 4, 16, 8), P(None, None, 'cp'))
    """
    fn = "ulysses_attention"
    axis = _check_axis_name(fn, axis)
    lay = _check_inputs(fn, q, k, v, (axis,), load_balance)
    r = _check_heads(fn, q, k, lay, lay.cp, "cp")
    chunks = _check_ulysses_chunks(fn, head_chunks, k, lay.tp, r, lay.cp, lay.cp)
    plan = _UlyssesPlan(lay.mesh, axis, lay.cp, r, chunks, load_balance == "zigzag", causal,
                        softmax_scale(scale, q.shape[-1]), None, load_balance)
    return _ulysses_dtensor(q, k, v, lay, plan, docs)
