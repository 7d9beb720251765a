"""``dtp train --resume`` against its checkpoint, and the segments of a run: which flags
trained which steps (``config.json`` and every checkpoint record them), so that ``--check``
and ``dtp check`` retrain a resumed run as it was trained, or refuse in one line.

Runs before any rank starts and imports nothing that imports torch (as :mod:`.flags`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

from ..checkpoint.dirs import checkpoints, latest, read_manifest
from ..core.mesh.launch import rejoined
from ..data.token_files import held_out_start, open_tokens, training_split
from ..config import MODEL_FIELDS, RunConfig, flag_of, master_weights
from ..models import config as model_config
from .parser import UsageError, note

__all__ = ["resume_checkpoint", "resume_from", "check_resume", "trained_segments", "segment_record", "segments_mixed"]


# --------------------------------------------------------------------------- --resume


# What a resumed run must keep because the data loader's position in the checkpoint is
# one of that order of batches (dtp.data.TokenLoader.load_state_dict refuses the others).
_DATA_ORDER = ("seed", "batch", "seq")
# What --check's one-process reference would train the steps already trained with, other
# than the checkpoint did: the lr schedule, the update, the document mask (the model's
# MoE hyperparameters are compared on the model; precision as resolved, see
# _reference_values). A layout, --recompute or --compile change no loss beyond --check's
# tolerance and may change; so does --microbatches, but for a model with experts, whose
# load-balancing loss is taken per microbatch (measured: tiny-moe m2 vs m4 on one process,
# 1.7e-5 apart at step 1 in fp64).
_REFERENCE_FIELDS = ("steps", "lr", "weight_decay", "warmup", "clip", "precision", "document_mask")
# How the run trains and keeps itself, which a resume takes from its own flags like any
# other: one not given again is its default (measured: --lr 0.001 --clip 0.5 --warmup 2
# resumed as --lr 0.003 --clip 1.0 --warmup 5, the loss 8x off, and --save-every 4 as no
# more checkpoints, with nothing said). Said in a note, not refused: a change may be meant.
_CARRIED_FIELDS = ("lr", "weight_decay", "warmup", "clip", "max_skipped", "save_every", "keep", "save_on_signal",
                   *MODEL_FIELDS)


def resume_checkpoint(out: str | os.PathLike[str]) -> Path:
    """The checkpoint ``--resume`` continues from: the newest complete one under
    ``out/checkpoints`` (:class:`UsageError` if there is none)."""
    root = Path(out) / "checkpoints"
    found = latest(root)
    if found is None:
        raise UsageError(f"--resume: no checkpoint in {root} (save some with --save-every N)")
    return found


def resume_from(run: RunConfig | argparse.Namespace) -> Path | None:
    """The checkpoint the ranks of ``dtp train`` start from: with ``--resume`` the newest in
    ``--out`` (:func:`resume_checkpoint`), after torchrun restarted them or their host came
    back into the job (:func:`dtp.launch.rejoined`) the newest if there is one, else ``None`` (they train from the start). One rule for the
    ranks, which load it (``run``: their :class:`dtp.RunConfig`), and the preflight, which
    then checks no ``--init-from`` weight file (``run``: its flags; only ``resume`` and
    ``out`` are read, which both name alike).

    >>> resume_from(RunConfig(resume=False, out="/nonexistent")) is None
    True
    """
    if run.resume:
        return resume_checkpoint(run.out)
    return latest(Path(run.out) / "checkpoints") if rejoined(run.out) else None


def check_resume(args: Any, path: Path, cfg: model_config.LlamaConfig, *, n_tokens: int | None = None) -> None:
    """The checkpoint at ``path`` against the flags that resume it (``args``; ``cfg`` the
    model they describe), from its manifest alone (no torch, no tensor data):

    - its parameters' dtype is ``--dtype`` (a checkpoint is never cast) and their shapes
      are the model's (``--model``, ``--init-from``, the MoE flags, the vocabulary of
      ``--data``); router biases are there if ``--router-bias-update`` needs them;
    - ``--seed``, ``--batch``, ``--seq`` are the ones its data position belongs to, and
      the training split has the checkpoint's tokens (``n_tokens``, the corpus's: the
      same ``--data``, held out alike by ``--eval-every``), the same ids by their
      fingerprint when the checkpoint records one;
    - with ``--check``, the lr schedule, clipping, precision and MoE hyperparameters are
      the ones the steps already trained ran with: the reference retrains every step
      with this run's flags.

    What may change is everything else: the layout (``--dp``, ``--tp``, ``--zero``, …,
    any layout loads any other), ``--steps`` without ``--check``, ``--save-every``, ….
    Raises :class:`UsageError`, one line naming the flag and the value to resume with.
    """
    try:
        manifest = read_manifest(path)
    except ValueError as e:
        older = [p for p in checkpoints(path.parent) if p.name < path.name]
        if older and getattr(args, "keep", 1) > 1:
            # The ranks skip it too (dtp.checkpoint.load's fallback: they rename it aside and
            # say so): the flags must fit the one they will resume from.
            return check_resume(args, older[-1], cfg, n_tokens=n_tokens)
        hint = (f"; {older[-1].name} before it is complete: move {path.name} out of {path.parent} to resume "
                f"from {older[-1].name} (--keep 1 trusts only the newest)") if older else ""
        raise UsageError(f"--resume: {e}{hint}") from None
    extra = manifest.get("extra") if isinstance(manifest.get("extra"), dict) else {}
    saved_run = extra.get("run") if isinstance(extra.get("run"), dict) else {}  # {}: not saved by dtp train
    tensors = manifest["tensors"]
    params = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
    here = f"--resume: the checkpoint in {args.out}"
    dtypes = sorted({str(v.get("dtype")) for v in params.values()})
    if dtypes and args.dtype not in dtypes:
        was = saved_run.get("dtype", dtypes[0])
        raise UsageError(f"{here} was trained with --dtype {was}; resume with --dtype {was} "
                         f"(a checkpoint is never cast)")
    shapes = {name: tuple(v.get("shape", ())) for name, v in params.items()}
    ours = model_config.param_shapes(cfg)
    detail, why = None, "a checkpoint is never reshaped"
    if shapes != ours:
        name = next(n for n in sorted({*shapes, *ours}) if shapes.get(n) != ours.get(n))
        detail = f"{name} is {shapes.get(name, 'absent')} there, {ours.get(name, 'absent')} here"
    else:
        # Same shapes, another model: what the parameters compute with (rope, norm eps, the
        # vocabulary's padding, ...) differs, e.g. --model for --init-from of an HF model of
        # the preset's shape. The MoE hyperparameters may change (their flags, like --lr), and
        # so may max_seq_len: a limit on --seq, not what the parameters compute.
        saved_model = extra.get("model") if isinstance(extra.get("model"), dict) else {}
        mine = dataclasses.asdict(cfg)
        differ = [k for k in sorted(saved_model) if k in mine and k not in (*MODEL_FIELDS, "max_seq_len")
                  and saved_model[k] != mine[k]]
        if differ:
            detail = f"{differ[0]} is {saved_model[differ[0]]} there, {mine[differ[0]]} here"
            why = "its parameters would go on training in another model"
    if detail is not None:
        changed = [k for k in ("init_from", "model", *MODEL_FIELDS, "data", "tokenizer")
                   if k in saved_run and saved_run[k] != getattr(args, k, None)]
        if not changed:
            raise UsageError(f"{here} holds another model ({detail}); resume with the flags it was trained with "
                             f"(its config.json)")
        now = {k: getattr(args, k, None) for k in changed}
        raise UsageError(f"{here} was trained with {_spell(saved_run, changed)}, this run asks for "
                         f"{_spell(now, changed)} ({detail}); resume {_spell(saved_run, changed, remedy=True)} "
                         f"({why})")
    has_biases = any(k.startswith("buffer/") for k in tensors)
    if cfg.router_bias_update and not has_biases:
        raise UsageError(f"{here} holds no router biases (trained without --router-bias-update); resume "
                         f"without --router-bias-update")
    if has_biases and not cfg.router_bias_update:
        # A state without them loads without them: the routing they steer would change, silently.
        rate = saved_run.get("router_bias_update") or "RATE"
        raise UsageError(f"{here} holds router biases (trained with --router-bias-update {rate}), which this run "
                         f"would drop; resume with --router-bias-update {rate}")
    if "init_from" in saved_run and _source(saved_run["init_from"]) != _source(args.init_from):
        # The same shapes (else refused above), so it would train: but config.json would then
        # record this run's source, and --check / dtp check retrain from it (measured: a random
        # tiny init against a fine-tune of an exported tiny, FAILED at 0.21).
        was = saved_run["init_from"]
        raise UsageError(f"{here} started from {f'--init-from {was}' if was else 'a random init (no --init-from)'}; "
                         f"resume {f'with --init-from {was}' if was else 'without --init-from'} (--check and dtp "
                         f"check retrain its steps from there)")
    _check_precision(args, saved_run, here)
    _check_split(args, saved_run, extra.get("loader") or {}, n_tokens, here)
    for k in _DATA_ORDER:
        if k in saved_run and saved_run[k] != getattr(args, k):
            raise UsageError(f"{here} was trained with {flag_of(k)} {saved_run[k]}, this run asks for {flag_of(k)} "
                             f"{getattr(args, k)}: its data position is one of that order of batches; resume with "
                             f"{flag_of(k)} {saved_run[k]}")
    if getattr(args, "check", False):
        _check_reference(args, manifest, cfg, here.replace("--resume", "--resume --check", 1))
    # Last: each refusal above names what to change, this one only that it already ran. Not
    # after torchrun restarted the ranks: a rank that died once the last checkpoint was
    # written restarts onto it, and the run is then done, not wrong.
    step = int(manifest.get("step", 0))
    if step >= args.steps and not rejoined(args.out):
        raise UsageError(f"{here} is at step {step}, and --steps {args.steps} leaves nothing to train: resume with "
                         f"--steps above {step} (dtp check RUN checks a finished run)")
    _note_changes(args, saved_run, cfg, here.removeprefix("--resume: "))  # a resume that runs: a refusal is one line


def _source(init_from: str | None) -> str | None:
    """An ``--init-from`` directory as a resolved path (``hf`` and ``./hf`` are one source)."""
    return None if init_from is None else str(Path(init_from).resolve())


def _note_changes(args: Any, saved_run: dict[str, Any], cfg: model_config.LlamaConfig, checkpoint: str) -> None:
    """What a resume that runs changes, each said in a note: the :data:`_CARRIED_FIELDS` it
    runs with other values than the checkpoint's run (a flag not given again being its
    default); ``--precision pure`` of a checkpoint with fp32 master weights, which drops
    them (the other way is refused: :func:`_check_precision`); another ``--microbatches``
    for a model with experts, whose load-balancing loss is per microbatch (``--check``
    refuses that: :func:`_check_reference`)."""
    changed = [k for k in _CARRIED_FIELDS if k in saved_run and saved_run[k] != getattr(args, k, saved_run[k])]
    if changed:
        now = {k: getattr(args, k, None) for k in changed}
        note(args, f"{checkpoint} trained with {_spell(saved_run, changed)}; this run has {_spell(now, changed)} "
                   f"(a flag not given is its default): give them again to go on as it did")
    kept = master_weights(saved_run.get("precision"), int(saved_run.get("zero") or 0), saved_run.get("dtype", ""))
    if args.dtype == "bfloat16" and "zero" in saved_run and args.precision == "pure" and kept:
        note(args, f"{checkpoint} kept fp32 master weights (--precision mixed); --precision pure drops them and "
                   f"goes on from the bf16 parameters, its optimizer state narrowed to bf16")
    trained_m = saved_run.get("microbatches")
    if cfg.num_experts and trained_m not in (None, args.microbatches):
        note(args, f"{checkpoint} trained with --microbatches {trained_m}: a model with experts takes its "
                   f"load-balancing loss per microbatch, so --microbatches {args.microbatches} goes on from there "
                   f"on another curve")


def trained_segments(extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Which flags trained a checkpoint's steps: ``[{"first": step, "run": …, "model": …}]``,
    oldest first, one per ``dtp train`` that trained some of them (the run config and model
    config of each). A checkpoint from before this record: its last run's, from step 1."""
    segments = extra.get("segments")
    if isinstance(segments, list) and all(isinstance(s, dict) for s in segments):
        return segments
    run, model = extra.get("run"), extra.get("model")
    return [{"first": 1, "run": run, "model": model}] if isinstance(run, dict) and isinstance(model, dict) else []


