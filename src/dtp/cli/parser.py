"""What the ``dtp`` command's parsers are made of (:mod:`.commands` puts them together).

A run's flags are made from :class:`dtp.RunConfig`'s fields (:func:`add_run_flags`): the
name, the doc as help, the bounds and choices as type checks, the default, the section as
the help group. The flags about an invocation (``--nproc``, ``--config``,
``--print-schedule``) are written here too, as functions a command adds to its parser;
:mod:`.commands` puts each command's parser together. How combinations are checked is
:mod:`.flags`'. Like that module it imports nothing that imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import math
import dataclasses
from typing import Any, Callable, Iterable, NoReturn, Sequence


from ..core.mesh.launch import in_torchrun, launched
from ..config import EVAL_BATCHES, SECTIONS, RunConfig

__all__ = ["add_run_flags", "add_config_flag", "add_nproc", "add_print_schedule", "UsageError", "positive_float",
           "PROG", "EVAL_BATCHES", "RUN_FILES", "RUN_DEFAULTS", "note"]


class UsageError(ValueError):
    """Invalid flags: reported as one line, exit code 2."""


PROG = "dtp"
# The parser's description: the first line of the package docstring (dtp.cli), as plain text.
DESCRIPTION = "The dtp command: train the reference Llama under any parallel layout, from a shell."


def note(args: argparse.Namespace, text: str) -> None:
    """``dtp <command>: note: text`` on stderr, once per run: not from a rank the launcher
    started (the launcher said it; its ranks parse the run again), and under an outside
    torchrun from rank 0 alone (every rank parses and checks the run alike)."""
    if in_torchrun() and (launched() or os.environ.get("RANK") != "0"):
        return
    print(f"{PROG} {getattr(args, 'command', None) or 'train'}: note: {text}", file=sys.stderr)


# What a run directory holds that dtp wrote (dtp.cli.report's table, the checkpoints, the
# TensorBoard events, the ranks' tracebacks): what --overwrite clears, and nothing else.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "loss.png", "check.json", "checkpoints",
             "tensorboard", "logs")


# Every default is RunConfig's: one table (the parser shows them in --help).
RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}


def _number(kind: type, minimum: int, *, strict: bool = False) -> Callable[[str], Any]:
    """An argparse type: ``kind`` (int or float, finite) >= ``minimum`` (> with ``strict``).
    argparse names the flag before the message ("argument --dp: expected ...")."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not (math.isfinite(value) and (value > minimum if strict else value >= minimum)):
            desc = "a finite number" if kind is float else "an integer"
            shown = repr(text) if kind is float else value
            raise argparse.ArgumentTypeError(f"expected {desc} {'>' if strict else '>='} {minimum}, got {shown}")
        return value

    return parse


_positive = _number(int, 1)
positive_float = _number(float, 0, strict=True)
_non_negative_float = _number(float, 0)
_non_negative_int = _number(int, 0)


class _Switch(argparse.Action):
    """An on/off flag of the run: ``--sp`` and ``--no-sp``, so that a flag turns off what a
    ``--config`` file turned on (argparse's ``BooleanOptionalAction`` would print each
    switch's default, which :class:`_HelpFormatter` leaves out)."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: bool = False, help: str | None = None):
        names = [*option_strings, *("--no-" + o[2:] for o in option_strings if o.startswith("--"))]
        super().__init__(names, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, not (option_string or "").startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


class _HelpFormatter(argparse.HelpFormatter):
    """Adds ``(default: X)`` to a flag's help where it tells something: not for on/off
    switches (their default is that they are off, or for ``--no-…`` on), not for ``None``,
    and not where the help already states its default in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default in (None, argparse.SUPPRESS) or action.nargs == 0 or "default" in text
                or action.option_strings == []):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors as one line (argparse prints the usage block, 20
    lines for ``dtp train``, before the one that says what is wrong)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_run_flags(parser: argparse.ArgumentParser, sections: Iterable[str]) -> dict[str, argparse._ArgumentGroup]:
    """A flag for each :class:`dtp.RunConfig` field of ``sections``, made from the field: its
    name (``cp_window`` is ``--cp-window``; an on/off field is ``--x`` and ``--no-x``), its
    doc as the help, its bounds and choices as the flag's type check, its default. One
    argument group per section (:data:`dtp.config.SECTIONS`' titles), returned by name so a
    command adds its own flags (``--nproc``, ``--check``) where they belong.

    >>> p = _Parser(prog="demo", allow_abbrev=False)
    >>> groups = add_run_flags(p, ["parallelism"])
    >>> p.parse_args(["--dp", "2", "--sp", "--cp-algo", "ulysses"]).cp_algo, list(groups)
    ('ulysses', ['parallelism'])
    """
    groups = {section: parser.add_argument_group(SECTIONS[section]) for section in sections}
    for f in dataclasses.fields(RunConfig):
        section = f.metadata["section"]
        if section in groups:
            groups[section].add_argument(f"--{f.name.replace('_', '-')}", **_flag_of_field(f))
    return groups


def _flag_of_field(f: dataclasses.Field) -> dict[str, Any]:
    """``add_argument``'s keywords for field ``f`` (:func:`add_run_flags`)."""
    meta, kind = f.metadata, str(f.type).split(" ")[0]
    flag: dict[str, Any] = {"default": f.default, "help": meta["doc"]}
    if kind == "bool":
        return {**flag, "action": _Switch}
    if meta["metavar"] is not None:
        flag["metavar"] = meta["metavar"]
    if meta["bare"] is not None:  # --compile alone: its bare value
        flag.update(nargs="?", const=meta["bare"])
    if meta["choices"] is not None:
        flag["choices"] = meta["choices"]
    if kind in ("int", "float"):
        number = int if kind == "int" else float
        if meta["above"] is not None:
            flag["type"] = _number(number, meta["above"], strict=True)
        elif meta["low"] is not None:
            flag["type"] = _number(number, meta["low"])
        else:
            flag["type"] = number
    return flag


def add_config_flag(group: argparse._ArgumentGroup) -> None:
    """``--config TOML``, which :func:`dtp.cli.commands.parse_args` reads before the flags."""
    group.add_argument("--config", dest="config_file", default=None, metavar="TOML",
                       help="read the run from a TOML file of dtp.RunConfig fields, each section a table ([parallelism], "
                            "[training], ...; or all at the top level); flags given beside it override its values")


def add_nproc(group: argparse._ArgumentGroup) -> None:
    """``--nproc``, for ``dtp train`` and ``dtp plan`` (which checks it as train does)."""
    group.add_argument("--nproc", type=_positive, default=None,
                       help="local ranks to start; default (and the only valid value): the mesh size, pp*dp*ep*cp*tp")


def add_print_schedule(group: argparse._ArgumentGroup) -> None:
    """``--print-schedule``, for ``dtp train`` and ``dtp plan``."""
    group.add_argument("--print-schedule", action="store_true",
                       help="print each pipeline rank's action list (F/B/I/W, chunk.microbatch) and exit")
