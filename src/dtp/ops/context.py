"""Context-parallel attention: MindSpeed's long-sequence algorithms on DTensors.

All four take ``q``/``k``/``v`` DTensors in SDPA's ``(batch, heads, seq, head_dim)``
layout with the sequence split over a context-parallel mesh axis (``cp``), heads
possibly over tensor parallel axes (``tp``) and the batch over data parallel axes, and
return the output laid out like ``q``:

=========================  ==================================================================
:func:`ulysses_attention`  DeepSpeed-Ulysses: one all-to-all per tensor trades the sequence
                           split for a head split, attention runs on the full sequence and
                           a head subset, one all-to-all brings the output back.
:func:`ring_attention`     K/V travel round the cp ring (one send/recv per step, the next
                           posted before the current block is computed); partial outputs
                           are merged by log-sum-exp. Backward recirculates K/V and carries
                           dK/dV (fp32 for low precision) round the ring back to their owner.
:func:`double_ring_attention`  MindSpeed's double ring: an inner ring inside windows of
                           ``window`` consecutive cp ranks, an outer ring across windows whose
                           transfer is prefetched for a whole inner round.
:func:`hybrid_attention`   USP (Ulysses × ring): Ulysses over groups of ``ulysses_degree``
                           contiguous cp ranks, (double) ring over the strided rest.
=========================  ==================================================================

Sequence order (load balancing)
-------------------------------
With ``load_balance="zigzag"`` (the default) the *global* sequence of the DTensors is in
cp order (:func:`dtp.ops.blockwise.to_cp_order`): rank ``r`` of ``cp`` holds chunks ``r``
and ``2cp-1-r`` of ``2cp`` equal chunks, which balances causal work. The same data order
serves every algorithm here (the data pipeline permutes tokens once, positions for RoPE
come from :func:`dtp.ops.blockwise.zigzag_permutation`); ``load_balance=None`` is the
plain contiguous split. The output is in the same order as the input.

Collectives all go through :mod:`dtp.comm` (recorded by :func:`dtp.comm_log`); ring
sub-axes (double ring windows, the hybrid's ring × Ulysses split of ``cp``) are mesh views
made with ``DeviceMesh._unflatten`` and cached per mesh. Every constraint is checked,
with a ``ValueError`` naming it, on every rank before any collective.

:func:`trace_compute` records when each ring step's block computation started and ended,
so tests can prove the transfers overlap the compute.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import comm
from ..layouts import attended_kv_heads
from ..redistribute import from_local, to_local
from ..spec import P, _sizes, spec_of
from .blockwise import (
    accum_dtype,
    block_backward,
    block_forward,
    merge_into,
    ring_block_plan,
    select_impl,
)

try:  # what torch.utils.checkpoint itself uses to save through the saved-tensors hooks
    from torch._C._autograd import SavedTensor as _SavedTensor
    from torch._C._autograd import _make_saved_tensor
except ImportError:  # pragma: no cover - older or newer torch without it
    _SavedTensor, _make_saved_tensor = None, None  # type: ignore[assignment,misc]

__all__ = [
    "ulysses_attention",
    "ring_attention",
    "double_ring_attention",
    "hybrid_attention",
    "context_attention",
    "default_chunks",
    "ALGORITHMS",
    "trace_compute",
]

_LOAD_BALANCES = ("zigzag", None)


# ------------------------------------------------------------------ compute trace

_trace: list[dict] | None = None


@contextlib.contextmanager
def trace_compute() -> Iterator[list[dict]]:
    """Record every ring step's block computation on this rank.

    Yields a list that fills with one dict per step: ``phase`` ("fwd"/"bwd"), ``step``
    (0-based, over the whole ring), ``src`` (ring coordinate whose K/V block it is),
    ``tasks`` (the :class:`~dtp.ops.blockwise.BlockTask` list run), ``start``/``end``
    (``time.perf_counter()``, the clock of :class:`dtp.comm.CommRecord`).

    >>> with trace_compute() as events:                          # doctest: +SKIP
    ...     out = ring_attention(q, k, v)
    """
    global _trace
    previous, events = _trace, []
    _trace = events
    try:
        yield events
    finally:
        _trace = previous


@contextlib.contextmanager
def _traced(phase: str, step: int, src: int, tasks: list) -> Iterator[None]:
    if _trace is None:
        yield
        return
    start = time.perf_counter()
    yield
    _trace.append({"phase": phase, "step": step, "src": src, "tasks": list(tasks),
                   "start": start, "end": time.perf_counter()})


# --------------------------------------------------------------------- validation


@dataclass(frozen=True)
class _Layout:
    """What the specs of q/k/v say, after validation."""

    mesh: DeviceMesh
    spec: P  # q's spec (k and v share batch/seq/head_dim axes; heads alike)
    batch_axes: tuple[str, ...]
    head_axes: tuple[str, ...]
    seq_axes: tuple[str, ...]
    tp: int  # product of the head axes' sizes
    cp: int  # product of the seq axes' sizes


def _check_inputs(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_axes: tuple[str, ...],
                  load_balance: str | None) -> _Layout:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, DTensor):
            raise TypeError(f"{fn}: {name} must be a DTensor with the sequence split over {seq_axes}, "
                            f"got {type(t).__name__}; use dtp.shard or ops.attention for local tensors")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if not (q.device_mesh is k.device_mesh is v.device_mesh):
        raise ValueError(f"{fn}: q, k and v must live on the same device mesh")
    mesh = q.device_mesh
    sizes = _sizes(mesh)
    for a in seq_axes:
        if a not in sizes:
            raise ValueError(f"{fn}: unknown mesh axis {a!r}; the mesh axes are {tuple(sizes)}")
    if load_balance not in _LOAD_BALANCES:
        raise ValueError(f"{fn}: load_balance must be 'zigzag' or None, got {load_balance!r}")
    qs, ks, vs = spec_of(q), spec_of(k), spec_of(v)
    for name, s in (("q", qs), ("k", ks), ("v", vs)):
        if s.partial:
            raise ValueError(f"{fn}: {name} has pending sums over {s.partial}; reshard it first")
        if s.axes_of(2) != seq_axes:
            raise ValueError(f"{fn}: {name} must split the sequence (dim 2) over exactly {seq_axes}, "
                             f"but its spec is {s}")
        if s.axes_of(3):
            raise ValueError(f"{fn}: {name} splits head_dim over {s.axes_of(3)} (spec {s}); head_dim is never split")
    if ks != vs or qs.axes_of(0) != ks.axes_of(0) or qs.axes_of(1) != ks.axes_of(1):
        raise ValueError(f"{fn}: q {qs}, k {ks} and v {vs} must split batch, heads and sequence alike")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, hq, s, d = q.shape
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(f"{fn}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, sequence or head_dim "
                         "(context-parallel attention is self-attention)")
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"{fn}: {hq} query heads do not group evenly over {hkv} kv heads")
    batch_axes, head_axes = qs.axes_of(0), qs.axes_of(1)
    tp = math.prod(sizes[a] for a in head_axes)
    cp = math.prod(sizes[a] for a in seq_axes)
    if load_balance == "zigzag" and s % (2 * cp):
        raise ValueError(f"{fn}: zigzag load balancing cuts the sequence into 2*cp chunks, so seq must be "
                         f"divisible by 2*cp; got seq={s}, cp={cp} (seq % {2 * cp} = {s % (2 * cp)})")
    if s % cp:  # (check_spec guarantees it for a DTensor; kept for clarity)
        raise ValueError(f"{fn}: seq={s} does not divide by cp={cp}")
    return _Layout(mesh, qs, batch_axes, head_axes, seq_axes, tp, cp)


def _check_heads(fn: str, q: torch.Tensor, k: torch.Tensor, lay: _Layout, degree: int, what: str) -> int:
    """Heads must split over tp × ``degree``; returns the kv-head repeat factor (>= 1)."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq % (lay.tp * degree):
        raise ValueError(f"{fn}: heads={hq} must divide by tp × {what} = {lay.tp} × {degree} "
                         f"(head axes {lay.head_axes or '()'}, tp={lay.tp}, {what}={degree})")
    kv_local = hkv // lay.tp
    if kv_local % degree == 0:
        return 1
    if degree % kv_local == 0:
        return degree // kv_local
    raise ValueError(f"{fn}: {kv_local} kv heads per tp rank (kv_heads={hkv}, tp={lay.tp}) neither divide by nor "
                     f"divide the {what}={degree}; use a {what} that is a multiple or a divisor of the kv heads")


