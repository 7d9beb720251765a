"""A rank's life around the training loop of ``dtp train``: its world (torchrun's, or one
process), a clean shutdown of the process group, and what ``SIGTERM`` does meanwhile."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import threading
from typing import Any, Iterator, TextIO

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import comm, make_mesh
from ..launch import in_torchrun
from ..mesh import clear_mesh_cache
from .flags import mesh_axes

__all__ = ["Terminated", "single_process_world", "run_world", "sigterm_raises", "sigterm_ignored", "why",
           "ReaderGone", "survive_closed_output", "note_when_output_closes"]


@contextlib.contextmanager
def single_process_world() -> Iterator[DeviceMesh]:
    """A 1-rank mesh in this process; the process group it creates is torn down after,
    so ``main()`` called from Python leaves no global state behind."""
    created = not dist.is_initialized()
    try:
        yield make_mesh(dp=1)
    finally:
        if created and dist.is_initialized():
            clear_mesh_cache()
            dist.destroy_process_group()


@contextlib.contextmanager
def run_world(args: argparse.Namespace) -> Iterator[DeviceMesh]:
    """The run's mesh: from torchrun's environment in a rank, else a world of one here."""
    if not in_torchrun():
        with single_process_world() as mesh:
            yield mesh
        return
    created = not dist.is_initialized()
    try:
        yield make_mesh(**mesh_axes(args), timeout=args.timeout)
        _quiesce()
    finally:
        # A clean shutdown: torch warns about process groups left to the interpreter exit.
        if created and dist.is_initialized():
            clear_mesh_cache()  # a live DeviceMesh keeps the group and its gloo threads alive (measured)
            dist.destroy_process_group()


def _quiesce() -> None:
    """Before the process group goes: nothing in flight here, nor on any peer.

    Measured on torch 2.13 (gloo; a core dump of an aborted rank): the group outlived
    ``destroy_process_group`` (a live DeviceMesh holds it) into interpreter shutdown, an
    all-gather of the last step completed then on a gloo thread, and its Python completion
    callback (dtp.comm's timing) could not take the GIL: ``pthread_exit`` through C++ →
    ``terminate called without an active exception``. So wait for every handle this rank
    posted (``train_loop`` already waited for its state's), then a barrier, so no rank closes
    its connections while a peer is still in a collective with it (the issue's
    ``gloo::IoException ... Connection reset by peer``). Only on success: after an error
    the peers may never reach the barrier (the launcher stops them instead).
    """
    comm.drain()
    dist.barrier()


class Terminated(KeyboardInterrupt):
    """``SIGTERM`` reached this rank (the launcher stopping it, or ``kill``): raised like
    Ctrl-C's ``KeyboardInterrupt``, so the run's summary and plot are written on the way out."""

    signum = signal.SIGTERM


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While training, ``SIGTERM`` raises :class:`Terminated` (Python's default would end
    the process on the spot, files unwritten). Only in the main thread: elsewhere Python
    cannot install handlers, and the caller has its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(f"stopped by signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def sigterm_ignored() -> Iterator[None]:
    """``SIGTERM`` waits (ignored) while rank 0 writes its last files, a second or so; the
    launcher's agent would ``SIGKILL`` a rank that took 30 s. Main thread only (as above)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def why(e: BaseException) -> str:
    """What ended a run early, for ``summary.json``'s ``interrupted``."""
    if isinstance(e, Terminated):
        return "SIGTERM"
    if isinstance(e, KeyboardInterrupt):
        return "Ctrl-C"
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


class ReaderGone(io.TextIOBase):
    """A console stream that outlives its reader: ``dtp train … | head -3``.

    Measured on torch 2.13 before this: ``head`` exits after three lines, rank 0's next
    progress line raised ``BrokenPipeError``, the launcher reported "rank 0 failed" and
    stopped the others mid-step (rc 1): a run lost because a pager closed. Now the first
    write that meets a closed pipe points the file descriptor at ``os.devnull`` (so the
    interpreter's own flush at exit, and every later write, go nowhere without an error),
    ``note`` goes once to stderr if it is still open, and the process carries on: the run's
    files (``metrics.jsonl``, ``summary.json``) hold everything the console would have said.

    >>> import os, sys
    >>> r, w = os.pipe(); os.close(r)                  # a pipe whose reader has gone
    >>> out = ReaderGone(open(w, "w"))
    >>> print("step 1", file=out, flush=True)          # no BrokenPipeError
    >>> out.gone
    True
    """

    def __init__(self, stream: TextIO, note: str | None = None, *, err: TextIO | None = None) -> None:
        self.stream, self.note, self.err = stream, note, err
        self.gone = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        if self.gone:
            return
        self.gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self.stream.fileno())
        finally:
            os.close(devnull)
        if self.note and self.err is not None:
            print(self.note, file=self.err, flush=True)

    def isatty(self) -> bool:
        return not self.gone and self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream.encoding


def survive_closed_output() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` :class:`ReaderGone` streams: the console
    script's, not those of a Python caller of :func:`dtp.cli.main`. Quiet when the reader
    goes (``dtp plan | head`` ends as ``cat`` would) until :func:`note_when_output_closes`."""
    err = ReaderGone(sys.stderr)
    sys.stderr = err  # type: ignore[assignment]
    sys.stdout = ReaderGone(sys.stdout, err=err)  # type: ignore[assignment]


def note_when_output_closes(note: str) -> None:
    """What the process that trains says on stderr if stdout's reader goes (nothing when
    stdout is not a :class:`ReaderGone`: a Python caller's own stream)."""
    if isinstance(sys.stdout, ReaderGone):
        sys.stdout.note = note