def _check_reference(args: Any, manifest: dict[str, Any], cfg: model_config.LlamaConfig, here: str) -> None:
    """``--resume --check``: the reference (:func:`dtp.cli.check.check_run`) trains every
    step from scratch with this run's flags, also the steps the checkpoint already holds;
    those ran with the lr schedule, clipping, precision and MoE options of the runs that
    trained them (:func:`trained_segments`), so any of them changed makes the check fail
    although the run is right."""
    extra = manifest.get("extra") or {}
    done = int((extra.get("loader") or {}).get("step", manifest.get("step", 0)))
    segments = trained_segments(extra)
    config = args.run_config  # validate built it (dtp.cli.flags), as every resume's preflight runs after
    now = _reference_values(dataclasses.asdict(config), {k: getattr(cfg, k) for k in MODEL_FIELDS})
    spans, trained = _trained_with(segments, done)
    mixed = _mixed(spans, trained)
    if mixed:
        raise UsageError(f"{here}: {mixed}; drop --check")
    names = [k for k in now if trained and k in trained[0] and trained[0][k] != now[k]]
    if names:
        steps = f"steps {segments[0]['first']}-{done}" if len(spans) > 1 else spans[0]
        raise UsageError(f"{here}: {steps} trained with {_spell(trained[0], names)}, this run asks for "
                         f"{_spell(now, names)}: --check retrains all steps on one process with this run's flags, "
                         f"so those would differ by design; resume {_spell(trained[0], names, remedy=True)}, "
                         f"or drop --check")


