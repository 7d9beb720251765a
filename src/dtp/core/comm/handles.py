"""Handles of asynchronous collectives (:class:`CommHandle`) and :func:`drain`.

A collective posted with ``async_op=True`` returns a :class:`CommHandle` whose
:meth:`CommHandle.wait` yields the result. Issue time is taken when the collective is
posted, completion time when the backend reports it done (the work's future callback),
not when someone gets round to waiting on it.

Every handle must be waited for on every rank before the process group goes away:
:func:`drain` waits for the ones this process posted and has not waited for (what
``dtp train`` and :mod:`dtp.testing` do before ``destroy_process_group``; a user's loop
calls :func:`dtp.wait` on its state). An unwaited gloo collective that completes while
the interpreter shuts down runs its completion callback (Python) on a gloo thread
and aborts the process (``terminate called without an active exception``). A process
that ends normally with handles still in flight (a loop that forgot ``dtp.wait``) has
them waited for at exit (:func:`_drain_at_exit`), within a bounded grace.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
import weakref
from typing import Callable

import torch

from ..compiled import eager
from .flight import _failure, _flight_mirror
from .link import _link_deadline
from .records import CommRecord

__all__ = ["CommHandle", "drain"]

# Serialises CommHandle._mark_done: the future's callback (a backend thread) and wait()
# can both see one completion, and the link must be booked once.
_mark_lock = threading.Lock()

# Handles posted and not yet waited for (wait() drops them). Weak references suffice: a
# handle's completion callback (the future's ``then``) keeps it alive until the backend
# has finished its work, which is all drain() must wait for; a handle dropped after that
# is gone for good, so a long-lived process (a dtp.testing pool rank) leaks nothing.
_unwaited: "weakref.WeakSet[CommHandle]" = weakref.WeakSet()

# (kind, device type) of works seen without a completion future (gloo's send/recv):
# asking again raises each time, ≈30-40 µs a message on this machine (a pipeline step
# posts hundreds), so later handles of that kind skip the attempt.
_futureless: set[tuple[str, str]] = set()

# A handle's link under simulated_link: axis, bytes sent, route, when every rank had posted.
_Link = tuple[str, int, int, "Callable[[], float | None] | None"]
_POINT_TO_POINT = frozenset({"send", "recv", "send_recv"})


def _posted(since: Callable[[], float | None] | None) -> float | None:
    """When every rank a transfer needs had posted it (the board), or None: unknown,
    also when reading the board fails — the link then starts the transfer now."""
    try:
        return since() if since is not None else None
    except Exception:
        return None


def drain() -> int:
    """Wait for every collective this process posted with ``async_op=True`` and has not
    waited for; return how many. Starts no collective — but blocks until the peers have
    posted theirs, so every rank must drain (the same handles) alike.

    What runs before ``destroy_process_group`` in ``dtp train`` and :mod:`dtp.testing`.

    >>> drain()
    0
    """
    handles = list(_unwaited)
    for handle in handles:
        handle.wait()
    return len(handles)


# How long the exit handler waits for the peers to finish what this rank has in flight.
_EXIT_GRACE = 30.0


def _drain_at_exit() -> None:
    """Wait, at a normal interpreter exit, for the handles this process never waited for.

    A loop of one's own under ZeRO 1/2 with ``overlap_param_gather`` that ends without
    :func:`dtp.wait` leaves the last step's all-gathers in flight. Measured (torch 2.13,
    gloo, dp 2, tiny Llama, a user's script under torchrun): every run of 3 trained, then
    aborted at exit (``terminate called without an active exception``, exit 1); with this
    handler the same script exits 0. The peers posted the same collectives in the same
    step, so they complete at once; still, it only waits for handles that complete within
    ``_EXIT_GRACE`` (a peer that died or never posted them cannot turn an exit into a
    hang), and not at all after an uncaught exception (``sys.last_value``: the process
    is failing, and its peers may be stuck before collectives it will never post).
    """
    handles = list(_unwaited)
    if not handles or hasattr(sys, "last_value"):
        return
    deadline = time.monotonic() + _EXIT_GRACE
    while not all(h.is_completed() for h in handles):
        if time.monotonic() > deadline:
            return
        time.sleep(0.001)
    try:
        drain()
    except Exception:  # a failed collective at exit: nothing is left to report it to
        pass


atexit.register(_drain_at_exit)


class _WaiterPool:
    """Daemon threads that each run one job at a time; a job never waits for a free
    one (a new thread starts when none is idle), and idle threads are reused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: "queue.SimpleQueue[tuple[Callable[..., None], tuple[object, ...]]]" = queue.SimpleQueue()
        self._idle = 0

    def submit(self, fn: Callable[..., None], *args: object) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._jobs.put((fn, args))
        if start:
            threading.Thread(target=self._work, daemon=True, name="dtp-p2p-link").start()

    def _work(self) -> None:
        while True:
            fn, args = self._jobs.get()
            fn(*args)  # _wait_in_thread: never raises
            with self._lock:
                self._idle += 1


_waiters = _WaiterPool()


def _finished() -> torch.Tensor:
    raise AssertionError("CommHandle: result already taken")


