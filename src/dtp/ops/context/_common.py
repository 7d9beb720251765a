"""What every context-parallel algorithm shares: input validation, mesh views of
sub-axes, the head-chunk defaults and the compute trace. No collectives here."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...layouts import attended_kv_heads, check_load_balance
from ...core.redistribute import to_local
from ...core._torch import unflatten_mesh
from ...core.mesh.devices import axis_sizes, bounded
from ...core.spec import P, spec_of

__all__ = ["trace_compute", "default_chunks", "CHUNK_TARGET", "MIN_CHUNK_BYTES"]


# ------------------------------------------------------------------ compute trace

_trace: list[dict] | None = None


@contextlib.contextmanager
def trace_compute() -> Iterator[list[dict]]:
    """Record every ring step's block computation on this rank.

    Yields a list that fills with one dict per step: ``phase`` ("fwd"/"bwd"), ``step``
    (0-based, over the whole ring), ``src`` (ring coordinate whose K/V block it is),
    ``tasks`` (the :class:`~dtp.ops.blockwise.BlockTask` list run), ``start``/``end``
    (``time.perf_counter()``, the clock of :class:`dtp.comm.CommRecord`).

    Not run as a doctest: a ring of one records no steps, and a longer ring needs real
    ranks (tests/test_context.py).

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
    sizes = axis_sizes(mesh)
    for a in seq_axes:
        if a not in sizes:
            raise ValueError(f"{fn}: unknown mesh axis {a!r}; the mesh axes are {tuple(sizes)}")
    check_load_balance(load_balance, fn)
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
        hit = _VIEWS[key] = (mesh, bounded(unflatten_mesh(mesh, axis, sizes, tuple(names))))
    return hit[1], tuple(names)


# ------------------------------------------------------------------ head chunks

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
