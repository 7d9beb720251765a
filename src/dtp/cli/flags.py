"""``dtp``'s flags: the checks of flag combinations, the run they describe, and the argv a
rank gets (the parser itself, every flag and its help, is :mod:`.parser`).

Everything here runs before any rank starts, and before torch is imported: a bad
combination is reported once, by the launcher, as one line (:class:`UsageError`, exit
code 2), in a fraction of a second. Rules that need the model or the mesh are the
layouts' and the model's: :func:`preflight` asks them too (:mod:`.shape`), against the
mesh's shape, so a layout that does not fit the model is refused before any rank starts.
This module imports nothing that imports torch (a test holds it to that); keep it so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from ..core.mesh.shape import MeshShape
from ..data.token_files import SAMPLE_TOKENS, TokenStats, held_out_start, token_stats
from ..core._rules import FLOAT32_MAX, TRAIN_ADAMW
from ..config import MODEL_FIELDS, RunConfig, flag_names, flag_of, mesh_axes_of, toml_fields
from ..layouts import Layout
from ..models import config as model_config
from ..models.hf.config import check_weight_files, config_for
from .parser import RUN_DEFAULTS, UsageError, note
from .resume import check_resume, resume_from
from .shape import check_shape, format_mesh


__all__ = ["UsageError", "validate", "preflight", "build_layout", "mesh_axes",
           "train_argv", "vocab_size", "check_config", "check_nproc", "run_config",
           "writable_dir"]


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

    >>> from dtp.cli import parse_args
    >>> mesh_axes(parse_args(["train", "--dp", "2", "--tp", "4"]))
    {'dp': 2, 'tp': 4}
    """
    return run_config(args).mesh_axes()


def validate(args: argparse.Namespace, *, world_size: int | None = None) -> argparse.Namespace:
    """Check the flags that need no model or process group and build the run from them
    (``args.run_config``, a :class:`dtp.RunConfig`, whose checks speak in flag names here).

    ``world_size`` is torchrun's ``WORLD_SIZE`` when joining an existing world. Raises
    :class:`UsageError` (a ``ValueError``) with a one-line message.

    >>> from dtp.cli import build_parser, parse_args
    >>> validate(build_parser().parse_args(["train", "--dp", "2", "--tp", "2"])).nproc
    4
    """
    for name in ("data", "tokenizer", "init_from"):  # the ranks and the reference may run elsewhere
        if getattr(args, name, None) is not None:
            setattr(args, name, str(Path(getattr(args, name)).expanduser().resolve()))
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --out, --overwrite deletes it: choose one")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        # torch.utils.tensorboard imports it; found here without importing anything.
        raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard")
    axes = mesh_axes_of(pp=args.pp, dp=args.dp, ep=args.ep, cp=args.cp, tp=args.tp)
    n, shape = math.prod(axes.values()), format_mesh(axes)
    if world_size is not None and world_size != n:
        raise UsageError(f"the mesh {shape} needs {n} rank{'s' * (n > 1)}, but torchrun started WORLD_SIZE={world_size}")
    check_nproc(args, axes)
    if args.nproc is None:
        args.nproc = n if world_size is None else world_size
    try:
        with flag_names():
            config = RunConfig.from_dict({k: v for k, v in vars(args).items() if k in RUN_DEFAULTS})
    except ValueError as e:
        raise UsageError(str(e)) from None
    # --print-config prints the run as given: a warm-up derived from --steps stays derived,
    # so the file still reads with other --steps (a printed "warmup = 5" refused --steps 3);
    # the precision derived from --dtype likewise (a printed "mixed" refused --dtype float32).
    args.derived = tuple(k for k in ("warmup", "precision", "microbatches") if getattr(args, k) is None)
    args.run_config, args.warmup, args.microbatches = config, config.warmup, config.microbatches
    _note_inert_zero(args)
    return args


def _note_inert_zero(args: argparse.Namespace) -> None:
    """``--zero`` at ``--dp 1`` shards over one rank: said, not refused (a run script that
    scales dp keeps its flags), by ``dtp train`` and ``dtp plan`` alike."""
    if getattr(args, "zero", 0) and args.dp == 1:
        note(args, f"--zero {args.zero} has no effect with --dp 1 (ZeRO shards over dp)")


