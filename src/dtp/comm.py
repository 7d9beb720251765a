"""The one recorded path for collectives.

Every collective dtp issues goes through this module, which runs it on the process
group of one named mesh axis and appends a :class:`CommRecord` to every active
:func:`comm_log`. Tests assert communication volume and overlap from those records;
``train_step`` reports bytes per collective per mesh axis from them.

Functions take and return *local* tensors (the per-rank shards); the DTensor-level
redistribution rules live in :mod:`dtp.redistribute`. Each has ``async_op=True``, which
returns a :class:`CommHandle` whose :meth:`CommHandle.wait` yields the result. Issue time
is taken when the collective is posted, completion time when the backend reports it done
(the work's future callback), not when someone gets round to waiting on it.

Every handle must be waited for on every rank before the process group goes away:
:func:`drain` waits for the ones this process posted and has not waited for (what
``dtp train`` and :mod:`dtp.testing` do before ``destroy_process_group``; a user's loop
calls :func:`dtp.wait` on its state). An unwaited gloo collective that completes while
the interpreter shuts down runs its completion callback (Python) on a gloo thread
and aborts the process (``terminate called without an active exception``).

Bytes are *sent per rank*, counted as the bandwidth-optimal (ring) algorithms move them:

==============  ================================
all_gather      (n-1) × local input bytes
reduce_scatter  (n-1)/n × local input bytes
all_reduce      2 (n-1)/n × bytes
all_to_all      (n-1)/n × local input bytes
all_to_all_v    rows sent to the other coordinates × bytes per row (uneven splits)
send_recv       bytes of the tensor sent
==============  ================================

A flight recorder is always on: the last :data:`FLIGHT_SLOTS` collectives this process
posted, numbered in posting order (:func:`flight_record`), so a rank whose collective
fails can say where it was. dtp's ranks run one program and post the same collectives
in the same order, so comparing ranks' sequence numbers names the rank that is behind. When a collective fails in the backend (a peer died, or did not
join within the process group's timeout: :func:`dtp.make_mesh`'s ``timeout``), it
raises :class:`CollectiveError` with the failed collective and the record in one line.
Under ``DTP_FLIGHT_DIR`` (set by :func:`dtp.launch.launch` for its ranks) each rank
also mirrors its record to a small memory-mapped file there, which outlives the process
even after ``SIGKILL``: the launcher reads every rank's last collectives from it.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import mmap
import os
import re
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "CommRecord",
    "CommLog",
    "ring_bytes",
    "CommHandle",
    "comm_log",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "exchange_counts",
    "send_recv",
    "send",
    "recv",
    "barrier",
    "drain",
    "Span",
    "span",
    "simulated_link",
    "CollectiveError",
    "FlightEntry",
    "flight_record",
    "format_flight_record",
    "FLIGHT_SLOTS",
    "FLIGHT_DIR_ENV",
]


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
    compute :class:`Span` s marked with :func:`span` (for timelines of overlap)."""

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
        ...         y = all_reduce(x, mesh, "dp", tag="grads")
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


# ------------------------------------------------------------------ a simulated slow link
# Overlap only shows on a link slower than compute. On one CPU machine loopback gloo is
# nearly free, so dtp can stand in a documented, deterministic link model: each mesh axis
# is one link of ``bandwidth`` bytes/s and ``latency`` s; a collective's modelled transfer
# starts once the real one has finished (every rank has posted it), queues behind the
# axis's earlier transfers (a link carries one message at a time), and the collective is
# complete when that transfer would be. Waiting on it
# blocks until then; compute in between runs freely — exactly what overlap hides.
_link_lock = threading.Lock()
_mark_lock = threading.Lock()
_link: dict[str, object] = {}


@contextlib.contextmanager
def simulated_link(bandwidth: float, latency: float = 0.0, axes: Sequence[str] | None = None) -> Iterator[None]:
    """Make every recorded collective on ``axes`` (all by default) take at least
    ``latency + bytes_sent / bandwidth`` seconds, queued per axis.

    Bytes are the per-rank bytes of the comm log (ring algorithms), so a ``bandwidth``
    of 1e8 models a 100 MB/s (0.8 Gbit/s) link per rank. Process-wide; every rank must
    use the same settings.

    >>> with dtp.testing.simulate(2):
    ...     mesh = make_mesh(dp=2)
    ...     with simulated_link(bandwidth=50e6, latency=1e-4, axes=("dp",)):
    ...         y = all_reduce(torch.ones(1000), mesh, "dp")   # takes >= 0.1 ms + 4 kB / 50 MB/s
    """
    if bandwidth <= 0 or latency < 0:
        raise ValueError(f"simulated_link: bandwidth must be > 0 and latency >= 0, got {bandwidth}, {latency}")
    with _link_lock:
        previous = dict(_link)
        _link.clear()
        _link.update(bandwidth=float(bandwidth), latency=float(latency),
                     axes=None if axes is None else frozenset(axes), busy={})
    try:
        yield
    finally:
        with _link_lock:
            _link.clear()
            _link.update(previous)


