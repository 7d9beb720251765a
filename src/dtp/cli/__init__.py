"""The ``dtp`` command: train the reference Llama under any parallel layout, from a shell.

::

    dtp train --nproc 4 --dp 2 --tp 2 --sp --model tiny --steps 50 --check
    dtp check runs/20250101-120000          # re-verify a finished run against 1 process
    dtp plan --model llama3-8b --dp 8 --zero 1 --dtype bfloat16 --memory-gb 80   # predict, allocate nothing

The package reads in the order a run goes: :mod:`~dtp.cli.flags` (parser, flag checks,
the argv each rank gets), :mod:`~dtp.cli.loop` (layout, mesh, the per-rank training loop),
:mod:`~dtp.cli.report` (console lines, run-directory files, summary, plot) and
:mod:`~dtp.cli.check` (the 1-process reference). Names with ``_`` are private to the
package; the modules import them from each other.

Exit codes: 0 success, 1 a rank crashed, a collective failed (a peer died or stalled past
``--timeout``: each rank says where it was, one line), ``--check`` failed or training
aborted after ``--max-skipped`` non-finite steps in a row, 2 invalid arguments or a layout
that does not fit (aborts and invalid arguments are one line on stderr;
``DTP_TRACEBACK=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from ..comm import CollectiveError
from .. import schedules
from ..launch import in_torchrun, launch, report_error
from ..layouts.pipeline import assign
from ..models import llama
from .check import _check_in_subprocess, check_run, compare_losses, tolerance_for
from .flags import PROG, UsageError, build_parser, mesh_axes, model_overrides, parse_args, train_argv, validate
from .plan import cmd_plan, train_refusal
from .loop import TrainingAborted, _load_data, _train_rank, _vocab_size, build_layout
from .report import _default_out, format_bytes, format_step, progress_bar, summarize

__all__ = [
    "main", "build_parser", "parse_args", "validate", "mesh_axes", "train_argv",
    "format_bytes", "format_step", "progress_bar", "summarize", "compare_losses", "tolerance_for",
    "UsageError", "build_layout", "check_run",
]


def _cmd_train(args: argparse.Namespace) -> int:
    """``dtp train``: be one rank under torchrun, else start the ranks here; then ``--check``."""
    if args.out is None:
        args.out = _default_out()
    args.out = str(Path(args.out).resolve())  # ranks and the reference must agree on it
    if in_torchrun():
        code = _train_rank(args)
        if code == 0 and args.check and int(os.environ["RANK"]) == 0:
            code = _check_in_subprocess(args.out)
        return code
    # Validate what can be validated here, before starting ranks that would all fail.
    layout = build_layout(args)
    refusal = train_refusal(args)  # the plan first: a run that cannot fit does not start
    if refusal is not None:
        table, _, verdict = refusal.rpartition("\n")
        print(table, file=sys.stderr)
        raise UsageError(verdict)
    cfg = llama.config(args.model, vocab_size=_vocab_size(args.model, _load_data(args.data)), **model_overrides(args))
    if layout.pipeline is not None:
        n_layers = len(llama.sequential(cfg))
        assign(n_layers, args.pp, args.virtual_stages, what=f"--pp {args.pp} --virtual-stages {args.virtual_stages}")
        if args.print_schedule:
            table = schedules.format_schedule(
                schedules.make(args.pp_schedule, p=args.pp, v=args.virtual_stages, m=args.microbatches), p=args.pp)
            print(f"{args.pp_schedule} schedule, pp={args.pp}, virtual stages {args.virtual_stages}, "
                  f"{args.microbatches} microbatches ({n_layers} layers; F forward, B backward, I/W its input/weight "
                  f"halves, chunk.microbatch):\n{table}")
            return 0
    if args.nproc > 1:
        code = launch(args.nproc, train_argv(args), max_restarts=args.max_restarts)
    else:
        code = _train_rank(args)
    if code == 0 and args.check:
        code = check_run(args.out)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dtp`` console script; returns the exit code.

    Not run as a doctest: it launches 4 ranks (tests/test_cli.py runs the CLI).

    >>> main(["train", "--dp", "2", "--tp", "2", "--steps", "10", "--check"])  # doctest: +SKIP
    0
    """
    parser = build_parser()
    try:
        args = parse_args(argv)
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "check":
            return check_run(args.run_dir, rtol=args.rtol)
        parser.print_help(sys.stderr)
        return 2
    except TrainingAborted as e:  # raised on every rank alike: the launcher prints it once
        if os.environ.get("DTP_TRACEBACK"):
            raise
        report_error(f"{PROG} {getattr(locals().get('args'), 'command', None) or 'train'}: {e}")
        return 1
    except (ValueError, NotImplementedError) as e:
        # Validation errors (ours, the layouts', the model's) are one line, not a traceback.
        if os.environ.get("DTP_TRACEBACK"):
            raise
        command = getattr(locals().get("args"), "command", None) or "train"
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        report_error(f"{PROG} {command}: error: {message}")
        return 2
    except CollectiveError as e:
        # A peer died or stalled: this rank's one line (where it was) for the launcher to
        # print beside the others', not a traceback per rank.
        if os.environ.get("DTP_TRACEBACK"):
            raise
        report_error(f"{PROG} train: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