def _check_split(args: Any, saved_run: dict[str, Any], loader: dict[str, Any], n_tokens: int | None,
                 here: str) -> None:
    """The training split this run reads has the checkpoint's token count and, of the same
    count, its ids (``loader``: the checkpoint's loader record; its loader refuses either,
    but only once the ranks have started, in its own words)."""
    saved = loader.get("num_tokens")
    if saved is None or n_tokens is None:
        return
    mine = held_out_start(n_tokens) if args.eval_every else n_tokens
    if int(saved) == mine:
        _check_tokens(args, saved_run, loader.get("fingerprint"), here)
        return
    held_then = saved == held_out_start(n_tokens) if not args.eval_every else saved == n_tokens
    if held_then:  # the same corpus, split otherwise
        flag = ("--eval-every, which held out the corpus's last tenth" if not args.eval_every else
                "no --eval-every, so the whole corpus trained")
        raise UsageError(f"{here} was trained with {flag}: its data position is one of that split's batches; "
                         f"resume {'with --eval-every N' if not args.eval_every else 'without --eval-every'}")
    changed = _id_flags_changed(args, saved_run)
    if [k for k in changed if k != "data"] == ["document_mask"]:
        # The same tokenizer (the text perhaps moved): with --tokenizer the mask decides the
        # ids (each line ended by the EOS, or the text encoded whole: dtp.data.token_files._encode).
        masked = bool(saved_run.get("document_mask"))
        said = "--document-mask" if masked else "no --document-mask"
        raise UsageError(f"{here} was trained with {said}, which with --tokenizer decides the ids (each line ended "
                         f"by the EOS, or the text encoded whole): its data position is one of those ids' batches; "
                         f"resume {'with' if masked else 'without'} --document-mask")
    theirs = f"{args.data or '(the bundled corpus)'} has {mine}{' in its training split' if args.eval_every else ''}"
    if set(changed) - {"data"}:  # another tokenizer (dtype, mask) of the same --data: not the --data to change
        raise UsageError(f"{here} trained on {saved} tokens, this run's --data {theirs}: resume "
                         f"{_spell(saved_run, changed, remedy=True)}")
    raise UsageError(f"{here} trained on {saved} tokens, this run's --data {theirs}: resume with the --data it "
                     f"was trained on ({saved_run.get('data') or 'the bundled corpus'})")