def _link_applies(axis: str) -> bool:
    with _link_lock:
        return bool(_link) and (_link["axes"] is None or axis in _link["axes"])


def _link_deadline(axis: str, nbytes: int) -> float | None:
    """When a modelled transfer of ``nbytes`` on ``axis`` starting now would end (it
    queues behind the axis's earlier transfers)."""
    with _link_lock:
        if not _link:
            return None
        busy: dict[str, float] = _link["busy"]  # type: ignore[assignment]
        start = max(time.perf_counter(), busy.get(axis, 0.0))
        end = start + _link["latency"] + nbytes / _link["bandwidth"]  # type: ignore[operator]
        busy[axis] = end
        return end


def _record(kind: str, axis: str, nbytes: float, n: int, x: torch.Tensor, async_op: bool, tag: str) -> CommRecord:
    rec = CommRecord(kind, axis, int(round(nbytes)), n, x.dtype, tuple(x.shape), time.perf_counter(), None, async_op,
                     tag, next(_seq))
    for log in _logs():
        log.records.append(rec)
    _flight.append(rec)
    if (mirror := _flight_mirror()) is not None:
        mirror.write(rec)
    return rec


# ------------------------------------------------------------------ the flight recorder
FLIGHT_SLOTS = 32
"""How many collectives the flight record keeps (the newest; older ones drop out)."""
FLIGHT_DIR_ENV = "DTP_FLIGHT_DIR"
"""When set (with ``RANK``), each process mirrors its flight record to
``$DTP_FLIGHT_DIR/flight-rank<RANK>.bin``; :func:`flight_record` reads such a file."""

# The ring holds the CommRecords themselves: completion times land in them as they do
# for comm_log, so recording costs an append and a counter (both atomic under the GIL:
# gloo's completion callbacks and the main thread share them without a lock).
_flight: "collections.deque[CommRecord]" = collections.deque(maxlen=FLIGHT_SLOTS)
_seq = itertools.count(1)


@dataclass(frozen=True)
class FlightEntry:
    """One collective of a flight record (see :func:`flight_record`)."""

    seq: int  # posting order in its process, from 1
    kind: str
    axis: str
    tag: str
    bytes: int  # bytes the rank sent
    posted: float  # time.time() when posted: wall clock, comparable across ranks of one machine
    completed: float | None  # time.time() when the backend finished it; None in flight or failed
    failed: bool = False

    @property
    def state(self) -> str:
        """``done``, ``in flight`` (posted, never completed) or ``failed``."""
        return "failed" if self.failed else "in flight" if self.completed is None else "done"

    def __str__(self) -> str:
        tag = f" {self.tag!r}" if self.tag else ""
        return f"#{self.seq} {self.kind} {self.axis}{tag} {_format_bytes(self.bytes)} {self.state}"


