"""USP hybrid attention: Ulysses inside groups of contiguous cp ranks, (double) ring
across the groups, on a cached mesh view that names both sub-axes."""

from __future__ import annotations

from typing import Sequence

from torch.distributed.tensor import DTensor

from ...layouts import check_window
from ...core.mesh.devices import axis_coordinate, axis_sizes, block_index
from ..blockwise import softmax_scale
from ._common import _check_heads, _check_inputs, _check_ulysses_chunks, _unflatten
from .ring import _Ring
from .ulysses import _ulysses_dtensor, _UlyssesPlan

__all__ = ["hybrid_attention"]


def hybrid_attention(q: DTensor, k: DTensor, v: DTensor, *, ulysses_degree: int | None = None, window: int = 1,
                     axis: str | Sequence[str] = "cp", causal: bool = True, scale: float | None = None,
                     load_balance: str | None = "zigzag", head_chunks: int | None = None,
                     docs: tuple[DTensor, DTensor] | None = None) -> DTensor:
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
    ``window`` in ``[1, R)`` dividing ``R``. ``docs``: packed documents, as for
    :func:`~dtp.ops.context.ring_attention`.

    Not run as a doctest: the ring sends point to point, which needs real ranks
    (``dtp.testing.run``), not ``simulate``; tests/test_context.py runs it.

    >>> out = hybrid_attention(q, k, v, ulysses_degree=2)  # doctest: +SKIP
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
        uly_size = axis_sizes(lay.mesh)[seq_axes[1]]
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
    w = check_window(window, R, algo="hybrid", what=fn, of="the ring degree cp/ulysses_degree")
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
        ring = _Ring(view, ring_axes[1], ring_axes[0], R, w, block_index(view, ring_axes))
    else:
        ring = _Ring(view, ring_axes[0], None, R, R, axis_coordinate(view, ring_axes[0]))

    # The collectives run on the view (its sub-axes name the ring and Ulysses groups);
    # the local shards are the same on either mesh, so q/k/v and the output stay on lay.mesh.
    plan = _UlyssesPlan(view, uly, u, r, chunks, load_balance == "zigzag", causal, softmax_scale(scale, q.shape[-1]),
                        ring, load_balance)
    return _ulysses_dtensor(q, k, v, lay, plan, docs)
