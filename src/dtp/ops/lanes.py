"""Cooperative lanes: several microbatches' work on threads that take turns, the turn
passing where one of them has an all-to-all in flight (``layouts.expert(ep_overlap=True)``,
run by :mod:`dtp.strategies.ep_overlap`).

:func:`run` starts one thread per callable and lets exactly one run at a time. A lane
keeps the turn until it calls :func:`hide` on a posted collective (or finishes): the
turn then goes to the next lane still working, which computes — its attention, its
experts, its backward — while the first lane's transfer travels, and hands the turn on
at its own next :func:`hide`. Since the turn moves only there, the order in which the
lanes post collectives is a function of the program alone: the same on every rank,
which gloo and NCCL need (they match collectives by issue order). Outside a lane
:func:`hide` is ``handle.wait()``.

The lanes are threads kept for the process (:class:`_Worker`). Why threads and not one loop: the model is one function that the all-to-all sits deep
inside (the MoE block of layer i); a thread keeps each microbatch's place in it, forward
or backward (CPU autograd runs a backward on the thread that asked for it), without the
model knowing. Thread-local state the step set (layout, recompute, loss divisor, comm
logs) is the caller's to carry into the lanes (:mod:`dtp.strategies.ep_overlap`).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Protocol, Sequence

__all__ = ["run", "hide", "active"]

_here = threading.local()  # .lane: (the _Lanes, this thread's index) inside a lane


class _Waitable(Protocol):
    def wait(self) -> Any: ...


class _Lanes:
    def __init__(self, n: int) -> None:
        self.turn = 0
        self.done = [False] * n
        self.cv = threading.Condition()

    def next_after(self, i: int) -> int:
        """The next lane still working after ``i`` (``i`` itself when it is the last)."""
        n = len(self.done)
        return next((j % n for j in range(i + 1, i + n) if not self.done[j % n]), i)

    def give(self, i: int) -> None:  # the condition held
        self.turn = self.next_after(i)
        self.cv.notify_all()

    def take(self, i: int) -> None:  # the condition held
        while self.turn != i:
            self.cv.wait()


def active() -> bool:
    """Whether this thread is a lane of :func:`run`.

    >>> active()
    False
    """
    return getattr(_here, "lane", None) is not None


def hide(handle: _Waitable) -> Any:
    """``handle.wait()``, after letting the other lanes run until the turn comes back
    (inside a lane of :func:`run`; elsewhere it only waits).

    >>> class Done:
    ...     def wait(self): return 7
    >>> hide(Done())
    7
    """
    lane = getattr(_here, "lane", None)
    if lane is not None:
        lanes, i = lane
        with lanes.cv:
            if lanes.next_after(i) != i:
                lanes.give(i)
                lanes.take(i)
    return handle.wait()


class _Worker:
    """A lane's thread, kept for the process: DTensor caches its sharding propagation per
    thread (torch 2.13's ``LocalLRUCache``), so a fresh thread per microbatch would pay
    for every op's propagation again (measured: a step 3× slower)."""

    def __init__(self, i: int) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=f"dtp lane {i}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.jobs.get()()


_workers: list[_Worker] = []
_workers_lock = threading.Lock()


def run(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run ``fns`` as cooperative lanes (one at a time, lane 0 first, the turn passed at
    :func:`hide` and when a lane ends) on the process's lane threads; return their
    results in order. The first error any lane raised is raised here, after every lane
    has ended.

    >>> order = []
    >>> run([lambda: order.append("a") or 1, lambda: order.append("b") or 2]), order
    ([1, 2], ['a', 'b'])
    """
    if active():
        raise RuntimeError("dtp.ops.lanes.run: called from inside a lane (its thread would wait for itself)")
    lanes = _Lanes(len(fns))
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)
    ended = threading.Semaphore(0)

    def work(i: int) -> None:
        _here.lane = (lanes, i)
        try:
            with lanes.cv:
                lanes.take(i)
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors[i] = e
        finally:
            _here.lane = None
            with lanes.cv:
                lanes.done[i] = True
                lanes.give(i)
            ended.release()

    with _workers_lock:
        while len(_workers) < len(fns):
            _workers.append(_Worker(len(_workers)))
        workers = _workers[:len(fns)]
    for i, w in enumerate(workers):
        w.jobs.put(lambda i=i: work(i))
    for _ in fns:
        ended.acquire()
    for e in errors:
        if e is not None:
            raise e
    return results