def _format_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class _FlightFile:
    """The flight record mirrored to a memory-mapped file: a header and ``FLIGHT_SLOTS``
    fixed slots, collective ``seq`` in slot ``(seq - 1) % FLIGHT_SLOTS``. Writes go to the
    page cache, so the file is whole even when the process is SIGKILLed a moment later."""

    MAGIC = b"DTPFLT01"
    # seq, bytes, state (0 in flight, 1 done, 2 failed), posted, completed (wall clock),
    # kind, axis, tag (UTF-8, cut to fit).
    SLOT = struct.Struct("<qqqdd16s24s40s")
    STATE_AND_DONE = struct.Struct("<qdd")  # state, posted, completed: at offset 16 of a slot
    HEADER = 16

    def __init__(self, path: Path):
        size = self.HEADER + FLIGHT_SLOTS * self.SLOT.size
        with open(path, "w+b") as f:
            f.truncate(size)
            self._map = mmap.mmap(f.fileno(), size)
        self._map[:8] = self.MAGIC
        struct.pack_into("<q", self._map, 8, FLIGHT_SLOTS)
        # perf_counter (the records' clock) to wall clock, taken once: two calls per
        # collective saved; a wall-clock step (NTP) after this is not followed.
        self._to_wall = time.time() - time.perf_counter()

    def _offset(self, seq: int) -> int:
        return self.HEADER + (seq - 1) % FLIGHT_SLOTS * self.SLOT.size

    def write(self, rec: CommRecord) -> None:
        self.SLOT.pack_into(self._map, self._offset(rec.seq), rec.seq, rec.bytes, 0, rec.issued + self._to_wall,
                            math.nan, rec.kind.encode()[:16], rec.axis.encode()[:24],
                            rec.tag.encode(errors="replace")[:40])

    def update(self, rec: CommRecord) -> None:
        """Completion or failure of ``rec`` (skipped once its slot holds a newer one)."""
        off = self._offset(rec.seq)
        if struct.unpack_from("<q", self._map, off)[0] != rec.seq:
            return
        state = 2 if rec.failed else 1 if rec.completed is not None else 0
        done = math.nan if rec.completed is None else rec.completed + self._to_wall
        self.STATE_AND_DONE.pack_into(self._map, off + 16, state, rec.issued + self._to_wall, done)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> list[FlightEntry]:
        data = Path(path).read_bytes()
        if data[:8] != cls.MAGIC:
            raise ValueError(f"flight_record: {path} is not a dtp flight record")
        slots = struct.unpack_from("<q", data, 8)[0]
        out = []
        for i in range(slots):
            seq, nbytes, state, posted, completed, kind, axis, tag = cls.SLOT.unpack_from(data, cls.HEADER + i * cls.SLOT.size)
            if seq <= 0:
                continue

            def text(b: bytes) -> str:
                return b.rstrip(b"\0").decode(errors="replace")

            out.append(FlightEntry(seq, text(kind), text(axis), text(tag), nbytes, posted,
                                   None if state != 1 else completed, failed=state == 2))
        return sorted(out, key=lambda e: e.seq)


_mirror: "_FlightFile | None | bool" = False  # False: DTP_FLIGHT_DIR not looked at yet


def _flight_mirror() -> _FlightFile | None:
    global _mirror
    if _mirror is False:
        directory, rank = os.environ.get(FLIGHT_DIR_ENV), os.environ.get("RANK")
        _mirror = None
        if directory and rank is not None and Path(directory).is_dir():
            with contextlib.suppress(OSError):  # no mirror is better than no collective
                _mirror = _FlightFile(Path(directory) / f"flight-rank{rank}.bin")
    return _mirror  # type: ignore[return-value]


def flight_record(path: str | os.PathLike[str] | None = None) -> list[FlightEntry]:
    """The last :data:`FLIGHT_SLOTS` collectives this process posted, oldest first; or,
    given ``path``, those of the rank that mirrored its record to that file (see
    :data:`FLIGHT_DIR_ENV`), read after that rank has ended — even by ``SIGKILL``.

    Always on, and no collective of its own: the record is a ring of the
    :class:`CommRecord` s every collective makes anyway. Measured (benchmarks/flight_record.py):
    0.45 µs per collective, 1.3 µs with the file mirror, next to 277 µs for the cheapest
    one (4 bytes, 2 gloo ranks). Collectives on an axis of size 1 move nothing and are not
    recorded.

    >>> with dtp.testing.simulate(2):
    ...     mesh = make_mesh(dp=2)
    ...     y = all_reduce(torch.ones(1000), mesh, "dp", tag="grads")
    >>> print(flight_record()[-1])
    #... all_reduce dp 'grads' 4.0 kB done
    """
    if path is not None:
        return _FlightFile.read(path)
    to_wall = time.time() - time.perf_counter()
    return [FlightEntry(r.seq, r.kind, r.axis, r.tag, r.bytes, r.issued + to_wall,
                        None if r.completed is None or r.failed else r.completed + to_wall, r.failed)
            for r in list(_flight)]


def format_flight_record(entries: Sequence[FlightEntry], last: int = 3) -> str:
    """The ``last`` entries of a flight record on one line, oldest first.

    >>> print(format_flight_record([FlightEntry(7, "all_reduce", "dp", "grads", 4096, 0.0, None)]))
    #7 all_reduce dp 'grads' 4.1 kB in flight
    >>> format_flight_record([])
    'none'
    """
    shown = list(entries)[-last:] if last > 0 else []
    return ", ".join(map(str, shown)) if shown else "none"