def check_nproc(args: argparse.Namespace, axes: dict[str, int]) -> None:
    """``--nproc``, when given, is the mesh's size (the only valid value)."""
    n = math.prod(axes.values())
    if args.nproc is not None and args.nproc != n:
        raise UsageError(f"--nproc {args.nproc} does not match the mesh {format_mesh(axes)}: it needs {n} "
                         f"rank{'s' * (n > 1)}; use --nproc {n} or leave --nproc out")


def read_config_file(path: str) -> dict[str, Any]:
    """A run's fields from a TOML file (``dtp train --config``): :class:`dtp.RunConfig`'s
    field names as keys, each in its section's table (``[parallelism]``, ``[training]``, …:
    :data:`dtp.config.SECTIONS`, what ``--print-config`` writes) or at the top level
    (:func:`dtp.config.toml_fields`). A bad file is one line.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "run.toml"
    >>> _ = f.write_text('model = "small"\\n[parallelism]\\ndp = 2\\ntp = 2\\nsp = true\\n')
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
    try:
        return toml_fields(document)
    except ValueError as e:
        raise UsageError(f"--config {path}: {e}") from None


def train_argv(args: argparse.Namespace) -> list[str]:
    """The ``train`` flags that state the run (:meth:`dtp.RunConfig.argv`: every field
    spelled out; no ``--nproc``, ``--check`` or ``--overwrite``, which are about this
    invocation): the command a run directory records.

    >>> from dtp.cli import parse_args
    >>> train_argv(parse_args(["train", "--dp", "2", "--out", "r"]))[:9]
    ['train', '--pp', '1', '--pp-schedule', '1f1b', '--virtual-stages', '1', '--dp', '2']
    """
    return run_config(args).argv()


def build_layout(args: argparse.Namespace) -> Layout:
    """The run's layout (:meth:`dtp.RunConfig.layout`, where the flags meet the presets).

    >>> from dtp.cli import parse_args
    >>> build_layout(parse_args(["train", "--dp", "2", "--tp", "2", "--sp"])).megatron.sequence_parallel
    True
    """
    return run_config(args).layout()


#: Token ids at or past this are refused as a misread file (the largest vocabularies in use,
#: Gemma's 256k, are a quarter of it).
MAX_VOCAB = 1 << 20


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
    microbatches, the sequence against context parallel, the corpus against a batch,
    ``--init-from``'s weight files (there and whole: their headers against their sizes;
    when the ranks resume from a checkpoint, :func:`~dtp.cli.resume.resume_from`: after
    ``--resume`` or a torchrun restart, only for ``--check``),
    with ``--resume`` the checkpoint against the flags (:func:`check_resume`), and the
    run directory (``check_out``: writable; not an earlier run's unless ``--resume`` or
    ``--overwrite``). Returns the layout.

    Raises :class:`UsageError` (or the presets' ``ValueError``): one line, exit code 2.
    The pipeline's composition rules (:meth:`~dtp.layouts.pipeline.PipelineOptions.check_composition`)
    are the ones ``train_step`` checks again on every rank, before any collective.
    """
    layout, cfg, n_tokens = _check_run(args)
    resume = resume_from(args)  # --resume's checkpoint, or the newest one after a torchrun restart
    # Its weights too (dtp plan reads only its config.json); not when the ranks resume, for
    # the checkpoint holds them (they read none: the files may be gone, and a restarted rank
    # that refused them would spend torchrun's restarts), unless --check's reference
    # retrains from them.
    if args.init_from is not None and (resume is None or args.check):
        try:
            check_weight_files(args.init_from)
        except (OSError, ValueError) as e:
            raise UsageError(f"--init-from {args.init_from}: {str(e).removeprefix('from_hf: ')}") from None
    if args.resume:  # read-only: every rank of an outside torchrun may check it alike
        check_resume(args, resume, cfg, n_tokens=n_tokens)
    if check_out:
        check_out_dir(args)
    return layout


