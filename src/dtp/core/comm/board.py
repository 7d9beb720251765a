"""The posting board of :func:`dtp.comm.simulated_link`: when each rank posted each
collective and each send, shared between the processes of one machine, so the link model
can start a transfer when every rank it needs has posted — not when the real loopback
transfer happens to finish.

Why: on a busy CPU the real gloo transfer under the model takes milliseconds of its own
(measured with ``benchmarks/link_delay.py`` on 2 cores, ZeRO-1 on dp=2: reduce-scatters
3-5 ms, all-gathers 5-8 ms, 36-45 ms a step of the link standing idle while every rank had
posted). A real link starts moving data once both ends are ready; charging the loopback
time first and the modelled transfer after it counted the transfer twice.

Each rank writes into its own small memory-mapped file (one per :func:`simulated_link`
context, in a directory of the user's own under the temporary directory) and reads its
peers' files. Times are ``time.perf_counter()``, the records' clock, which on Linux is
``CLOCK_MONOTONIC``: one clock for every process of the machine, so no conversion (a
per-process offset to the wall clock, sampled in two calls, was off by milliseconds on
a loaded machine). Where ``perf_counter`` is another clock there is no board.

A file outlives its context: a sender leaves its context without waiting for the
receiver, which may read the sender's entry later (measured: a send waited, then its
context left, before the peer had posted the receive). A process keeps its last
:data:`KEPT` files and removes the rest, and all of them at exit.

Ranks run one program, so the n-th collective on a group, and the n-th message from a
rank to another with one tag, are the same operation on every rank: that is the key an
entry is found by, with the collective's kind or the message's size in it. Ranks that
got out of step (entered different :func:`simulated_link` contexts) read each other as
unknown where the operations differ in kind or size — where they do not, as the other
one (an optimistic start: hence simulated_link's rule that every rank enters the same
contexts). An entry a peer has not written (another machine, a file already gone, a
slot overwritten) reads as unknown, and so does anything that goes wrong reading it;
the model then falls back to starting the transfer when the real one has finished (the
conservative choice).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import mmap
import os
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Callable, Iterable

import torch.distributed as dist

__all__: list[str] = []

# Entries a rank keeps, hashed: an entry is lost (reads as unknown) if about SLOTS later
# postings of this rank land on its slot before its peers read it — in a step, dozens.
SLOTS = 8192
KEPT = 16  # board files a process keeps (128 kB each at most): a sender may be contexts ahead
_SLOT = struct.Struct("<qd")  # key, posted (perf_counter)
_KEY = struct.Struct("<q")
_generation = itertools.count(1)  # simulated_link contexts entered by this process
_files: collections.deque[Path] = collections.deque()  # this process's board files, oldest first


class Board:
    """This process's posting board for one :func:`simulated_link` context."""

    def __init__(self, directory: Path, run: str, generation: int, rank: int):
        self._prefix = directory / f"dtp-link-{run}-{generation}-rank"
        self._generation = generation
        self.path = Path(f"{self._prefix}{rank}.bin")
        size = SLOTS * _SLOT.size
        # Truncated (whatever an earlier run left is gone); a link in its place is refused.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._peers: dict[int, mmap.mmap] = {}
        self._counts: collections.Counter[tuple] = collections.Counter()
        self._members: dict[str, list[int]] = {}
        self._lock = threading.Lock()  # posting threads (a pipeline's) share the counters

    def _key(self, group: dist.ProcessGroup, what: tuple) -> int:
        with self._lock:
            name = group.group_name
            self._counts[(name, what)] += 1
            count = self._counts[(name, what)]
        # Ints and tuples of ints hash alike in every process (strings would not: hash
        # randomisation), so every "what" is a tuple of ints. Never 0 (an empty slot).
        return hash((self._generation, zlib.crc32(name.encode()), what, count)) % (2 ** 62 - 1) + 1

    def _write(self, key: int, posted: float) -> None:
        off = key % SLOTS * _SLOT.size
        # Key cleared, time written, key set: a reader that reads the key before and after
        # the time and finds this key both times has this time — on x86's ordered stores;
        # elsewhere a torn read is possible (a modelled start off, never a hang: a start
        # after now is taken as now, dtp.comm.link._link_deadline).
        _KEY.pack_into(self._map, off, 0)
        struct.pack_into("<d", self._map, off + 8, posted)
        _KEY.pack_into(self._map, off, key)

    def _read(self, rank: int, key: int) -> float | None:
        """When ``rank`` posted the operation ``key`` (``perf_counter``), or None."""
        m = self._peer(rank)
        if m is None:
            return None
        off = key % SLOTS * _SLOT.size
        try:
            first, posted = _SLOT.unpack_from(m, off)
            again = _KEY.unpack_from(m, off)[0]
        except (ValueError, BufferError, struct.error):  # closed under us, or not a board
            return None
        return posted if first == again == key else None

    def _peer(self, rank: int) -> mmap.mmap | None:
        if rank not in self._peers:
            try:
                with open(f"{self._prefix}{rank}.bin", "rb") as f:
                    self._peers[rank] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # not there (yet, or any more): unknown
                return None
        return self._peers[rank]

    def _ranks(self, group: dist.ProcessGroup) -> list[int]:
        name = group.group_name
        if name not in self._members:
            self._members[name] = dist.get_process_group_ranks(group)
        return self._members[name]

    def collective(self, group: dist.ProcessGroup, kind: str, posted: float) -> Callable[[], float | None]:
        """Note this rank's next collective on ``group`` (``kind``, posted at ``posted``:
        ``perf_counter``); the returned function, called once the collective has
        finished, tells when the last rank posted it (None if some rank's entry is missing)."""
        key = self._key(group, (0, zlib.crc32(kind.encode())))
        self._write(key, posted)
        ranks = self._ranks(group)

        def last_posted() -> float | None:
            times = [self._read(r, key) for r in ranks]
            return None if None in times else max(times)  # type: ignore[type-var]
        return last_posted

    def send(self, group: dist.ProcessGroup, to: int, tag: int, nbytes: int, posted: float) -> None:
        """Note this rank's next message (``nbytes``) to group rank ``to`` with ``tag``."""
        me = dist.get_rank(group)
        self._write(self._key(group, (1, me, to, tag, nbytes)), posted)

    def recv(self, group: dist.ProcessGroup, frm: int, tag: int, nbytes: int,
             posted: float) -> Callable[[], float | None]:
        """The receive (``nbytes``) matching group rank ``frm``'s next :meth:`send` to this
        rank with ``tag``; the returned function, called once the data has arrived, tells
        when both ends had posted (None if the sender's entry is missing)."""
        me = dist.get_rank(group)
        key = self._key(group, (1, frm, me, tag, nbytes))
        sender = self._ranks(group)[frm]

        def both_posted() -> float | None:
            sent = self._read(sender, key)
            return None if sent is None else max(sent, posted)
        return both_posted


def open_board() -> Board | None:
    """A board for a new :func:`simulated_link` context, or None where ranks cannot share
    one: no process group, a single process, no ``MASTER_PORT`` to tell this run's files
    from another's on the same machine, ``perf_counter`` not the machine's monotonic
    clock, or any error making the file."""
    generation = next(_generation)  # every rank enters its contexts in the same order
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    port = os.environ.get("MASTER_PORT")
    if port is None or "CLOCK_MONOTONIC" not in time.get_clock_info("perf_counter").implementation:
        return None
    try:
        user = os.getuid() if hasattr(os, "getuid") else os.getpid()  # type: ignore[attr-defined]
        directory = Path(tempfile.gettempdir()) / f"dtp-link-{user}"
        directory.mkdir(mode=0o700, exist_ok=True)
        board = Board(directory, port, generation, dist.get_rank())
    except Exception:  # no board is better than no link
        return None
    if not _files:
        atexit.register(_remove, _files)
    _files.append(board.path)
    while len(_files) > KEPT:
        _remove([_files.popleft()])
    return board


def _remove(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()