def _id_flags_changed(args: Any, saved_run: dict[str, Any]) -> list[str]:
    """The flags that decide the ids of ``--data`` whose value this run changes: the data,
    its dtype, its tokenizer and, through a tokenizer, the mask (each line encoded alone
    and ended by the EOS, or the text whole) and with the mask the EOS (``--eos-id``).

    >>> import argparse
    >>> now = argparse.Namespace(data="t.txt", data_dtype=None, tokenizer="b.json", document_mask=False, eos_id=None)
    >>> _id_flags_changed(now, {"data": "t.txt", "tokenizer": "a.json", "document_mask": True})
    ['tokenizer', 'document_mask']
    """
    keys = ("data", "data_dtype", "tokenizer", *(("document_mask",) if args.tokenizer else ()),
            *(("eos_id",) if args.tokenizer and args.document_mask else ()))
    return [k for k in keys if k in saved_run and saved_run[k] != getattr(args, k)]


def _check_tokens(args: Any, saved_run: dict[str, Any], saved: str | None, here: str) -> None:
    """This run's training split has the ids the checkpoint trained on (as many: its count
    is checked), by their fingerprint (:meth:`dtp.data.Tokens.fingerprint`, the loader's
    record; a checkpoint from before it has none, and is not checked): another ``--data``
    of the same length would go on at a position that means nothing there."""
    if saved is None:
        return
    tokens = open_tokens(args.data, dtype=args.data_dtype, eos_id=args.eos_id, tokenizer=args.tokenizer,
                         documents=bool(args.document_mask))  # with --tokenizer the mask decides the ids
    if training_split(tokens, bool(args.eval_every))[0].fingerprint() == saved:
        return
    # (another --eos-id, a toggled mask through a tokenizer: other ids, as many of them)
    changed = _id_flags_changed(args, saved_run)
    what = f"{args.data or '(the bundled corpus)'}{' (its training split)' if args.eval_every else ''}"
    if not changed:  # the same flags, other ids: the file was rewritten
        raise UsageError(f"{here} trained on other ids than this run's --data {what} holds now (as many, but "
                         f"another fingerprint): has it changed since? resume with the data it was trained on")
    raise UsageError(f"{here} trained on {saved_run.get('data') or 'the bundled corpus'}, this run's --data {what} "
                     f"holds as many tokens but other ids (another fingerprint): its data position means nothing "
                     f"there; resume {_spell(saved_run, changed, remedy=True)}")


