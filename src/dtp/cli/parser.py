"""The argument parser of the ``dtp`` command: every flag, its type check and its help.

What the flags mean is :class:`dtp.RunConfig`'s (the defaults shown are its fields');
how combinations are checked is :mod:`.flags`'. Like that module it imports nothing
that imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import math
import dataclasses
from typing import Any, Callable, NoReturn, Sequence

from .. import layouts, schedules
from .._rules import COMPILE_BACKENDS, RUN_RTOL, SCORE_FUNCTIONS
from .._token_files import DTYPES as TOKEN_DTYPES
from ..launch import in_torchrun, launched
from ..config import DEFAULT_WARMUP, DTYPES, RECOMPUTE, RunConfig
from ..layouts import CP_ALGORITHMS, ZERO_STAGES
from ..models import config as model_config
from . import plan as plan_cli

__all__ = ["build_parser", "UsageError", "positive_float", "PROG", "EVAL_BATCHES", "RUN_FILES", "RUN_DEFAULTS", "note"]


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dtp`` command (subcommands ``train``, ``plan``, ``check`` and ``export``).

    >>> args = build_parser().parse_args(["train", "--dp", "2", "--tp", "2", "--sp"])
    >>> args.dp, args.tp, args.sp, args.dtype
    (2, 2, True, 'float32')
    """
    parser = _Parser(prog=PROG, description=DESCRIPTION)
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
    g.add_argument("--nproc", type=_positive, default=None,
                   help="local ranks to start; default (and the only valid value): the mesh size, pp*dp*ep*cp*tp")
    g.add_argument("--dp", type=_positive, default=RUN_DEFAULTS["dp"], help="data-parallel degree")
    g.add_argument("--cp", type=_positive, default=RUN_DEFAULTS["cp"], help="context-parallel degree")
    g.add_argument("--tp", type=_positive, default=RUN_DEFAULTS["tp"], help="tensor-parallel degree")
    g.add_argument("--sp", action=_Switch, help="Megatron sequence parallel (needs --tp > 1)")
    g.add_argument("--async-tp", action=_Switch,
                   help="with --sp: the block's all-gathers / reduce-scatters as rings of send/recv hops under the "
                        "matmuls (collective matmul)")
    g.add_argument("--cp-algo", choices=CP_ALGORITHMS, default=RUN_DEFAULTS["cp_algo"], help="context-parallel algorithm (with --cp > 1)")
    g.add_argument("--cp-window", type=_positive, default=RUN_DEFAULTS["cp_window"],
                   help="double-ring window: cp ranks per inner ring (MindSpeed --cp-window-size; with --cp > 1)")
    g.add_argument("--ulysses-degree", type=_positive, default=RUN_DEFAULTS["ulysses_degree"],
                   help="Ulysses part of hybrid context parallel (with --cp > 1)")
    g.add_argument("--cp-head-chunks", type=_positive, default=RUN_DEFAULTS["cp_head_chunks"],
                   help="context-parallel attention in this many head chunks (default: the fewest with chunks × cp >= 16 "
                        "keeping each chunk's K+V >= 1 MiB; "
                        "1: Megatron's schedule, fewer and larger transfers, more memory; with --cp > 1)")
    g.add_argument("--pp", type=_positive, default=RUN_DEFAULTS["pp"], help="pipeline-parallel degree (outermost mesh axis)")
    g.add_argument("--pp-schedule", choices=schedules.SCHEDULES, default=RUN_DEFAULTS["pp_schedule"],
                   help="pipeline schedule (with --pp > 1; interleaved needs --virtual-stages >= 2; zbv and "
                        "dualpipev hold two chunks per rank in a V: rank r stages r and 2pp-1-r)")
    g.add_argument("--virtual-stages", type=_positive, default=RUN_DEFAULTS["virtual_stages"], metavar="V",
                   help="model chunks per pipeline rank (interleaved schedule; zbv and dualpipev: 2)")
    g.add_argument("--print-schedule", action="store_true",
                   help="print each pipeline rank's action list (F/B/I/W, chunk.microbatch) and exit")
    g.add_argument("--zero", type=int, choices=ZERO_STAGES, default=RUN_DEFAULTS["zero"],
                   help="ZeRO stage over dp: 1 optimizer state, 2 + gradients, 3 + parameters (0: plain DP)")
    g.add_argument("--overlap-grad-reduce", action=_Switch,
                   help="with --zero: reduce-scatter each gradient bucket during backward")
    g.add_argument("--overlap-param-gather", action=_Switch,
                   help="with --zero: leave the update's parameter all-gathers in flight until the next forward "
                        "(--zero 3: those of its first --zero-prefetch + 1 buckets)")
    g.add_argument("--reshard-after-forward", action=_Switch, default=RUN_DEFAULTS["reshard_after_forward"],
                   help="with --zero 3 (on unless --no-…): free gathered buckets after forward and gather them again "
                        "in backward; --no-reshard-after-forward keeps them until backward is done with them (2Ψ "
                        "traffic instead of 3Ψ; parameters whole during a step)")
    g.add_argument("--zero-prefetch", type=_positive, default=RUN_DEFAULTS["zero_prefetch"], metavar="N",
                   help="with --zero 3: buckets gathered ahead of the one in use")
    g.add_argument("--bucket-mb", type=positive_float, default=RUN_DEFAULTS["bucket_mb"],
                   help="with --zero: gradient/parameter bucket size in MiB")

    g = t.add_argument_group("model and training")
    g.add_argument("--model", default=RUN_DEFAULTS["model"], help=f"llama preset: {', '.join(model_config.CONFIGS)}")
    g.add_argument("--init-from", default=RUN_DEFAULTS["init_from"], metavar="HF_DIR",
                   help="fine-tune a Hugging Face Llama / Mistral / Mixtral / Qwen2 / Qwen3 / Qwen3-MoE: the model "
                        "from HF_DIR's config.json (instead of --model), its weights from HF_DIR's *.safetensors; the vocabulary padded "
                        "to a multiple of 128 so tp splits it (pip install 'dtp[hf]')")
    g.add_argument("--steps", type=_positive, default=RUN_DEFAULTS["steps"], help="optimizer steps")
    g.add_argument("--batch", type=_positive, default=RUN_DEFAULTS["batch"], help="global batch size (sequences)")
    g.add_argument("--seq", type=_positive, default=RUN_DEFAULTS["seq"], help="sequence length (tokens)")
    g.add_argument("--dtype", choices=DTYPES, default=RUN_DEFAULTS["dtype"], help="parameter and compute dtype")
    g.add_argument("--precision", choices=layouts.PRECISIONS, default=RUN_DEFAULTS["precision"],
                   help="with --dtype bfloat16: mixed keeps fp32 master weights, Adam moments and gradient "
                        "accumulation (Megatron's), pure updates in bf16 (not with --zero) (default: mixed)")
    g.add_argument("--lr", type=_non_negative_float, default=RUN_DEFAULTS["lr"], help="peak learning rate (AdamW, cosine)")
    g.add_argument("--weight-decay", type=_non_negative_float, default=RUN_DEFAULTS["weight_decay"],
                   help="AdamW's decoupled weight decay, on the weight matrices and embeddings; norms and biases "
                        "are not decayed (Megatron's rule)")
    g.add_argument("--warmup", type=int, default=RUN_DEFAULTS["warmup"],
                   help=f"linear warm-up steps (default: min({DEFAULT_WARMUP}, --steps))")
    g.add_argument("--microbatches", type=_positive, default=RUN_DEFAULTS["microbatches"],
                   help="gradient-accumulation microbatches per step (default 1; under --pp the fewest that keep "
                        "every stage busy, --pp or 2 x --pp for dualpipev, or the next count that splits --batch)")
    g.add_argument("--recompute", choices=RECOMPUTE, default=RUN_DEFAULTS["recompute"], help="activation recomputation")
    g.add_argument("--compile", nargs="?", const=COMPILE_BACKENDS[0], choices=COMPILE_BACKENDS, default=RUN_DEFAULTS["compile"],
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
                   help="the id that ends a document in --data (default: the sidecar's eos_id; with --tokenizer "
                        "the eos_token of a tokenizer_config.json beside it, else </s>, <|endoftext|>, … in its "
                        "vocabulary)")
    g.add_argument("--document-mask", action=_Switch,
                   help="pack documents (ended by --eos-id; in text, its lines: byte text's end at the newline, "
                        "--tokenizer's are encoded one by one, each followed by the EOS id): attention within each "
                        "document, positions restarting in each, the target at each document end masked")
    g.add_argument("--tokenizer", default=RUN_DEFAULTS["tokenizer"], metavar="TOKENIZER_JSON",
                   help="a Hugging Face tokenizer.json that tokenizes --data's text (pip install 'dtp[hf]')")
    # Non-finite steps: train_step skips them (state unchanged); the loop counts them.
    g.add_argument("--max-skipped", type=_non_negative_int, default=RUN_DEFAULTS["max_skipped"], metavar="N",
                   help="abort after N steps in a row skipped for a non-finite loss or gradient norm (0: never)")

    g = t.add_argument_group("mixture of experts (or --model tiny-moe)")
    g.add_argument("--num-experts", type=_non_negative_int, default=RUN_DEFAULTS["num_experts"], metavar="E",
                   help="experts per MoE block (0: dense; default: the preset's)")
    g.add_argument("--top-k", type=_positive, default=RUN_DEFAULTS["top_k"], metavar="K",
                   help="experts each token is routed to (default: the preset's)")
    g.add_argument("--capacity-factor", type=positive_float, default=RUN_DEFAULTS["capacity_factor"], metavar="C",
                   help="each expert keeps its ceil(T·k/E · C) highest-probability tokens (default: dropless)")
    g.add_argument("--aux-loss-coeff", type=_non_negative_float, default=RUN_DEFAULTS["aux_loss_coeff"], metavar="C",
                   help="weight of the switch load-balancing loss (default: the preset's, 1e-2; 0: none)")
    g.add_argument("--router-score", choices=SCORE_FUNCTIONS, default=RUN_DEFAULTS["router_score"],
                   help="router scores: softmax (Megatron) or sigmoid with the k chosen normalised (DeepSeek-V3); "
                        "default: the preset's")
    g.add_argument("--n-groups", type=_positive, default=RUN_DEFAULTS["n_groups"], metavar="G",
                   help="group-limited routing: the experts form G groups (with --topk-group)")
    g.add_argument("--topk-group", type=_positive, default=RUN_DEFAULTS["topk_group"], metavar="K",
                   help="group-limited routing: each token picks its K best groups, then its top-k in them")
    g.add_argument("--routed-scaling-factor", type=positive_float,
                   default=RUN_DEFAULTS["routed_scaling_factor"], metavar="S",
                   help="multiply the k combine weights by S (DeepSeek-V3: 2.5)")
    g.add_argument("--router-bias-update", type=_non_negative_float, default=RUN_DEFAULTS["router_bias_update"],
                   metavar="RATE", help="aux-loss-free balancing: after each step each expert's selection bias "
                                        "moves by RATE·sign(mean load − load) (DeepSeek-V3: 1e-3; 0: off)")
    g.add_argument("--ep", type=_positive, default=RUN_DEFAULTS["ep"],
                   help="expert-parallel degree: experts split over an ep mesh axis (after dp; also a data axis)")
    g.add_argument("--expert-tp", action=_Switch,
                   help="split each expert's hidden width over tp (Megatron's expert tensor parallel; needs --tp > 1, "
                        "any --ep; without it every tp rank holds its experts whole and computes them on the same tokens)")
    g.add_argument("--pipe-experts", action=_Switch,
                   help="MindSpeed pipe-experts: move and compute the dispatched tokens per local expert, each "
                        "chunk's all-to-all in flight while another computes")
    g.add_argument("--multi-data", type=_positive, default=RUN_DEFAULTS["multi_data"], metavar="N",
                   help="with --pipe-experts: split each local expert's tokens into N chunks (for 1 local expert)")
    g.add_argument("--multi-stream", action=_Switch,
                   help="with --pipe-experts and --sp: one communication stream for the ep all-to-alls and the tp "
                        "all-gathers / reduce-scatters, so they never run at the same time")
    g.add_argument("--ep-overlap", action=_Switch,
                   help="hide one microbatch's expert all-to-alls under another microbatch's compute (needs --ep; "
                        "at pp 1 --microbatches >= 2; under --pp 1f1b, interleaved or dualpipev)")

    g = t.add_argument_group("output")
    g.add_argument("--out", default=RUN_DEFAULTS["out"], help="run directory (default: runs/<timestamp>)")
    g.add_argument("--check", action="store_true",
                   help="compare every step's loss and gradient norm with a 1-process reference run; exit 1 on mismatch")
    g.add_argument("--log-every", type=_positive, default=RUN_DEFAULTS["log_every"], help="print a line every N steps")
    g.add_argument("--overwrite", action="store_true",
                   help="reuse a non-empty --out: delete the files an earlier run wrote there "
                        f"({', '.join(RUN_FILES)}) first")
    g.add_argument("--eval-every", type=_non_negative_int, default=RUN_DEFAULTS["eval_every"], metavar="N",
                   help=f"every N steps (and after the last) the loss on a held-out tenth of the corpus, forward "
                        f"only, mean of {EVAL_BATCHES} batches (0: never; the held-out tenth then trains too)")
    g.add_argument("--tensorboard", action=_Switch,
                   help="also write TensorBoard events to <out>/tensorboard (needs the tensorboard package)")
    g.add_argument("--debug", action=_Switch,
                   help="full Python tracebacks on the console (otherwise one line per failing rank; "
                        "the tracebacks are in <out>/logs)")

    g = t.add_argument_group("checkpoints (in <out>/checkpoints; any parallel flags can resume any others)")
    g.add_argument("--save-every", type=int, default=RUN_DEFAULTS["save_every"], metavar="N",
                   help="save a checkpoint every N steps and after the last (0: never)")
    g.add_argument("--keep", type=_positive, default=RUN_DEFAULTS["keep"], metavar="K", help="keep the newest K checkpoints")
    g.add_argument("--async-save", action=_Switch,
                   help="write checkpoints while training goes on (each waits for the one before)")
    g.add_argument("--resume", action=_Switch,
                   help="continue from the newest checkpoint in --out (metrics.jsonl and loss.png continue)")

    g = t.add_argument_group("failures")
    g.add_argument("--timeout", type=positive_float, default=RUN_DEFAULTS["timeout"], metavar="SECONDS",
                   help="a collective that waits this long for a peer fails, and every rank exits with its "
                        "last collectives (a dead peer is noticed at once)")
    g.add_argument("--max-restarts", type=_non_negative_int, default=RUN_DEFAULTS["max_restarts"], metavar="R",
                   help="when a rank dies, stop the others and start all again from the newest checkpoint, "
                        "up to R times (torchrun's elastic agent; needs --save-every)")

    plan_cli.add_train_flags(t)
    plan_cli.add_parser(sub, t)  # dtp plan: train's parallel and model flags, shared
    from .export import add_parser as add_export  # it reports with this module's UsageError

    add_export(sub)

    c = sub.add_parser("check", help="compare a finished run's losses and gradient norms with a 1-process reference",
                       formatter_class=_HelpFormatter)
    c.add_argument("run_dir", help="the run directory (with config.json and metrics.jsonl)")
    c.add_argument("--rtol", type=_non_negative_float, default=None,
                   help="relative tolerance (default: by dtype, " +
                        ", ".join(f"{k} {v:g}" for k, v in RUN_RTOL.items()) + ")")
    return parser