class CollectiveError(RuntimeError):
    """A collective failed in the backend: a peer's process ended (gloo: connection reset
    or closed by peer, at once) or a peer did not join it within the process group's
    timeout. The message names this rank, the collective and its flight record;
    ``record`` is the failed collective's :class:`CommRecord`."""

    def __init__(self, message: str, record: CommRecord | None = None):
        super().__init__(message)
        self.record = record


# gloo prefixes its errors with the C++ source location and ends the ones about peers with
# advice ("This is typically caused by ... GLHF!"): the one sentence in between is the fact.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*")


def _failure(record: CommRecord, error: BaseException) -> CollectiveError:
    record.failed = True
    if (mirror := _flight_mirror()) is not None:
        mirror.update(record)
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = _SOURCE_PREFIX.sub("", text).split(". This is typically")[0].rstrip(".")
    if "Timed out" in text or "timed out" in text:
        text += " (a peer did not join it in time: stalled or dead, or the timeout is too short for this job)"
    elif "by peer" in text:
        text += " (a peer's process has ended)"
    try:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    except (RuntimeError, ValueError):
        rank = -1
    tag = f" {record.tag!r}" if record.tag else ""
    return CollectiveError(
        f"rank {rank}: {record.kind} over {record.axis!r} (#{record.seq}{tag}) failed "
        f"{time.perf_counter() - record.issued:.2f} s after it was posted: {text}. "
        f"Last collectives here: {format_flight_record(flight_record())}", record)


# Handles posted and not yet waited for (wait() drops them). Weak references suffice: a
# handle's completion callback (the future's ``then``) keeps it alive until the backend
# has finished its work, which is all drain() must wait for; a handle dropped after that
# is gone for good, so a long-lived process (a dtp.testing pool rank) leaks nothing.
_unwaited: "weakref.WeakSet[CommHandle]" = weakref.WeakSet()


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


def _finished() -> torch.Tensor:
    raise AssertionError("CommHandle: result already taken")


class CommHandle:
    """An in-flight collective; :meth:`wait` returns its (post-processed) result."""

    def __init__(self, work: object | None, record: CommRecord | None, finish: Callable[[], torch.Tensor],
                 link: tuple[str, int] | None = None):
        self._work, self._record, self._finish = work, record, finish
        self._link = link  # (axis, bytes) under simulated_link
        self._deadline: float | None = None  # end of the modelled transfer
        self._done = False  # completion seen (and the link booked)
        self._result: torch.Tensor | None = None
        if work is not None:
            _unwaited.add(self)  # until wait(): drain() finds it
        future = getattr(work, "get_future", None)
        if record is not None and work is not None:
            try:
                future().then(self._mark_done)  # type: ignore[misc]
            except (TypeError, RuntimeError, NotImplementedError):
                pass  # no future (gloo's send/recv): completion is taken at wait()

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
            # The modelled transfer starts when the real collective has finished, i.e.
            # once every rank has posted it: waiting for a late peer is never hidden.
            if self._link is not None:
                self._deadline = _link_deadline(*self._link)
            if self._record is not None and self._record.completed is None:
                self._record.completed = max(time.perf_counter(), self._deadline or 0.0)
                if (mirror := _flight_mirror()) is not None:
                    mirror.update(self._record)

    def wait(self) -> torch.Tensor:
        if self._result is None:
            entered = time.perf_counter()
            if self._work is not None:
                try:
                    self._work.wait()
                except RuntimeError as e:  # gloo raises RuntimeError (measured); DistBackendError is a subclass
                    if self._record is None:
                        raise
                    _unwaited.discard(self)  # it will never complete: nothing for drain() to wait on
                    raise _failure(self._record, e) from e
            self._mark_done(None)
            if self._deadline is not None and (left := self._deadline - time.perf_counter()) > 0:
                time.sleep(left)
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
        done = bool(self._work.is_completed())
        return done and (self._link is None or (self._deadline is not None and time.perf_counter() >= self._deadline))


def _group(mesh: DeviceMesh, axis: str) -> tuple[dist.ProcessGroup, int]:
    names = mesh.mesh_dim_names or ()
    if axis not in names:
        raise ValueError(f"collective on unknown mesh axis {axis!r}; the mesh has {names}")
    return mesh.get_group(axis), mesh.size(names.index(axis))


