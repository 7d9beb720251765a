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
import dataclasses
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
from .._token_files import DTYPES as TOKEN_DTYPES, document_eos, held_out_start, open_tokens, token_stats
from .._rules import COMPILE_BACKENDS, SCORE_FUNCTIONS
from ..config import DEFAULT_WARMUP, DTYPES, MODEL_FIELDS, RECOMPUTE, RunConfig, flag_names, mesh_axes_of, type_error
from ..launch import in_torchrun
from ..layouts import CP_ALGORITHMS, ZERO_STAGES, Layout
from ..models import config as model_config
from . import plan as plan_cli

__all__ = ["UsageError", "build_parser", "parse_args", "validate", "preflight", "build_layout", "mesh_axes",
           "train_argv", "vocab_size", "run_config"]

PROG = "dtp"
# The parser's description: the first line of the package docstring (dtp.cli).
DESCRIPTION = "The ``dtp`` command: train the reference Llama under any parallel layout, from a shell."

# --eval-every: the held-out split is the corpus's last tenth (dtp.data.split_held_out), and
# each evaluation averages the loss of its first EVAL_BATCHES batches: the same tokens every
# time, so the curve compares step with step.
EVAL_BATCHES = 4

# What a run directory holds that dtp wrote (dtp.cli.report's table, the checkpoints, the
# TensorBoard events, the ranks' tracebacks): what --overwrite clears, and nothing else.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "loss.png", "check.json", "checkpoints",
             "tensorboard", "logs")