def _check_precision(args: Any, saved_run: dict[str, Any], here: str) -> None:
    """A bf16 run resumed under the default ``--precision`` (mixed) from a checkpoint that
    trained pure bf16 — an older dtp's default without ``--zero`` — would start fp32 master
    weights from the bf16 parameters with nothing said: refused, naming both choices. The
    other way, ``--precision pure`` asked of a checkpoint with master weights, is the
    user's word, and noted (:func:`_note_changes`)."""
    if args.precision is not None or args.dtype != "bfloat16" or "zero" not in saved_run:
        return
    if not master_weights(saved_run.get("precision"), int(saved_run.get("zero") or 0), saved_run.get("dtype", "")):
        how = "" if saved_run.get("precision") == "pure" else ", an older dtp's default without --zero"
        raise UsageError(f"{here} trained pure bf16 (--precision pure{how}); this run's default, --precision mixed, "
                         f"would start fp32 master weights from the bf16 parameters: resume with --precision pure to "
                         f"go on as it did, or --precision mixed to change it")


def _trained_with(segments: list[dict[str, Any]], done: int) -> tuple[list[str], list[dict[str, Any]]]:
    """Per segment (:func:`trained_segments`, ``done`` steps in all): its steps as words
    ("steps 1-4") and its values of what ``--check``'s reference retrains with (the lr
    schedule, clipping, precision, the MoE options)."""
    spans, trained = [], []
    for i, segment in enumerate(segments):
        run, model = segment.get("run") or {}, segment.get("model") or {}
        last = segments[i + 1]["first"] - 1 if i + 1 < len(segments) else done
        spans.append(f"step {last}" if segment["first"] == last else f"steps {segment['first']}-{last}")
        split = _dropping_split(run, model)
        trained.append({**_reference_values(run, model), "warmup_from_step_one": bool(run.get("warmup_from_step_one")),
                        **({"dropping_split": split} if split > 1 else {})})
    return spans, trained


