"""``dtp``'s flags: the argument parser, the checks of flag combinations, and the argv a rank gets.

Everything here runs before any rank starts, and before torch is imported: a bad
combination is reported once, by the launcher, as one line (:class:`UsageError`, exit
code 2), in a fraction of a second. Rules that need the model or the mesh are the
layouts' and the model's: :func:`preflight` asks them here too, against the mesh's shape
(:class:`dtp._mesh_shape.MeshShape`), so a layout that does not fit the model is refused
before any rank starts. This module imports nothing that imports torch (a test holds it
to that); keep it so.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import layouts, schedules
from .._mesh_shape import MeshShape
from .._rules import RUN_RTOL
from .._token_files import held_out_start, token_stats
from ..launch import in_torchrun
from ..layouts import CP_ALGORITHMS, ZERO_STAGES, Layout, zero
from ..layouts.zero import misplaced_options
from ..models import config as model_config
from . import plan as plan_cli

# layouts.zero's options: the argparse attribute and the flag that set each.
ZERO_ARGS = {"overlap_grad_reduce": "overlap_grad_reduce", "overlap_param_gather": "overlap_param_gather",
             "prefetch": "zero_prefetch", "reshard_after_forward": "reshard_after_forward"}
ZERO_FLAGS = {"overlap_grad_reduce": "--overlap-grad-reduce", "overlap_param_gather": "--overlap-param-gather",
              "prefetch": "--zero-prefetch", "reshard_after_forward": "--no-reshard-after-forward"}

__all__ = ["UsageError", "build_parser", "parse_args", "validate", "preflight", "build_layout", "mesh_axes",
           "train_argv", "vocab_size"]

PROG = "dtp"
# The parser's description: the first line of the package docstring (dtp.cli).
DESCRIPTION = "The ``dtp`` command: train the reference Llama under any parallel layout, from a shell."
DTYPES = ("float32", "float64", "bfloat16")
RECOMPUTE = ("none", "full", "selective")
DEFAULT_WARMUP = 5
# Ten in a row is no bad batch any more but a diverged run: stop it rather than burn the
# remaining steps on updates that are all skipped.
DEFAULT_MAX_SKIPPED = 10

# --timeout: torch's gloo default (30 min) leaves a stalled job hanging half an hour. A
# collective waits only for its slowest peer to post it, not for a whole step: the longest
# wait in any collective of `dtp train --nproc 4 --dp 2 --tp 2 --sp --model small --seq 256`
# (20 steps, 4 ranks on 2 loaded cores) was 0.25 s, the first one (model init skew) 0.20 s.
# 300 s leaves three orders of magnitude for larger models and slower machines, and still
# turns a hang into an error within 5 minutes. A dead peer is noticed at once regardless.
DEFAULT_TIMEOUT = 300.0

# --eval-every: the held-out split is the corpus's last tenth (dtp.data.split_held_out), and
# each evaluation averages the loss of its first EVAL_BATCHES batches: the same tokens every
# time, so the curve compares step with step.
EVAL_BATCHES = 4

# What a run directory holds that dtp wrote (dtp.cli.report's table, the checkpoints, the
# TensorBoard events, the ranks' tracebacks): what --overwrite clears, and nothing else.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "loss.png", "check.json", "checkpoints",
             "tensorboard", "logs")


class UsageError(ValueError):
    """Invalid flags: reported as one line, exit code 2."""


def _number(kind: type, minimum: int, *, strict: bool = False, name: str | None = None) -> Callable[[str], Any]:
    """An argparse type: ``kind`` (int or float, finite) >= ``minimum`` (> with ``strict``);
    the message names the flag when ``name`` is given."""
    lead = f"{name} must be" if name else "expected"
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{lead} {noun}, got {text!r}") from None
        if not (math.isfinite(value) and (value > minimum if strict else value >= minimum)):
            desc = "a finite number " if kind is float else ("" if name else "an integer ")
            shown = repr(text) if kind is float else value
            raise argparse.ArgumentTypeError(f"{lead} {desc}{'>' if strict else '>='} {minimum}, got {shown}")
        return value

    return parse


def _positive(name: str) -> Callable[[str], int]:
    return _number(int, 1, name=name)


def _positive_float(name: str) -> Callable[[str], float]:
    return _number(float, 0, strict=True, name=name)


_non_negative_float = _number(float, 0)
_non_negative_int = _number(int, 0)


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dtp`` command (subcommands ``train``, ``plan`` and ``check``).

    >>> args = build_parser().parse_args(["train", "--dp", "2", "--tp", "2", "--sp"])
    >>> args.dp, args.tp, args.sp, args.dtype
    (2, 2, True, 'float32')
    """
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    # More subcommands (dtp plan, ...) add themselves with sub.add_parser(...): the
    # metavar lists whatever is there.
    sub = parser.add_subparsers(dest="command")

    t = sub.add_parser("train", help="train the reference Llama on N ranks under a parallel layout",
                       formatter_class=_HelpFormatter)
    g = t.add_argument_group("parallelism (mesh order dp, cp, tp: outer to inner)")
    g.add_argument("--nproc", type=_positive("--nproc"), default=None,
                   help="local ranks to start; default (and the only valid value): the mesh size, pp*dp*ep*cp*tp")
    g.add_argument("--dp", type=_positive("--dp"), default=1, help="data-parallel degree")
    g.add_argument("--cp", type=_positive("--cp"), default=1, help="context-parallel degree")
    g.add_argument("--tp", type=_positive("--tp"), default=1, help="tensor-parallel degree")
    g.add_argument("--sp", action="store_true", help="Megatron sequence parallel (needs --tp > 1)")
    g.add_argument("--cp-algo", choices=CP_ALGORITHMS, default=None, help="context-parallel algorithm (with --cp > 1)")
    g.add_argument("--cp-window", type=_positive("--cp-window"), default=None,
                   help="double-ring window: cp ranks per inner ring (MindSpeed --cp-window-size; with --cp > 1)")
    g.add_argument("--ulysses-degree", type=_positive("--ulysses-degree"), default=None,
                   help="Ulysses part of hybrid context parallel (with --cp > 1)")
    g.add_argument("--cp-head-chunks", type=_positive("--cp-head-chunks"), default=None,
                   help="context-parallel attention in this many head chunks (default: the fewest with chunks × cp >= 16 "
                        "keeping each chunk's K+V >= 1 MiB; "
                        "1: Megatron's schedule, fewer and larger transfers, more memory; with --cp > 1)")
    g.add_argument("--pp", type=_positive("--pp"), default=1, help="pipeline-parallel degree (outermost mesh axis)")
    g.add_argument("--pp-schedule", choices=schedules.SCHEDULES, default="1f1b",
                   help="pipeline schedule (with --pp > 1; interleaved needs --virtual-stages >= 2)")
    g.add_argument("--virtual-stages", type=_positive("--virtual-stages"), default=1, metavar="V",
                   help="model chunks per pipeline rank (interleaved schedule)")
    g.add_argument("--print-schedule", action="store_true",
                   help="print each pipeline rank's action list (F/B/I/W, chunk.microbatch) and exit")
    g.add_argument("--zero", type=int, choices=ZERO_STAGES, default=0,
                   help="ZeRO stage over dp: 1 optimizer state, 2 + gradients, 3 + parameters (0: plain DP)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="with --zero: reduce-scatter each gradient bucket during backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --zero 1/2: leave the parameter all-gathers in flight until the next forward")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="with --zero 3: keep gathered buckets from forward until backward is done with them "
                        "(2Ψ traffic instead of 3Ψ; parameters whole during a step)")
    g.add_argument("--zero-prefetch", type=_positive("--zero-prefetch"), default=1, metavar="N",
                   help="with --zero 3: buckets gathered ahead of the one in use")
    g.add_argument("--bucket-mb", type=_non_negative_float, default=40.0,
                   help="with --zero: gradient/parameter bucket size in MiB")

    g = t.add_argument_group("model and training")
    g.add_argument("--model", default="tiny", help="llama preset: tiny, small, 1b, llama2-7b, llama3-8b, ...")
    g.add_argument("--steps", type=_positive("--steps"), default=50, help="optimizer steps")
    g.add_argument("--batch", type=_positive("--batch"), default=8, help="global batch size (sequences)")
    g.add_argument("--seq", type=_positive("--seq"), default=64, help="sequence length (tokens)")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter and compute dtype")
    g.add_argument("--lr", type=_non_negative_float, default=3e-3, help="peak learning rate (AdamW, cosine)")
    g.add_argument("--warmup", type=int, default=None,
                   help=f"linear warm-up steps (default: min({DEFAULT_WARMUP}, --steps))")
    g.add_argument("--microbatches", type=_positive("--microbatches"), default=1,
                   help="gradient-accumulation microbatches per step")
    g.add_argument("--recompute", choices=RECOMPUTE, default="none", help="activation recomputation")
    g.add_argument("--clip", type=_non_negative_float, default=1.0, help="global-norm gradient clip (0: off)")
    g.add_argument("--seed", type=int, default=0, help="seed of the model init and the data order")
    g.add_argument("--data", default=None,
                   help="token file: .txt (bytes), .npy (int ids), .bin (uint16 ids); default: bundled corpus")
    # Non-finite steps: train_step skips them (state unchanged); the loop counts them.
    g.add_argument("--max-skipped", type=_non_negative_int, default=DEFAULT_MAX_SKIPPED, metavar="N",
                   help="abort after N steps in a row skipped for a non-finite loss or gradient norm (0: never)")

    g = t.add_argument_group("mixture of experts (or --model tiny-moe)")
    g.add_argument("--num-experts", type=_number(int, 0, name="--num-experts"), default=None, metavar="E",
                   help="experts per MoE block (0: dense; default: the preset's)")
    g.add_argument("--top-k", type=_positive("--top-k"), default=None, metavar="K",
                   help="experts each token is routed to (default: the preset's)")
    g.add_argument("--capacity-factor", type=_positive_float("--capacity-factor"), default=None, metavar="C",
                   help="each expert keeps its ceil(T·k/E · C) highest-probability tokens (default: dropless)")
    g.add_argument("--ep", type=_positive("--ep"), default=1,
                   help="expert-parallel degree: experts split over an ep mesh axis (after dp; also a data axis)")
    g.add_argument("--expert-tp", action="store_true",
                   help="split each expert's hidden width over tp (Megatron's expert tensor parallel; needs --tp > 1)")
    g.add_argument("--pipe-experts", action="store_true",
                   help="MindSpeed pipe-experts: move and compute the dispatched tokens per local expert, each "
                        "chunk's all-to-all in flight while another computes")
    g.add_argument("--multi-data", type=_positive("--multi-data"), default=1, metavar="N",
                   help="with --pipe-experts: split each local expert's tokens into N chunks (for 1 local expert)")
    g.add_argument("--multi-stream", action="store_true",
                   help="with --pipe-experts and --sp: one communication stream for the ep all-to-alls and the tp "
                        "all-gathers / reduce-scatters, so they never run at the same time")

    g = t.add_argument_group("output")
    g.add_argument("--out", default=None, help="run directory (default: runs/<timestamp>)")
    g.add_argument("--check", action="store_true",
                   help="compare every step's loss with a 1-process reference run; exit 1 on mismatch")
    g.add_argument("--log-every", type=_positive("--log-every"), default=1, help="print a line every N steps")
    g.add_argument("--overwrite", action="store_true",
                   help="reuse a non-empty --out: delete the files an earlier run wrote there "
                        f"({', '.join(RUN_FILES)}) first")
    g.add_argument("--eval-every", type=_non_negative_int, default=0, metavar="N",
                   help=f"every N steps (and after the last) the loss on a held-out tenth of the corpus, forward "
                        f"only, mean of {EVAL_BATCHES} batches (0: never; the held-out tenth then trains too)")
    g.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard events to <out>/tensorboard (needs the tensorboard package)")
    g.add_argument("--debug", action="store_true",
                   help="full Python tracebacks on the console (otherwise one line per failing rank; "
                        "the tracebacks are in <out>/logs)")

    g = t.add_argument_group("checkpoints (in <out>/checkpoints; any parallel flags can resume any others)")
    g.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="save a checkpoint every N steps and after the last (0: never)")
    g.add_argument("--keep", type=_positive("--keep"), default=3, metavar="K", help="keep the newest K checkpoints")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints while training goes on (each waits for the one before)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out (metrics.jsonl and loss.png continue)")

    g = t.add_argument_group("failures")
    g.add_argument("--timeout", type=_positive_float("--timeout"), default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="a collective that waits this long for a peer fails, and every rank exits with its "
                        "last collectives (a dead peer is noticed at once)")
    g.add_argument("--max-restarts", type=_non_negative_int, default=0, metavar="R",
                   help="when a rank dies, stop the others and start all again from the newest checkpoint, "
                        "up to R times (torchrun's elastic agent; needs --save-every)")

    plan_cli.add_train_flags(t)
    plan_cli.add_parser(sub, t)  # dtp plan: train's parallel and model flags, shared

    c = sub.add_parser("check", help="compare a finished run's losses with a 1-process reference",
                       formatter_class=_HelpFormatter)
    c.add_argument("run_dir", help="the run directory (with config.json and metrics.jsonl)")
    c.add_argument("--rtol", type=_non_negative_float, default=None,
                   help="relative tolerance (default: by dtype, " +
                        ", ".join(f"{k} {v:g}" for k, v in RUN_RTOL.items()) + ")")
    return parser


