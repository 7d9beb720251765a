"""What rank 0 shows and writes: the per-step line and progress bar, the run directory's
files, the summary and the loss plot.

=================  =============================================================
``config.json``    the resolved arguments, mesh, vocabulary size, world size
``metrics.jsonl``  one JSON object per step, appended as the step ends: loss, grad_norm,
                   lr, tokens, step_time, tokens_per_s, comm_bytes ``{axis: {kind:
                   bytes}}``, skipped (the update was skipped: non-finite loss or
                   gradient norm), skipped_steps (skips so far), mfu (estimate), and
                   eval_loss on the steps that evaluated
``summary.json``   first/last loss, mean step time, tokens/s, bytes per mesh axis,
                   skipped steps, last eval loss; ``interrupted`` (why) when the run
                   stopped early (Ctrl-C, SIGTERM, a crash): it is written then too
``loss.png``       the loss curve (matplotlib when installed, a built-in writer if not)
``tensorboard/``   with ``--tensorboard``: the same scalars as TensorBoard events
``logs/``          ``rank<N>.txt``: the traceback of a rank that crashed
``check.json``     with ``--check`` (or after ``dtp check``): per-step losses of the
                   1-process reference and the largest absolute / relative difference,
                   of every step in ``metrics.jsonl``; a ``--resume`` removes it once its
                   checkpoint has loaded (it would cover only the earlier steps)
=================  =============================================================

Every file but ``metrics.jsonl`` is written whole to a temporary name and renamed, so a
reader (or a run killed mid-write) never sees half a file. ``metrics.jsonl`` grows by
one line per step (rewriting it whole made a run quadratic in its steps); a reader
skips a last line that is not complete yet.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from ..core.mesh.launch import report_error as _report_error
from ..training.plot import atomic_path, plot_loss
from .parser import PROG, RUN_FILES

__all__ = ["print_compile_report", "format_bytes", "format_step", "format_duration", "progress_bar", "summarize", "describe_exception",
           "clear_run_files", "read_metrics", "report_exception", "Progress", "plot_losses", "write_json",
           "atomic_write_text", "format_summary", "default_out", "ReaderGone", "survive_closed_output",
           "note_when_output_closes"]


# --------------------------------------------------------------------------- console


def format_bytes(n: float) -> str:
    """Decimal units, one decimal: what a per-step line has room for.

    >>> format_bytes(512), format_bytes(1_234_567), format_bytes(3.2e9)
    ('512B', '1.2MB', '3.2GB')
    """
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def _axis_totals(comm: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    return {axis: sum(kinds.values()) for axis, kinds in comm.items()}


def format_duration(seconds: float) -> str:
    """A duration for an ETA: ``42s``, ``3m05s``, ``2h07m``.

    >>> format_duration(42.4), format_duration(185), format_duration(7620)
    ('42s', '3m05s', '2h07m')
    """
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_step(step: int, total: int, m: Mapping[str, Any], eta: float | None = None) -> str:
    """One line per step, from ``train_step``'s metrics (and ``eta``, seconds left).

    The step number is padded to the width of the total, so columns line up in a log; a
    held-out loss is shown on the steps that evaluated; a skipped update (non-finite
    loss or gradient norm) is marked at the end.

    >>> format_step(3, 50, {"loss": 4.1234, "grad_norm": 1.0213, "lr": 3e-3, "tokens": 512,
    ...                     "step_time": 0.05, "comm_bytes": {"tp": {"all_reduce": 1_200_000}}}, eta=2.35)
    'step  3/50 loss 4.1234 gnorm 1.02 lr 3.0e-03 tok/s 10240 comm tp:1.2MB eta 2s'
    """
    width = len(str(total))
    step_time = float(m.get("step_time") or 0.0)
    tps = f"{m['tokens'] / step_time:.0f}" if step_time > 0 else "-"
    totals = _axis_totals(m.get("comm_bytes") or {})
    comm = " ".join(f"{axis}:{format_bytes(b)}" for axis, b in totals.items() if b) or "none"
    moe = (f" aux {_digits(m['aux_loss'])} load {m['expert_imbalance']:.2f}x"
           + (f" dropped {m['dropped_fraction']:.1%}" if m.get("dropped_fraction") else "")) if "aux_loss" in m else ""
    held_out = f" eval {m['eval_loss']:.4f}" if m.get("eval_loss") is not None else ""
    return (f"step {step:>{width}}/{total} loss {m['loss']:.4f}{held_out}{moe} gnorm {_digits(m['grad_norm'])} "
            f"lr {m['lr']:.1e} tok/s {tps} comm {comm}" + (f" eta {format_duration(eta)}" if eta is not None else "")
            + (" SKIPPED (non-finite)" if m.get("skipped") else ""))


def _digits(value: float) -> str:
    """Three significant digits, trailing zeros kept so a column keeps its width (``2.00``,
    not ``2``), and no bare point (``123``, not ``123.``).

    >>> [_digits(v) for v in (2.0, 2.1, 123.4, 0.0003, 12345.0)]
    ['2.00', '2.10', '123', '0.000300', '1.23e+04']
    """
    return f"{value:#.3g}".rstrip(".")


def progress_bar(step: int, total: int, width: int = 24) -> str:
    """A text progress bar.

    >>> progress_bar(5, 10, width=10)
    '[#####.....]  50%'
    """
    done = round(width * step / total) if total else width
    return f"[{'#' * done}{'.' * (width - done)}] {100 * step // max(total, 1):>3d}%"


class Progress:
    """Rank 0's console output: a live bar on a terminal, plain lines in a log file."""

    def __init__(self, total: int, log_every: int, stream: TextIO | None = None):
        self.total, self.log_every = total, log_every
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.times: list[float] = []  # wall time of each step this process ran

    def eta(self, step: int) -> float | None:
        """Seconds left at the mean time of the steps so far (the first left out once
        there are others: it carries one-off set-up); ``None`` before any."""
        timed = self.times[1:] or self.times
        return (self.total - step) * sum(timed) / len(timed) if timed else None

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.times.append(float(metrics.get("step_time") or 0.0) + float(metrics.get("eval_time") or 0.0))
        line = format_step(step, self.total, metrics, eta=self.eta(step) if step < self.total else None)
        keep = step % self.log_every == 0 or step == self.total or step == 1
        if self.tty:
            # \r + erase-line: the bar line is redrawn in place; logged lines scroll above it.
            # Cut to the terminal's width: a wrapped line could not be redrawn with \r.
            columns = shutil.get_terminal_size((100, 24)).columns
            live = f"{progress_bar(step, self.total)} {line}"[: max(columns - 1, 20)]
            text = f"\r\x1b[K{line}\n" if keep else ""
            text += f"\r\x1b[K{live}" if step < self.total else ""
            self.stream.write(text)
        elif keep:
            self.stream.write(line + "\n")
        self.stream.flush()


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


