"""The ``dtp`` command: train the reference Llama under any parallel layout, from a shell.

::

    dtp train --nproc 4 --dp 2 --tp 2 --sp --model tiny --steps 50 --check
    dtp check runs/20250101-120000          # re-verify a finished run against 1 process
    dtp plan --model llama3-8b --dp 8 --zero 1 --dtype bfloat16 --memory-gb 80   # predict, allocate nothing
    dtp train --init-from llama-dir --tp 2 --save-every 50 --out runs/ft   # fine-tune a Hugging Face model
    dtp export --hf ft-hf --run runs/ft                 # its newest checkpoint as Hugging Face

The package reads in the order a run goes: :mod:`~dtp.cli.commands` (the parser, put together
from :mod:`~dtp.cli.parser`'s pieces), :mod:`~dtp.cli.flags` (flag checks, the run configuration), :mod:`~dtp.cli.loop` (layout, mesh, the per-rank training loop),
:mod:`~dtp.cli.resume` (``--resume`` against its checkpoint, which flags trained which steps),
:mod:`~dtp.cli.report` (console lines, run-directory files, summary, plot),
:mod:`~dtp.cli.check` (the 1-process reference) and :mod:`~dtp.cli.export` (``dtp export``). What one module uses of another is in
that module's ``__all__``; names with ``_`` stay inside their module.

Exit codes: 0 success, 1 a rank crashed, a collective failed (a peer died or stalled past
``--timeout``: each rank says where it was, one line), ``--check`` failed or training
aborted after ``--max-skipped`` non-finite steps in a row, 2 invalid arguments or a layout
that does not fit, 130 interrupted (Ctrl-C; 143 for ``SIGTERM``). Invalid arguments and
aborts are one line on stderr, a crash one line per failing rank (its exception and where
it was raised); ``--debug`` (or ``DTP_TRACEBACK=1``) shows the tracebacks, which are also in
``<out>/logs/rank<N>.txt``.

Flags are parsed and the whole run checked (:func:`~dtp.cli.flags.preflight`) before torch
is imported: this package imports torch only once a run starts (:mod:`~dtp.cli.loop`).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

from ..config import to_toml
from ..core.mesh import launch as launcher  # called as launcher.launch: a test pool stands in for it
from ..core.mesh.launch import in_torchrun, launched, rejoined
from .commands import build_parser, parse_args
from .flags import UsageError, build_layout, check_config, mesh_axes, preflight, train_argv, validate
from .plan import cmd_plan, print_schedule, train_refusal
from .report import (default_out, clear_run_files, format_bytes, format_step, progress_bar, report_exception,
                     summarize, survive_closed_output)

__all__ = [
    "main", "console", "build_parser", "parse_args", "validate", "mesh_axes", "train_argv",
    "format_bytes", "format_step", "progress_bar", "summarize", "compare_losses", "tolerance_for",
    "UsageError", "build_layout", "check_run",
]

# Names from the modules that import torch: imported on first use (PEP 562), so that
# `import dtp.cli` (the console script) stays torch-free until a run starts.
_LAZY = {"check_run": ".check", "compare_losses": ".check", "tolerance_for": ".check"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def _cmd_train(args: argparse.Namespace) -> int:
    """``dtp train``: check the run, then be one rank under torchrun, else start the ranks
    here; then ``--check``."""
    if args.print_config or args.print_schedule:
        # Print and exit: the run as given, checked, but no run directory. Neither invents a
        # default --out nor touches one (--print-schedule once created runs/<timestamp> and,
        # with --overwrite, deleted an earlier run's files before printing).
        layout = check_config(args)  # a run that would be refused is not printed
        if int(os.environ.get("RANK", "0")) != 0:
            # Under torchrun every rank checks alike, rank 0 alone prints: N interleaved copies
            # of the TOML, redirected to a file, were a --config that refuses its repeated keys.
            return 0
        if args.print_config:
            print(to_toml(args.run_config, leave_out=getattr(args, "derived", ())), end="")
        else:
            print_schedule(args, layout)
        return 0
    if args.out is None:
        args.out = default_out()
    args.out = str(Path(args.out).resolve())  # ranks and the reference must agree on it
    args.run_config = dataclasses.replace(args.run_config, out=args.out)
    rank = int(os.environ.get("RANK", "0"))
    if in_torchrun():
        if not launched():
            # Under an outside torchrun every rank checks alike (one line each, nothing
            # hangs); rank 0 alone owns the run directory, and not after a restart or on a
            # host that came back into the job (its checkpoints are what they resume from).
            preflight(args, check_out=rank == 0 and not rejoined(args.out))
            # The plan's memory check too: each rank computes the same verdict from the same
            # flags (no collective), rank 0 alone prints the table. The host's RAM is shared
            # by this node's ranks (torchrun's LOCAL_WORLD_SIZE), not by the whole world.
            _refuse_unfit(args, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), show=rank == 0)
            if rank == 0 and args.overwrite and not rejoined(args.out):
                clear_run_files(Path(args.out))
        from .check import check_in_subprocess  # here and below: the ranks' modules import torch
        from .loop import train_rank

        code = train_rank(args.run_config)
        if code == 0 and args.check and rank == 0:
            code = check_in_subprocess(args.out)
        return code
    # Everything that can be checked without torch, before starting ranks that would all fail.
    layout = preflight(args)
    _refuse_unfit(args, local_ranks=args.nproc, show=True)  # then the plan (imports torch)
    if args.overwrite:
        clear_run_files(Path(args.out))
    if args.nproc > 1:
        code = _launch(args)
    else:
        from .loop import train_rank  # torch, once the flags have passed

        code = train_rank(args.run_config)
    if code == 0 and args.check:
        from .check import check_run  # torch, once the run is done

        code = check_run(args.out)
    return code


def _refuse_unfit(args: argparse.Namespace, *, local_ranks: int, show: bool) -> None:
    """A run whose plan does not fit its memory does not start: :class:`UsageError` with the
    plan's verdict (its table on stderr first when ``show``)."""
    refusal = train_refusal(args, local_ranks=local_ranks, quiet=not show)
    if refusal is not None:
        table, _, verdict = refusal.rpartition("\n")
        if show:
            print(table, file=sys.stderr)
        raise UsageError(verdict)


