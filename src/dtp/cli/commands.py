"""The ``dtp`` command's parser, put together: ``train`` (a flag per :class:`dtp.RunConfig`
field, :func:`.parser.add_run_flags`, and the invocation's own), ``plan`` (:mod:`.plan`),
``export`` (:mod:`.export`) and ``check``; and :func:`parse_args`, which reads a
``--config`` file first and checks a train run (:func:`.flags.validate`).

The one module of the package that knows every subcommand; none of them imports it.
Like :mod:`.flags`, it imports nothing that imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from ..config import SECTIONS
from ..core._rules import RUN_RTOL
from ..core.mesh.launch import in_torchrun
from . import export, plan
from .flags import read_config_file, validate
from .parser import (DESCRIPTION, PROG, RUN_FILES, _HelpFormatter, _non_negative_float, _Parser,
                     add_config_flag, add_nproc, add_print_schedule, add_run_flags)

__all__ = ["build_parser", "parse_args"]


class _Version(argparse.Action):
    """``dtp --version``: ``dtp.__version__`` (the installed metadata's), looked up only
    when asked, so that parsing any other command does not scan sys.path for it."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print dtp's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        import dtp  # the package, for its lazy __version__: commands.py is imported by dtp.cli

        print(f"{PROG} {dtp.__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dtp`` command (subcommands ``train``, ``plan``, ``check`` and ``export``).

    >>> args = build_parser().parse_args(["train", "--dp", "2", "--tp", "2", "--sp"])
    >>> args.dp, args.tp, args.sp, args.dtype
    (2, 2, True, 'float32')
    """
    parser = _Parser(prog=PROG, description=DESCRIPTION, allow_abbrev=False)
    parser.add_argument("--version", action=_Version)
    # More subcommands (dtp plan, ...) add themselves with sub.add_parser(...): the
    # metavar lists whatever is there.
    sub = parser.add_subparsers(dest="command")

    t = sub.add_parser("train", help="train the reference Llama on N ranks under a parallel layout",
                       formatter_class=_HelpFormatter, allow_abbrev=False)
    groups = add_run_flags(t, SECTIONS)
    add_nproc(groups["parallelism"])
    add_print_schedule(groups["parallelism"])
    g = groups["run"]
    add_config_flag(g)
    g.add_argument("--print-config", action="store_true",
                   help="print the resolved run as TOML (what --config reads) and exit")
    g.add_argument("--check", action="store_true",
                   help="compare every step's loss and gradient norm with a 1-process reference run; exit 1 on mismatch")
    g.add_argument("--overwrite", action="store_true",
                   help="reuse a non-empty --out: delete the files an earlier run wrote there "
                        f"({', '.join(RUN_FILES)}) first")

    plan.add_train_flags(t)
    plan.add_parser(sub)  # dtp plan: train's sections of a run but checkpoints and run
    export.add_parser(sub)

    c = sub.add_parser("check", help="compare a finished run's losses and gradient norms with a 1-process reference",
                       formatter_class=_HelpFormatter, allow_abbrev=False)
    c.add_argument("run_dir", help="the run directory (with config.json and metrics.jsonl)")
    c.add_argument("--rtol", type=_non_negative_float, default=None,
                   help="relative tolerance (default: by dtype, " +
                        ", ".join(f"{k} {v:g}" for k, v in RUN_RTOL.items()) + ")")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate ``dtp`` arguments (argparse errors exit with code 2). ``train
    --config run.toml`` (and ``plan --config``) reads a run first; the flags given beside it
    override its fields.

    >>> parse_args(["train", "--nproc", "2", "--dp", "2"]).warmup
    5
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] in (["train"], ["plan"]):
        path = _config_path(argv)
        if path is not None:  # a plan takes the whole run too: its fields beyond plan's flags included
            _subparser(parser, argv[0]).set_defaults(**read_config_file(path))
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser: "dtp plan: error: ... (see dtp plan --help)", not "dtp: ..."
        command = args.command and _subparser(parser, args.command)
        (command or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "train":
        validate(args, world_size=int(os.environ["WORLD_SIZE"]) if in_torchrun() else None)
    return args


def _config_path(argv: Sequence[str]) -> str | None:
    """``--config PATH`` (or ``--config=PATH``) in ``argv``, before argparse sees it."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # no public accessor
    return sub.choices[command]