def _run(kind: str, mesh: DeviceMesh, axis: str, x: torch.Tensor, nbytes: Callable[[int], float],
         post: Callable[[dist.ProcessGroup, int], tuple[object, Callable[[], torch.Tensor]]],
         async_op: bool, tag: str) -> torch.Tensor | CommHandle:
    group, n = _group(mesh, axis)
    if n == 1:  # nothing moves: no collective, no record (a ring of one does no send/recv)
        handle = CommHandle(None, None, lambda: x)
        return handle if async_op else handle.wait()
    record = _record(kind, axis, nbytes(n), n, x, async_op, tag)
    try:
        work, finish = post(group, n)
    except RuntimeError as e:  # a peer already gone: gloo can fail at posting
        raise _failure(record, e) from e
    handle = CommHandle(work, record, finish, (axis, record.bytes) if _link_applies(axis) else None)
    return handle if async_op else handle.wait()


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


_RING_SHARE = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
               "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def ring_bytes(kind: str, nbytes: int, n: int) -> int:
    """The bytes one rank sends, as the comm log records them, for a ring ``kind``
    (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``) of ``nbytes`` of
    local input over ``n`` ranks (module docstring's table); :func:`dtp.plan` predicts
    with it.

    >>> ring_bytes("all_reduce", 1000, 4), ring_bytes("all_gather", 1000, 4)
    (1500, 3000)
    """
    return int(round(_RING_SHARE[kind](n) * nbytes))


def all_gather(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, dim: int = 0, out: torch.Tensor | None = None,
               async_op: bool = False, tag: str = "") -> torch.Tensor | CommHandle:
    """Concatenate every rank's ``x`` along ``dim`` in axis-coordinate order.

    ``out`` (``dim=0`` only): a contiguous buffer of the gathered shape to gather into,
    so a caller can hand out views of it while the gather is still in flight.
    """
    x = x.contiguous()
    if out is not None and (dim != 0 or not out.is_contiguous()):
        raise ValueError("all_gather: out= needs dim=0 and a contiguous buffer")

    def post(group: dist.ProcessGroup, n: int):
        nonlocal out
        if out is None:
            out = x.new_empty((n * x.shape[0], *x.shape[1:])) if dim == 0 else x.new_empty((n, *x.shape))
        work = dist.all_gather_single(out.view(-1), x.view(-1), group=group, async_op=True)

        def finish() -> torch.Tensor:
            if dim == 0:
                return out
            stacked = out.movedim(0, dim)  # (..., n, x.shape[dim], ...)
            shape = list(x.shape)
            shape[dim] *= n
            return stacked.reshape(shape)

        return work, finish

    return _run("all_gather", mesh, axis, x, lambda n: ring_bytes("all_gather", _nbytes(x), n), post, async_op, tag)


def reduce_scatter(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, dim: int = 0,
                   async_op: bool = False, tag: str = "") -> torch.Tensor | CommHandle:
    """Sum ``x`` over the axis and keep this rank's ``dim``-chunk (by coordinate).

    Every rank of the axis must pass the same ``async_op``: on gloo the async form is a
    different collective (an all-to-all, see below) with the same bytes.
    """

    def post(group: dist.ProcessGroup, n: int):
        if x.shape[dim] % n:
            raise ValueError(f"reduce_scatter over {axis!r}: dim {dim} of size {x.shape[dim]} does not divide by {n}")
        c = x.shape[dim] // n
        # Bring the n destination chunks to the front so the backend splits on dim 0;
        # what is left, (*x.shape[:dim], c, *x.shape[dim+1:]), is exactly the result.
        inp = x.reshape(*x.shape[:dim], n, c, *x.shape[dim + 1:]).movedim(dim, 0).contiguous()
        if async_op and dist.get_backend(group) == "gloo":
            # gloo's reduce-scatter does not run until wait() (its work never completes
            # on its own: measured, torch 2.13), so an "async" one would hide nothing.
            # The same bytes as an all-to-all, which gloo does run in the background:
            # chunk k goes to coordinate k, and the n chunks that arrive are summed here.
            # Costs a whole-size receive buffer while in flight (instead of 1/n).
            recv = torch.empty_like(inp)
            work = dist.all_to_all_single(recv, inp, group=group, async_op=True)
            return work, (lambda: recv.sum(0, dtype=recv.dtype))
        out = x.new_empty(inp.shape[1:])
        # Flat buffers: the chunks are contiguous either way, and LocalTensorMode's
        # reduce-scatter (torch 2.13) mishandles multi-dim ones.
        work = dist.reduce_scatter_single(out.view(-1), inp.view(-1), group=group, async_op=True)
        return work, (lambda: out)

    return _run("reduce_scatter", mesh, axis, x, lambda n: ring_bytes("reduce_scatter", _nbytes(x), n), post, async_op, tag)


