"""``dtp export``: a run's checkpoint written in another format.

::

    dtp export --hf OUT --run runs/20250101-120000     # its newest checkpoint, as Hugging Face

``--hf`` writes what :func:`dtp.models.hf.to_hf` writes (``config.json``, sharded
``.safetensors`` with their index, vocabulary padding stripped), which transformers'
``AutoModelForCausalLM.from_pretrained(OUT)`` loads. It streams: the checkpoint is read
on one process (any layout saved it: checkpoints are logical) one parameter at a time
(:class:`dtp.checkpoint.ParamReader`), which is written and freed before the next is
read; the optimizer state is never read (only its files' CRC32s are checked, streamed).
Peak memory is about one tensor — a Mixtral layer's stacked experts — twice (read, then
transposed for writing), not the model.

A directory that holds a model already (a ``config.json`` or weights: another model, an
earlier export) is written over only with ``--overwrite``, and then only once the new files
are whole (:func:`dtp.models.hf_config.staged`): an export that fails leaves it as it was.
The run's own ``--init-from`` source is refused: ``dtp check`` reads its weights again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..checkpoint.dirs import MANIFEST, latest
from ..data.token_files import TOKENIZER_CONFIGS, document_eos, open_tokens, tokenizer_eos
from ..config import DTYPES
from ..models.hf.config import INDEX, SINGLE, staged, weight_file_names
from .flags import UsageError, writable_dir
from .parser import RUN_FILES, positive_float

__all__ = ["add_parser", "cmd_export"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``export`` subcommand.

    >>> p = argparse.ArgumentParser().add_subparsers(dest="command")
    >>> add_parser(p).parse_args(["--hf", "out", "--run", "runs/r"]).dtype is None
    True
    """
    e = sub.add_parser("export", help="write a run's newest checkpoint as a Hugging Face model directory",
                       allow_abbrev=False)
    e.add_argument("--hf", required=True, metavar="OUT",
                   help="the Hugging Face directory to write (config.json, *.safetensors and their index)")
    e.add_argument("--run", required=True, metavar="RUN",
                   help="a dtp train run directory (its newest checkpoint; train with --save-every N) "
                        "or one checkpoint directory (step_*)")
    e.add_argument("--dtype", choices=DTYPES, default=None, help="the dtype written (default: the run's)")
    e.add_argument("--overwrite", action="store_true",
                   help="write over the model already in OUT (its config.json, weights and the tokenizer and "
                        "generation files the export carries); other files there stay")
    e.add_argument("--max-shard-gb", type=positive_float, default=5.0, metavar="GB",
                   help="the most GiB per .safetensors file (default: transformers' 5)")
    return e


