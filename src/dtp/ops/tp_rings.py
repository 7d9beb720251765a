"""The hop schedules of async tensor parallel (:mod:`dtp.ops.collective_matmul`): a ring
all-gather that hands each shard to the caller as it arrives (:func:`gather_ring`) and
the dual ring of partial sums that reduce-scatters (:func:`scatter_ring`), one-way or
bidirectional. Every hop is a :func:`dtp.comm.send_recv` on the tp axis (recorded); a
bidirectional step posts its two as one :func:`dtp.comm.send_recv_batch`, so that NCCL
moves them as one group rather than one direction after the other on its stream.

**One-way** (shift +1): ``n - 1`` steps of one hop, one shard each. **Bidirectional**
(Wang et al., ASPLOS 2023; XLA's collective matmul): every step sends one hop each way
(shift +1 and shift -1), so a shard travels at most ``n // 2`` hops and the ring takes
``n // 2`` steps (tp 4: 2 instead of 3; tp 8: 4 instead of 7). For an even ``n`` the
shard opposite (``n / 2`` hops either way) goes half each way in the last step, split
along the ring's dim. Each rank still sends ``n - 1`` shards in all (the collective's
bytes, per rank per axis); each *direction* carries ``(n - 1) / 2`` of them.

Which one runs (:func:`both_ways`): bidirectional from a ring of 3 up when the shard
splits in halves along the ring's dim (``n`` odd, or an even number of rows); one-way
otherwise, and always at ``n = 2``, where both neighbours are the same rank: one hop
either way, so two directions would send the same bytes as two messages to one peer.
:func:`one_way` forces one-way (to compare the two).

What the bidirectional ring buys depends on the link. Where a rank's links to its two
neighbours are separate (a ring or torus) both directions move at once: half the link
time and half the steps. Where a rank has one link for the axis (a switch; and
:func:`dtp.comm.simulated_link`'s model, one outgoing and one incoming queue per rank per
axis) its bytes out take as long either way: only the number of dependent steps (the
latencies, the waits) halves. The first step also carries two shards' hops under one
shard's matmul (only the own shard is in hand), so on such a link it can expose more
than the one-way ring, whose every hop has one shard's matmul under it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..core import comm

__all__ = ["both_ways", "one_way", "piece", "gather_ring", "scatter_ring"]

_one_way_depth = 0  # > 0 inside one_way()


@contextlib.contextmanager
def one_way() -> Iterator[None]:
    """Rings made inside run one-way whatever their size (their backward too: the choice
    is taken in forward); what ``benchmarks/async_tp.py --one-way`` compares against.

    >>> with one_way():
    ...     both_ways(4, 8)
    False
    """
    global _one_way_depth
    _one_way_depth += 1
    try:
        yield
    finally:
        _one_way_depth -= 1


def both_ways(n: int, rows: int) -> bool:
    """Whether a ring of ``n`` ranks over shards of ``rows`` along its dim runs
    bidirectional (module docstring): ``n >= 3``, and ``n`` odd or ``rows`` even.

    >>> both_ways(2, 8), both_ways(3, 5), both_ways(4, 8), both_ways(4, 5)
    (False, True, True, False)
    """
    return _one_way_depth == 0 and n >= 3 and (n % 2 == 1 or rows % 2 == 0)


def piece(t: torch.Tensor, dim: int, n: int, c: int, part: int | None = None) -> torch.Tensor:
    """Chunk ``c`` of ``n`` of ``t`` along ``dim`` (a view), or its half ``part`` (0, 1).

    >>> piece(torch.arange(8), 0, 2, 1).tolist(), piece(torch.arange(8), 0, 2, 1, part=0).tolist()
    ([4, 5, 6, 7], [4, 5])
    """
    size = t.shape[dim] // n
    out = t.narrow(dim, c * size, size)
    return out if part is None else out.narrow(dim, part * (size // 2), size // 2)


def _added(t: torch.Tensor, r: torch.Tensor, dim: int, part: int | None) -> torch.Tensor:
    """``t`` plus ``r`` (into half ``part`` of ``t`` along ``dim``), out of place: a term
    may be a view of a caller's tensor."""
    if part is None:
        return t + r
    lo, hi = t.chunk(2, dim)
    return torch.cat((lo + r, hi) if part == 0 else (lo, hi + r), dim)