def all_reduce(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, op: str = "sum", async_op: bool = False,
               tag: str = "") -> torch.Tensor | CommHandle:
    """Reduce ``x`` over the axis with ``op`` ("sum" or "max") into a new tensor."""
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    out = x.detach().clone(memory_format=torch.contiguous_format)

    def post(group: dist.ProcessGroup, n: int):
        return dist.all_reduce(out, op=reduce_op, group=group, async_op=True), (lambda: out)

    return _run("all_reduce", mesh, axis, x, lambda n: ring_bytes("all_reduce", _nbytes(x), n), post, async_op, tag)


def all_to_all(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, split_dim: int, concat_dim: int,
               async_op: bool = False, tag: str = "") -> torch.Tensor | CommHandle:
    """Split ``x`` into n chunks along ``split_dim`` (chunk k goes to coordinate k) and
    concatenate what arrives along ``concat_dim`` — Shard(concat_dim) → Shard(split_dim)."""

    def post(group: dist.ProcessGroup, n: int):
        if x.shape[split_dim] % n:
            raise ValueError(
                f"all_to_all over {axis!r}: dim {split_dim} of size {x.shape[split_dim]} does not divide by {n}"
            )
        c = x.shape[split_dim] // n
        inp = x.reshape(*x.shape[:split_dim], n, c, *x.shape[split_dim + 1:]).movedim(split_dim, 0).contiguous()
        out = torch.empty_like(inp)
        work = dist.all_to_all_single(out, inp, group=group, async_op=True)

        def finish() -> torch.Tensor:
            # out[k] is coordinate k's chunk, the k-th block along concat_dim: put the
            # block index right in front of concat_dim and fold the two together.
            shape = list(inp.shape[1:])
            shape[concat_dim] *= n
            return out.movedim(0, concat_dim).reshape(shape)

        return work, finish

    return _run("all_to_all", mesh, axis, x, lambda n: ring_bytes("all_to_all", _nbytes(x), n), post, async_op, tag)


def _check_splits(name: str, counts: Sequence[int], n: int) -> list[int]:
    out = list(counts)
    if len(out) != n or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in out):
        raise ValueError(f"all_to_all_v: {name} must be {n} ints >= 0 (one per axis coordinate), got {counts!r}")
    return out


def all_to_all_v(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, send_counts: Sequence[int],
                 recv_counts: Sequence[int], async_op: bool = False, tag: str = "") -> torch.Tensor | CommHandle:
    """Send rows of ``x`` (dim 0) to each coordinate of ``axis``, ``send_counts[k]`` to
    coordinate k in order; return the rows received, concatenated in coordinate order
    (``recv_counts[k]`` from coordinate k) — the uneven all-to-all of expert parallel.

    Records ``all_to_all_v``: the rows sent to *other* coordinates × bytes per row. Every
    rank's ``recv_counts[k]`` must equal coordinate k's ``send_counts`` for it (exchange
    them with :func:`exchange_counts`); a mismatch is the backend's error or a hang.

    Raises: ``ValueError`` when a count list is not one int >= 0 per coordinate or
    ``send_counts`` does not sum to ``x.shape[0]`` (before any collective, on this rank).
    """
    group, n = _group(mesh, axis)
    send, recv = _check_splits("send_counts", send_counts, n), _check_splits("recv_counts", recv_counts, n)
    if x.dim() == 0 or sum(send) != x.shape[0]:
        raise ValueError(f"all_to_all_v: send_counts {send} must sum to the rows of x (dim 0), "
                         f"got shape {tuple(x.shape)}")
    x = x.contiguous()  # gloo: "Tensors must be contiguous" (measured)
    me = mesh.get_local_rank(axis)
    row = math.prod(x.shape[1:]) * x.element_size()

    def post(group: dist.ProcessGroup, n: int):
        out = x.new_empty((sum(recv), *x.shape[1:]))
        work = dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group,
                                      async_op=True)
        return work, (lambda: out)

    return _run("all_to_all_v", mesh, axis, x, lambda n: (sum(send) - send[me]) * row, post, async_op, tag)