def check_config(args: argparse.Namespace) -> Layout:
    """The run as configured: :func:`preflight` less the run directory and a resume. ``dtp
    plan`` (which has neither) refuses what ``dtp train`` refuses, with the same line, and
    plans the model the data makes (``args.model_config``); ``--print-config`` and
    ``--print-schedule`` print only a run that passes. Returns the layout.

    >>> from dtp.cli import parse_args
    >>> check_config(parse_args(["plan", "--tp", "3"]))
    Traceback (most recent call last):
    ...
    dtp.cli.parser.UsageError: --model tiny on the mesh dp=1 × tp=3: heads=4 is not divisible by tp=3 (--tp splits the heads); choose a model with heads a multiple of 3 (--model, --init-from), or a smaller --tp
    """
    check_nproc(args, mesh_axes_of(pp=args.pp, dp=args.dp, ep=args.ep, cp=args.cp, tp=args.tp))  # as validate
    if args.command != "train":  # dtp train's validate said it (--print-config said it twice)
        _note_inert_zero(args)
    if args.print_schedule and args.pp == 1:
        raise UsageError("--print-schedule prints the pipeline's schedule; pipeline options need --pp > 1")
    if getattr(args, "microbatches", 1) is None:  # dtp plan's default, as validate resolves dtp train's
        args.microbatches = run_config(args).microbatches
        args.derived = (*getattr(args, "derived", ()), "microbatches")
    # A plan predicts one step of the model: the corpus's length is not in it (a 70B plan at
    # --batch 256 --seq 8192 was refused because the bundled corpus holds 46 such windows).
    return _check_run(args, corpus=getattr(args, "command", None) != "plan")[0]


def _check_run(args: argparse.Namespace, *, corpus: bool = True) -> tuple[Layout, model_config.LlamaConfig, int]:
    """The layout, the data, the model the data makes and its shape (:func:`check_shape`),
    the corpus against a batch (``corpus``): the layout, the model (also ``args.model_config``,
    what the plan predicts: a vocabulary grown to the data's ids is the run's) and the token
    count."""
    layout = build_layout(args)
    _check_lr(run_config(args))
    try:  # one read of the data's sample: its largest id and, with --document-mask, its document ends
        stats = token_stats(args.data, dtype=args.data_dtype, eos_id=args.eos_id, tokenizer=args.tokenizer,
                            documents=args.document_mask)
    except OSError as e:
        raise UsageError(f"--data {args.data}: {e.strerror or e}") from None
    except ValueError as e:
        raise UsageError(f"--data: {e}" if not str(e).startswith("--") else str(e)) from None
    if args.document_mask:
        _check_document_ends(args, stats)
    cfg = args.model_config = _model(args, stats.largest)
    check_shape(args, layout, cfg, MeshShape(mesh_axes(args)))
    if corpus:
        _check_corpus(args, stats.count)
    return layout, cfg, stats.count


def _model(args: argparse.Namespace, max_id: int) -> model_config.LlamaConfig:
    """The run's model: the preset, its vocabulary grown to the data's ids (:func:`vocab_size`),
    or ``--init-from``'s, which must hold the data's ids."""
    if max_id >= MAX_VOCAB:
        # No tokenizer has that many ids: a token file read with a wider dtype than it was
        # written in (pairs of uint16 ids as one uint32) gives ids in the billions, and the
        # embedding a vocabulary of them needs.
        raise UsageError(f"--data holds token id {max_id}, past the {MAX_VOCAB} ids any tokenizer has: is "
                         f"--data-dtype {args.data_dtype or 'the default'} the dtype the file was written in?")
    if args.init_from is None:
        try:  # LlamaConfig's checks of the MoE fields, in the flags' words
            with model_config.named({f: flag_of(f) for f in MODEL_FIELDS}):
                return model_config.config(args.model, vocab_size=vocab_size(args.model, max_id),
                                           **run_config(args).model_overrides())
        except ValueError as e:
            raise UsageError(str(e).removeprefix("LlamaConfig: ")) from None
    if importlib.util.find_spec("safetensors") is None:
        raise UsageError("--init-from reads Hugging Face weights with safetensors: pip install 'dtp[hf]'")
    try:
        cfg = config_for(args.model, init_from=args.init_from, **run_config(args).model_overrides())
    except OSError as e:
        raise UsageError(f"--init-from {args.init_from}: {e.strerror or e} ({e.filename})") from None
    except KeyError as e:  # str(KeyError) is the bare key, quoted
        raise UsageError(f"--init-from {args.init_from}: its config.json has no {e.args[0]!r}, which a Llama "
                         f"config needs") from None
    except ValueError as e:
        if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) and Path(args.init_from).is_file():
            # a file that is no config.json (dtp plan reads one; a run needs the directory): was json's
            # "Expecting value: line 1 column 1 (char 0)"
            raise UsageError(f"--init-from {args.init_from}: {args.init_from} is not a directory (a Hugging Face "
                             f"model directory holds config.json and *.safetensors)") from None
        raise UsageError(f"--init-from {args.init_from}: {e}") from None
    real = cfg.vocab_size - cfg.vocab_pad
    if max_id >= real:
        raise UsageError(f"--data holds token id {max_id}, but the model of --init-from {args.init_from} has "
                         f"{real} token ids; tokenize the data with its tokenizer")
    return cfg