# --------------------------------------------------------------------------- files


def default_out() -> str:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, k = base, 1
    while path.exists():  # two runs started within the same second
        path, k = base.with_name(f"{base.name}-{k}"), k + 1
    return str(path)


def clear_run_files(out: Path) -> None:
    """``--overwrite``: delete what an earlier run wrote in ``out`` (:data:`~dtp.cli.parser.RUN_FILES`,
    their temporary files too), and nothing else that is there."""
    for name in RUN_FILES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def describe_exception(e: BaseException, *, log_dir: Path | None = None, rank: int = 0) -> str:
    """``Type: message (file:line in function)`` for a crash, naming the innermost frame in
    dtp or the user's code (not torch's or the standard library's); the full traceback
    is written to ``log_dir/rank<N>.txt`` when given (and that path is named).

    >>> try:
    ...     {}["missing"]
    ... except KeyError as err:
    ...     describe_exception(err).startswith("KeyError: 'missing' (")
    True
    """
    frames = traceback.extract_tb(e.__traceback__)
    foreign = (os.path.dirname(os.__file__), os.sep + "torch" + os.sep, "site-packages" + os.sep + "torch")
    ours = [f for f in frames if not any(part in f.filename for part in foreign)]
    frame = (ours or frames or [None])[-1]
    message = " ".join(str(e).split()) or "(no message)"
    text = f"{type(e).__name__}: {message[:300]}"
    if frame is not None:
        text += f" ({_short_path(frame.filename)}:{frame.lineno} in {frame.name})"
    if log_dir is not None:
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            path = log_dir / f"rank{rank}.txt"
            path.write_text("".join(traceback.format_exception(type(e), e, e.__traceback__)))
            text += f"; traceback in {path} (or rerun with --debug)"
        except OSError:
            text += "; rerun with --debug for the traceback"
    return text