def exchange_counts(counts: torch.Tensor, mesh: DeviceMesh, axis: str, *, async_op: bool = False,
                    tag: str = "counts") -> torch.Tensor | CommHandle:
    """Tell each coordinate how many rows it will get: ``counts[k]`` (int64, dim 0 one
    entry per coordinate, any trailing shape) goes to coordinate k; returns the same shape
    with ``[k]`` what coordinate k sends here. The split sizes of :func:`all_to_all_v`.

    Records an ``all_to_all`` of (n-1) × ``counts[0]``'s bytes. Reading the result on the
    host (``.tolist()``, which :func:`all_to_all_v`'s split sizes need) is expert
    parallel's one host sync per layer: on an accelerator it waits for the exchange.

    Raises: ``ValueError`` when ``counts`` is not int64 with ``counts.shape[0]`` = the axis size.
    """
    _, n = _group(mesh, axis)
    if counts.dtype != torch.int64 or counts.dim() == 0 or counts.shape[0] != n:
        raise ValueError(f"exchange_counts: counts must be int64 with dim 0 of size {n} (the {axis!r} axis), "
                         f"got {counts.dtype} {tuple(counts.shape)}")
    return all_to_all(counts, mesh, axis, split_dim=0, concat_dim=0, async_op=async_op, tag=tag)


def send_recv(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, shift: int = 1, async_op: bool = False,
              tag: str = "") -> torch.Tensor | CommHandle:
    """Ring step: send ``x`` to coordinate ``c + shift`` and receive from ``c - shift``."""
    x = x.contiguous()

    def post(group: dist.ProcessGroup, n: int):
        me = dist.get_rank(group)
        dst = dist.get_global_rank(group, (me + shift) % n)
        src = dist.get_global_rank(group, (me - shift) % n)
        out = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, dst, group), dist.P2POp(dist.irecv, out, src, group)]
        works = dist.batch_isend_irecv(ops)
        return _Works(works), (lambda: out)

    return _run("send_recv", mesh, axis, x, lambda n: _nbytes(x) if n > 1 else 0, post, async_op, tag)


def send(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, to: int, key: int, tag: str = "") -> CommHandle:
    """Post ``x`` to coordinate ``to`` on ``axis`` (point to point, always asynchronous;
    wait on the handle before reusing ``x``). ``key`` (an int, as gloo's tag) pairs it with
    the :func:`recv` of the same key, so sends and receives between two ranks may be
    posted in any order. What a pipeline stage does with its activations and gradients."""
    x = x.contiguous()

    def post(group: dist.ProcessGroup, n: int):
        return dist.isend(x, dist.get_global_rank(group, to), group=group, tag=key), (lambda: x)

    return _run("send", mesh, axis, x, lambda n: _nbytes(x), post, True, tag)  # type: ignore[return-value]


def recv(shape: Sequence[int], dtype: torch.dtype, mesh: DeviceMesh, axis: str, *, frm: int, key: int,
         tag: str = "", device: torch.device | str | None = None) -> CommHandle:
    """Post a receive of a ``shape``/``dtype`` tensor from coordinate ``frm`` on ``axis``
    (asynchronous: ``wait()`` returns the tensor). Records 0 bytes: the sender counts them."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)

    def post(group: dist.ProcessGroup, n: int):
        return dist.irecv(out, dist.get_global_rank(group, frm), group=group, tag=key), (lambda: out)

    return _run("recv", mesh, axis, out, lambda n: 0, post, True, tag)  # type: ignore[return-value]


class _Works:
    """Several backend works that complete together (a send and a receive)."""

    def __init__(self, works: Sequence[object]):
        self.works = list(works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def get_future(self) -> torch.futures.Future:
        """Completes when the send and the receive both have (so the comm log records
        the transfer's real end, not when someone waited on it)."""
        return torch.futures.collect_all([w.get_future() for w in self.works])


def barrier(*, tag: str = "") -> None:
    """Wait until every rank of the default group reaches this call (recorded, 0 bytes).

    For work outside the mesh's axes, such as :mod:`dtp.checkpoint`'s rename after every
    rank has written. A world of one returns at once.

    >>> barrier()
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    record = _record("barrier", "world", 0, dist.get_world_size(), torch.empty(0), False, tag)
    dist.barrier()
    record.completed = time.perf_counter()