def _launch(args: argparse.Namespace) -> int:
    """Start the ranks with the run as a TOML file (``--config``): shipped whole, resolved
    once here, not re-spelled as flags (``--out`` stays visible on their command lines)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dtp-run-") as tmp:
        path = Path(tmp) / "run.toml"
        path.write_text(to_toml(args.run_config), encoding="utf-8")  # what tomllib reads
        return launcher.launch(args.nproc, ["train", "--config", str(path), "--out", args.out],
                               max_restarts=args.max_restarts, save_on_signal=args.save_on_signal,
                               shutdown_timeout=args.shutdown_timeout)


def _debug(args: argparse.Namespace | None) -> bool:
    """Show tracebacks: ``--debug``, or ``DTP_TRACEBACK=1`` (also for ``dtp check``)."""
    return bool(os.environ.get("DTP_TRACEBACK")) or bool(getattr(args, "debug", False))


def console() -> None:
    """The ``dtp`` console script and ``python -m dtp.cli``: :func:`main`, then end the
    process without the interpreter's finalization (not a doctest: it ends the process)."""
    survive_closed_output()  # a reader that goes (`dtp train ... | head`) does not stop the run
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if in_torchrun() and sys.argv[1:2] == ["train"]:
        # A rank leaves without running Python's exit at all. Measured on torch 2.13 / gloo:
        # even after dtp.wait, comm.drain, a barrier and destroy_process_group, a dp=4 ZeRO-1
        # run with both overlap flags on a loaded machine (the test suite beside it) still
        # aborted with "terminate called without an active exception": a gloo thread meeting
        # Python's shutdown. By now every file is written (atomically) and the group is gone.
        if code == 128 + signal.SIGTERM:
            # Stopped by SIGTERM, files written on the way (dtp.cli.process.Terminated): end by
            # that signal as well, so torchrun's agent and the launcher see "stopped", not a crash.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        os._exit(code)
    # The launcher, a world of one, dtp plan / check / export: the exit handlers run (logging's
    # flush, a user's), the finalization does not. Measured (torch 2.13, quiet 2-core machine,
    # perf): after `dtp train --nproc 2` had finished, finalization took 0.7-0.9 s, mostly
    # garbage-collection passes over torch's heap; the handlers take 0.01 s. A profiler or
    # tracer (python -m cProfile -m dtp.cli ...) reports at exit, and a non-daemon thread
    # is joined there: then the ordinary exit. So after a signal (130, 143): CI once printed
    # torchrun's rendezvous finalizer failing ("cannot join current thread") when the
    # launcher, stopped by SIGINT, ran the exit handlers itself and left at once.
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if sys.gettrace() is not None or sys.getprofile() is not None or others or code in (130, 143):
        sys.exit(code)
    atexit._run_exitfuncs()  # CPython's runner of the atexit handlers (what sys.exit would run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """``dtp <argv>`` called from Python (:func:`console` is the script); returns the exit code.

    Not run as a doctest: it launches 4 ranks (tests/test_cli.py runs the CLI).

    >>> main(["train", "--dp", "2", "--tp", "2", "--steps", "10", "--check"])  # doctest: +SKIP
    0
    """
    parser = build_parser()
    args: argparse.Namespace | None = None
    try:
        try:
            args = parse_args(argv)
        except SystemExit as e:  # argparse's --help (0) or usage error (2), already printed
            return e.code if isinstance(e.code, int) else 2
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "check":
            from .check import check_run  # torch: dtp check retrains

            return check_run(args.run_dir, rtol=args.rtol)
        if args.command == "export":
            from .export import cmd_export  # its parser is torch-free, its command is not: cmd_export imports as it runs

            return cmd_export(args)
        parser.print_help(sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # Ctrl-C (130), or SIGTERM raised as dtp.cli.process.Terminated (143): what was written
        # so far is on disk, the run's summary and plot too. No traceback.
        return 128 + int(getattr(e, "signum", signal.SIGINT))
    except Exception as e:  # noqa: BLE001 -- sorted below; a crash becomes one line unless --debug
        if _debug(args):
            raise
        return report_exception(e, getattr(args, "command", None) or "train", getattr(args, "out", None))