def _short_path(filename: str) -> str:
    # dtp's own files relative to the package ("dtp/cli/loop.py"); the user's as they are
    marker = os.sep + "dtp" + os.sep
    return "dtp" + os.sep + filename.rsplit(marker, 1)[1] if marker in filename else filename


def atomic_write_text(path: Path, text: str) -> None:
    # tmp file in the same directory + rename: readers never see a partial file, and a
    # run killed mid-write leaves the previous complete version.
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def print_compile_report(step: int, graphs_per_step: Sequence[int]) -> None:
    """``dtp train --compile --debug``: after the first and the last step, on rank 0, the
    graph breaks met and the recompiles (graphs compiled after the first step)."""
    import torch.distributed as dist  # here: the launcher reads this module before torch

    from ..core import compiled  # torch, as the import above

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"compile after step {step}: " + compiled.report(recompiles=sum(graphs_per_step[1:])), flush=True)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a last line still being written (or cut short
    by a crash) is left out.

    >>> p = Path("m.jsonl"); _ = p.write_text('{"step": 1}\\n{"step": 2}\\n{"st')
    >>> read_metrics(p)
    [{'step': 1}, {'step': 2}]
    """
    records = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the last line only: anything earlier is a broken file
                break
            raise
    return records


def plot_losses(out: Path, curves: Mapping[str, Sequence[float]], cfg: Mapping[str, Any]) -> None:
    mesh = " ".join(f"{k}={v}" for k, v in cfg["mesh"].items()) + (" +sp" if cfg.get("sp") else "")
    plot_loss(out / "loss.png", curves, title=f"{cfg['model']} {cfg['dtype']} {mesh}")


# --------------------------------------------------------------------------- summaries


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Totals over a run's per-step metrics.

    Step times and throughput leave out step 1 when there are more (it carries one-off
    set-up: process-group warm-up, allocator growth), and say so with ``timed_steps``.

    >>> s = summarize([{"loss": 5.0, "step_time": 1.0, "tokens": 10, "comm_bytes": {"dp": {"all_reduce": 4}}},
    ...                {"loss": 4.0, "step_time": 0.5, "tokens": 10, "comm_bytes": {"dp": {"all_reduce": 4}}}])
    >>> s["first_loss"], s["last_loss"], s["mean_step_time"], s["tokens_per_s"], s["comm_bytes_per_axis"]
    (5.0, 4.0, 0.5, 20.0, {'dp': 8})
    """
    if not records:
        raise ValueError("summarize: no steps")
    timed = records[1:] if len(records) > 1 else records
    time_total = sum(float(r["step_time"]) for r in timed)
    comm: dict[str, dict[str, int]] = {}
    for r in records:
        for axis, kinds in (r.get("comm_bytes") or {}).items():
            per_axis = comm.setdefault(axis, {})
            for kind, b in kinds.items():
                per_axis[kind] = per_axis.get(kind, 0) + int(b)
    losses = [float(r["loss"]) for r in records]
    evals = [float(r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    return {
        "steps": len(records),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "min_loss": min((x for x in losses if math.isfinite(x)), default=math.nan),  # min() and NaN disagree
        "mean_step_time": time_total / len(timed),
        "timed_steps": len(timed),
        "tokens_per_s": sum(int(r["tokens"]) for r in timed) / time_total if time_total > 0 else None,
        "total_tokens": sum(int(r["tokens"]) for r in records),
        "comm_bytes_per_axis": _axis_totals(comm),
        "comm_bytes": comm,
        "skipped_steps": sum(bool(r.get("skipped")) for r in records),
        **({"eval_loss": evals[-1], "eval_steps": len(evals)} if evals else {}),
    }


def format_summary(s: Mapping[str, Any]) -> str:
    tps = f"{s['tokens_per_s']:.0f}" if s.get("tokens_per_s") else "-"
    comm = ", ".join(f"{a} {format_bytes(b)}" for a, b in s["comm_bytes_per_axis"].items()) or "none"
    skipped = f" ({s['skipped_steps']} skipped: non-finite)" if s.get("skipped_steps") else ""
    held_out = f", eval loss {s['eval_loss']:.4f}" if s.get("eval_loss") is not None else ""
    # The exception's type only: its message is the error line the rank already printed.
    lead = f"stopped ({s['interrupted'].split(':')[0]})" if s.get("interrupted") else "done"
    return (f"{lead}: {s['steps']} steps{skipped}, loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}{held_out}, "
            f"{1e3 * s['mean_step_time']:.1f} ms/step, {tps} tok/s, comm per rank: {comm}")


# --------------------------------------------------------------------------- errors


_MAX_MESSAGE = 600  # characters of an error's message on its one line


def report_exception(e: Exception, command: str, out: str | None) -> int:
    """One line on stderr (through the launcher, once per distinct message) for ``e``;
    returns the exit code. Once per exception: a rank reports a crash as soon as it
    happens (before writing its summary, while the launcher may already be stopping the
    others), and ``main`` then returns the code stored on it."""
    if hasattr(e, "_dtp_exit_code"):
        return e._dtp_exit_code  # type: ignore[attr-defined]
    code = _report(e, command, out)
    with contextlib.suppress(AttributeError):  # an exception type with __slots__: report twice at worst
        e._dtp_exit_code = code  # type: ignore[attr-defined]
    return code


def _report(e: Exception, command: str, out: str | None) -> int:
    # The exception's module is imported by now if it was raised; none of them is imported here.
    loop = sys.modules.get("dtp.cli.loop")  # imported once a run started; nothing to sort before
    comm = sys.modules.get("dtp.core.comm")
    if loop is not None and isinstance(e, loop.TrainingAborted):
        # Raised on every rank alike: the launcher prints it once.
        _report_error(f"{PROG} {command}: {e}")
        return 1
    saving = sys.modules.get("dtp.checkpoint.commit")
    if saving is not None and isinstance(e, saving.SaveFailed):
        # The run's last save failed (a full disk), on every rank alike: said once, code 1.
        _report_error(f"{PROG} {command}: {e}")
        return 1
    if comm is not None and isinstance(e, comm.CollectiveError):
        # A peer died or stalled: this rank's one line (where it was) for the launcher to
        # print beside the others', not a traceback per rank.
        _report_error(f"{PROG} {command}: {e}")
        return 1
    if isinstance(e, (ValueError, NotImplementedError)):
        # Validation errors (ours, the layouts', the model's) are one line, not a traceback.
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        if len(message) > _MAX_MESSAGE:  # a library's message can carry a whole tensor's repr
            message = f"{message[:_MAX_MESSAGE]}… ({len(message) - _MAX_MESSAGE} characters cut)"
        _report_error(f"{PROG} {command}: error: {message}")
        return 2
    # A crash: the exception and the line that raised it, one line per failing rank; the
    # traceback goes to the run's log (and to the console with --debug).
    rank = int(os.environ.get("RANK", "0"))
    where = describe_exception(e, log_dir=Path(out) / "logs" if out else None, rank=rank)
    _report_error(f"{PROG} {command}: rank {rank} failed: {where}")
    return 1