# Every default is RunConfig's: one table (the parser shows them in --help).
RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}


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
    """The argument parser of the ``dtp`` command (subcommands ``train``, ``plan``, ``check`` and ``export``).

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
    g = t.add_argument_group("run configuration (dtp.RunConfig: one field per flag below, named with '_')")
    g.add_argument("--config", dest="config_file", default=None, metavar="TOML",
                   help="read the run from a TOML file of dtp.RunConfig fields, top level or in tables; flags "
                        "given beside it override its values")
    g.add_argument("--print-config", action="store_true",
                   help="print the resolved run as TOML (what --config reads) and exit")
    g = t.add_argument_group("parallelism (mesh order dp, cp, tp: outer to inner)")
    g.add_argument("--nproc", type=_positive("--nproc"), default=None,
                   help="local ranks to start; default (and the only valid value): the mesh size, pp*dp*ep*cp*tp")
    g.add_argument("--dp", type=_positive("--dp"), default=RUN_DEFAULTS["dp"], help="data-parallel degree")
    g.add_argument("--cp", type=_positive("--cp"), default=RUN_DEFAULTS["cp"], help="context-parallel degree")
    g.add_argument("--tp", type=_positive("--tp"), default=RUN_DEFAULTS["tp"], help="tensor-parallel degree")
    g.add_argument("--sp", action="store_true", help="Megatron sequence parallel (needs --tp > 1)")
    g.add_argument("--async-tp", action="store_true",
                   help="with --sp: the block's all-gathers / reduce-scatters as rings of send/recv hops under the "
                        "matmuls (collective matmul; dense models)")
    g.add_argument("--cp-algo", choices=CP_ALGORITHMS, default=RUN_DEFAULTS["cp_algo"], help="context-parallel algorithm (with --cp > 1)")
    g.add_argument("--cp-window", type=_positive("--cp-window"), default=RUN_DEFAULTS["cp_window"],
                   help="double-ring window: cp ranks per inner ring (MindSpeed --cp-window-size; with --cp > 1)")
    g.add_argument("--ulysses-degree", type=_positive("--ulysses-degree"), default=RUN_DEFAULTS["ulysses_degree"],
                   help="Ulysses part of hybrid context parallel (with --cp > 1)")
    g.add_argument("--cp-head-chunks", type=_positive("--cp-head-chunks"), default=RUN_DEFAULTS["cp_head_chunks"],
                   help="context-parallel attention in this many head chunks (default: the fewest with chunks × cp >= 16 "
                        "keeping each chunk's K+V >= 1 MiB; "
                        "1: Megatron's schedule, fewer and larger transfers, more memory; with --cp > 1)")
    g.add_argument("--pp", type=_positive("--pp"), default=RUN_DEFAULTS["pp"], help="pipeline-parallel degree (outermost mesh axis)")
    g.add_argument("--pp-schedule", choices=schedules.SCHEDULES, default=RUN_DEFAULTS["pp_schedule"],
                   help="pipeline schedule (with --pp > 1; interleaved needs --virtual-stages >= 2; zbv and "
                        "dualpipev hold two chunks per rank in a V: rank r stages r and 2pp-1-r)")
    g.add_argument("--virtual-stages", type=_positive("--virtual-stages"), default=RUN_DEFAULTS["virtual_stages"], metavar="V",
                   help="model chunks per pipeline rank (interleaved schedule; zbv and dualpipev: 2)")
    g.add_argument("--print-schedule", action="store_true",
                   help="print each pipeline rank's action list (F/B/I/W, chunk.microbatch) and exit")
    g.add_argument("--zero", type=int, choices=ZERO_STAGES, default=RUN_DEFAULTS["zero"],
                   help="ZeRO stage over dp: 1 optimizer state, 2 + gradients, 3 + parameters (0: plain DP)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="with --zero: reduce-scatter each gradient bucket during backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --zero 1/2: leave the parameter all-gathers in flight until the next forward")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="with --zero 3: keep gathered buckets from forward until backward is done with them "
                        "(2Ψ traffic instead of 3Ψ; parameters whole during a step)")
    g.add_argument("--zero-prefetch", type=_positive("--zero-prefetch"), default=RUN_DEFAULTS["zero_prefetch"], metavar="N",
                   help="with --zero 3: buckets gathered ahead of the one in use")
    g.add_argument("--bucket-mb", type=_non_negative_float, default=RUN_DEFAULTS["bucket_mb"],
                   help="with --zero: gradient/parameter bucket size in MiB")

    g = t.add_argument_group("model and training")
    g.add_argument("--model", default=RUN_DEFAULTS["model"], help="llama preset: tiny, small, 1b, llama2-7b, llama3-8b, ...")
    g.add_argument("--init-from", default=RUN_DEFAULTS["init_from"], metavar="HF_DIR",
                   help="fine-tune a Hugging Face Llama / Mistral / Mixtral: the model from HF_DIR's config.json "
                        "(instead of --model), its weights from HF_DIR's *.safetensors; the vocabulary padded "
                        "to a multiple of 128 so tp splits it (pip install 'dtp[hf]')")
    g.add_argument("--steps", type=_positive("--steps"), default=RUN_DEFAULTS["steps"], help="optimizer steps")
    g.add_argument("--batch", type=_positive("--batch"), default=RUN_DEFAULTS["batch"], help="global batch size (sequences)")
    g.add_argument("--seq", type=_positive("--seq"), default=RUN_DEFAULTS["seq"], help="sequence length (tokens)")
    g.add_argument("--dtype", choices=DTYPES, default=RUN_DEFAULTS["dtype"], help="parameter and compute dtype")
    g.add_argument("--precision", choices=layouts.PRECISIONS, default=RUN_DEFAULTS["precision"],
                   help="with --dtype bfloat16: mixed keeps fp32 master weights, Adam moments and gradient "
                        "accumulation (Megatron's), pure updates in bf16 (default: mixed under --zero, else pure)")
    g.add_argument("--lr", type=_non_negative_float, default=RUN_DEFAULTS["lr"], help="peak learning rate (AdamW, cosine)")
    g.add_argument("--warmup", type=int, default=RUN_DEFAULTS["warmup"],
                   help=f"linear warm-up steps (default: min({DEFAULT_WARMUP}, --steps))")
    g.add_argument("--microbatches", type=_positive("--microbatches"), default=RUN_DEFAULTS["microbatches"],
                   help="gradient-accumulation microbatches per step")
    g.add_argument("--recompute", choices=RECOMPUTE, default=RUN_DEFAULTS["recompute"], help="activation recomputation")
    g.add_argument("--compile", nargs="?", const="inductor", choices=COMPILE_BACKENDS, default=RUN_DEFAULTS["compile"],
                   metavar="BACKEND", help="compile the local computation (each block, or each local_map body; "
                   "dtp's collectives run between): torch.compile's inductor, or aot_eager / eager (with --debug: "
                   "prints the graph breaks and recompiles)")
    g.add_argument("--clip", type=_non_negative_float, default=RUN_DEFAULTS["clip"], help="global-norm gradient clip (0: off)")
    g.add_argument("--seed", type=int, default=RUN_DEFAULTS["seed"], help="seed of the model init and the data order")
    g.add_argument("--data", default=RUN_DEFAULTS["data"],
                   help="token file (.npy; .bin: uint16 ids unless --data-dtype or its sidecar says uint32) or a "
                        "directory of them, memory-mapped; or text (bytes, or --tokenizer's); default: bundled corpus")
    g.add_argument("--data-dtype", choices=TOKEN_DTYPES, default=RUN_DEFAULTS["data_dtype"],
                   help="the ids of --data's .bin files (default: the sidecar's dtype, else uint16)")
    g.add_argument("--eos-id", type=_non_negative_int, default=RUN_DEFAULTS["eos_id"], metavar="ID",
                   help="the id that ends a document in --data (default: the sidecar's eos_id)")
    g.add_argument("--document-mask", action="store_true",
                   help="pack documents (ended by --eos-id; lines of byte text): attention within each document, "
                        "positions restarting in each, the target at each document end masked")
    g.add_argument("--tokenizer", default=RUN_DEFAULTS["tokenizer"], metavar="TOKENIZER_JSON",
                   help="a Hugging Face tokenizer.json that tokenizes --data's text (pip install 'dtp[hf]')")
    # Non-finite steps: train_step skips them (state unchanged); the loop counts them.
    g.add_argument("--max-skipped", type=_non_negative_int, default=RUN_DEFAULTS["max_skipped"], metavar="N",
                   help="abort after N steps in a row skipped for a non-finite loss or gradient norm (0: never)")

    g = t.add_argument_group("mixture of experts (or --model tiny-moe)")
    g.add_argument("--num-experts", type=_number(int, 0, name="--num-experts"), default=RUN_DEFAULTS["num_experts"], metavar="E",
                   help="experts per MoE block (0: dense; default: the preset's)")
    g.add_argument("--top-k", type=_positive("--top-k"), default=RUN_DEFAULTS["top_k"], metavar="K",
                   help="experts each token is routed to (default: the preset's)")
    g.add_argument("--capacity-factor", type=_positive_float("--capacity-factor"), default=RUN_DEFAULTS["capacity_factor"], metavar="C",
                   help="each expert keeps its ceil(T·k/E · C) highest-probability tokens (default: dropless)")
    g.add_argument("--aux-loss-coeff", type=_non_negative_float, default=RUN_DEFAULTS["aux_loss_coeff"], metavar="C",
                   help="weight of the switch load-balancing loss (default: the preset's, 1e-2; 0: none)")
    g.add_argument("--router-score", choices=SCORE_FUNCTIONS, default=RUN_DEFAULTS["router_score"],
                   help="router scores: softmax (Megatron) or sigmoid with the k chosen normalised (DeepSeek-V3); "
                        "default: the preset's")
    g.add_argument("--n-groups", type=_positive("--n-groups"), default=RUN_DEFAULTS["n_groups"], metavar="G",
                   help="group-limited routing: the experts form G groups (with --topk-group)")
    g.add_argument("--topk-group", type=_positive("--topk-group"), default=RUN_DEFAULTS["topk_group"], metavar="K",
                   help="group-limited routing: each token picks its K best groups, then its top-k in them")
    g.add_argument("--routed-scaling-factor", type=_positive_float("--routed-scaling-factor"),
                   default=RUN_DEFAULTS["routed_scaling_factor"], metavar="S",
                   help="multiply the k combine weights by S (DeepSeek-V3: 2.5)")
    g.add_argument("--router-bias-update", type=_non_negative_float, default=RUN_DEFAULTS["router_bias_update"],
                   metavar="RATE", help="aux-loss-free balancing: after each step each expert's selection bias "
                                        "moves by RATE·sign(mean load − load) (DeepSeek-V3: 1e-3; 0: off)")
    g.add_argument("--ep", type=_positive("--ep"), default=RUN_DEFAULTS["ep"],
                   help="expert-parallel degree: experts split over an ep mesh axis (after dp; also a data axis)")
    g.add_argument("--expert-tp", action="store_true",
                   help="split each expert's hidden width over tp (Megatron's expert tensor parallel; needs --tp > 1)")
    g.add_argument("--pipe-experts", action="store_true",
                   help="MindSpeed pipe-experts: move and compute the dispatched tokens per local expert, each "
                        "chunk's all-to-all in flight while another computes")
    g.add_argument("--multi-data", type=_positive("--multi-data"), default=RUN_DEFAULTS["multi_data"], metavar="N",
                   help="with --pipe-experts: split each local expert's tokens into N chunks (for 1 local expert)")
    g.add_argument("--multi-stream", action="store_true",
                   help="with --pipe-experts and --sp: one communication stream for the ep all-to-alls and the tp "
                        "all-gathers / reduce-scatters, so they never run at the same time")
    g.add_argument("--ep-overlap", action="store_true",
                   help="hide one microbatch's expert all-to-alls under another microbatch's compute (needs --ep; "
                        "at pp 1 --microbatches >= 2; under --pp 1f1b, interleaved or dualpipev)")

    g = t.add_argument_group("output")
    g.add_argument("--out", default=RUN_DEFAULTS["out"], help="run directory (default: runs/<timestamp>)")
    g.add_argument("--check", action="store_true",
                   help="compare every step's loss with a 1-process reference run; exit 1 on mismatch")
    g.add_argument("--log-every", type=_positive("--log-every"), default=RUN_DEFAULTS["log_every"], help="print a line every N steps")
    g.add_argument("--overwrite", action="store_true",
                   help="reuse a non-empty --out: delete the files an earlier run wrote there "
                        f"({', '.join(RUN_FILES)}) first")
    g.add_argument("--eval-every", type=_non_negative_int, default=RUN_DEFAULTS["eval_every"], metavar="N",
                   help=f"every N steps (and after the last) the loss on a held-out tenth of the corpus, forward "
                        f"only, mean of {EVAL_BATCHES} batches (0: never; the held-out tenth then trains too)")
    g.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard events to <out>/tensorboard (needs the tensorboard package)")
    g.add_argument("--debug", action="store_true",
                   help="full Python tracebacks on the console (otherwise one line per failing rank; "
                        "the tracebacks are in <out>/logs)")

    g = t.add_argument_group("checkpoints (in <out>/checkpoints; any parallel flags can resume any others)")
    g.add_argument("--save-every", type=int, default=RUN_DEFAULTS["save_every"], metavar="N",
                   help="save a checkpoint every N steps and after the last (0: never)")
    g.add_argument("--keep", type=_positive("--keep"), default=RUN_DEFAULTS["keep"], metavar="K", help="keep the newest K checkpoints")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints while training goes on (each waits for the one before)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out (metrics.jsonl and loss.png continue)")

    g = t.add_argument_group("failures")
    g.add_argument("--timeout", type=_positive_float("--timeout"), default=RUN_DEFAULTS["timeout"], metavar="SECONDS",
                   help="a collective that waits this long for a peer fails, and every rank exits with its "
                        "last collectives (a dead peer is noticed at once)")
    g.add_argument("--max-restarts", type=_non_negative_int, default=RUN_DEFAULTS["max_restarts"], metavar="R",
                   help="when a rank dies, stop the others and start all again from the newest checkpoint, "
                        "up to R times (torchrun's elastic agent; needs --save-every)")

    plan_cli.add_train_flags(t)
    plan_cli.add_parser(sub, t)  # dtp plan: train's parallel and model flags, shared
    from .export import add_parser as add_export  # it reports with this module's UsageError

    add_export(sub)

    c = sub.add_parser("check", help="compare a finished run's losses with a 1-process reference",
                       formatter_class=_HelpFormatter)
    c.add_argument("run_dir", help="the run directory (with config.json and metrics.jsonl)")
    c.add_argument("--rtol", type=_non_negative_float, default=None,
                   help="relative tolerance (default: by dtype, " +
                        ", ".join(f"{k} {v:g}" for k, v in RUN_RTOL.items()) + ")")
    return parser


def run_config(args: Any) -> RunConfig:
    """The run the parsed flags describe (:func:`validate` builds it once, as ``args.run_config``)."""
    found = getattr(args, "run_config", None)
    if isinstance(found, RunConfig):
        return found
    try:  # dtp plan's flags (a subset: the others keep RunConfig's defaults)
        with flag_names():
            return RunConfig.from_dict(vars(args), strict=False)
    except ValueError as e:
        raise UsageError(str(e)) from None


def mesh_axes(args: argparse.Namespace) -> dict[str, int]:
    """The mesh to build (:meth:`dtp.RunConfig.mesh_axes`): the non-trivial axes in order
    pp, dp, ep, cp, tp (dp always present).

    >>> mesh_axes(parse_args(["train", "--dp", "2", "--tp", "4"]))
    {'dp': 2, 'tp': 4}
    """
    return run_config(args).mesh_axes()


def format_mesh(axes: dict[str, int]) -> str:
    """A mesh for a message: ``dp=2 × tp=2``.

    >>> format_mesh({"dp": 2, "tp": 2}), format_mesh({"dp": 1})
    ('dp=2 × tp=2', 'dp=1')
    """
    return " × ".join(f"{k}={v}" for k, v in axes.items())


def validate(args: argparse.Namespace, *, world_size: int | None = None) -> argparse.Namespace:
    """Check the flags that need no model or process group and build the run from them
    (``args.run_config``, a :class:`dtp.RunConfig`, whose checks speak in flag names here).

    ``world_size`` is torchrun's ``WORLD_SIZE`` when joining an existing world. Raises
    :class:`UsageError` (a ``ValueError``) with a one-line message.

    >>> validate(build_parser().parse_args(["train", "--dp", "2", "--tp", "2"])).nproc
    4
    """
    for name in ("data", "tokenizer", "init_from"):  # the ranks and the reference may run elsewhere
        if getattr(args, name, None) is not None:
            setattr(args, name, str(Path(getattr(args, name)).expanduser().resolve()))
    if args.print_schedule and args.pp == 1:
        raise UsageError("--print-schedule prints the pipeline's schedule; pipeline options need --pp > 1")
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --out, --overwrite deletes it: choose one")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        # torch.utils.tensorboard imports it; found here without importing anything.
        raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard")
    axes = mesh_axes_of(pp=args.pp, dp=args.dp, ep=args.ep, cp=args.cp, tp=args.tp)
    n, shape = math.prod(axes.values()), format_mesh(axes)
    if world_size is not None and world_size != n:
        raise UsageError(f"the mesh {shape} needs {n} rank{'s' * (n > 1)}, but torchrun started WORLD_SIZE={world_size}")
    if args.nproc is None:
        args.nproc = n if world_size is None else world_size
    elif args.nproc != n:
        raise UsageError(f"--nproc {args.nproc} does not match the mesh {shape}: it needs {n} "
                         f"rank{'s' * (n > 1)}; use --nproc {n} or leave --nproc out")
    try:
        with flag_names():
            config = RunConfig.from_dict({k: v for k, v in vars(args).items() if k in RUN_DEFAULTS})
    except ValueError as e:
        raise UsageError(str(e)) from None
    args.run_config, args.warmup = config, config.warmup
    if args.zero and args.dp == 1:
        print(f"{PROG} train: note: --zero {args.zero} has no effect with --dp 1 (ZeRO shards over dp)",
              file=sys.stderr)
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate ``dtp`` arguments (argparse errors exit with code 2). ``train
    --config run.toml`` reads a run first; the flags given beside it override its fields.

    >>> parse_args(["train", "--nproc", "2", "--dp", "2"]).warmup
    5
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["train"]:
        path = _config_path(argv)
        if path is not None:
            _train_parser(parser).set_defaults(**read_config_file(path))
    args = parser.parse_args(argv)
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


def _train_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # no public accessor
    return sub.choices["train"]


def read_config_file(path: str) -> dict[str, Any]:
    """A run's fields from a TOML file (``dtp train --config``): :class:`dtp.RunConfig`'s
    field names as keys, at the top level or in tables (``[parallel]``, ``[training]``, …,
    as a reader likes to group them). An unknown key or a bad file is one line.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "run.toml"
    >>> _ = f.write_text('model = "small"\\n[parallel]\\ndp = 2\\ntp = 2\\nsp = true\\n')
    >>> read_config_file(str(f))
    {'model': 'small', 'dp': 2, 'tp': 2, 'sp': True}
    """
    import tomllib  # Python 3.11's (requires-python >= 3.11)

    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML ({e})") from None
    values: dict[str, Any] = {}
    for key, value in document.items():
        for k, v in (value.items() if isinstance(value, dict) else [(key, value)]):
            if k not in RUN_DEFAULTS:
                raise UsageError(f"--config {path}: unknown key {k!r}; the keys are dtp.RunConfig's fields, "
                                 f"the train flags' names with '_' ({', '.join(list(RUN_DEFAULTS)[:6])}, ...)")
            wrong = type_error(k, v)
            if wrong:  # here, not in argparse: it would parse a string default with the flag's type
                raise UsageError(f"--config {path}: {k} {wrong}")
            values[k] = v
    return values


def train_argv(args: argparse.Namespace) -> list[str]:
    """The ``train`` flags that state the run (:meth:`dtp.RunConfig.argv`: every field
    spelled out; no ``--nproc``, ``--check`` or ``--overwrite``, which are about this
    invocation): the command a run directory records.

    >>> train_argv(parse_args(["train", "--dp", "2", "--out", "r"]))[:9]
    ['train', '--pp', '1', '--pp-schedule', '1f1b', '--virtual-stages', '1', '--dp', '2']
    """
    return run_config(args).argv()


def model_overrides(args: Any) -> dict[str, Any]:
    """The model-config fields the MoE flags set (``args`` a Namespace or the run config).

    >>> model_overrides({"num_experts": 4, "top_k": None, "capacity_factor": None})
    {'num_experts': 4}
    """
    get = args.get if isinstance(args, dict) else lambda k: getattr(args, k, None)
    return {k: get(k) for k in MODEL_FIELDS if get(k) is not None}


def build_layout(args: argparse.Namespace) -> Layout:
    """The run's layout (:meth:`dtp.RunConfig.layout`, where the flags meet the presets).

    >>> build_layout(parse_args(["train", "--dp", "2", "--tp", "2", "--sp"])).megatron.sequence_parallel
    True
    """
    return run_config(args).layout()


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
        n_tokens, max_id = token_stats(args.data, dtype=args.data_dtype, eos_id=args.eos_id,
                                       tokenizer=args.tokenizer)
    except (OSError, ValueError) as e:
        raise UsageError(f"--data: {e}" if not str(e).startswith("--") else str(e)) from None
    if args.document_mask:
        try:
            document_eos(open_tokens(args.data, dtype=args.data_dtype, eos_id=args.eos_id, tokenizer=args.tokenizer))
        except ValueError as e:
            raise UsageError(str(e)) from None
    cfg = _model(args, max_id)
    mesh = MeshShape(mesh_axes(args))
    model = f"--init-from {args.init_from}" if args.init_from else f"--model {args.model}"
    what = f"{model} on the mesh {format_mesh(mesh.sizes)}"
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
        # The model's facts as llama.sequential(cfg) has them: the head reads the embedding when tied.
        layout.pipeline.check_composition(layout, mesh, shared=("embed",) if cfg.tie_embeddings else (),
                                          what=f"--pp {args.pp}")
    if layout.context is not None:
        layouts.check_divisible(args.seq, layout.context_degree(mesh), layout.context.load_balance,
                                what=f"--seq {args.seq}")
    _check_corpus(args, n_tokens)
    if check_out:
        check_out_dir(args)
    return layout


def _model(args: argparse.Namespace, max_id: int) -> model_config.LlamaConfig:
    """The run's model: the preset, its vocabulary grown to the data's ids (:func:`vocab_size`),
    or ``--init-from``'s, which must hold the data's ids."""
    if args.init_from is None:
        return model_config.config(args.model, vocab_size=vocab_size(args.model, max_id), **model_overrides(args))
    if importlib.util.find_spec("safetensors") is None:
        raise UsageError("--init-from reads Hugging Face weights with safetensors: pip install 'dtp[hf]'")
    try:
        cfg = model_config.config_for(args.model, init_from=args.init_from, **model_overrides(args))
    except OSError as e:
        raise UsageError(f"--init-from {args.init_from}: {e.strerror or e} ({e.filename})") from None
    except (ValueError, KeyError) as e:
        raise UsageError(f"--init-from {args.init_from}: {e}") from None
    real = cfg.vocab_size - cfg.vocab_pad
    if max_id >= real:
        raise UsageError(f"--data holds token id {max_id}, but the model of --init-from {args.init_from} has "
                         f"{real} token ids; tokenize the data with its tokenizer")
    return cfg


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