def _check_document_ends(args: argparse.Namespace, stats: TokenStats) -> None:
    """``--document-mask``'s id that ends a document occurs in the data (``stats``: what
    :func:`~dtp.data.token_files.token_stats` read with ``documents=True``): an id that never
    occurs masks nothing (every window one document), which is the run without the mask
    under another name. Refused when the whole corpus was read; a note when only a sample was."""
    if stats.end_seen:
        return
    source = f"--eos-id {stats.end}" if args.eos_id is not None else f"the id that ends a document ({stats.end})"
    if stats.count <= SAMPLE_TOKENS:
        raise UsageError(f"--document-mask: {source} never occurs in the {stats.count} tokens of --data, so every "
                         f"window would be one document, as without the mask; check the id")
    # dtp plan checks the run too: the note names the command that runs
    note(args, f"--document-mask: {source} does not occur in a sample of {SAMPLE_TOKENS} of the {stats.count} "
               f"tokens of --data; check the id")


def _check_lr(config: RunConfig) -> None:
    """AdamW's step size, ``lr_t / (1 - b1^t)`` (its bias correction, 10× at step 1), goes to
    torch as a scalar of the kernels' compute dtype, float32 unless ``--dtype float64``
    (bfloat16 computes in float32), and torch refuses one past float32's largest number
    ("value cannot be converted to type float without overflow", on every rank, at the
    step). The largest is at the end of the warm-up (``lr_t / lr`` grows faster than the
    correction shrinks; :func:`dtp.cli.optimizer.lr_schedule` reaches the peak at step
    ``warmup``, or 1). Only that is refused: a large lr that fits diverges into skipped
    steps, which ``--max-skipped`` handles."""
    if config.dtype == "float64":  # a float64 scalar: lr is a finite float, and an infinite step is only divergence
        return
    t = max(config.warmup, 1)
    correction = 1 - TRAIN_ADAMW["b1"] ** t
    step = config.lr / correction
    if step > FLOAT32_MAX:
        most = FLOAT32_MAX * correction
        unit = 10 ** (math.floor(math.log10(most)) - 2)  # three significant digits, rounded down: an lr that runs
        shown = math.floor(most / unit) * unit
        raise UsageError(f"--lr {config.lr:g}: AdamW's step size at step {t} (the lr over its bias correction "
                         f"1 - {TRAIN_ADAMW['b1']}^{t}) is {step:.3g}, past float32's largest number "
                         f"({FLOAT32_MAX:.3g}), which torch refuses in a --dtype {config.dtype} run; use --lr <= "
                         f"{shown:.3g}, or --dtype float64")


def _check_corpus(args: argparse.Namespace, n_tokens: int) -> None:
    """Enough windows of ``--seq + 1`` tokens for one ``--batch`` (in each split, with ``--eval-every``)."""
    parts = {"the corpus": n_tokens}
    if getattr(args, "eval_every", 0):  # dtp plan has no --eval-every: it plans a training step
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
    if args.overwrite and not _run_record(out / "config.json"):
        # --overwrite deletes a run's config.json; one no run wrote (a Hugging Face model's,
        # the user's own) is not a run's to delete
        raise UsageError(f"--out {out}: its config.json is not a dtp run's (a model directory?); --overwrite "
                         f"would delete it: name another --out")
    writable_dir(out, "--out")  # create it now (rank 0 would anyway)


def writable_dir(path: Path, flag: str) -> None:
    """Create ``path`` (a directory a flag names) and write into it: that is what
    "writable" means; :class:`UsageError` in the flag's words when it cannot."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create or write it ({e.strerror or e})") from None


def _run_record(path: Path) -> bool:
    """``path`` is absent or a run's ``config.json``: a JSON object with a key every dtp
    train wrote (``segments`` since 2026-11-27, ``command`` and ``layout`` before).

    >>> _run_record(Path("/nonexistent/config.json"))
    True
    """
    if not path.is_file():
        return not path.exists()
    try:
        record = json.loads(path.read_text())
    except (ValueError, OSError):
        return False
    return isinstance(record, dict) and not {"segments", "command", "layout"}.isdisjoint(record)
