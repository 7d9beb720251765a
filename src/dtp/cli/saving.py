"""The checkpoints of ``dtp train`` as its loop takes them, at each step boundary: the
``--save-every`` saves (``--async-save``: completed at the first boundary where every rank's
files are written), the save ``--save-on-signal`` asks for, and a save that fails (a full
disk) said in one line and survived — unless it was the run's last.

Every decision here is the same on every rank: the step, the flags, and what the ranks
agree on in one small all-reduce (:func:`dtp.comm.any_rank`: a signal seen, a write done).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from torch.distributed.device_mesh import DeviceMesh

from .. import RunConfig, TrainState
from ..checkpoint import store as checkpoint
from ..core import comm
from .parser import UsageError
from .process import Preempted, SaveOnSignal, Terminated
from .report import read_metrics
from .resume import resume_from

__all__ = ["Checkpointing", "Saver", "checkpointing", "records_until", "skipped_line"]


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """Where and how often ``dtp train`` saves, and the checkpoint it resumes from.
    ``fallback``: a damaged newest checkpoint is skipped for the one before it
    (``--keep`` > 1: with one kept there is none before it to trust)."""

    root: Path
    every: int = 0  # 0: never
    keep: int = 3
    async_save: bool = False
    resume_from: Path | None = None
    fallback: bool = True


class Saver:
    """One run's saves, called by every rank at every step boundary (:meth:`after_step`).

    ``extra()`` is what each checkpoint records besides the state (the loader's position,
    the run), taken when it is saved; ``last`` the run's last step, whose save failing ends
    the run (:class:`dtp.checkpoint.SaveFailed`, exit code 1): the steps since the one
    before would be lost without a word. ``note(line)`` says a failed save that training
    survives (rank 0 prints it)."""

    def __init__(self, checkpoints: Checkpointing | None, stop: SaveOnSignal | None, mesh: DeviceMesh, *,
                 extra: Callable[[], dict[str, Any]], last: int, note: Callable[[str], None]) -> None:
        if stop is not None and checkpoints is None:
            raise ValueError("Saver: a stop on a signal saves, and needs the run's checkpoints")
        self.checkpoints, self.stop, self.mesh = checkpoints, stop, mesh
        self.extra, self.last, self.note = extra, last, note
        self.pending: tuple[int, checkpoint.AsyncSave] | None = None  # (step, save in flight)
        self._failed_step: int | None = None  # the step of the last save that failed

    def after_step(self, state: TrainState, step: int) -> None:
        """Step ``step`` is done on every rank: finish a landed async save, save if one is
        due, then stop if any rank has seen the ``--save-on-signal`` signal (after saving
        this step: :class:`dtp.cli.process.Preempted`)."""
        c = self.checkpoints
        if self.pending is not None and not comm.any_rank(not self.pending[1].done(), self.mesh,
                                                          tag="async save landed"):
            self.wait()  # every rank's files are written: rename it now, a failure said now
        saved = None
        if c is not None and c.every and (step % c.every == 0 or step == self.last):
            saved = self._save(state, step, async_save=c.async_save)
        if self.stop is None or step >= self.last or not self.stop.requested(self.mesh):
            return
        self.wait()  # an async save in flight first (this step's, or an earlier one)
        if saved is not None and self._failed_step != step:
            path = saved if isinstance(saved, Path) else saved.path  # this step is saved already
        else:
            path = self._save(state, step, async_save=False)
        if path is None:  # stopped all the same, as the signal asked, with nothing new saved
            stopped = Terminated(f"stopped by {self.stop.name} after step {step}; its save failed")
            stopped.signum = self.stop.signum
            raise stopped
        raise Preempted(self.stop.name, step, path.name)

    def wait(self) -> None:
        """The save in flight completed (or its failure said); collective, every rank."""
        if self.pending is None:
            return
        step, pending = self.pending
        self.pending = None
        try:
            pending.wait()
        except checkpoint.SaveFailed as e:
            self._failed(step, e)

    def _save(self, state: TrainState, step: int, *, async_save: bool) -> Path | checkpoint.AsyncSave | None:
        """Save ``state`` at ``step``; ``None`` if it failed (said, or raised at the last step)."""
        c = self.checkpoints
        assert c is not None  # __init__: a stop comes with checkpoints, and saves are due only with them
        self.wait()  # one save in flight at a time
        try:
            saved = checkpoint.save(state, c.root, keep=c.keep, async_save=async_save, extra=self.extra())
        except checkpoint.SaveFailed as e:
            self._failed(step, e)
            return None
        if isinstance(saved, checkpoint.AsyncSave):
            self.pending = (step, saved)
        return saved

    def _failed(self, step: int, e: checkpoint.SaveFailed) -> None:
        self._failed_step = step
        if step >= self.last and not (self.stop is not None and self.stop.seen):
            raise e  # the run's end, unsaved: an error (exit code 1), not a note
        self.note(f"step {step}: {e}; training goes on")


def checkpointing(config: RunConfig, out: Path) -> Checkpointing:
    """The run's checkpoint settings; with ``--resume`` (or when torchrun restarted the
    ranks after a failure) the newest complete checkpoint in ``out``, found the same way
    on every rank (the directory is shared), which falls back to an older one if it does
    not verify unless ``--keep 1`` (:func:`dtp.checkpoint.load`'s ``fallback``)."""
    return Checkpointing(out / "checkpoints", config.save_every, config.keep, config.async_save, resume_from(config),
                         fallback=config.keep > 1)


def skipped_line(path: Path, why: str, moved: Path | None) -> str:
    """The line a resume says of a damaged checkpoint it skipped."""
    kept = f"renamed {moved.name}" if moved is not None else "it could not be renamed"
    return f"--resume: skipped {path.name}, which does not verify ({why}); {kept}, resuming from the one before"


def records_until(out: Path, step: int, resume_from: Path) -> list[dict[str, Any]]:
    """The metrics of the ``step`` steps (iterations, skips included) the checkpoint
    ``resume_from`` holds."""
    path = out / "metrics.jsonl"
    records = read_metrics(path) if path.exists() else []
    kept = [r for r in records if r.get("step", 0) <= step]
    if len(kept) != step:
        raise UsageError(f"--resume: {path} holds {len(kept)} of the {step} steps before {resume_from.name}; "
                         f"the run directory is not the one the checkpoint was saved in")
    return kept
