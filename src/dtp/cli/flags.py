"""The ``dtp`` command: train the reference Llama under any parallel layout, from a shell.

::

    dtp train --nproc 4 --dp 2 --tp 2 --sp --model tiny --steps 50 --check
    dtp check runs/20250101-120000          # re-verify a finished run against 1 process

``dtp train`` outside torchrun starts the ranks itself through torchrun's machinery
(:func:`dtp.launch.launch`); inside torchrun it joins the world it finds, so multi-node
runs are plain ``torchrun ... -m dtp.cli train ...``. Rank 0 shows progress and writes the
run directory (``--out``, default ``runs/<timestamp>``):

=================  =============================================================
``config.json``    the resolved arguments, mesh, vocabulary size, world size
``metrics.jsonl``  one JSON object per step: loss, grad_norm, lr, tokens, step_time,
                   tokens_per_s, comm_bytes ``{axis: {kind: bytes}}``
``summary.json``   first/last loss, mean step time, tokens/s, bytes per mesh axis
``loss.png``       the loss curve (matplotlib when installed, a built-in writer if not)
``check.json``     with ``--check``: per-step losses of the 1-process reference and
                   the largest absolute / relative difference
=================  =============================================================

``--check`` retrains the same model (seed, data, dtype, optimizer, microbatches) on one
process with the plain data-parallel layout and compares the per-step losses. The bar is
a relative difference of 1e-9 in float64, 1e-4 in float32 and 5e-2 in bfloat16, over
*every* step: in low precision the two trajectories drift apart a little more each step
(different reduction orders round differently, and the optimizer feeds that back), so
short runs are the meaningful check there; float64 stays tight for hundreds of steps.

Exit codes: 0 success, 1 a rank crashed or ``--check`` failed, 2 invalid arguments or a
layout that does not fit (one line on stderr; ``DTP_TRACEBACK=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TextIO

__all__ = [
    "main", "build_parser", "parse_args", "validate", "mesh_axes", "train_argv",
    "format_bytes", "format_step", "progress_bar", "summarize", "compare_losses", "tolerance_for",
]

PROG = "dtp"
DTYPES = ("float32", "float64", "bfloat16")
CP_ALGOS = ("ulysses", "ring", "double_ring", "hybrid")
RECOMPUTE = ("none", "full", "selective")
# Relative per-step loss difference --check accepts (see the module docstring for why
# it is per dtype and why low precision drifts with the number of steps).
CHECK_RTOL = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2}
DEFAULT_WARMUP = 5


class UsageError(ValueError):
    """Invalid flags: reported as one line, exit code 2."""


# --------------------------------------------------------------------------- arguments


def _positive(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dtp`` command (subcommands ``train`` and ``check``).

    >>> args = build_parser().parse_args(["train", "--dp", "2", "--tp", "2", "--sp"])
    >>> args.dp, args.tp, args.sp, args.dtype
    (2, 2, True, 'float32')
    """
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="{train,check}")

    t = sub.add_parser("train", help="train the reference Llama on N ranks under a parallel layout",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = t.add_argument_group("parallelism (mesh order dp, cp, tp: outer to inner)")
    g.add_argument("--nproc", type=_positive("--nproc"), default=None,
                   help="local ranks to start; default (and required value): dp*cp*tp")
    g.add_argument("--dp", type=_positive("--dp"), default=1, help="data-parallel degree")
    g.add_argument("--cp", type=_positive("--cp"), default=1, help="context-parallel degree")
    g.add_argument("--tp", type=_positive("--tp"), default=1, help="tensor-parallel degree")
    g.add_argument("--sp", action="store_true", help="Megatron sequence parallel (needs --tp > 1)")
    g.add_argument("--cp-algo", choices=CP_ALGOS, default=None, help="context-parallel algorithm (with --cp > 1)")
    g.add_argument("--cp-window", type=_positive("--cp-window"), default=None,
                   help="double-ring window: cp ranks per inner ring (MindSpeed --cp-window-size; with --cp > 1)")
    g.add_argument("--ulysses-degree", type=_positive("--ulysses-degree"), default=None,
                   help="Ulysses part of hybrid context parallel (with --cp > 1)")
    g.add_argument("--cp-head-chunks", type=_positive("--cp-head-chunks"), default=None,
                   help="context-parallel attention in this many head chunks (default: the fewest with chunks × cp >= 16 "
                        "keeping each chunk's K+V >= 1 MiB; "
                        "1: Megatron's schedule, fewer and larger transfers, more memory; with --cp > 1)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO stage over dp: 1 optimizer state, 2 + gradients, 3 + parameters (0: plain DP)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="with --zero: reduce-scatter each gradient bucket during backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --zero 1/2: leave the parameter all-gathers in flight until the next forward")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="with --zero 3: keep gathered buckets from forward until backward is done with them "
                        "(2Ψ traffic instead of 3Ψ; parameters whole during a step)")
    g.add_argument("--zero-prefetch", type=int, default=1, metavar="N",
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

    g = t.add_argument_group("output")
    g.add_argument("--out", default=None, help="run directory (default: runs/<timestamp>)")
    g.add_argument("--check", action="store_true",
                   help="compare every step's loss with a 1-process reference run; exit 1 on mismatch")
    g.add_argument("--log-every", type=_positive("--log-every"), default=1, help="print a line every N steps")

    c = sub.add_parser("check", help="compare a finished run's losses with a 1-process reference")
    c.add_argument("run_dir", help="the run directory (with config.json and metrics.jsonl)")
    c.add_argument("--rtol", type=_non_negative_float, default=None,
                   help="relative tolerance (default by dtype: " +
                        ", ".join(f"{k} {v:g}" for k, v in CHECK_RTOL.items()) + ")")
    return parser


def mesh_axes(args: argparse.Namespace) -> dict[str, int]:
    """The mesh to build: the non-trivial axes in order dp, cp, tp (dp always present).

    >>> mesh_axes(argparse.Namespace(dp=2, cp=1, tp=4))
    {'dp': 2, 'tp': 4}
    """
    axes = {"dp": args.dp}
    for name in ("cp", "tp"):
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
    shape = " × ".join(f"{k}={getattr(args, k)}" for k in ("dp", "cp", "tp"))
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
    if not args.zero and (args.overlap_grad_reduce or args.overlap_param_gather):
        raise UsageError("--overlap-grad-reduce / --overlap-param-gather overlap ZeRO's collectives; they need --zero 1, 2 or 3")
    if args.zero_prefetch != 1 and args.zero != 3:
        raise UsageError("--zero-prefetch is a ZeRO-3 option; it needs --zero 3")
    if args.zero_prefetch < 1:
        raise UsageError(f"--zero-prefetch must be >= 1, got {args.zero_prefetch}")
    if not args.reshard_after_forward and args.zero != 3:
        raise UsageError("--no-reshard-after-forward is a ZeRO-3 option; it needs --zero 3")
    if args.zero and args.dp == 1:
        print(f"{PROG} train: note: --zero {args.zero} has no effect with --dp 1 (ZeRO shards over dp)",
              file=sys.stderr)
    if args.bucket_mb <= 0:
        raise UsageError(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    if args.sp and args.tp == 1:
        # As in Megatron-LM: sequence parallel splits over the tp group, a group of one.
        print(f"{PROG} train: note: --sp has no effect with --tp 1 (sequence parallel splits over tp)",
              file=sys.stderr)
        args.sp = False
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
        from ..launch import in_torchrun

        validate(args, world_size=int(os.environ["WORLD_SIZE"]) if in_torchrun() else None)
    return args


def train_argv(args: argparse.Namespace) -> list[str]:
    """The ``train`` arguments a rank needs, spelled out (no ``--nproc``, no ``--check``).

    Every value is explicit, so each rank resolves exactly what the launcher resolved
    (the run directory, the warm-up, the absolute data path), and ``--check`` stays with
    the launcher, which runs the reference once instead of on every rank.

    >>> train_argv(parse_args(["train", "--dp", "2", "--out", "r"]))[:5]
    ['train', '--dp', '2', '--cp', '1']
    """
    out = ["train", "--dp", str(args.dp), "--cp", str(args.cp), "--tp", str(args.tp)]
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
                                  ("--no-reshard-after-forward", not args.reshard_after_forward)) if on]
    out += ["--zero", str(args.zero), "--zero-prefetch", str(args.zero_prefetch), "--bucket-mb", repr(args.bucket_mb), "--model", args.model, "--steps", str(args.steps),
            "--batch", str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype,
            "--lr", repr(args.lr), "--warmup", str(args.warmup), "--microbatches", str(args.microbatches),
            "--recompute", args.recompute, "--clip", repr(args.clip), "--seed", str(args.seed),
            "--log-every", str(args.log_every)]
    return out


def _default_out() -> str:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, k = base, 1
    while path.exists():  # two runs started within the same second
        path, k = base.with_name(f"{base.name}-{k}"), k + 1
    return str(path)


# --------------------------------------------------------------------------- formatting


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


def format_step(step: int, total: int, m: Mapping[str, Any]) -> str:
    """One line per step, from ``train_step``'s metrics.

    The step number is padded to the width of the total, so columns line up in a log.

    >>> format_step(3, 50, {"loss": 4.1234, "grad_norm": 1.0213, "lr": 3e-3, "tokens": 512,
    ...                     "step_time": 0.05, "comm_bytes": {"tp": {"all_reduce": 1_200_000}}})
    'step  3/50 loss 4.1234 gnorm 1.02 lr 3.0e-03 tok/s 10240 comm tp:1.2MB'
    """
    width = len(str(total))
    step_time = float(m.get("step_time") or 0.0)
    tps = f"{m['tokens'] / step_time:.0f}" if step_time > 0 else "-"
    totals = _axis_totals(m.get("comm_bytes") or {})
    comm = " ".join(f"{axis}:{format_bytes(b)}" for axis, b in totals.items() if b) or "none"
    return (f"step {step:>{width}}/{total} loss {m['loss']:.4f} gnorm {m['grad_norm']:.3g} "
            f"lr {m['lr']:.1e} tok/s {tps} comm {comm}")


def progress_bar(step: int, total: int, width: int = 24) -> str:
    """A text progress bar.

    >>> progress_bar(5, 10, width=10)
    '[#####.....]  50%'
    """
    done = round(width * step / total) if total else width
    return f"[{'#' * done}{'.' * (width - done)}] {100 * step // max(total, 1):>3d}%"


class _Progress:
    """Rank 0's console output: a live bar on a terminal, plain lines in a log file."""

    def __init__(self, total: int, log_every: int, stream: TextIO | None = None):
        self.total, self.log_every = total, log_every
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        line = format_step(step, self.total, metrics)
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


# --------------------------------------------------------------------------- files


def _atomic_write_text(path: Path, text: str) -> None:
    # tmp file in the same directory + rename: readers never see a partial file, and a
    # run killed mid-write leaves the previous complete version.
    from ..plot import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _write_json(path: Path, obj: Any) -> None:
    _atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise UsageError(f"{path} does not exist (did the run finish?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
    return {
        "steps": len(records),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "min_loss": min(losses),
        "mean_step_time": time_total / len(timed),
        "timed_steps": len(timed),
        "tokens_per_s": sum(int(r["tokens"]) for r in timed) / time_total if time_total > 0 else None,
        "total_tokens": sum(int(r["tokens"]) for r in records),
        "comm_bytes_per_axis": _axis_totals(comm),
        "comm_bytes": comm,
    }


def _format_summary(s: Mapping[str, Any]) -> str:
    tps = f"{s['tokens_per_s']:.0f}" if s.get("tokens_per_s") else "-"
    comm = ", ".join(f"{a} {format_bytes(b)}" for a, b in s["comm_bytes_per_axis"].items()) or "none"
    return (f"done: {s['steps']} steps, loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, "
            f"{1e3 * s['mean_step_time']:.1f} ms/step, {tps} tok/s, comm per rank: {comm}")


def tolerance_for(dtype: str) -> float:
    """The relative per-step loss tolerance of ``--check`` for a dtype name.

    >>> tolerance_for("float64")
    1e-09
    """
    return CHECK_RTOL[dtype]


def compare_losses(run: Sequence[float], reference: Sequence[float], rtol: float) -> dict[str, Any]:
    """Largest absolute and relative per-step difference; ``ok`` when every step is within ``rtol``.

    A NaN anywhere, or a different number of steps, fails.

    >>> r = compare_losses([5.0, 4.0], [5.0, 4.004], rtol=1e-4)
    >>> r["ok"], r["worst_step"], round(r["max_rel_diff"], 6)
    (False, 2, 0.000999)
    """
    result: dict[str, Any] = {"steps": len(run), "reference_steps": len(reference), "rtol": rtol,
                              "max_abs_diff": 0.0, "max_rel_diff": 0.0, "worst_step": None}
    if len(run) != len(reference) or not run:
        result.update(ok=False, reason=f"the run has {len(run)} steps, the reference {len(reference)}")
        return result
    for i, (a, b) in enumerate(zip(run, reference), start=1):
        diff = abs(float(a) - float(b))
        rel = diff / max(abs(float(b)), 1e-30)
        if not math.isfinite(rel):
            result.update(ok=False, worst_step=i, max_abs_diff=math.inf, max_rel_diff=math.inf,
                          reason=f"step {i}: non-finite loss (run {a}, reference {b})")
            return result
        result["max_abs_diff"] = max(result["max_abs_diff"], diff)
        if rel >= result["max_rel_diff"]:
            result["max_rel_diff"], result["worst_step"] = rel, i
    result["ok"] = result["max_rel_diff"] <= rtol
    return result


# --------------------------------------------------------------------------- training


def _api(name: str) -> Any:
    """``dtp.<name>``, or a clear error while the training API is not there."""
    import dtp

    value = getattr(dtp, name, None)
    if value is None:
        raise UsageError(f"dtp.{name} is not available in this version of dtp")
    return value


def _llama() -> Any:
    try:
        from ..models import llama
    except ImportError as e:
        raise UsageError(f"the reference model dtp.models.llama is not available ({e})") from None
    return llama


def _layouts() -> Any:
    try:
        from .. import layouts
    except ImportError as e:
        raise UsageError(f"dtp.layouts is not available ({e})") from None
    return layouts


def build_layout(args: argparse.Namespace) -> Any:
    """``data() + megatron(sequence_parallel=sp)`` (+ ``context(...)`` with cp > 1, + ``zero``).

    Megatron's rules name the ``tp`` axis; on a mesh without it they are dropped, so the
    same layout serves tp = 1.
    """
    layouts = _layouts()
    layout = layouts.data() + layouts.megatron(sequence_parallel=args.sp)
    if args.cp > 1:
        options = {k: v for k, v in (("algo", args.cp_algo), ("window", args.cp_window),
                                     ("ulysses_degree", args.ulysses_degree),
                                     ("head_chunks", args.cp_head_chunks)) if v is not None}
        layout = layout + layouts.context(**options)
    if args.zero:
        layout = layout + layouts.zero(stage=args.zero, bucket_mb=args.bucket_mb,
                                       overlap_grad_reduce=args.overlap_grad_reduce,
                                       overlap_param_gather=args.overlap_param_gather,
                                       reshard_after_forward=args.reshard_after_forward,
                                       prefetch=args.zero_prefetch)
    return layout


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[name]


@functools.lru_cache(maxsize=2)  # the launcher validates with the data, then trains with it
def _load_data(path: str | None) -> Any:
    from ..data import load_tokens

    try:
        return load_tokens(path)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise UsageError(f"--data: {e}") from None


def _vocab_size(model: str, tokens: Any) -> int:
    """The preset's vocabulary, grown (to a multiple of 128, like nanoGPT's 50304) when the
    data holds larger ids. Independent of tp, so runs under different layouts share a model."""
    preset = _llama().config(model).vocab_size
    needed = -(-(int(tokens.max()) + 1) // 128) * 128
    return max(preset, needed)


def _train(args: Mapping[str, Any], mesh: Any, layout: Any, *, recompute: str | None,
           on_step: Callable[[int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """The training loop every rank runs (and the 1-process reference); returns the metrics."""
    import torch

    from .. import optim
    from ..data import TokenLoader

    llama = _llama()
    torch.manual_seed(args["seed"])
    tokens = _load_data(args["data"])
    loader = TokenLoader(tokens, batch_size=args["batch"], seq_len=args["seq"], seed=args["seed"])
    cfg = llama.config(args["model"], vocab_size=args["vocab_size"])
    params = llama.init(cfg, seed=args["seed"], dtype=_torch_dtype(args["dtype"]))
    opt = optim.adamw(optim.warmup_cosine(args["lr"], args["warmup"], args["steps"]), weight_decay=0.1)
    # axis_sizes: the layout's rules (heads per tp × Ulysses degree, kv heads per head
    # chunk, vocab per tp …) are checked here, on every rank, before any collective.
    state = _api("TrainState").create(params, opt, mesh=mesh, layout=layout, axes=llama.param_axes(cfg),
                                      axis_sizes=llama.axis_sizes(cfg))
    train_step, shard_batch = _api("train_step"), _api("shard_batch")
    loss_fn = functools.partial(llama.loss, cfg=cfg)
    clip = args["clip"] if args["clip"] > 0 else None
    records = []
    for step in range(1, args["steps"] + 1):
        batch = shard_batch(loader.next_batch(), state)
        state, m = train_step(loss_fn, state, batch, microbatches=args["microbatches"],
                              recompute=recompute, clip_norm=clip)
        step_time = float(m["step_time"])
        record = {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                  "lr": float(m["lr"]), "tokens": int(m["tokens"]), "step_time": step_time,
                  "tokens_per_s": int(m["tokens"]) / step_time if step_time > 0 else None,
                  "comm_bytes": {a: {k: int(b) for k, b in kinds.items()}
                                 for a, kinds in (m.get("comm_bytes") or {}).items()}}
        records.append(record)
        if on_step is not None:
            on_step(step, record)
    return records


@contextlib.contextmanager
def _single_process_world() -> Iterator[Any]:
    """A 1-rank mesh in this process; the process group it creates is torn down after,
    so ``main()`` called from Python leaves no global state behind."""
    import torch.distributed as dist

    from .. import make_mesh
    from .. import mesh as mesh_module

    created = not dist.is_initialized()
    try:
        yield make_mesh(dp=1)
    finally:
        if created and dist.is_initialized():
            mesh_module._MESH_CACHE.clear()
            dist.destroy_process_group()


def _run_config(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if k not in ("command", "check", "nproc")}
    cfg.update(vocab_size=_vocab_size(args.model, _load_data(args.data)), world_size=world_size,
               mesh=mesh_axes(args))
    return cfg


@contextlib.contextmanager
def _world(args: argparse.Namespace) -> Iterator[Any]:
    """The run's mesh: from torchrun's environment in a rank, else a world of one here."""
    import torch.distributed as dist

    from .. import make_mesh
    from ..launch import in_torchrun

    if not in_torchrun():
        with _single_process_world() as mesh:
            yield mesh
        return
    created = not dist.is_initialized()
    try:
        yield make_mesh(**mesh_axes(args))
    finally:
        # A clean shutdown: torch warns about process groups left to the interpreter exit.
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _train_rank(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Train as one rank of the current world (torchrun's, or a world of one)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(args.out)
    run_cfg = _run_config(args, world)
    layout = build_layout(args)
    progress = _Progress(args.steps, args.log_every, stream) if rank == 0 else None
    lines: list[str] = []

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "config.json", {**run_cfg, "layout": getattr(layout, "name", str(layout)),
                                          "command": shlex.join([PROG, *train_argv(args)])})
        mesh = " × ".join(f"{k}={v}" for k, v in run_cfg["mesh"].items())
        print(f"{PROG} train: {args.model} on mesh {mesh} ({world} rank{'s' * (world > 1)}), "
              f"layout {getattr(layout, 'name', layout)}, {args.dtype}, writing {out}", file=stream, flush=True)

    def on_step(step: int, record: dict[str, Any]) -> None:
        if rank != 0:
            return
        lines.append(json.dumps(record))
        # The whole file each step (tmp + rename), so it is always complete; at ~250 bytes a
        # step that is a few ms even after thousands of steps, small next to a step.
        _atomic_write_text(out / "metrics.jsonl", "\n".join(lines) + "\n")
        progress.update(step, record)

    with _world(args) as mesh:
        records = _train(run_cfg, mesh, layout, recompute=_recompute(args), on_step=on_step)

    if rank == 0:
        summary = summarize(records)
        _write_json(out / "summary.json", summary)
        _plot(out, {"loss": [r["loss"] for r in records]}, run_cfg)
        print(_format_summary(summary), file=stream, flush=True)
    return 0


def _recompute(args: argparse.Namespace) -> str | None:
    return None if args.recompute == "none" else args.recompute


def _plot(out: Path, curves: Mapping[str, Sequence[float]], cfg: Mapping[str, Any]) -> None:
    from ..plot import plot_loss

    mesh = " ".join(f"{k}={v}" for k, v in cfg["mesh"].items()) + (" +sp" if cfg.get("sp") else "")
    plot_loss(out / "loss.png", curves, title=f"{cfg['model']} {cfg['dtype']} {mesh}")


def check_run(run_dir: str | os.PathLike[str], *, rtol: float | None = None,
              stream: TextIO | None = None) -> int:
    """Retrain a finished run on one process (plain data layout) and compare per-step losses.

    Prints the largest absolute and relative difference, writes ``check.json``, redraws
    ``loss.png`` with the reference, and returns 0 (within tolerance) or 1.

    >>> check_run("runs/20250101-120000")                        # doctest: +SKIP
    check: 50 steps vs 1-process reference: max |Δloss| 3.1e-15, max rel 7.2e-16 at step 41 (rtol 1e-09, float64): OK
    0
    """
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists():
        raise UsageError(f"{cfg_path} does not exist: not a dtp run directory")
    cfg = json.loads(cfg_path.read_text())
    run = [float(r["loss"]) for r in _read_metrics(run_dir)]
    rtol = tolerance_for(cfg["dtype"]) if rtol is None else rtol
    print(f"check: retraining {cfg['steps']} steps on 1 process (layout data, recompute none) ...",
          file=stream, flush=True)
    with _single_process_world() as mesh:
        ref = [r["loss"] for r in _train(cfg, mesh, _layouts().data(), recompute=None)]
    result = compare_losses(run, ref, rtol)
    result.update(dtype=cfg["dtype"], run_losses=run, reference_losses=ref)
    _write_json(run_dir / "check.json", result)
    mesh_name = " ".join(f"{k}={v}" for k, v in cfg["mesh"].items())
    _plot(run_dir, {mesh_name: run, "1-process reference": ref}, cfg)
    verdict = "OK" if result["ok"] else "FAILED"
    detail = result.get("reason") or (
        f"max |Δloss| {result['max_abs_diff']:.2e}, max rel {result['max_rel_diff']:.2e} "
        f"at step {result['worst_step']}")
    print(f"check: {len(run)} steps vs 1-process reference: {detail} (rtol {rtol:g}, {cfg['dtype']}): {verdict}",
          file=stream, flush=True)
    return 0 if result["ok"] else 1


def _check_in_subprocess(out: str) -> int:
    """Under an outside torchrun world, the reference needs a process of its own (this
    one's process group has WORLD_SIZE ranks): rank 0 runs ``dtp check`` without torchrun's
    variables, so it builds a world of one."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                        "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")}
    return subprocess.call([sys.executable, "-m", "dtp.cli", "check", out], env=env)


# --------------------------------------------------------------------------- entry point


def _cmd_train(args: argparse.Namespace) -> int:
    from ..launch import in_torchrun, launch

    if args.out is None:
        args.out = _default_out()
    args.out = str(Path(args.out).resolve())  # ranks and the reference must agree on it
    if in_torchrun():
        code = _train_rank(args)
        if code == 0 and args.check and int(os.environ["RANK"]) == 0:
            code = _check_in_subprocess(args.out)
        return code
    # Validate what can be validated here, before starting ranks that would all fail.
    build_layout(args)
    _llama().config(args.model, vocab_size=_vocab_size(args.model, _load_data(args.data)))
    if args.nproc > 1:
        code = launch(args.nproc, train_argv(args))
    else:
        code = _train_rank(args)
    if code == 0 and args.check:
        code = check_run(args.out)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dtp`` console script; returns the exit code.

    >>> main(["train", "--dp", "2", "--tp", "2", "--steps", "10", "--check"])  # doctest: +SKIP
    0
    """
    parser = build_parser()
    try:
        args = parse_args(argv)
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "check":
            return check_run(args.run_dir, rtol=args.rtol)
        parser.print_help(sys.stderr)
        return 2
    except (ValueError, NotImplementedError) as e:
        # Validation errors (ours, the layouts', the model's) are one line, not a traceback.
        if os.environ.get("DTP_TRACEBACK"):
            raise
        from ..launch import report_error

        command = getattr(locals().get("args"), "command", None) or "train"
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        report_error(f"{PROG} {command}: error: {message}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