def mesh_axes(args: argparse.Namespace) -> dict[str, int]:
    """The mesh to build: the non-trivial axes in order pp, dp, ep, cp, tp (dp always present).

    >>> mesh_axes(argparse.Namespace(pp=1, dp=2, ep=1, cp=1, tp=4))
    {'dp': 2, 'tp': 4}
    """
    axes = {"pp": args.pp} if getattr(args, "pp", 1) > 1 else {}
    axes["dp"] = args.dp
    for name in ("ep", "cp", "tp"):
        if getattr(args, name) > 1:
            axes[name] = getattr(args, name)
    return axes


def format_mesh(axes: dict[str, int]) -> str:
    """A mesh for a message: ``dp=2 × tp=2``.

    >>> format_mesh({"dp": 2, "tp": 2}), format_mesh({"dp": 1})
    ('dp=2 × tp=2', 'dp=1')
    """
    return " × ".join(f"{k}={v}" for k, v in axes.items())


def validate(args: argparse.Namespace, *, world_size: int | None = None) -> argparse.Namespace:
    """Check flag combinations that need no model or process group; fill in defaults.

    ``world_size`` is torchrun's ``WORLD_SIZE`` when joining an existing world. Raises
    :class:`UsageError` (a ``ValueError``) with a one-line message.

    >>> validate(build_parser().parse_args(["train", "--dp", "2", "--tp", "2"])).nproc
    4
    """
    n = math.prod(mesh_axes(args).values())
    shape = format_mesh(mesh_axes(args))
    if world_size is not None and world_size != n:
        raise UsageError(f"the mesh {shape} needs {n} rank{'s' * (n > 1)}, but torchrun started WORLD_SIZE={world_size}")
    if args.nproc is None:
        args.nproc = n if world_size is None else world_size
    elif args.nproc != n:
        raise UsageError(f"--nproc {args.nproc} does not match the mesh {shape}: it needs {n} "
                         f"rank{'s' * (n > 1)}; use --nproc {n} or leave --nproc out")
    if args.warmup is None:
        args.warmup = min(DEFAULT_WARMUP, args.steps)
    elif not 0 <= args.warmup <= args.steps:
        raise UsageError(f"--warmup must lie in [0, --steps={args.steps}], got {args.warmup}")
    if args.batch % (args.dp * args.microbatches):
        raise UsageError(f"--batch {args.batch} must be divisible by --dp × --microbatches = "
                         f"{args.dp} × {args.microbatches}: every rank gets equal microbatches")
    if args.cp == 1 and (args.cp_algo or args.cp_window or args.ulysses_degree or args.cp_head_chunks):
        flags = [f for f, v in (("--cp-algo", args.cp_algo), ("--cp-window", args.cp_window),
                                ("--ulysses-degree", args.ulysses_degree),
                                ("--cp-head-chunks", args.cp_head_chunks)) if v]
        raise UsageError(f"{' and '.join(flags)} {'configure' if len(flags) > 1 else 'configures'} context "
                         f"parallel: {'they need' if len(flags) > 1 else 'it needs'} --cp > 1, got --cp 1")
    # Which ZeRO options need which stage is layouts.zero's rule; here it is phrased as flags.
    for option, stages, why in misplaced_options(args.zero, **{o: getattr(args, ZERO_ARGS[o]) for o in ZERO_ARGS}):
        flag = ZERO_FLAGS[option]
        if stages == (3,):
            raise UsageError(f"{flag} is a ZeRO-3 option ({why}); it needs --zero 3")
        raise UsageError(f"{flag} {why.removeprefix('it ')}; overlap flags need --zero 1, 2 or 3")
    try:  # the rest (bucket size, prefetch range) as the preset states it
        zero_layout(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.zero and args.dp == 1:
        print(f"{PROG} train: note: --zero {args.zero} has no effect with --dp 1 (ZeRO shards over dp)",
              file=sys.stderr)
    if args.sp and args.tp == 1:
        # Sequence parallel splits over the tp group; with a group of one it would be
        # silently off, so say so instead of running something else than was asked.
        raise UsageError("--sp (sequence parallel) splits the sequence over the tp group: it needs --tp > 1, "
                         "got --tp 1")
    if args.ep > 1 and args.batch % (args.dp * args.ep * args.microbatches):
        raise UsageError(f"--batch {args.batch} must be divisible by --dp × --ep × --microbatches = "
                         f"{args.dp} × {args.ep} × {args.microbatches}: ep is a data axis too")
    moe_flags = [f for f, on in (("--expert-tp", args.expert_tp), ("--pipe-experts", args.pipe_experts),
                                 ("--multi-data", args.multi_data > 1), ("--multi-stream", args.multi_stream)) if on]
    if moe_flags and args.ep == 1:
        raise UsageError(f"{' '.join(moe_flags)} configure expert parallel; they need --ep > 1")
    if not args.pipe_experts and (args.multi_data > 1 or args.multi_stream):
        raise UsageError(f"{'--multi-data' if args.multi_data > 1 else '--multi-stream'} splits the pipe-experts "
                         f"schedule; it needs --pipe-experts")
    if args.multi_stream and not args.sp:
        raise UsageError("--multi-stream keeps the ep all-to-alls apart from sequence parallel's tp all-gathers / "
                         "reduce-scatters; it needs --tp > 1 --sp")
    if args.expert_tp and args.tp == 1:
        raise UsageError("--expert-tp splits each expert over tp; it needs --tp > 1")
    if args.pp == 1 and (args.virtual_stages > 1 or args.print_schedule):
        raise UsageError("--virtual-stages and --print-schedule configure the pipeline; they need --pp > 1")
    if args.pp > 1:
        if args.virtual_stages > 1 and args.pp_schedule != "interleaved":
            raise UsageError(f"--virtual-stages {args.virtual_stages} needs --pp-schedule interleaved")
        try:
            schedules.check(args.pp_schedule, p=args.pp, v=args.virtual_stages, m=args.microbatches)
        except ValueError as e:
            raise UsageError(f"--pp {args.pp} --microbatches {args.microbatches}: {e}") from None
    if args.save_every < 0:
        raise UsageError(f"--save-every must be >= 0 (0: never), got {args.save_every}")
    if args.async_save and not args.save_every:
        raise UsageError("--async-save needs --save-every N: there is nothing to save")
    if args.max_restarts and not args.save_every:
        raise UsageError("--max-restarts needs --save-every N: a restart resumes from the newest checkpoint")
    if args.resume and args.out is None:
        raise UsageError("--resume continues the run in --out; name it (--out runs/…)")
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --out, --overwrite deletes it: choose one")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        # torch.utils.tensorboard imports it; found here without importing anything.
        raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard")
    if args.eval_every and args.pp > 1:
        raise UsageError("--eval-every is not supported with --pp > 1 yet (the evaluation forward runs the "
                         "model whole, not in stages)")
    if args.data is not None:
        args.data = str(Path(args.data).expanduser().resolve())
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate ``dtp`` arguments (argparse errors exit with code 2).

    >>> parse_args(["train", "--nproc", "2", "--dp", "2"]).warmup
    5
    """
    args = build_parser().parse_args(argv)
    if args.command == "train":
        validate(args, world_size=int(os.environ["WORLD_SIZE"]) if in_torchrun() else None)
    return args


def train_argv(args: argparse.Namespace) -> list[str]:
    """The ``train`` arguments a rank needs, spelled out (no ``--nproc``, ``--check`` or ``--overwrite``).

    Every value is explicit, so each rank resolves exactly what the launcher resolved
    (the run directory, the warm-up, the absolute data path), and ``--check`` stays with
    the launcher, which runs the reference once instead of on every rank, as does
    ``--overwrite`` (the launcher cleared the directory before the ranks started).

    >>> train_argv(parse_args(["train", "--dp", "2", "--out", "r"]))[:9]
    ['train', '--pp', '1', '--pp-schedule', '1f1b', '--virtual-stages', '1', '--dp', '2']
    """
    out = ["train", "--pp", str(args.pp), "--pp-schedule", args.pp_schedule, "--virtual-stages",
           str(args.virtual_stages), "--dp", str(args.dp), "--ep", str(args.ep), "--cp", str(args.cp),
           "--tp", str(args.tp)]
    if args.sp:
        out.append("--sp")
    for flag, value in (("--cp-algo", args.cp_algo), ("--cp-window", args.cp_window),
                        ("--ulysses-degree", args.ulysses_degree), ("--cp-head-chunks", args.cp_head_chunks),
                        ("--data", args.data),
                        ("--out", args.out)):
        if value is not None:
            out += [flag, str(value)]
    out += [flag for flag, on in (("--overlap-grad-reduce", args.overlap_grad_reduce),
                                  ("--overlap-param-gather", args.overlap_param_gather),
                                  ("--no-reshard-after-forward", not args.reshard_after_forward),
                                  ("--async-save", args.async_save), ("--resume", args.resume),
                                  ("--tensorboard", args.tensorboard), ("--debug", args.debug)) if on]
    out += ["--save-every", str(args.save_every), "--keep", str(args.keep)]
    out += ["--zero", str(args.zero), "--zero-prefetch", str(args.zero_prefetch), "--bucket-mb", repr(args.bucket_mb), "--model", args.model, "--steps", str(args.steps),
            "--batch", str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype,
            "--lr", repr(args.lr), "--warmup", str(args.warmup), "--microbatches", str(args.microbatches),
            "--recompute", args.recompute, "--clip", repr(args.clip), "--seed", str(args.seed),
            "--log-every", str(args.log_every), "--eval-every", str(args.eval_every)]
    out += ["--max-skipped", str(args.max_skipped), "--multi-data", str(args.multi_data)]
    out += [flag for flag, on in (("--expert-tp", args.expert_tp), ("--pipe-experts", args.pipe_experts),
                                  ("--multi-stream", args.multi_stream)) if on]
    for flag, value in (("--num-experts", args.num_experts), ("--top-k", args.top_k),
                        ("--capacity-factor", args.capacity_factor)):
        if value is not None:
            out += [flag, repr(value)]
    out += ["--timeout", repr(args.timeout)]
    return out


def zero_layout(args: argparse.Namespace) -> Layout:
    """``layouts.zero`` from the ZeRO flags (``--zero 0`` gives plain data parallel)."""
    return zero(stage=args.zero, bucket_mb=args.bucket_mb, overlap_grad_reduce=args.overlap_grad_reduce,
                overlap_param_gather=args.overlap_param_gather,
                reshard_after_forward=args.reshard_after_forward, prefetch=args.zero_prefetch)


def model_overrides(args: Any) -> dict[str, Any]:
    """The model-config fields the MoE flags set (``args`` a Namespace or the run config).

    >>> model_overrides({"num_experts": 4, "top_k": None, "capacity_factor": None})
    {'num_experts': 4}
    """
    get = args.get if isinstance(args, dict) else lambda k: getattr(args, k, None)
    return {k: get(k) for k in ("num_experts", "top_k", "capacity_factor") if get(k) is not None}


def build_layout(args: argparse.Namespace) -> Layout:
    """``data() + megatron(sequence_parallel=sp)`` (+ ``context(...)`` with cp > 1, + ``zero``,
    + ``expert`` with ep > 1, + ``pipeline`` with pp > 1): the flags mapped to the presets,
    which check their own options.

    Megatron's rules name the ``tp`` axis; on a mesh without it they are dropped, so the
    same layout serves tp = 1.

    >>> build_layout(parse_args(["train", "--dp", "2", "--tp", "2", "--sp"])).megatron.sequence_parallel
    True
    """
    layout = layouts.data() + layouts.megatron(sequence_parallel=args.sp)
    if args.cp > 1:
        options = {k: v for k, v in (("algo", args.cp_algo), ("window", args.cp_window),
                                     ("ulysses_degree", args.ulysses_degree),
                                     ("head_chunks", args.cp_head_chunks)) if v is not None}
        layout = layout + layouts.context(**options)
    if args.zero:  # --zero 0 is plain data parallel, which the layout already is
        layout = layout + zero_layout(args)
    if args.ep > 1:
        layout = layout + layouts.expert(pipe_experts=args.pipe_experts, multi_data=args.multi_data,
                                         multi_stream=args.multi_stream, tp_axis="tp" if args.expert_tp else None)
    if args.pp > 1:
        layout = layout + layouts.pipeline(args.pp_schedule, virtual_stages=args.virtual_stages)
    return layout


def vocab_size(model: str, max_id: int) -> int:
    """The preset's vocabulary, grown (to a multiple of 128, like nanoGPT's 50304) when the
    data holds larger ids. Independent of tp, so runs under different layouts share a model.

    >>> vocab_size("tiny", 255), vocab_size("tiny", 300)
    (256, 384)
    """
    preset = model_config.config(model).vocab_size
    return max(preset, -(-(max_id + 1) // 128) * 128)


def preflight(args: argparse.Namespace, *, check_out: bool = True) -> Layout:
    """Check the whole run before any rank starts (and before torch is imported): the
    layout's presets, the model against the layout on the mesh's shape (heads, kv heads,
    vocabulary, experts divisible by their splits), the pipeline's layers and
    microbatches, the sequence against context parallel, the corpus against a batch, and
    the run directory (``check_out``: writable; not an earlier run's unless ``--resume``
    or ``--overwrite``). Returns the layout.

    Raises :class:`UsageError` (or the presets' ``ValueError``): one line, exit code 2.
    The pipeline's composition rules (:meth:`~dtp.layouts.pipeline.PipelineOptions.check_composition`)
    are the ones ``train_step`` checks again on every rank, before any collective.
    """
    layout = build_layout(args)
    try:
        n_tokens, max_id = token_stats(args.data)
    except (OSError, ValueError) as e:
        raise UsageError(f"--data: {e}") from None
    cfg = model_config.config(args.model, vocab_size=vocab_size(args.model, max_id), **model_overrides(args))
    mesh = MeshShape(mesh_axes(args))
    what = f"--model {args.model} on the mesh {format_mesh(mesh.sizes)}"
    split = args.dp * args.ep * args.cp
    if args.check and cfg.num_experts and cfg.capacity_factor is not None and split > 1:
        # dtp.ops.moe: capacity is computed from the tokens a rank routes (Megatron's rule),
        # so a batch split over dp × ep × cp drops other tokens than one process does.
        raise UsageError(f"--check compares with one process, but with --capacity-factor each rank drops by its "
                         f"own tokens (Megatron's rule), so a batch split {split} ways (--dp × --ep × --cp) "
                         f"differs from one process by design; drop --check, or train dropless")
    layout.check_mesh(mesh, what=f"the mesh {format_mesh(mesh.sizes)}")
    layout.check_sizes(model_config.axis_sizes(cfg), mesh, what=what)
    if layout.pipeline is not None:
        layout.pipeline.check(n_layers=model_config.n_sequential_layers(cfg), mesh=mesh,
                              microbatches=args.microbatches,
                              what=f"--pp {args.pp} --virtual-stages {args.virtual_stages}")
        # The model's facts as llama.sequential(cfg) has them: the head reads the embedding
        # when tied; MoE blocks make the carry between layers a tree.
        layout.pipeline.check_composition(layout, mesh, shared=("embed",) if cfg.tie_embeddings else (),
                                          carries_tree=cfg.num_experts > 0, what=f"--pp {args.pp}")
    if layout.context is not None:
        layouts.check_divisible(args.seq, layout.context_degree(mesh), layout.context.load_balance,
                                what=f"--seq {args.seq}")
    _check_corpus(args, n_tokens)
    if check_out:
        check_out_dir(args)
    return layout


def _check_corpus(args: argparse.Namespace, n_tokens: int) -> None:
    """Enough windows of ``--seq + 1`` tokens for one ``--batch`` (in each split, with ``--eval-every``)."""
    parts = {"the corpus": n_tokens}
    if args.eval_every:
        cut = held_out_start(n_tokens)
        parts = {"the training split (the corpus's first nine tenths)": cut,
                 "the held-out split (its last tenth, --eval-every)": n_tokens - cut}
    for name, n in parts.items():
        windows = max(n - 1, 0) // args.seq
        if windows < args.batch:
            raise UsageError(f"--batch {args.batch} --seq {args.seq}: {name} has {n} tokens, {windows} windows of "
                             f"{args.seq} + 1 tokens, fewer than a batch; use a smaller --batch or --seq, or more data")


def check_out_dir(args: argparse.Namespace) -> None:
    """The run directory: its parent creatable and writable; an earlier run's directory
    only with ``--resume`` (continue it) or ``--overwrite`` (clear dtp's files from it)."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (args.resume or args.overwrite):
        raise UsageError(f"--out {out} is not empty (an earlier run?): add --resume to continue it, "
                         f"--overwrite to start again there, or name another --out")
    try:  # create it now (rank 0 would anyway) and write into it: that is what "writable" means
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise UsageError(f"--out {out}: cannot create or write it ({e.strerror or e})") from None