_Use = Callable[[int, int | None, torch.Tensor], None]  # (coordinate, half or None, its shard)


def gather_ring(shard: torch.Tensor, n: int, me: int, mesh: DeviceMesh | None, axis: str, dim: int, tag: str,
                use: _Use, *, bidirectional: bool) -> None:
    """The ring all-gather of every coordinate's ``shard`` over ``axis``: calls
    ``use(c, part, x)`` with coordinate ``c``'s shard (or its half ``part``) — this
    rank's first, each while the next hops are in flight, the last ones after.

    >>> got = []
    >>> gather_ring(torch.ones(2), 1, 0, None, "tp", 0, "x", lambda c, p, x: got.append((c, p)),
    ...             bidirectional=False)
    >>> got
    [(0, None)]
    """
    if not bidirectional:
        cur = shard
        for s in range(n):
            hop = comm.send_recv(cur, mesh, axis, shift=1, async_op=True, tag=tag) if s < n - 1 else None
            use((me - s) % n, None, cur)  # under the hop in flight
            if hop is not None:
                cur = hop.wait()  # type: ignore[union-attr]
        return
    steps, halves = n // 2, n % 2 == 0
    cw = ccw = shard  # the shards travelling clockwise (to c + 1) and counter-clockwise
    for s in range(1, steps + 1):
        last = halves and s == steps  # the opposite shard: half each way
        right, left = comm.send_recv_batch([(piece(cw, dim, 1, 0, 0) if last else cw, 1),
                                            (piece(ccw, dim, 1, 0, 1) if last else ccw, -1)], mesh, axis, tag=tag)
        if s == 1:  # under the first hops: the own shard, the only one in hand
            use(me, None, shard)
        else:  # under these hops: the two shards the previous step brought
            use((me - s + 1) % n, None, cw)
            use((me + s - 1) % n, None, ccw)
        cw, ccw = right.wait(), left.wait()  # type: ignore[union-attr]
    use((me - steps) % n, 0 if halves else None, cw)
    use((me + steps) % n, 1 if halves else None, ccw)


_Terms = Callable[[int, int | None], torch.Tensor]  # (destination chunk, half or None) -> term


def scatter_ring(terms: _Terms, n: int, me: int, mesh: DeviceMesh | None, axis: str, dim: int, tag: str,
                 under: Callable[[], None] | None = None, *, bidirectional: bool) -> torch.Tensor:
    """The dual ring: ``terms(c, part)`` is this rank's term of destination chunk ``c``
    (or its half ``part`` along ``dim``); returns the whole sum of this rank's own chunk.
    The next terms are computed while the partial sums are in flight, and ``under()``
    (work that needs no hop: weight gradients) under the first hops.

    >>> scatter_ring(lambda c, p: torch.ones(2), 1, 0, None, "tp", 0, "x", bidirectional=False).tolist()
    [1.0, 1.0]
    """
    if not bidirectional:
        acc = terms((me - 1) % n, None)
        for s in range(n - 1):
            hop = comm.send_recv(acc, mesh, axis, shift=1, async_op=True, tag=tag)
            nxt = terms((me - s - 2) % n, None)
            if s == 0 and under is not None:
                under()
            acc = hop.wait() + nxt  # type: ignore[union-attr]
        return acc
    # The transpose of gather_ring: destination d's partial sums travel towards d, the
    # clockwise stream from d - n//2 (the opposite chunk's half 0 when n is even), the
    # counter-clockwise one from d + n//2 (half 1); d adds its own term and both.
    steps, halves = n // 2, n % 2 == 0
    cw = terms((me + steps) % n, 0 if halves else None)
    ccw = terms((me - steps) % n, 1 if halves else None)
    for s in range(1, steps + 1):
        right, left = comm.send_recv_batch([(cw, 1), (ccw, -1)], mesh, axis, tag=tag)
        if s < steps:
            nxt_cw, nxt_ccw = terms((me + steps - s) % n, None), terms((me - steps + s) % n, None)
        else:
            own = terms(me, None)
        if s == 1 and under is not None:
            under()
        from_left, from_right = right.wait(), left.wait()  # type: ignore[union-attr]
        if s < steps:
            first = halves and s == 1
            cw = _added(nxt_cw, from_left, dim, 0 if first else None)
            ccw = _added(nxt_ccw, from_right, dim, 1 if first else None)
    return own + from_left + from_right
