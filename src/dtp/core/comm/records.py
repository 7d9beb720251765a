"""What collectives leave behind: a :class:`CommRecord` per collective in every active
:func:`comm_log`, beside the compute :class:`Span` s marked with :func:`span`.

Which logs a collective lands in is per thread: those of the :func:`comm_log` blocks the
posting thread is inside. A thread that runs collectives on another's behalf (a
communication stream) records where that thread does with :func:`active_logs` and
:func:`record_into`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

__all__ = ["CommRecord", "Span", "CommLog", "comm_log", "span", "active_logs", "record_into"]


@dataclass
class CommRecord:
    """One collective as one rank saw it."""

    # all_gather | reduce_scatter | all_reduce | all_to_all | all_to_all_v | send_recv | send | recv | barrier
    kind: str
    axis: str  # mesh axis name (a flattened view's name for several axes)
    bytes: int  # bytes this rank sent
    group_size: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # local input shape
    issued: float  # time.perf_counter() when posted
    completed: float | None = None  # when the backend finished it
    async_op: bool = False
    tag: str = ""  # free text from the caller ("ring step 2", "bucket 0", …)
    seq: int = 0  # posting order in this process, from 1 (the flight recorder's number)
    failed: bool = False  # the backend reported an error (see CollectiveError)
    # Seconds the caller spent blocked in wait(): the *exposed* part of the collective
    # (all of it for a synchronous one; ~0 for one hidden behind compute).
    waited: float = 0.0

    @property
    def duration(self) -> float | None:
        return None if self.completed is None else self.completed - self.issued


@dataclass
class Span:
    """A named stretch of compute on this rank (``forward``, ``backward``, ``update`` …)."""

    name: str
    start: float
    end: float | None = None


@dataclass(eq=False)  # identity: nested logs with equal records are still different logs
class CommLog:
    """Records of collectives issued while a :func:`comm_log` block was active, and the
    compute :class:`Span` s marked with :func:`span` (for timelines of overlap).

    >>> import torch
    >>> with dtp.testing.simulate(2):
    ...     x = dtp.shard(torch.zeros(4, 4), dtp.make_mesh(dp=2), dtp.P("dp"))
    ...     with dtp.comm_log() as log:
    ...         _ = dtp.reshard(x, dtp.P())
    >>> [(r.kind, r.axis, r.bytes) for r in log.records]   # one CommRecord per collective
    [('all_gather', 'dp', 32)]
    """

    records: list[CommRecord] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)

    def overlapping(self, span: Span) -> list[CommRecord]:
        """Collectives in flight during ``span`` (issued before it ended, completed after it started)."""
        end = span.end if span.end is not None else time.perf_counter()
        return [r for r in self.records
                if r.issued < end and (r.completed is None or r.completed > span.start)]

    def timeline(self, width: int = 72) -> str:
        """A text timeline: one row per span and per collective, time running left to right.

        >>> with dtp.testing.simulate(2):
        ...     mesh = make_mesh(dp=2)
        ...     with comm_log() as log:
        ...         with span("forward"):
        ...             x = torch.ones(4)
        ...         y = dtp.comm.all_reduce(x, mesh, "dp", tag="grads")
        >>> print(log.timeline())
        |0 ...ms|
        forward |#...|
        all_reduce dp |...=| grads
        """
        rows: list[tuple[str, float, float, str]] = []
        for sp in self.spans:
            rows.append((sp.name, sp.start, sp.end if sp.end is not None else sp.start, ""))
        for r in self.records:
            rows.append((f"{r.kind} {r.axis}", r.issued, r.completed if r.completed is not None else r.issued, r.tag))
        if not rows:
            return "(empty)"
        t0 = min(r[1] for r in rows)
        t1 = max(r[2] for r in rows)
        scale = (width - 1) / max(t1 - t0, 1e-9)
        out = [f"{'':<24}|{'0':<{width - 8}}{1e3 * (t1 - t0):>6.1f}ms|"]
        for i, (label, a, b, tag) in enumerate(rows):
            lo, hi = int((a - t0) * scale), max(int((b - t0) * scale), int((a - t0) * scale))
            mark = "#" if i < len(self.spans) else "="
            bar = " " * lo + mark * (hi - lo + 1)
            out.append(f"{label[:23]:<24}|{bar:<{width}}| {tag}")
        return "\n".join(out)

    def filter(self, kind: str | None = None, axis: str | None = None) -> list[CommRecord]:
        return [r for r in self.records if (kind is None or r.kind == kind) and (axis is None or r.axis == axis)]

    def bytes(self, kind: str | None = None, axis: str | None = None) -> int:
        """Total bytes this rank sent, optionally for one kind and/or axis."""
        return sum(r.bytes for r in self.filter(kind, axis))

    def summary(self) -> dict[str, dict[str, int]]:
        """``{axis: {kind: bytes}}`` — what ``train_step`` reports as metrics."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            per_axis = out.setdefault(r.axis, {})
            per_axis[r.kind] = per_axis.get(r.kind, 0) + r.bytes
        return out

    def __len__(self) -> int:
        return len(self.records)

    def __str__(self) -> str:
        lines = [f"{'kind':<15}{'axis':<10}{'bytes':>12}{'ms':>9}  tag"]
        for r in self.records:
            ms = f"{1e3 * r.duration:.2f}" if r.duration is not None else "-"
            lines.append(f"{r.kind:<15}{r.axis:<10}{r.bytes:>12}{ms:>9}  {r.tag}")
        return "\n".join(lines)


