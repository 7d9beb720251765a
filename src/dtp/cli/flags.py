"""``dtp``'s flags: the argument parser, the checks of flag combinations, and the argv a rank gets.

Everything here runs before any rank starts, so a bad combination is reported once, by
the launcher, as one line (:class:`UsageError`, exit code 2). Rules that need the model
or the mesh are the layouts' and the model's to check.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .._rules import RUN_RTOL
from ..launch import in_torchrun
from ..layouts import CP_ALGORITHMS, ZERO_STAGES, Layout, zero
from ..layouts.zero import misplaced_options
from .. import schedules
from . import plan as plan_cli

# layouts.zero's options: the argparse attribute and the flag that set each.
ZERO_ARGS = {"overlap_grad_reduce": "overlap_grad_reduce", "overlap_param_gather": "overlap_param_gather",
             "prefetch": "zero_prefetch", "reshard_after_forward": "reshard_after_forward"}
ZERO_FLAGS = {"overlap_grad_reduce": "--overlap-grad-reduce", "overlap_param_gather": "--overlap-param-gather",
              "prefetch": "--zero-prefetch", "reshard_after_forward": "--no-reshard-after-forward"}

__all__ = ["UsageError", "build_parser", "parse_args", "validate", "mesh_axes", "train_argv"]

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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dtp`` command (subcommands ``train``, ``plan`` and ``check``).

    >>> args = build_parser().parse_args(["train", "--dp", "2", "--tp", "2", "--sp"])
    >>> args.dp, args.tp, args.sp, args.dtype
    (2, 2, True, 'float32')
    """
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="{train,plan,check}")

    t = sub.add_parser("train", help="train the reference Llama on N ranks under a parallel layout",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = t.add_argument_group("parallelism (mesh order dp, cp, tp: outer to inner)")
    g.add_argument("--nproc", type=_positive("--nproc"), default=None,
                   help="local ranks to start; default (and required value): dp*cp*tp")
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
                   help="with --zero 3: buckets gathered ahead of the one in use (default 1)")
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

    g = t.add_argument_group("output")
    g.add_argument("--out", default=None, help="run directory (default: runs/<timestamp>)")
    g.add_argument("--check", action="store_true",
                   help="compare every step's loss with a 1-process reference run; exit 1 on mismatch")
    g.add_argument("--log-every", type=_positive("--log-every"), default=1, help="print a line every N steps")

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

    c = sub.add_parser("check", help="compare a finished run's losses with a 1-process reference")
    c.add_argument("run_dir", help="the run directory (with config.json and metrics.jsonl)")
    c.add_argument("--rtol", type=_non_negative_float, default=None,
                   help="relative tolerance (default by dtype: " +
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


def validate(args: argparse.Namespace, *, world_size: int | None = None) -> argparse.Namespace:
    """Check flag combinations that need no model or process group; fill in defaults.

    ``world_size`` is torchrun's ``WORLD_SIZE`` when joining an existing world. Raises
    :class:`UsageError` (a ``ValueError``) with a one-line message.

    >>> validate(build_parser().parse_args(["train", "--dp", "2", "--tp", "2"])).nproc
    4
    """
    n = math.prod(mesh_axes(args).values())
    shape = " × ".join(f"{k}={v}" for k, v in mesh_axes(args).items())
    if world_size is not None and world_size != n:
        raise UsageError(f"the mesh {shape} = {n} ranks, but torchrun started WORLD_SIZE={world_size}")
    if args.nproc is None:
        args.nproc = n if world_size is None else world_size
    elif args.nproc != n:
        raise UsageError(f"--nproc {args.nproc} does not match the mesh {shape} = {n} ranks; "
                         f"use --nproc {n} or leave --nproc out")
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
        raise UsageError(f"{', '.join(flags)} configure context parallel; they need --cp > 1")
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
        # As in Megatron-LM: sequence parallel splits over the tp group, a group of one.
        print(f"{PROG} train: note: --sp has no effect with --tp 1 (sequence parallel splits over tp)",
              file=sys.stderr)
        args.sp = False
    if args.ep > 1 and args.batch % (args.dp * args.ep * args.microbatches):
        raise UsageError(f"--batch {args.batch} must be divisible by --dp × --ep × --microbatches = "
                         f"{args.dp} × {args.ep} × {args.microbatches}: ep is a data axis too")
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
    """The ``train`` arguments a rank needs, spelled out (no ``--nproc``, no ``--check``).

    Every value is explicit, so each rank resolves exactly what the launcher resolved
    (the run directory, the warm-up, the absolute data path), and ``--check`` stays with
    the launcher, which runs the reference once instead of on every rank.

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
                                  ("--async-save", args.async_save), ("--resume", args.resume)) if on]
    out += ["--save-every", str(args.save_every), "--keep", str(args.keep)]
    out += ["--zero", str(args.zero), "--zero-prefetch", str(args.zero_prefetch), "--bucket-mb", repr(args.bucket_mb), "--model", args.model, "--steps", str(args.steps),
            "--batch", str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype,
            "--lr", repr(args.lr), "--warmup", str(args.warmup), "--microbatches", str(args.microbatches),
            "--recompute", args.recompute, "--clip", repr(args.clip), "--seed", str(args.seed),
            "--log-every", str(args.log_every)]
    out += ["--max-skipped", str(args.max_skipped)]
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
