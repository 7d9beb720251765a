"""The flight recorder: every collective this process posts is numbered and the last
:data:`FLIGHT_SLOTS` kept (:func:`flight_record`), so a rank whose collective fails can
say where it was.

dtp's ranks run one program and post the same collectives in the same order, so
comparing ranks' sequence numbers names the rank that is behind. When a collective fails
in the backend (a peer died, or did not join within the process group's timeout:
:func:`dtp.make_mesh`'s ``timeout``), it raises :class:`CollectiveError` with the failed
collective and the record in one line. Under ``DTP_FLIGHT_DIR`` (set by
:func:`dtp.launch.launch` for its ranks) each rank also mirrors its record to a small
memory-mapped file there, which outlives the process even after ``SIGKILL``: the
launcher reads every rank's last collectives from it.
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from .records import CommRecord, _logs

__all__ = ["FLIGHT_SLOTS", "FLIGHT_DIR_ENV", "FlightEntry", "flight_record", "format_flight_record",
           "CollectiveError"]

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


def _record(kind: str, axis: str, nbytes: float, n: int, x: torch.Tensor, async_op: bool, tag: str) -> CommRecord:
    """Number a collective being posted and record it: in every active comm log, the
    flight record and its file mirror (the one place a :class:`CommRecord` is made)."""
    rec = CommRecord(kind, axis, int(round(nbytes)), n, x.dtype, tuple(x.shape), time.perf_counter(), None, async_op,
                     tag, next(_seq))
    for log in _logs():
        log.records.append(rec)
    _flight.append(rec)
    if (mirror := _flight_mirror()) is not None:
        mirror.write(rec)
    return rec


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
    ...     y = dtp.comm.all_reduce(torch.ones(1000), mesh, "dp", tag="grads")
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

    # Named where it is imported from: a rank's uncaught one prints
    # ``dtp.comm.CollectiveError: rank 0: …``, the line the launcher passes on.
    __module__ = "dtp.comm"

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
    # gloo says "Timed out waiting …" for the collective that timed out, and "Application
    # timeout caused pair closure" for one posted beside it on the same pair (a step's
    # gradient all-reduces are posted together): the same fact.
    if "timed out" in text.lower() or "timeout" in text.lower():
        text += " (a peer did not join it in time: stalled or dead, or the timeout is too short for this job)"
    elif "by peer" in text:
        text += " (a peer's process has ended)"
    try:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    except (RuntimeError, ValueError):
        rank = -1
    tag = f" {record.tag!r}" if record.tag else ""
    entries = flight_record()
    shown = format_flight_record(entries)
    # Collectives posted together and waited later (a step's gradient all-reduces) put the
    # failed one before the last three: name it first, so the line always shows it.
    if all(e.seq != record.seq for e in entries[-3:]):
        shown = ", …, ".join([str(e) for e in entries if e.seq == record.seq][:1] + [shown])
    return CollectiveError(
        f"rank {rank}: {record.kind} over {record.axis!r} (#{record.seq}{tag}) failed "
        f"{time.perf_counter() - record.issued:.2f} s after it was posted: {text}. "
        f"Last collectives here: {shown}", record)
