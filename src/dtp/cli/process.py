"""A rank's life around the training loop of ``dtp train``: its world (torchrun's, or one
process), a clean shutdown of the process group, and what a signal does meanwhile:
``SIGTERM`` raises where the rank is (:func:`sigterm_raises`), unless ``--save-on-signal``
names it, whose signal only sets a flag the loop reads between steps (:class:`SaveOnSignal`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import RunConfig, make_mesh
from ..core import comm
from ..core.mesh.launch import PREEMPTED_CODE, in_torchrun
from ..core.mesh.devices import clear_mesh_cache

__all__ = ["Terminated", "Preempted", "PREEMPTED", "SaveOnSignal", "single_process_world", "run_world",
           "stop_signals", "sigterm_raises", "sigterm_ignored", "why"]

#: The exit code of a run stopped by its ``--save-on-signal`` signal after the save completed
#: (the launcher's, which returns it too: one constant).
PREEMPTED = PREEMPTED_CODE


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
def run_world(config: RunConfig) -> Iterator[DeviceMesh]:
    """The run's mesh (:meth:`dtp.RunConfig.mesh_axes`, collectives timing out after its
    ``timeout``): from torchrun's environment in a rank, else a world of one here."""
    if not in_torchrun():
        with single_process_world() as mesh:
            yield mesh
        return
    created = not dist.is_initialized()
    try:
        yield make_mesh(**config.mesh_axes(), timeout=config.timeout)
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
    comm.barrier(tag="exit")  # recorded: a hang at exit shows in the flight records which ranks got here


class Terminated(KeyboardInterrupt):
    """``SIGTERM`` reached this rank (the launcher stopping it, or ``kill``): raised like
    Ctrl-C's ``KeyboardInterrupt``, so the run's summary and plot are written on the way out."""

    signum = signal.SIGTERM


class Preempted(Exception):
    """The run stopped after its ``--save-on-signal`` save: every rank finished the same
    step and the checkpoint of it is complete. Exit code :data:`PREEMPTED`."""

    def __init__(self, signal_name: str, step: int, path: str) -> None:
        super().__init__(f"stopped by {signal_name} after step {step}: saved {path}; continue with --resume")
        self.signal_name, self.step, self.path = signal_name, step, path


class SaveOnSignal:
    """``--save-on-signal SIGNAL``: that signal's handler, and ``SIGTERM``'s, only note it
    (any number of times, during the save too); :meth:`requested`, called by every rank at
    each step boundary, says whether any rank has seen one. Raising where the signal lands,
    as ``SIGTERM`` does otherwise, could stop a rank inside a collective its peers then wait
    in; a flag read between steps lets every rank finish the step it is in, and the ranks
    agree on which step to save although the signal reached each at its own moment.
    ``SIGTERM`` too: torchrun's agent, signalled a second time while the ranks save, stops
    them with ``SIGTERM`` (measured on torch 2.13: its ``run`` calls ``_shutdown`` again
    from its ``finally``), which must not cut the save short.

    >>> import os
    >>> stop = SaveOnSignal("SIGUSR1")
    >>> with stop:
    ...     os.kill(os.getpid(), signal.SIGUSR1)
    >>> stop.name, stop.requested(make_mesh(dp=1))
    ('SIGUSR1', True)
    """

    def __init__(self, name: str) -> None:
        self.asked, self.name, self.seen = name, name, False  # name: the first signal seen
        self._previous: dict[int, Any] = {}

    def _note(self, signum: int, frame: Any) -> None:
        if not self.seen:
            self.seen, self.name = True, signal.Signals(signum).name

    def __enter__(self) -> "SaveOnSignal":
        if threading.current_thread() is threading.main_thread():  # only there can Python install handlers
            for signum in dict.fromkeys((getattr(signal, self.asked), signal.SIGTERM)):
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def requested(self, mesh: DeviceMesh) -> bool:
        """Has any rank seen the signal? A collective (:func:`dtp.comm.any_rank`): every rank
        calls it at the same step boundary."""
        return comm.any_rank(self.seen, mesh, tag="save on signal")

    @property
    def signum(self) -> int:
        return int(getattr(signal, self.name))


@contextlib.contextmanager
def stop_signals(save_on: str | None) -> Iterator[SaveOnSignal | None]:
    """While training: ``save_on``'s signal (``--save-on-signal``) and ``SIGTERM`` set the
    flag yielded; without it ``SIGTERM`` raises :class:`Terminated`."""
    if save_on is None:
        with sigterm_raises():
            yield None
        return
    with SaveOnSignal(save_on) as stop:
        yield stop


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
    if isinstance(e, Preempted):
        return f"{e.signal_name}, saved {e.path}"
    if isinstance(e, KeyboardInterrupt):
        return "Ctrl-C"
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