def _dropping_split(run: dict[str, Any], model: dict[str, Any]) -> int:
    """How many ways a segment split the batch it routed with a capacity factor (dp × ep ×
    cp; 1 dropless or on one rank): each rank drops by its own tokens (Megatron's rule), so
    a split > 1 drops other tokens than one process (:func:`dtp.cli.shape.check_shape`
    refuses ``--check`` there). A config.json's cut record keeps it as ``dropping_split``.

    >>> _dropping_split({"dp": 2, "ep": 2, "cp": 1}, {"num_experts": 4, "capacity_factor": 1.25})
    4
    >>> _dropping_split({"dp": 2, "ep": 2}, {"num_experts": 4, "capacity_factor": None})
    1
    """
    if "dropping_split" in run:
        return int(run["dropping_split"])
    if not model.get("num_experts") or model.get("capacity_factor") is None:
        return 1
    return int(run.get("dp", 1)) * int(run.get("ep", 1)) * int(run.get("cp", 1))


def _reference_values(run: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """What ``--check``'s reference retrains a step with, of a run config and a model
    config (as dicts; an older record may lack some): :data:`_REFERENCE_FIELDS`, the MoE
    fields, ``--microbatches`` for a model with experts, and the precision as resolved
    (``None``, in an older record, is mixed under ZeRO in bf16, else pure).

    >>> _reference_values({"lr": 0.1, "precision": None, "zero": 1, "dtype": "bfloat16", "microbatches": 2}, {})
    {'lr': 0.1, 'precision': 'mixed'}
    """
    values = {k: run[k] for k in _REFERENCE_FIELDS if k in run}
    values.update({k: model[k] for k in MODEL_FIELDS if k in model})
    if "dtype" in run:
        values["precision"] = ("mixed" if master_weights(run.get("precision"), int(run.get("zero") or 0), run["dtype"])
                               else "pure")
    if model.get("num_experts") and "microbatches" in run:
        values["microbatches"] = run["microbatches"]
    return values


def segment_record(segment: dict[str, Any]) -> dict[str, Any]:
    """A segment (:func:`trained_segments`) cut to what :func:`segments_mixed` reads: its
    first step, the lr schedule, clipping and precision (resolved) it ran under, its MoE
    options (what a run's config.json keeps of each; :func:`_reference_values`).

    >>> segment_record({"first": 5, "run": {"lr": 0.1, "dp": 2}, "model": {"top_k": 2, "dim": 64}})
    {'first': 5, 'run': {'lr': 0.1}, 'model': {'top_k': 2}}
    """
    run, model = segment.get("run") or {}, segment.get("model") or {}
    values = _reference_values(run, model)
    split = _dropping_split(run, model)
    return {"first": segment["first"],
            "run": {**{k: v for k, v in values.items() if k not in MODEL_FIELDS},
                    **({"warmup_from_step_one": run["warmup_from_step_one"]} if "warmup_from_step_one" in run else {}),
                    **({"dropping_split": split} if split > 1 else {})},
            "model": {k: model[k] for k in MODEL_FIELDS if k in model}}


def segments_mixed(segments: list[dict[str, Any]], done: int) -> str | None:
    """Why one process cannot retrain these segments' ``done`` steps with one set of flags
    (``--check``'s reference, :func:`dtp.cli.check.check_run`): a segment under dtp's
    earlier lr schedule, or two that ran under another lr schedule, clipping, precision or
    MoE options (a ``--resume`` that changed them). ``None`` when one set trained all.

    >>> seg = lambda first, lr: {"first": first, "run": {"lr": lr, "warmup_from_step_one": True}, "model": {}}
    >>> segments_mixed([seg(1, 0.001), seg(5, 0.002)], 8)
    "steps 1-4 trained with --lr 0.001, steps 5-8 with --lr 0.002; --check's one-process reference trains all steps with one set of flags, so it cannot check this run"
    >>> segments_mixed([seg(1, 0.001), seg(5, 0.001)], 8) is None
    True
    """
    return _mixed(*_trained_with(segments, done))


def _mixed(spans: list[str], trained: list[dict[str, Any]]) -> str | None:
    """:func:`segments_mixed` on the segments' spans and values (:func:`_trained_with`)."""
    for span, values in zip(spans, trained):
        if not values["warmup_from_step_one"]:
            return (f"{span} trained under dtp's earlier lr schedule (lr 0 at step 1), which --check's reference no "
                    f"longer trains")
        if values.get("dropping_split", 1) > 1:
            return (f"{span} trained with --capacity-factor {values.get('capacity_factor')} on a batch split "
                    f"{values['dropping_split']} ways (--dp × --ep × --cp): each rank dropped by its own tokens "
                    f"(Megatron's rule), which one process does not, so --check's one-process reference cannot "
                    f"check this run")
    before = [span for span, values in zip(spans, trained) if "weight_decay" not in values]
    if before and len(before) < len(spans):  # a record from before --weight-decay (optimizer.weight_decay)
        return (f"{before[0]} decayed every parameter (dtp's weight decay before --weight-decay, which exempts norms "
                f"and biases as Megatron does), later steps only the matrices; --check's one-process reference "
                f"trains all steps with one rule, so it cannot check this run")
    for i in range(1, len(trained)):
        names = [k for k in trained[0] if trained[i].get(k) != trained[0].get(k)]
        if names:  # no one set of flags retrains both
            return (f"{spans[0]} trained with {_spell(trained[0], names)}, {spans[i]} with "
                    f"{_spell(trained[i], names)}; --check's one-process reference trains all steps with one set of "
                    f"flags, so it cannot check this run")
    return None


def _spell(values: dict[str, Any], names: Sequence[str], *, remedy: bool = False) -> str:
    """``names`` as the flags that give ``values`` (``no --init-from`` for an unset one);
    ``remedy``: what to resume with (``with --model tiny, without --init-from``).

    >>> _spell({"model": "tiny", "init_from": None, "lr": 0.003}, ["init_from", "model", "lr"])
    'no --init-from --model tiny --lr 0.003'
    >>> _spell({"model": "tiny", "init_from": None, "lr": 0.003}, ["init_from", "model", "lr"], remedy=True)
    'with --model tiny --lr 0.003, without --init-from'
    """
    words, unset = [], []
    for name in names:
        value = values.get(name)
        if value is None or value is False:
            (unset if remedy else words).append(f"{'' if remedy else 'no '}{flag_of(name)}")
        else:
            words.append(flag_of(name) if value is True else f"{flag_of(name)} {value}")
    if not remedy:
        return " ".join(words)
    return ", ".join(part for part in (words and "with " + " ".join(words), unset and "without " + " ".join(unset))
                     if part)
