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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import comm
from ..redistribute import from_local, reshard, to_local
from ..spec import P, _sizes, spec_of
from .blockwise import (
    accum_dtype,
    block_backward,
    block_forward,
    from_cp_order,
    merge_into,
    ring_block_plan,
    to_cp_order,
)
from .recompute import remat

__all__ = [
    "ulysses_attention",
    "ring_attention",
    "double_ring_attention",
    "hybrid_attention",
    "context_attention",
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


def _repeat_kv(t: DTensor, r: int) -> DTensor:
    """Repeat every kv head ``r`` times (``repeat_interleave`` on dim 1; backward sums).

    Local and exact: with heads split contiguously over tp, repeating each rank's heads
    is repeating the global heads.
    """
    if r == 1:
        return t
    spec = spec_of(t)
    local = to_local(t).repeat_interleave(r, dim=1)
    b, h, s, d = t.shape
    return from_local(local, t.device_mesh, spec, (b, h * r, s, d))


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                     cp: int, load_balance: str | None) -> torch.Tensor:
    """SDPA on the full (cp-ordered) sequence: un-permute, attend, re-permute."""
    if load_balance == "zigzag" and causal:
        q, k, v = (from_cp_order(t, 2, cp, load_balance) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if load_balance == "zigzag" and causal:
        out = to_cp_order(out, 2, cp, load_balance)
    return out


def _ulysses(q: DTensor, k: DTensor, v: DTensor, lay: _Layout, uly_axis: str, r: int, inner) -> DTensor:
    """Shared by Ulysses and the hybrid: all-to-all ``uly_axis`` from the sequence to the
    heads, ``inner(q, k, v)`` on local tensors, all-to-all back."""
    k, v = _repeat_kv(k, r), _repeat_kv(v, r)
    seq_rest = tuple(a for a in lay.seq_axes if a != uly_axis)
    src = lay.spec
    dst = _respec(src, seq_rest, (uly_axis,))
    kv_dst = _respec(spec_of(k), seq_rest, (uly_axis,))
    q2 = reshard(q, dst, name="q", tag="ulysses q")
    k2 = reshard(k, kv_dst, name="k", tag="ulysses k")
    v2 = reshard(v, kv_dst, name="v", tag="ulysses v")
    out_local = inner(to_local(q2), to_local(k2), to_local(v2))
    out = from_local(out_local, lay.mesh, dst, tuple(q.shape), name="out")
    return reshard(out, src, name="out", tag="ulysses out")


def ulysses_attention(q: DTensor, k: DTensor, v: DTensor, *, axis: str = "cp", causal: bool = True,
                      scale: float | None = None, load_balance: str | None = "zigzag") -> DTensor:
    """DeepSpeed-Ulysses attention: all-to-all over ``axis`` from a sequence split to a
    head split, local attention on the full sequence, all-to-all back.

    ``q``/``k``/``v`` are laid out ``P(batch_axes, head_axes, axis)``; each is resharded
    to ``P(batch_axes, head_axes + (axis,), None)`` — exactly one all-to-all over
    ``axis`` moving ``(cp-1)/cp`` of the local bytes — and the output comes back the same
    way: 4 all-to-alls forward, 4 backward.

    The gathered sequence is in cp order; for a causal mask it is un-permuted locally
    (an ``index_select`` with :func:`~dtp.ops.blockwise.from_cp_order`), attended with
    SDPA and re-permuted, so the mask holds in original positions for ``"zigzag"`` and
    ``None`` alike.

    Heads must divide by tp × cp (tp: the product of the head axes' sizes). GQA: when the
    kv heads per tp rank (``kv_heads/tp``) divide by cp they are split like the query
    heads. When fewer than cp, each kv head is repeated ``cp / (kv_heads/tp)`` times
    (``repeat_interleave`` on the head dim, before the all-to-all; its backward sums the
    copies' gradients) so every rank gets the one kv head its query heads use: rank ``c``
    gets query heads ``[c·hq/cp, (c+1)·hq/cp)``, all in the group of repeated kv head
    ``c``. That needs ``kv_heads/tp`` to divide cp; otherwise ``ValueError``.

    >>> out = ulysses_attention(q, k, v, axis="cp")             # doctest: +SKIP
    """
    fn = "ulysses_attention"
    axis = _check_axis_name(fn, axis)
    lay = _check_inputs(fn, q, k, v, (axis,), load_balance)
    r = _check_heads(fn, q, k, lay, lay.cp, "cp")
    cp = lay.cp

    def inner(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor) -> torch.Tensor:
        return remat(_local_attention, ql, kl, vl, causal, scale, cp, load_balance, level="selective")

    return _ulysses(q, k, v, lay, axis, r, inner)


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
                  load_balance: str | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    L = q.shape[2]
    acc = accum_dtype(q.dtype)
    out: torch.Tensor | None = None  # the accumulators start as the diagonal block's result
    lse: torch.Tensor | None = None
    block: torch.Tensor | None = torch.stack([k, v])  # one buffer per transfer: (2, b, h_kv, L, d)
    step = 0
    for t in range(ring.n_out):
        assert block is not None
        # Outer ring: this round's first block goes on to the next window while the whole
        # inner round computes (prefetch), arriving as the next round's first block.
        outer = _send(block, ring, ring.outer, f"ring fwd outer {t}") if t + 1 < ring.n_out else None
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
                        out, lse = ob.to(acc), lb
                    else:
                        assert lse is not None
                        merge_into(out[:, :, qs], lse[:, :, qs], ob, lb)
                    del ob, lb
            if nxt is not None:
                cur = nxt.wait()
            step += 1
        del cur
        if outer is not None:
            block = outer.wait()
    assert out is not None and lse is not None
    return out.to(q.dtype), lse


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, ring: _Ring, causal: bool, load_balance: str | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    at a step: 3 K/V blocks (own, computing, arriving) and 2 dK/dV partials (leaving,
    arriving) plus one block's kernel outputs.
    """
    L = q.shape[2]
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    block: torch.Tensor | None = torch.stack([k, v])
    step = 0
    carried: comm.CommHandle | None = None  # dK/dV partial on the outer ring
    dkv: torch.Tensor | None = None
    for t in range(ring.n_out):
        assert block is not None
        outer = _send(block, ring, ring.outer, f"ring bwd outer {t}") if t + 1 < ring.n_out else None
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
            carried = _send(round_grad, ring, ring.outer, f"ring bwd dkv outer {t}")
        del round_grad
        if outer is not None:
            block = outer.wait()
    if carried is not None:
        dkv = carried.wait()  # the last outer hop brings this rank's own block home
    assert dkv is not None
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, load_balance, scale):  # type: ignore[override]
        out, lse = _ring_forward(q, k, v, ring, causal, load_balance, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (ring, causal, load_balance, scale)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.cfg)
        return dq, dk, dv, None, None, None, None


def _scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _ring_local(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, ring: _Ring, causal: bool,
                load_balance: str | None, scale: float | None) -> torch.Tensor:
    return _RingAttention.apply(ql, kl, vl, ring, causal, load_balance, _scale(scale, ql.shape[-1]))


def _ring_dtensor(q: DTensor, k: DTensor, v: DTensor, lay: _Layout, ring: _Ring, causal: bool,
                  load_balance: str | None, scale: float | None) -> DTensor:
    out = _ring_local(to_local(q), to_local(k), to_local(v), ring, causal, load_balance, scale)
    return from_local(out, lay.mesh, lay.spec, tuple(q.shape), name="out")


def ring_attention(q: DTensor, k: DTensor, v: DTensor, *, axis: str = "cp", causal: bool = True,
                   scale: float | None = None, load_balance: str | None = "zigzag") -> DTensor:
    """Ring attention over mesh axis ``axis`` (Megatron-CP / ring-flash-attention).

    Each rank keeps its Q block; the K/V blocks (one ``(2, b, h_kv, s/cp, d)`` buffer)
    travel round the ring with :func:`dtp.comm.send_recv`: at step ``i`` the transfer that
    brings step ``i+1``'s block is posted (tag ``"ring fwd step {i}"``) *before* step
    ``i``'s block is computed. Which sub-blocks are computed comes from
    :func:`~dtp.ops.blockwise.ring_block_plan` (causal + zigzag: every rank does the same
    work); partial outputs are merged by log-sum-exp in fp32 (fp64 stays fp64).
    Forward moves ``cp-1`` blocks of K+V per rank; backward ``cp-1`` K/V blocks plus ``cp``
    dK/dV partials (accumulation dtype) that travel with them back to their owner.
    A ring of one sends nothing.

    >>> out = ring_attention(q, k, v, axis="cp", load_balance="zigzag")   # doctest: +SKIP
    """
    fn = "ring_attention"
    axis = _check_axis_name(fn, axis)
    lay = _check_inputs(fn, q, k, v, (axis,), load_balance)
    ring = _Ring(lay.mesh, axis, None, lay.cp, lay.cp, _coord(lay.mesh, axis))
    return _ring_dtensor(q, k, v, lay, ring, causal, load_balance, scale)


def double_ring_attention(q: DTensor, k: DTensor, v: DTensor, *, window: int, axis: str = "cp",
                          causal: bool = True, scale: float | None = None,
                          load_balance: str | None = "zigzag") -> DTensor:
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
    view, (outer, inner) = _unflatten(lay.mesh, axis, (lay.cp // w, w), ("outer", "inner"))
    rank = _coord(view, outer) * w + _coord(view, inner)
    ring = _Ring(view, inner, outer, lay.cp, w, rank)
    return _ring_dtensor(q, k, v, lay, ring, causal, load_balance, scale)


# ------------------------------------------------------------------------- hybrid


def _hybrid_order(u: int, L: int, device: torch.device) -> torch.Tensor:
    """Local reorder after the Ulysses gather of ``u`` zigzag pieces of length ``L``.

    Ulysses rank ``j`` of ring group ``g`` (cp rank ``g·u + j``) holds zigzag chunks
    ``g·u + j`` and ``2cp-1-g·u-j``, so after the gather the group holds the chunk runs
    ``[g·u, (g+1)·u)`` and ``[2cp-(g+1)·u, 2cp-g·u)``: super-chunks ``g`` and ``2R-1-g``
    of a zigzag over the ring degree ``R``. Putting the pieces' first halves in order
    ``j = 0..u-1``, then their second halves in order ``j = u-1..0`` sorts them by
    position, which is exactly that layout, so the ring runs its ordinary zigzag plan.
    """
    h = L // 2
    first = [torch.arange(j * L, j * L + h, device=device) for j in range(u)]
    second = [torch.arange(j * L + h, (j + 1) * L, device=device) for j in reversed(range(u))]
    return torch.cat(first + second)


def hybrid_attention(q: DTensor, k: DTensor, v: DTensor, *, ulysses_degree: int | None = None, window: int = 1,
                     axis: str | Sequence[str] = "cp", causal: bool = True, scale: float | None = None,
                     load_balance: str | None = "zigzag") -> DTensor:
    """USP: Ulysses over groups of ``ulysses_degree`` contiguous cp ranks, ring attention
    (double ring with ``window > 1``) over the strided rest (MindSpeed ``hybrid_cp_algo``).

    ``cp = R × u``: cp rank ``g·u + j`` is Ulysses rank ``j`` of ring rank ``g``. One
    all-to-all per tensor inside each Ulysses group turns the sequence split into a head
    split (heads must divide by tp × u; GQA kv heads are repeated up to ``u`` as in
    :func:`ulysses_attention`); the group's gathered sequence is reordered locally into a
    zigzag over ``R`` (see :func:`_hybrid_order`; nothing to do for ``load_balance=None``);
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

    def on_view(t: DTensor) -> DTensor:
        return from_local(to_local(t), view, _respec(spec_of(t), view_seq), tuple(t.shape))

    vq, vk, vv = on_view(q), on_view(k), on_view(v)
    vlay = _Layout(view, _respec(lay.spec, view_seq), lay.batch_axes, lay.head_axes, view_seq, lay.tp, cp)

    def inner_fn(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor) -> torch.Tensor:
        if load_balance == "zigzag":
            order = _hybrid_order(u, ql.shape[2] // u, ql.device)
            ql, kl, vl = (t.index_select(2, order) for t in (ql, kl, vl))
        out = _ring_local(ql, kl, vl, ring, causal, load_balance, scale)
        if load_balance == "zigzag":
            out = out.index_select(2, torch.argsort(order))
        return out

    out = _ulysses(vq, vk, vv, vlay, uly, r, inner_fn)
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