def cmd_export(args: argparse.Namespace) -> int:
    """``dtp export --hf OUT --run RUN``; returns the exit code (bad input: :class:`UsageError`)."""
    import torch

    # Here, not at the top: `dtp export --help` and the CLI's other commands load this parser without torch.
    from ..checkpoint import store as checkpoint
    from ..models.hf import convert as hf
    from ..models import llama

    run = Path(args.run)
    if Path(args.hf).exists() and not Path(args.hf).is_dir():
        raise UsageError(f"--hf {args.hf}: a file is there; the export is a directory (config.json and "
                         f".safetensors shards)")
    held = _run_files(Path(args.hf))
    if held:
        raise UsageError(f"--hf {args.hf}: holds {held}, which dtp train wrote (a run or its checkpoints); the "
                         f"export's config.json and .safetensors would be written among them: name another "
                         f"directory")
    model = _model_files(Path(args.hf))
    if model and not args.overwrite:
        named = ", ".join(model) if len(model) <= 4 else f"config.json and {len(model) - 1} weight files" \
            if model[0] == "config.json" else f"{len(model)} weight files"
        raise UsageError(f"--hf {args.hf}: holds a model already ({named}); add --overwrite to replace it, or "
                         f"name another directory")
    if taken := [n for n in _WRITTEN if (Path(args.hf) / n).is_dir()]:
        raise UsageError(f"--hf {args.hf}: {taken[0]} is a directory there, where the export writes a file")
    root = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    try:
        reader = checkpoint.ParamReader(root)
    except ValueError as e:
        # the hint only where there is no checkpoint, not beside a corrupt one
        hint = "; a run saves checkpoints with --save-every N" if latest(root) is None and not \
            (root / MANIFEST).is_file() else ""
        raise UsageError(f"--run {run}: {e}{hint}") from None
    extra = reader.manifest.get("extra") or {}
    if "model" not in extra or "run" not in extra:
        raise UsageError(f"--run {run}: the checkpoint does not record its model (not saved by dtp train)")
    source = extra["run"].get("init_from")
    if source and Path(source).resolve() == Path(args.hf).resolve():
        # its weights are what dtp check and --resume --check of the run train again from
        raise UsageError(f"--hf {args.hf}: the run's --init-from source, which dtp check and --resume --check "
                         f"read again; export to another directory")
    # once the checkpoint has opened (a refused export leaves no directory behind); writable:
    # the staging directory goes there
    writable_dir(Path(args.hf), "--hf")
    cfg = llama.LlamaConfig(**extra["model"])
    saved = getattr(torch, extra["run"]["dtype"])
    last: dict[str, torch.Tensor] = {}  # the stacked experts being written (one tensor)

    def read(path: tuple) -> torch.Tensor:
        name = ".".join(map(str, path[:3] if path[0] == "layers" else path))
        if name not in last:
            last.clear()  # free the previous one before reading the next
            last[name] = reader.read(name)
        t = last[name]
        if len(path) == 4:  # one expert of a stacked parameter: its neighbours come next
            return t[path[3]]
        del last[name]
        return t

    # the whole export or (an error) nothing replaced; an old model's tokenizer and generation
    # files this one does not carry go with it
    with staged(args.hf, replaces=(*_TOKENIZER_FILES, _GENERATION)) as out:
        files = hf.to_hf(cfg, read, out, dtype=getattr(torch, args.dtype) if args.dtype else saved,
                         max_shard_bytes=int(args.max_shard_gb * 2**30))
        _carry_generation(extra["run"].get("init_from"), out)
        _carry_tokenizer(extra["run"].get("tokenizer"), extra["run"].get("init_from"), out)
        _carry_eos(extra["run"], out)
    print(f"dtp export: step {reader.manifest['step']} of {run} -> {args.hf} "
          f"({len(files)} file{'s' * (len(files) > 1)})", file=sys.stdout)
    return 0


def _model_files(path: Path) -> list[str]:
    """What in ``path`` an export would write over: a model's ``config.json`` and weight
    files (:func:`~dtp.models.hf_config.weight_file_names`).

    >>> import tempfile
    >>> _model_files(Path(tempfile.mkdtemp()))
    []
    """
    if not path.is_dir():
        return []
    return ["config.json"] * (path / "config.json").is_file() + weight_file_names(path)


def _run_files(path: Path) -> str | None:
    """The first thing in ``path`` that makes it a dtp run directory, a checkpoint or a
    checkpoints folder (None: none): an export there would replace a run's config.json,
    which records which flags trained which steps (--resume and dtp check read it).
    An earlier export's files are not among them (:func:`_model_files`: ``--overwrite``).

    >>> import tempfile
    >>> _run_files(Path(tempfile.mkdtemp())) is None
    True
    """
    if not path.is_dir():
        return None
    for name in (*(f for f in RUN_FILES if f != "config.json"), "manifest.json"):
        if (path / name).exists():
            return name
    return next((p.name for p in sorted(path.glob("step_*")) if p.is_dir()), None)


# What a Hugging Face directory says about generation that dtp's model does not hold: the
# special-token ids (config.json) and generation_config.json.
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_GENERATION = "generation_config.json"


def _carry_generation(source: str | None, out: Path) -> None:
    """An ``--init-from`` run's export keeps its source's special-token ids and generation
    config, when the source directory is still there: without them transformers falls back
    to its defaults (bos 1, eos 2), and ``generate`` of a fine-tuned Llama 3 would not stop
    at its end of text. A run of a preset has none to keep."""
    if not source or not (Path(source) / "config.json").is_file():
        return
    import json
    import shutil

    try:
        ids = {k: v for k, v in json.loads((Path(source) / "config.json").read_text()).items() if k in _TOKEN_IDS}
    except (ValueError, AttributeError):  # not a JSON object any more: nothing to carry
        return
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **ids}, indent=2) + "\n")
    if (Path(source) / _GENERATION).is_file():
        shutil.copyfile(Path(source) / _GENERATION, out / _GENERATION)


