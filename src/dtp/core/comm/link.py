"""A simulated slow link (:func:`simulated_link`): every recorded collective on the chosen
mesh axes takes as long as a modelled transfer of its bytes would."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Sequence

from .board import Board, open_board

__all__ = ["simulated_link"]

# Overlap only shows on a link slower than compute. On one CPU machine loopback gloo is
# nearly free, so dtp can stand in a documented, deterministic link model: each mesh axis
# is one full-duplex link of ``bandwidth`` bytes/s and ``latency`` s per rank (a switch), or
# with ``neighbours=True`` one such link to each ring neighbour (a ring or torus), so what a
# rank sends to coordinate c + 1 and to c - 1 moves at once (a bidirectional ring's two hops,
# dtp.ops.tp_rings); a collective (a ring algorithm, one way round) takes the c + 1 link.
# - A collective's modelled transfer starts when the last rank of its group posted it
#   (read from the posting board, dtp.comm.board; where a rank's entry is missing, when
#   the real one has finished) and queues behind the rank's earlier transfers out on that
#   axis. It completes when the modelled transfer would, or the real one has, the later.
# - Point to point (send, recv, a ring step's send_recv): gloo's isend/irecv have no
#   completion future (torch 2.13: "Work::getFuture not implemented"), so the handle
#   books them itself. A send's transfer starts when it is posted (the eager protocol of
#   NCCL and gloo for activation-sized messages) on the outgoing queue; a receive's starts
#   when both sides have posted (the board again; unknown: when its data has really
#   arrived) on the incoming queue, booked by a waiter thread once the data is in, so the
#   receiver pays the transfer too and compute in between hides it.
# A handle is complete when its transfers would be; waiting blocks until then and compute
# in between runs freely — exactly what overlap hides.
_link_lock = threading.Lock()
_link: dict[str, object] = {}


@contextlib.contextmanager
def simulated_link(bandwidth: float, latency: float = 0.0, axes: Sequence[str] | None = None, *,
                   neighbours: bool = False) -> Iterator[None]:
    """Make every recorded collective on ``axes`` (all by default) take at least
    ``latency + bytes_sent / bandwidth`` seconds, queued per axis (``neighbours``: per
    axis and ring direction, a link to each neighbour; default False, one link a rank).

    Bytes are the per-rank bytes of the comm log (ring algorithms), so a ``bandwidth``
    of 1e8 models a 100 MB/s (0.8 Gbit/s) link per rank. Process-wide; every rank must
    use the same settings and enter the same contexts in the same order (nesting
    included), not while another thread is posting: ranks match their transfers by the
    order of contexts and postings (:mod:`dtp.comm.board`; where they do not match, a
    transfer starts when the real one has finished).

    >>> with dtp.testing.simulate(2):
    ...     mesh = make_mesh(dp=2)
    ...     with simulated_link(bandwidth=50e6, latency=1e-4, axes=("dp",)):
    ...         y = dtp.comm.all_reduce(torch.ones(1000), mesh, "dp")   # takes >= 0.1 ms + 4 kB / 50 MB/s
    """
    if bandwidth <= 0 or latency < 0:
        raise ValueError(f"simulated_link: bandwidth must be > 0 and latency >= 0, got {bandwidth}, {latency}")
    board = open_board()
    with _link_lock:
        previous = dict(_link)
        _link.clear()
        _link.update(bandwidth=float(bandwidth), latency=float(latency),
                     axes=None if axes is None else frozenset(axes), busy={}, neighbours=bool(neighbours),
                     board=board)
    try:
        yield
    finally:
        with _link_lock:
            _link.clear()
            _link.update(previous)


def _link_applies(axis: str) -> bool:
    with _link_lock:
        return bool(_link) and (_link["axes"] is None or axis in _link["axes"])


def _link_board() -> Board | None:
    """The posting board of the link in force (None: none, or ranks cannot share one)."""
    with _link_lock:
        return _link.get("board")  # type: ignore[return-value]


def _link_deadline(axis: str, nbytes: int, incoming: bool = False, *, route: int = 1,
                   start: float | None = None) -> float | None:
    """When a modelled transfer of ``nbytes`` on ``axis`` starting at ``start`` (a
    ``perf_counter`` time; default now) would end (it queues behind the axis's earlier
    transfers in the same direction: out, or ``incoming``; with ``neighbours``, the same
    way round the ring too: ``route`` +1 or -1)."""
    with _link_lock:
        if not _link:
            return None
        busy: dict[tuple[str, bool, int], float] = _link["busy"]  # type: ignore[assignment]
        key = (axis, incoming, route if _link["neighbours"] else 1)
        now = time.perf_counter()
        # Never later than now: it is asked once the transfer is real, so a start in the
        # future could only be a clock gone wrong, and would make wait() sleep for it.
        start = max(now if start is None else min(start, now), busy.get(key, 0.0))
        end = start + _link["latency"] + nbytes / _link["bandwidth"]  # type: ignore[operator]
        busy[key] = end
        return end