class CommHandle:
    """An in-flight collective; :meth:`wait` returns its (post-processed) result.

    ``link`` is ``(axis, bytes sent, route, since)`` under :func:`dtp.comm.simulated_link`
    (``route``: +1, or -1 for a point-to-point hop to coordinate c - 1; ``since``, from
    the posting board, tells once the transfer is real when every rank it needs had
    posted it: a collective's whole group, a receive's sender and itself; None, or a
    None answer, where that is unknown);
    ``received`` the bytes a point-to-point receive brings in (its record counts none:
    the sender does), which the link books on the incoming queue; ``device`` the
    tensor's device type (with the kind, what a missing future is remembered by)."""

    def __init__(self, work: object | None, record: CommRecord | None, finish: Callable[[], torch.Tensor],
                 link: _Link | None = None, received: int = 0, device: str = "cpu"):
        self._work, self._record, self._finish = work, record, finish
        self._link = link  # (axis, bytes, route, since) under simulated_link
        self._deadline: float | None = None  # end of the modelled transfer
        self._done = False  # completion seen (and the link booked)
        self._result: torch.Tensor | None = None
        self._arrived: threading.Event | None = None  # point to point under the link: set by _wait_in_thread
        self._error: RuntimeError | None = None
        if work is not None:
            _unwaited.add(self)  # until wait(): drain() finds it
        future = getattr(work, "get_future", None)
        if record is not None and work is not None:
            kind = (record.kind, device)
            try:
                if kind in _futureless:
                    raise NotImplementedError
                future().then(self._mark_done)  # type: ignore[misc]
            except (TypeError, RuntimeError, NotImplementedError):
                # No future (gloo's send/recv): completion is taken at wait() — unless the
                # link must see the transfer from when it was posted (see dtp.comm.link).
                _futureless.add(kind)
                if link is not None:
                    self._book_point_to_point(work, link, received)

    def _book_point_to_point(self, work: object, link: _Link, received: int) -> None:
        axis, sent, route, since = link
        self._done = True  # booked here, not by _mark_done
        if sent:  # leaves when posted
            self._deadline = _link_deadline(axis, sent, route=route)
        if not received:
            return
        self._arrived = threading.Event()
        # A waiting thread per receive in flight, only under the simulated link: measured
        # on torch 2.13, gloo's recv work has neither a future nor an is_completed() that
        # turns true before wait(), and one shared waiter would see a late peer hold up
        # the rest. Pooled: Thread.start() blocks until the new thread runs, which on a
        # busy CPU measured ~1-3 ms of the posting thread per hop.
        _waiters.submit(self._wait_in_thread, work, axis, received, route, since)

    def _wait_in_thread(self, work: object, axis: str, received: int, route: int,
                        since: Callable[[], float | None] | None) -> None:
        try:
            work.wait()  # type: ignore[attr-defined]
        except RuntimeError as e:  # raised again by wait() on the posting thread
            self._error = e
        else:
            end = _link_deadline(axis, received, incoming=True, route=route, start=_posted(since))
            with _mark_lock:
                self._deadline = max(self._deadline or 0.0, end or 0.0)
                if self._record is not None:  # the data is in: complete when the modelled transfer is
                    self._record.completed = self._deadline
        finally:
            assert self._arrived is not None
            self._arrived.set()

    def _finish_point_to_point(self) -> None:
        assert self._arrived is not None
        self._arrived.wait()
        if self._error is not None:
            raise self._error
        # The work is not waited on again: measured on torch 2.13, a second wait() on a
        # gloo receive blocks for the buffer's next message.

    def _mark_done(self, fut: object) -> None:
        # Called once per handle by whoever sees the completion first: the future's
        # callback (on a backend thread) or wait() (this one).
        if fut is not None:
            try:
                fut.value()  # type: ignore[attr-defined]
            except Exception:  # the future also completes when the work fails
                if self._record is not None:
                    self._record.failed = True
                    if (mirror := _flight_mirror()) is not None:
                        mirror.update(self._record)
                return
        with _mark_lock:
            if self._done:
                return
            self._done = True
            # A collective's modelled transfer starts once every rank has posted it (the
            # board; unknown: now, when the real one has finished): waiting for a late
            # peer is never hidden, and the loopback transfer is not charged on top. A
            # point-to-point one with a future (NCCL's) starts, as gloo's, when posted.
            if self._link is not None:
                axis, sent, route, since = self._link
                p2p = self._record is not None and self._record.kind in _POINT_TO_POINT
                start = self._record.issued if p2p else _posted(since)  # type: ignore[union-attr]
                self._deadline = _link_deadline(axis, sent, route=route, start=start)
            if self._record is not None and self._record.completed is None:
                self._record.completed = max(time.perf_counter(), self._deadline or 0.0)
                if (mirror := _flight_mirror()) is not None:
                    mirror.update(self._record)

    @eager  # a graph break inside a compiled region (dtp.compiled)
    def wait(self) -> torch.Tensor:
        if self._result is None:
            entered = time.perf_counter()
            if self._work is not None:
                try:
                    self._finish_point_to_point() if self._arrived is not None else self._work.wait()
                except RuntimeError as e:  # gloo raises RuntimeError (measured); DistBackendError is a subclass
                    if self._record is None:
                        raise
                    _unwaited.discard(self)  # it will never complete: nothing for drain() to wait on
                    raise _failure(self._record, e) from e
            self._mark_done(None)
            if self._deadline is not None and (left := self._deadline - time.perf_counter()) > 0:
                time.sleep(left)
            if self._record is not None and self._record.completed is None:  # point to point under the link
                self._record.completed = max(time.perf_counter(), self._deadline or 0.0)
                if (mirror := _flight_mirror()) is not None:
                    mirror.update(self._record)
            self._result = self._finish()
            if self._record is not None:
                self._record.waited = time.perf_counter() - entered
            # The work and the closure hold the input and any staging buffer (a whole
            # gradient bucket for a reduce-scatter): only the result may outlive wait().
            self._work = None
            self._finish = _finished
            _unwaited.discard(self)
        return self._result

    def is_completed(self) -> bool:
        if self._result is not None or self._work is None:
            return True
        if self._arrived is not None and not self._arrived.is_set():
            return False
        done = bool(self._work.is_completed())
        return done and (self._link is None or (self._deadline is not None and time.perf_counter() >= self._deadline))