def _check_axis_name(fn: str, axis: object) -> str:
    if not isinstance(axis, str):
        raise ValueError(f"{fn}: axis must be a mesh axis name, got {axis!r}")
    return axis


def _check_window(fn: str, window: object, n: int, what: str = "cp") -> int:
    if not isinstance(window, int) or isinstance(window, bool) or not (1 <= window < n) or n % window:
        raise ValueError(f"{fn}: window must be an int in [1, {what}) dividing {what}={n}, got window={window!r}")
    return window


# ------------------------------------------------------------------ mesh views

_VIEWS: dict[tuple, tuple[DeviceMesh, DeviceMesh]] = {}


def _unflatten(mesh: DeviceMesh, axis: str, sizes: tuple[int, ...], suffixes: tuple[str, ...]) -> tuple[DeviceMesh, tuple[str, ...]]:
    """A view of ``mesh`` with ``axis`` split into sub-axes (row-major: the last is the
    fastest-varying, so coordinate ``c`` of ``axis`` is ``mixed_radix(sub-coordinates)``).

    Creating a view creates process groups (all ranks must call it alike); views are
    cached per (mesh, axis, sizes), so that happens once.
    """
    taken = set(mesh.mesh_dim_names or ())
    names = []
    for s in suffixes:
        name = f"{axis}_{s}"
        while name in taken:
            name += "_"
        names.append(name)
    key = (id(mesh), axis, sizes, tuple(names))
    hit = _VIEWS.get(key)
    if hit is None:
        hit = _VIEWS[key] = (mesh, mesh._unflatten(axis, sizes, tuple(names)))
    return hit[1], tuple(names)