# What AutoTokenizer.from_pretrained reads from a model directory.
_TOKENIZER_FILES = ("tokenizer.json", *TOKENIZER_CONFIGS, "tokenizer.model")
# The names an export may write (besides its shards): a directory of one of them is refused.
_WRITTEN = ("config.json", SINGLE, INDEX, *_TOKENIZER_FILES, _GENERATION)


def _carry_tokenizer(tokenizer: str | None, source: str | None, out: Path) -> None:
    """The tokenizer the run's ids came from, beside the weights, so that the export loads
    with ``AutoTokenizer`` as with ``AutoModelForCausalLM``: the run's ``--tokenizer`` file
    (as tokenizer.json: those were its ids) with the tokenizer_config.json and
    special_tokens_map.json beside it (which name its EOS), else an ``--init-from``
    source's tokenizer files, when still there. A preset on token files has none to carry.

    >>> import tempfile
    >>> src, out = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    >>> _ = (src / "tokenizer.json").write_text("{}"), (src / "tokenizer_config.json").write_text("{}")
    >>> _carry_tokenizer(None, str(src), out)
    >>> sorted(p.name for p in out.iterdir())
    ['tokenizer.json', 'tokenizer_config.json']
    >>> _ = (src / "bpe.json").write_text('{"model": {}}')
    >>> _carry_tokenizer(str(src / "bpe.json"), str(src), out)   # the run's --tokenizer wins
    >>> (out / "tokenizer.json").read_text()
    '{"model": {}}'
    """
    import shutil

    if tokenizer and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        for name in TOKENIZER_CONFIGS:  # what names its special tokens (its EOS), when beside it
            if (Path(tokenizer).parent / name).is_file():
                shutil.copyfile(Path(tokenizer).parent / name, out / name)
        return
    if source and Path(source).is_dir():
        for name in _TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, out / name)


def _carry_eos(run: dict, out: Path) -> None:
    """A run that packed documents (``--document-mask``) trained its model to end each with
    the id that ends a document there; the export's ``config.json`` (and a carried
    ``generation_config.json``, which ``generate`` reads first) names it as ``eos_token_id``,
    beside the ids an ``--init-from`` source named (a list then), so that ``generate``
    stops where the model learnt to. That id is ``--eos-id``, else the tokenizer's
    (:func:`dtp.data.token_files.tokenizer_eos`), else the data's (its sidecar's; byte text's
    newline); when the data or tokenizer has gone since, nothing is written.

    >>> import json, tempfile
    >>> out = Path(tempfile.mkdtemp()); _ = (out / "config.json").write_text("{}")
    >>> _carry_eos({"document_mask": True, "data": None}, out)   # the bundled corpus: lines of bytes
    >>> json.loads((out / "config.json").read_text())
    {'eos_token_id': 10}
    """
    import json

    if not run.get("document_mask"):
        return
    eos, tokenizer = run.get("eos_id"), run.get("tokenizer")
    try:
        if eos is None and tokenizer:
            from tokenizers import Tokenizer

            eos = tokenizer_eos(Tokenizer.from_file(tokenizer), tokenizer)
        elif eos is None:  # token files are mapped, not read; byte text is read once
            eos = document_eos(open_tokens(run.get("data"), dtype=run.get("data_dtype")))
    except Exception:  # gone or changed since the run (the tokenizers library raises its own kind): say nothing
        return
    if eos is None:
        return
    for name in ("config.json", _GENERATION):  # the generation config only where the source's was carried
        if not (out / name).is_file():
            continue
        config = json.loads((out / name).read_text())
        named = config.get("eos_token_id")
        named = [] if named is None else named if isinstance(named, list) else [named]
        if int(eos) not in named:  # one id stays an int (transformers' own form), more are a list
            ids = [*named, int(eos)]
            (out / name).write_text(json.dumps({**config, "eos_token_id": ids if len(ids) > 1 else ids[0]},
                                               indent=2) + "\n")