# Per thread: a collective lands in the logs of the comm_log blocks the thread that posts
# it is inside (innermost last); another thread's blocks see it only via record_into.
_active = threading.local()


def _logs() -> list[CommLog]:
    if not hasattr(_active, "logs"):
        _active.logs = []
    return _active.logs


@contextlib.contextmanager
def comm_log(*, isolated: bool = False) -> Iterator[CommLog]:
    """Record every collective dtp issues inside the block (nests freely).

    ``isolated=True``: the block's collectives go to this log alone, not to the logs
    around it — for checks that are not a step's traffic (:mod:`dtp.guard` records its
    one exchange per state / batch signature in its own log, so a step's comm records
    and ``comm_bytes`` stay what the algorithm moves).

    >>> with comm_log() as log:
    ...     pass                                  # reshard, train_step, attention …
    >>> log.bytes("all_to_all")
    0
    """
    log = CommLog()
    logs = _logs()
    hidden = list(logs) if isolated else []
    del logs[:len(hidden)]
    logs.append(log)
    try:
        yield log
    finally:
        logs.remove(log)
        logs[:0] = hidden


@contextlib.contextmanager
def span(name: str) -> Iterator[Span]:
    """Mark a stretch of compute in every active :func:`comm_log` (``train_step`` marks
    ``forward``, ``backward`` and ``update``), so a timeline shows what overlapped what.

    >>> with comm_log() as log, span("forward"):
    ...     pass
    >>> log.spans[0].name
    'forward'
    """
    sp = Span(name, time.perf_counter())
    for log in _logs():
        log.spans.append(sp)
    try:
        yield sp
    finally:
        sp.end = time.perf_counter()


def active_logs() -> tuple[CommLog, ...]:
    """The comm logs this thread records into now, outermost first: what a thread that
    hands collectives to another passes to :func:`record_into` there.

    >>> with comm_log() as outer, comm_log() as inner:
    ...     active_logs() == (outer, inner)
    True
    >>> active_logs()
    ()
    """
    return tuple(_logs())


@contextlib.contextmanager
def record_into(logs: Iterable[CommLog]) -> Iterator[None]:
    """Inside the block, this thread records into ``logs`` (another thread's
    :func:`active_logs`) instead of its own: a worker that runs collectives on behalf of
    that thread (:class:`dtp.ops.moe_pipe.Stream`) keeps its comm log, spans and
    ``comm_bytes`` whole. A :func:`comm_log` opened inside nests on top of ``logs``;
    on leaving, the thread's own logs are back.

    >>> import threading
    >>> with comm_log() as log:
    ...     logs = active_logs()
    ...     def work() -> None:
    ...         with record_into(logs), span("on a worker"):
    ...             pass
    ...     worker = threading.Thread(target=work)
    ...     worker.start()
    ...     worker.join()
    >>> [s.name for s in log.spans]
    ['on a worker']
    """
    own = _logs()
    _active.logs = list(logs)  # a copy: comm_log blocks opened here add to it, not to the caller's
    try:
        yield
    finally:
        _active.logs = own