def _coord(mesh: DeviceMesh, axis: str) -> int:
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the mesh")
    return coord[mesh.mesh_dim_names.index(axis)]


def _respec(spec: P, seq_axes: tuple[str, ...], heads_extra: tuple[str, ...] = ()) -> P:
    return P(spec.axes_of(0), spec.axes_of(1) + heads_extra, seq_axes)


# ------------------------------------------------------------------------ Ulysses


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
    return _make_saved_tensor(t, is_output=False) if _make_saved_tensor is not None else t


def _unpack(saved: object) -> torch.Tensor:
    return saved.unpack() if _SavedTensor is not None and isinstance(saved, _SavedTensor) else saved  # type: ignore[return-value]


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


#: The default head chunking makes chunks × cp at least this. A rank's transient
#: buffers (K/V blocks in flight, dK/dV partials, kernel results, all-to-all staging)
#: are about ten of its local q-sized tensors for one chunk, 10 / (cp × chunks) of a
#: full-sequence one: under 10/16 of one, against the ~8.5 that one device's attention
#: forward + backward holds. That keeps a rank's peak within 1/cp + 15% of one device's
#: (benchmarks/context_memory.py).
CHUNK_TARGET = 16

#: ... but by default no chunk's K+V transfer gets smaller than this. Each chunk costs
#: its own transfers, kernel calls and synchronisations (about a millisecond per ring
#: step on CPU/gloo, tens of microseconds on NCCL), which pays off only where the
#: buffers it saves are large; small problems run as one chunk, Megatron's schedule.
MIN_CHUNK_BYTES = 1 << 20


def default_chunks(kv_heads: int, cp: int, kv_bytes: int) -> int:
    """dtp's default ``head_chunks``: the fewest divisor ``c`` of ``kv_heads`` with
    ``c × cp >= CHUNK_TARGET``, among those that keep ``kv_bytes / c`` (the K+V bytes a
    rank sends per hop, or attends with after a Ulysses split) at least
    ``MIN_CHUNK_BYTES``; the largest of those if none reaches the target; 1 if none.

    >>> default_chunks(8, 4, 64 << 20), default_chunks(8, 2, 64 << 20), default_chunks(8, 4, 1 << 20)
    (4, 8, 1)
    """
    fits = [c for c in range(1, kv_heads + 1) if kv_heads % c == 0 and kv_bytes // c >= MIN_CHUNK_BYTES] or [1]
    return next((c for c in fits if c * cp >= CHUNK_TARGET), fits[-1])


def _check_chunks(fn: str, head_chunks: object, kv_heads: int, cp: int, kv_bytes: int,
                  where: str = "ring rank holds") -> int:
    """``head_chunks`` must divide the kv heads a rank attends with; ``None`` is the default."""
    if head_chunks is None:
        return default_chunks(kv_heads, cp, kv_bytes)
    if not isinstance(head_chunks, int) or isinstance(head_chunks, bool) or head_chunks < 1 \
            or kv_heads % head_chunks:
        raise ValueError(f"{fn}: head_chunks must be a positive int dividing the {kv_heads} kv heads each {where} "
                         f"(None: dtp's default, see default_chunks), got head_chunks={head_chunks!r}")
    return head_chunks


def _check_ulysses_chunks(fn: str, head_chunks: object, k: DTensor, tp: int, repeat: int, u: int, cp: int) -> int:
    """Head chunks for Ulysses: they must divide the kv heads a rank has after the split
    (which holds as many K/V bytes as its local shard, times the GQA repeat)."""
    return _check_chunks(fn, head_chunks, attended_kv_heads(k.shape[1] // tp, u), cp, _kv_bytes(k) * repeat,
                         "rank holds after the all-to-all")


def _kv_bytes(k: DTensor) -> int:
    """K+V bytes of this rank's shard: the same on every rank of a cp group (they share
    batch and head coordinates, and the sequence splits evenly), so they all pick the
    same chunks and post the same collectives."""
    with torch.no_grad():  # only its size: no autograd node
        local = to_local(k)
    return 2 * local.numel() * local.element_size()


def _ulysses_dtensor(q: DTensor, k: DTensor, v: DTensor, lay: _Layout, plan: _UlyssesPlan) -> DTensor:
    out = _UlyssesAttention.apply(to_local(q), to_local(k), to_local(v), plan, torch.is_grad_enabled())
    return from_local(out, lay.mesh, lay.spec, tuple(q.shape), name="out")


def ulysses_attention(q: DTensor, k: DTensor, v: DTensor, *, axis: str = "cp", causal: bool = True,
                      scale: float | None = None, load_balance: str | None = "zigzag",
                      head_chunks: int | None = None) -> DTensor:
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

    >>> out = ulysses_attention(q, k, v, axis="cp")             # doctest: +SKIP
    """
    fn = "ulysses_attention"
    axis = _check_axis_name(fn, axis)
    lay = _check_inputs(fn, q, k, v, (axis,), load_balance)
    r = _check_heads(fn, q, k, lay, lay.cp, "cp")
    chunks = _check_ulysses_chunks(fn, head_chunks, k, lay.tp, r, lay.cp, lay.cp)
    plan = _UlyssesPlan(lay.mesh, axis, lay.cp, r, chunks, load_balance == "zigzag", causal,
                        _scale(scale, q.shape[-1]), None, load_balance)
    return _ulysses_dtensor(q, k, v, lay, plan)


# --------------------------------------------------------------------------- ring


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
            tasks = ring_block_plan(ring.rank, src, ring.n, causal=causal, load_balance=load_balance, local_len=L)
            with _traced("fwd", step, src, tasks):
                for task in tasks:
                    qs, ks = task.q_slice, task.k_slice
                    ob, lb = block_forward(q[:, :, qs], cur[0][:, :, ks], cur[1][:, :, ks], scale=scale,
                                           mask=task.mask)  # type: ignore[arg-type]
                    if out is None:
                        # Step 0 is this rank's own block: one task over every row (causal
                        # or not), so every accumulator row is non-empty from here on.
                        assert src == ring.rank and qs == slice(0, L)
                        out = out_to if out_to.dtype == acc else torch.empty(ob.shape, dtype=acc, device=ob.device)
                        out.copy_(ob)
                        lse_to.copy_(lb)
                    else:
                        merge_into(out[:, :, qs], lse_to[:, :, qs], ob, lb)
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
            tasks = ring_block_plan(ring.rank, src, ring.n, causal=causal, load_balance=load_balance, local_len=L)
            # The first step of an inner round starts a partial; later steps hold their
            # block's (few) kernel results until the incoming partial lands, then add.
            grad = torch.zeros(cur.shape, dtype=acc, device=cur.device) if partial is None else None
            pending: list[tuple[slice, torch.Tensor, torch.Tensor]] = []
            with _traced("bwd", step, src, tasks):
                for task in tasks:
                    qs, ks = task.q_slice, task.k_slice
                    gq, gk, gv = block_backward(dout[:, :, qs], q[:, :, qs], cur[0][:, :, ks], cur[1][:, :, ks],
                                                out[:, :, qs], lse[:, :, qs], scale=scale,
                                                mask=task.mask)  # type: ignore[arg-type]
                    dq[:, :, qs] += gq
                    del gq
                    if grad is not None:
                        grad[0][:, :, ks] += gk
                        grad[1][:, :, ks] += gv
                    else:
                        pending.append((ks, gk, gv))
                    del gk, gv
            if grad is None:
                assert partial is not None
                grad = partial.wait()  # also completes our previous send: that buffer is free
                for ks, gk, gv in pending:
                    grad[0][:, :, ks] += gk
                    grad[1][:, :, ks] += gv
                pending.clear()
            partial = _send(grad, ring, ring.inner, f"ring bwd dkv step {step}")
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


def _scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _ring_local(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, ring: _Ring, causal: bool,
                load_balance: str | None, scale: float | None, chunks: int) -> torch.Tensor:
    if ring.n == 1:
        # A ring of one sends nothing, and its one block is exactly SDPA on the local
        # sequence (cp order of one rank is the identity): the fused kernel, no ring
        # buffers, the same memory as a plain SDPA call.
        return F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal, scale=scale,
                                              enable_gqa=kl.shape[1] != ql.shape[1])
    return _RingAttention.apply(ql, kl, vl, ring, causal, load_balance, _scale(scale, ql.shape[-1]), chunks)


def _ring_dtensor(q: DTensor, k: DTensor, v: DTensor, lay: _Layout, ring: _Ring, causal: bool,
                  load_balance: str | None, scale: float | None, chunks: int) -> DTensor:
    out = _ring_local(to_local(q), to_local(k), to_local(v), ring, causal, load_balance, scale, chunks)
    return from_local(out, lay.mesh, lay.spec, tuple(q.shape), name="out")


def ring_attention(q: DTensor, k: DTensor, v: DTensor, *, axis: str = "cp", causal: bool = True,
                   scale: float | None = None, load_balance: str | None = "zigzag",
                   head_chunks: int | None = None) -> DTensor:
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

    >>> out = ring_attention(q, k, v, axis="cp", load_balance="zigzag")   # doctest: +SKIP
    """
    fn = "ring_attention"
    axis = _check_axis_name(fn, axis)
    lay = _check_inputs(fn, q, k, v, (axis,), load_balance)
    chunks = _check_chunks(fn, head_chunks, k.shape[1] // lay.tp, lay.cp, _kv_bytes(k))
    ring = _Ring(lay.mesh, axis, None, lay.cp, lay.cp, _coord(lay.mesh, axis))
    return _ring_dtensor(q, k, v, lay, ring, causal, load_balance, scale, chunks)


def double_ring_attention(q: DTensor, k: DTensor, v: DTensor, *, window: int, axis: str = "cp",
                          causal: bool = True, scale: float | None = None,
                          load_balance: str | None = "zigzag", head_chunks: int | None = None) -> DTensor:
    """MindSpeed's double-ring attention over ``axis`` with windows of ``window`` ranks.

    The cp ranks form ``cp / window`` windows of ``window`` consecutive ranks (on one node,
    say). Within a window K/V go round an inner ring; across windows an outer ring moves
    each window's blocks to the next window, the transfer posted at the start of an inner
    round and needed only at its end (prefetched). Results and bytes equal the plain
    ring's (``cp-1`` K/V blocks forward); backward carries dK/dV partials inner round by
    inner round and then across windows (``cp + cp/window`` partial transfers).

    The two rings run on a cached view of the mesh with ``axis`` split into
    ``{axis}_outer`` (size ``cp/window``) and ``{axis}_inner`` (size ``window``), the names
    the comm log shows. Needs ``1 <= window < cp`` and ``cp % window == 0``.

    >>> out = double_ring_attention(q, k, v, window=2)          # doctest: +SKIP
    """
    fn = "double_ring_attention"
    axis = _check_axis_name(fn, axis)
    lay = _check_inputs(fn, q, k, v, (axis,), load_balance)
    w = _check_window(fn, window, lay.cp)
    chunks = _check_chunks(fn, head_chunks, k.shape[1] // lay.tp, lay.cp, _kv_bytes(k))
    view, (outer, inner) = _unflatten(lay.mesh, axis, (lay.cp // w, w), ("outer", "inner"))
    rank = _coord(view, outer) * w + _coord(view, inner)
    ring = _Ring(view, inner, outer, lay.cp, w, rank)
    return _ring_dtensor(q, k, v, lay, ring, causal, load_balance, scale, chunks)


# ------------------------------------------------------------------------- hybrid


def hybrid_attention(q: DTensor, k: DTensor, v: DTensor, *, ulysses_degree: int | None = None, window: int = 1,
                     axis: str | Sequence[str] = "cp", causal: bool = True, scale: float | None = None,
                     load_balance: str | None = "zigzag", head_chunks: int | None = None) -> DTensor:
    """USP: Ulysses over groups of ``ulysses_degree`` contiguous cp ranks, ring attention
    (double ring with ``window > 1``) over the strided rest (MindSpeed ``hybrid_cp_algo``).

    ``cp = R × u``: cp rank ``g·u + j`` is Ulysses rank ``j`` of ring rank ``g``. One
    all-to-all per tensor inside each Ulysses group turns the sequence split into a head
    split (heads must divide by tp × u; GQA kv heads are repeated up to ``u`` as in
    :func:`ulysses_attention`); the group's gathered pieces are placed, as they land, in
    zigzag order over ``R`` (see :func:`_slots`; side by side for ``load_balance=None``);
    a ring of ``R`` ranks (windows of ``window`` ring ranks with a double ring) runs on
    ``s·u/cp`` tokens and ``h/(tp·u)`` heads; the output goes back the same way.

    ``axis`` is either the cp axis name (a cached mesh view splits it into
    ``{axis}_ring`` × ``{axis}_uly``, or ``{axis}_outer`` × ``{axis}_inner`` × ``{axis}_uly``
    with a window) or a pair ``(ring_axis, ulysses_axis)`` of mesh axes over which the
    sequence is split (major → minor), ``ulysses_degree`` then defaulting to the second's
    size. Needs ``R > 1`` (for ``R = 1`` use :func:`ulysses_attention`) and
    ``window`` in ``[1, R)`` dividing ``R``.

    >>> out = hybrid_attention(q, k, v, ulysses_degree=2)       # doctest: +SKIP
    """
    fn = "hybrid_attention"
    if isinstance(axis, str):
        seq_axes: tuple[str, ...] = (axis,)
    elif isinstance(axis, (tuple, list)) and len(axis) == 2 and all(isinstance(a, str) for a in axis):
        seq_axes = tuple(axis)
    else:
        raise ValueError(f"{fn}: axis must be the cp axis name or a (ring_axis, ulysses_axis) pair, got {axis!r}")
    lay = _check_inputs(fn, q, k, v, seq_axes, load_balance)
    cp = lay.cp
    if len(seq_axes) == 2:
        uly_size = _sizes(lay.mesh)[seq_axes[1]]
        if ulysses_degree is None:
            ulysses_degree = uly_size
        if ulysses_degree != uly_size:
            raise ValueError(f"{fn}: ulysses_degree={ulysses_degree} but the Ulysses axis {seq_axes[1]!r} "
                             f"has size {uly_size}")
    if not isinstance(ulysses_degree, int) or isinstance(ulysses_degree, bool) or ulysses_degree < 1 \
            or cp % ulysses_degree:
        raise ValueError(f"{fn}: ulysses_degree must be a positive int dividing cp={cp}, got {ulysses_degree!r}")
    u = ulysses_degree
    R = cp // u
    if R < 2:
        raise ValueError(f"{fn}: the ring degree cp / ulysses_degree = {cp} / {u} = {R} must be > 1; "
                         "use ulysses_attention for pure Ulysses")
    w = _check_window(fn, window, R, "ring degree")
    r = _check_heads(fn, q, k, lay, u, "ulysses_degree")
    chunks = _check_ulysses_chunks(fn, head_chunks, k, lay.tp, r, u, cp)

    # Mesh view with the ring (outer × inner when windowed) and Ulysses sub-axes.
    if len(seq_axes) == 1:
        if w > 1:
            view, (outer, inner, uly) = _unflatten(lay.mesh, seq_axes[0], (R // w, w, u), ("outer", "inner", "uly"))
            ring_axes = (outer, inner)
        else:
            view, (ring_ax, uly) = _unflatten(lay.mesh, seq_axes[0], (R, u), ("ring", "uly"))
            ring_axes = (ring_ax,)
    else:
        ring_ax, uly = seq_axes
        if w > 1:
            view, (outer, inner) = _unflatten(lay.mesh, ring_ax, (R // w, w), ("outer", "inner"))
            ring_axes = (outer, inner)
        else:
            view, ring_axes = lay.mesh, (ring_ax,)
    if w > 1:
        ring = _Ring(view, ring_axes[1], ring_axes[0], R, w, _coord(view, ring_axes[0]) * w + _coord(view, ring_axes[1]))
    else:
        ring = _Ring(view, ring_axes[0], None, R, R, _coord(view, ring_axes[0]))

    # Re-express q/k/v on the view (same local shards, the seq split named by sub-axes).
    view_seq = ring_axes + (uly,)
    vlay = _Layout(view, _respec(lay.spec, view_seq), lay.batch_axes, lay.head_axes, view_seq, lay.tp, cp)
    plan = _UlyssesPlan(view, uly, u, r, chunks, load_balance == "zigzag", causal, _scale(scale, q.shape[-1]),
                        ring, load_balance)
    vq, vk, vv = (from_local(to_local(t), view, _respec(spec_of(t), view_seq), tuple(t.shape)) for t in (q, k, v))
    out = _ulysses_dtensor(vq, vk, vv, vlay, plan)
    return from_local(to_local(out), lay.mesh, lay.spec, tuple(q.shape), name="out")


# ---------------------------------------------------------------------- dispatch

ALGORITHMS = {
    "ulysses": ulysses_attention,
    "ring": ring_attention,
    "double_ring": double_ring_attention,
    "hybrid": hybrid_attention,
}


def context_attention(q: DTensor, k: DTensor, v: DTensor, *, algo: str = "ring", **options) -> DTensor:
    """Dispatch to one of :data:`ALGORITHMS` (``"ulysses"``, ``"ring"``, ``"double_ring"``,
    ``"hybrid"``) with its keyword options (axis, causal, scale, load_balance, window,
    ulysses_degree).

    >>> out = context_attention(q, k, v, algo="hybrid", ulysses_degree=2)   # doctest: +SKIP
    """
    if algo not in ALGORITHMS:
        raise ValueError(f"context_attention: algo must be one of {tuple(ALGORITHMS)}, got {algo!r}")
    return ALGORITHMS[algo](q, k, v, **options)
