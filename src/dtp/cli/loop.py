"""The training loop of ``dtp train``: the layout, mesh and state built from the run's
:class:`dtp.RunConfig`, and the per-rank worker that trains and reports.

``dtp train`` outside torchrun starts the ranks itself through torchrun's machinery
(:func:`dtp.launch.launch`); inside torchrun it joins the world it finds, so multi-node
runs are plain ``torchrun ... -m dtp.cli train ...``. Every rank runs :func:`train_rank`;
rank 0 shows progress and writes the run directory (:mod:`dtp.cli.report`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
import shlex
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

import torch
from torch.distributed.device_mesh import DeviceMesh

from .. import CompileOptions, Layout, RunConfig, TrainState, shard_batch, train_step, wait
from ..training import strategies
from ..checkpoint import store as checkpoint
from ..data.token_files import SAMPLE_TOKENS, past_vocab, sidecar_path, training_split
from ..training.buffers import lay_out as lay_out_buffers
from ..training.guard import ID_KEYS, id_range
from ..data.loader import TokenLoader, Tokens, document_eos, open_tokens
from ..core.mesh.devices import mesh_device
from ..core.mesh.launch import JOB_KEY, job_id, report_preempted
from ..planning.report import format_count
from ..models.hf import convert as hf
from ..models import llama
from ..core.redistribute import value_of
from .process import PREEMPTED, Preempted, SaveOnSignal, Terminated, sigterm_ignored, stop_signals, run_world, \
    single_process_world, why
from .saving import Checkpointing, Saver, checkpointing, records_until, skipped_line
from .optimizer import OptimizerRules, decay_changes, train_optimizer
from .parser import EVAL_BATCHES, PROG
from .plan import plan_of
from .flags import UsageError, build_layout, vocab_size
from .shape import format_mesh
from .resume import segment_record, trained_segments
from .report import (atomic_write_text, format_summary, plot_losses, Progress, write_json, format_bytes,
                     note_when_output_closes,
                     print_compile_report, report_exception, summarize)

__all__ = ["build_layout", "SkipCounter", "TrainingAborted", "Terminated", "train_loop", "train_rank",
           "single_process_world"]


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # a name of dtp.config.DTYPES (the run config checked it)


@functools.lru_cache(maxsize=2)  # rank 0 opens it for the run config, then trains with it
def _open_data(path: str | None, dtype: str | None, eos_id: int | None, tokenizer: str | None,
               documents: bool) -> Tokens:
    try:
        return open_tokens(path, dtype=dtype, eos_id=eos_id, tokenizer=tokenizer, documents=documents)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise UsageError(f"--data: {e}") from None


def _load_data(config: RunConfig) -> Tokens:
    """``--data`` as the run describes it: memory-mapped token files, or text in memory
    (through ``--tokenizer``, with ``--document-mask`` a line at a time, each ended by the EOS:
    the ids the preflight counted)."""
    return _open_data(config.data, config.data_dtype, config.eos_id, config.tokenizer, config.document_mask)


def _splits(config: RunConfig) -> tuple[Tokens, Tokens | None]:
    """The training tokens and, with ``--eval-every``, the held-out ones (the corpus's last
    tenth, :func:`dtp.data.token_files.held_out_start`): the same split on every rank and in
    the 1-process reference. Views of the mapped file: nothing is read here."""
    return training_split(_load_data(config), bool(config.eval_every))  # before the flag: no split


def _documents(config: RunConfig, tokens: Tokens) -> int | None:
    """The EOS id that packs ``--document-mask`` batches (None: plain windows)."""
    return document_eos(tokens) if config.document_mask else None


def _vocab_size(config: RunConfig, tokens: Tokens) -> int:
    """:func:`dtp.cli.flags.vocab_size` for the tokens: the preflight's rule
    (:func:`dtp.data.token_files.token_stats`: the stated vocabulary, else a bounded sample);
    ``--init-from``'s own (padded)."""
    if config.init_from:
        return _model(config, None).vocab_size
    return vocab_size(config.model,
                      tokens.vocab_size - 1 if tokens.vocab_size is not None else tokens.sample_range()[1])


def _model(config: RunConfig, vocab: int | None) -> llama.LlamaConfig:
    """The run's model: the preset with the run's vocabulary, or ``--init-from``'s."""
    return llama.config_for(config.model, init_from=config.init_from, vocab_size=vocab, **config.model_overrides())


def run_record(config: RunConfig, *, vocab_size: int, world_size: int,
               rules: OptimizerRules = OptimizerRules()) -> dict[str, Any]:
    """What a run records of itself (its directory's ``config.json``, each checkpoint's
    ``run`` and segments): the run's fields and what the ranks found (vocabulary, world,
    mesh), and under which optimizer rules it trains, in the words
    :meth:`OptimizerRules.of_record` reads back (today's: ``warmup_from_step_one``).

    >>> record = run_record(RunConfig(dp=2, tp=2), vocab_size=256, world_size=4)
    >>> record["mesh"], record["world_size"], record["warmup_from_step_one"], record["weight_decay"]
    ({'dp': 2, 'tp': 2}, 4, True, 0.1)
    >>> older = OptimizerRules(warmup_from_step_one=False, decay_matrices_only=False)
    >>> OptimizerRules.of_record(run_record(RunConfig(), vocab_size=256, world_size=1, rules=older)) == older
    True
    """
    record = {**config.to_dict(), "vocab_size": vocab_size, "world_size": world_size, "mesh": config.mesh_axes(),
              "warmup_from_step_one": rules.warmup_from_step_one}
    if not rules.decay_matrices_only:  # a record from before --weight-decay had none
        del record["weight_decay"]
    return record


def train_loop(config: RunConfig, mesh: DeviceMesh, layout: Layout, *, vocab_size: int, recompute: str | None,
               on_step: Callable[[int, dict[str, Any]], None] | None = None,
               checkpoints: Checkpointing | None = None,
               on_start: Callable[[int, list[dict[str, Any]], Path | None], None] | None = None,
               last: int | None = None, rules: OptimizerRules = OptimizerRules(), stop: SaveOnSignal | None = None,
               on_note: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The training loop every rank runs (and the 1-process reference) for the run
    ``config`` on ``mesh`` under ``layout``, its model's vocabulary ``vocab_size`` (what
    the ranks found in the data, :func:`_vocab_size`); returns the metrics of the steps it
    ran (after the resumed one, when resuming), up to step ``last`` (default
    ``config.steps``; the lr schedule is the whole run's). ``rules``: the optimizer's,
    today's unless ``dtp check`` retrains an older run directory. ``on_start(first,
    segments, resumed)`` runs once the state is built and a resumed checkpoint (``resumed``,
    its path: after a fallback, not the newest) and data position
    have loaded, before step ``first``: what a run writes before that is lost if the load
    fails. ``segments``: which flags trained which steps (:func:`resume.trained_segments`),
    this run's last. ``stop``: ``--save-on-signal``'s flag (:class:`dtp.cli.saving.Saver`
    saves and stops on it); ``on_note(line)``: what the run says on the way that is no
    metric (a damaged checkpoint skipped, a save that failed)."""
    torch.manual_seed(config.seed)
    tokens, held_out = _splits(config)
    loader = TokenLoader(tokens, batch_size=config.batch, seq_len=config.seq, seed=config.seed,
                         documents=_documents(config, tokens))
    cfg = _model(config, vocab_size)
    dtype = _torch_dtype(config.dtype)
    opt = train_optimizer(config, rules)
    # The run's and what the ranks found, as train_rank records it (mesh.size(): its world).
    run_cfg = run_record(config, vocab_size=vocab_size, world_size=mesh.size(), rules=rules)
    # axis_sizes: the layout's rules (heads per tp × Ulysses degree, kv heads per head
    # chunk, vocab per tp …) are checked here, on every rank, before any collective.
    resuming = checkpoints is not None and checkpoints.resume_from is not None
    if config.init_from:  # each rank reads only its blocks of the weight files
        # Resuming, the checkpoint replaces them: only config.json is read (the weight files
        # may be gone, and every rank would read its blocks for nothing).
        state = TrainState.from_hf(config.init_from, opt, mesh=mesh, layout=layout, dtype=dtype,
                                   vocab_multiple=hf.INIT_VOCAB_MULTIPLE, weights=not resuming)
        if buffers := llama.init_buffers(cfg, dtype):  # aux-loss-free balancing's router biases
            state = state.replace(buffers=lay_out_buffers(buffers, mesh), buffer_update=llama.buffer_update(cfg))
    else:
        # buffers: aux-loss-free balancing's router biases (none without --router-bias-update)
        state = TrainState.create(llama.init(cfg, seed=config.seed, dtype=dtype), opt, mesh=mesh, layout=layout,
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg),
                                  buffers=llama.init_buffers(cfg, dtype), buffer_update=llama.buffer_update(cfg))
    loss_fn = llama.sequential(cfg)  # the model as layers: a pipeline cuts it into stages; else llama.loss
    clip = config.clip if config.clip > 0 else None
    skips = SkipCounter(config.max_skipped)  # 0 for a run directory from before the flag (check.run_of_record)
    eval_every = config.eval_every
    eval_batches = [_check_ids(b, cfg, config, held_out, "a held-out batch (--eval-every)")
                    for b in (_eval_batches(held_out, config) if held_out is not None else [])]
    # MFU: the model's training FLOPs per token (PaLM's count) against a matmul's measured
    # rate on this rank (a CPU has no datasheet peak dtp could look up): an estimate.
    flops_per_token = llama.flops_per_token(cfg, config.seq)
    peak = _matmul_rate(dtype, mesh_device(mesh)) * mesh.size()
    first, earlier = 1, []
    if resuming:
        # The same state and data position whatever the flags it was saved under:
        # checkpoint.load reshards, the loader refuses another seed/batch/seq/corpus.
        # The newest that verifies (a damaged one set aside, said); a path of its own is never fallen back from.
        state, extra = checkpoint.load(checkpoints.root if checkpoints.fallback else checkpoints.resume_from,
                                       like=state, fallback=checkpoints.fallback,
                                       on_skip=lambda path, why, moved: on_note and on_note(skipped_line(path, why, moved)))
        loader.load_state_dict((extra or {}).get("loader", {}))
        first = loader.state_dict()["step"] + 1  # iterations, skipped steps included (state.step counts updates)
        earlier = trained_segments(extra or {})
        # The skips so far go on counting (they restarted at 0: a run aborted by --max-skipped
        # resumed for --max-skipped more): the total is the iterations less the updates, the
        # run in a row the checkpoint's record (0 from one written before it kept it).
        skips.total = max(0, first - 1 - int(state.step))
        skips.in_a_row = int(((extra or {}).get("skips") or {}).get("in_a_row", 0))
    # Which flags trained which steps: a resume may change --steps, --lr, … (not without
    # --check, whose reference trains every step with the last ones: resume.check_resume).
    segments = [*earlier, {"first": first, "run": run_cfg, "model": dataclasses.asdict(cfg)}]
    if on_start is not None:
        on_start(first, segments, checkpoints.root / f"step_{state.step:08d}" if resuming else None)
    records = []
    final = min(config.steps, last or config.steps)
    saver = Saver(checkpoints, stop, mesh, last=final, note=on_note or (lambda line: None),
                  extra=lambda: {"loader": loader.state_dict(), "model": dataclasses.asdict(cfg),
                                 "run": run_cfg,  # the run's RunConfig and what the ranks found
                                 "segments": segments, "skips": {"in_a_row": skips.in_a_row}})
    # Dropless MoE changes its expert batches' shapes every step: dynamic from the start.
    compiling = config.compile and CompileOptions(backend=config.compile, dynamic=cfg.num_experts > 0 or None)
    for step in range(first, final + 1):
        batch = shard_batch(_check_ids(loader.next_batch(), cfg, config, tokens, f"step {step}'s batch"), state)
        with warnings.catch_warnings():
            # The step's line says SKIPPED, in the run's numbering; train_step's warning would
            # add two lines (the source line under it) counting state.step, the updates made.
            warnings.filterwarnings("ignore", "dtp.train_step: non-finite", RuntimeWarning)
            state, m = train_step(loss_fn, state, batch, microbatches=config.microbatches,
                                  recompute=recompute, clip_norm=clip, compile=compiling)
        step_time = float(m["step_time"])
        skips.add(bool(m["skipped"]))
        tokens_per_s = int(m["tokens"]) / step_time if step_time > 0 else None
        record = {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                  "lr": float(m["lr"]), "tokens": int(m["tokens"]), "step_time": step_time,
                  "tokens_per_s": tokens_per_s,
                  "mfu": tokens_per_s * flops_per_token / peak if tokens_per_s and peak > 0 else None,
                  "comm_bytes": {a: {k: int(b) for k, b in kinds.items()}
                                 for a, kinds in (m.get("comm_bytes") or {}).items()},
                  "skipped": bool(m["skipped"]), "skipped_steps": skips.total, **_moe_metrics(m.get("aux")),
                  **{k: m[k] for k in ("compile_graphs", "compile_breaks") if k in m}}
        if compiling and config.debug and (step == first or step == config.steps):
            print_compile_report(step, [r.get("compile_graphs", 0) for r in [*records, record]])
        if eval_every and (step % eval_every == 0 or step == config.steps):
            t0 = time.perf_counter()
            record["eval_loss"] = _evaluate(state, cfg, eval_batches)
            record["eval_time"] = time.perf_counter() - t0
        records.append(record)
        if on_step is not None:
            on_step(step, record)
        try:
            skips.check(step)  # after the record is written: metrics.jsonl shows the steps that led here
        except TrainingAborted:
            # Every rank aborts at this step (the skip is decided on the reduced gradient
            # norm), so all can finish the save in flight: else the newest checkpoint stays
            # .partial and --resume finds none.
            saver.wait()
            raise
        saver.after_step(state, step)
    saver.wait()
    wait(state)  # the last step's prefetched parameter gathers (overlap_param_gather)
    return records


def _check_ids(batch: dict[str, torch.Tensor], cfg: llama.LlamaConfig, config: RunConfig, tokens: Tokens,
               where: str) -> dict[str, torch.Tensor]:
    """``batch``, its ids checked against the model's vocabulary, or a :class:`UsageError`
    that says what to do about it in the flags' words. The preflight sized the vocabulary
    by a sample of ``--data`` when nothing states it, and an id past it that the sample
    missed is met here, in the first batch that holds it: the same line on every rank (each
    reads the same global batch), before ``shard_batch``, whose check names the model's
    ``vocab_size`` and which one device does not make (the embedding's IndexError; on a
    GPU, a device-side assert). An id at or past the ``vocab_size`` a sidecar states is
    refused too, although the model's vocabulary may hold it (the preflight's sample met none)."""
    found = [r for k in ID_KEYS if k in batch and (r := id_range(k, batch[k])) is not None]
    lo, hi = min(r[0] for r in found), max(r[1] for r in found)
    vocab = cfg.vocab_size - cfg.vocab_pad  # --init-from's padding rows are no ids
    # The sidecar's vocab_size (a tokenizer's ids are all below its own): the model's may
    # be larger (the preset's, or rounded up to 128), so an id in between would train,
    # silently, a row no token has.
    stated = tokens.vocab_size
    if 0 <= lo and hi < min(vocab, stated or vocab):
        return batch
    data = f"--data {tokens.name}: {where} holds token id"
    if lo < 0:
        raise UsageError(f"{data} {lo}, and token ids are >= 0; fix the data")
    if hi >= vocab and config.init_from:  # the preflight's rule, for an id its sample missed
        raise UsageError(f"{data} {hi}, but the model of --init-from {config.init_from} has {vocab} token ids; "
                         f"tokenize the data with its tokenizer")
    if stated is not None:  # the model's vocabulary is at least the sidecar's: past it either way
        raise UsageError(f"--data {tokens.name}: {where} holds {past_vocab(tokens, hi)}")
    side = sidecar_path(tokens.name)
    raise UsageError(f"{data} {hi}, past the {vocab} ids of the model, whose vocabulary was sized by the largest id "
                     f"in the preflight's sample of the data ({SAMPLE_TOKENS} ids); state the vocabulary in the "
                     f"sidecar {side}: {{\"vocab_size\": N}}, N above the largest id")


def _eval_batches(held_out: Tokens, config: RunConfig) -> list[dict[str, torch.Tensor]]:
    """The held-out batches every evaluation uses: the first :data:`EVAL_BATCHES` of a
    loader over the held-out split (fewer if it holds fewer), the same ones each time."""
    loader = TokenLoader(held_out, batch_size=config.batch, seq_len=config.seq, seed=config.seed,
                         documents=_documents(config, held_out))
    return [loader.next_batch() for _ in range(min(EVAL_BATCHES, loader.batches_per_epoch))]


def _evaluate(state: TrainState, cfg: llama.LlamaConfig, batches: list[dict[str, torch.Tensor]]) -> float:
    """The mean language-model loss over ``batches``, forward only, under the run's layout:
    the same value on every rank (a global mean). Every rank calls it at the same step:
    under ZeRO-3 the parameters are all-gathered, under a pipeline the batches run through
    the stages as a forward-only schedule (:func:`dtp.strategies.evaluate`)."""
    results = strategies.evaluate(llama.sequential(cfg), state.params, state.strategy, state.layout, state.mesh,
                                  [shard_batch(batch, state) for batch in batches], buffers=state.buffers)
    # An MoE model returns (loss + aux terms, aux): the held-out number is the LM loss.
    total = sum(value_of(aux["lm_loss"].detach()) if aux is not None else loss for loss, aux in results)
    return total / len(batches)


def _matmul_rate(dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    """FLOP/s of a square matmul on this rank's device, best of ``repeats``: the MFU's
    denominator. An accelerator gets a large one, synchronized (256² times the launch)."""
    n = 256 if device.type == "cpu" else 4096
    sync = (lambda: None) if device.type == "cpu" else (lambda: torch.accelerator.synchronize(device))
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    best = math.inf
    for _ in range(repeats + 1):  # the first warms up the kernel
        sync()
        t0 = time.perf_counter()
        a @ a
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best if best > 0 else 0.0


# --------------------------------------------------------------------------- non-finite steps


class TrainingAborted(RuntimeError):
    """Training stopped on purpose (``--max-skipped``): one line on stderr, exit code 1."""


class SkipCounter:
    """Skipped steps (``train_step``'s ``metrics["skipped"]``): the running total, and an
    abort after ``max_skipped`` in a row (0: never). A skip is the same on every rank, so
    every rank counts alike and aborts at the same step: no rank is left waiting.

    >>> skips = SkipCounter(max_skipped=2)
    >>> for skipped in (True, False, True, True):
    ...     skips.add(skipped)
    >>> skips.total, skips.in_a_row
    (3, 2)
    >>> skips.check(4)
    Traceback (most recent call last):
    ...
    dtp.cli.loop.TrainingAborted: training aborted at step 4: 2 steps in a row skipped ...
    >>> one = SkipCounter(max_skipped=1)
    >>> one.add(True)
    >>> one.check(7)
    Traceback (most recent call last):
    ...
    dtp.cli.loop.TrainingAborted: training aborted at step 7: 1 step in a row skipped ...
    """

    def __init__(self, max_skipped: int) -> None:
        self.max_skipped, self.total, self.in_a_row = max_skipped, 0, 0

    def add(self, skipped: bool) -> None:
        """Count one step."""
        self.total += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0

    def check(self, step: int) -> None:
        """Raise :class:`TrainingAborted` once ``max_skipped`` steps in a row were skipped."""
        if self.max_skipped and self.in_a_row >= self.max_skipped:
            raise TrainingAborted(
                f"training aborted at step {step}: {self.in_a_row} step{'s' * (self.in_a_row != 1)} in a row "
                f"skipped (non-finite loss or gradient norm; parameters unchanged since step "
                f"{step - self.in_a_row}) — --max-skipped "
                f"{self.max_skipped} (0: never abort)")


def train_rank(config: RunConfig, *, stream: TextIO | None = None) -> int:
    """Train the run ``config`` (its ``out`` resolved: the ranks and the reference agree on
    it) as one rank of the current world (torchrun's, or a world of one).

    Rank 0 writes the run directory: ``metrics.jsonl`` a line per step, and
    ``summary.json`` and ``loss.png`` at the end, also when the run ends early (Ctrl-C,
    ``SIGTERM``, an exception after some steps: the summary then says ``interrupted``).
    """
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(config.out)
    vocab = _vocab_size(config, _load_data(config))
    run_cfg = run_record(config, vocab_size=vocab, world_size=world)
    layout = config.layout()
    progress = Progress(config.steps, config.log_every, stream) if rank == 0 else None
    if rank == 0:
        note_when_output_closes(f"{PROG} train: standard output was closed; training goes on, "
                                f"each step in {out / 'metrics.jsonl'}")
    checkpoints = checkpointing(config, out)
    records: list[dict[str, Any]] = []
    started = False  # the run directory is this run's: the state (and checkpoint) loaded

    with contextlib.ExitStack() as files:
        metrics = board = None
        if rank == 0:
            _print_header(config, _model(config, vocab), layout, world, out, stream)

        def on_start(first: int, segments: list[dict[str, Any]], resumed: Path | None) -> None:
            # Nothing in the run directory changes before this: a resume whose checkpoint
            # does not load (another dtype, model, a corrupt file) leaves the earlier run's
            # config, metrics, summary and plot as they were.
            nonlocal metrics, board, started
            # Resuming: the steps up to the checkpoint stay in metrics.jsonl (the ones after
            # it are run again), so the file, the summary and the loss plot cover the whole
            # run. Read on every rank (a refusal is every rank's), of the checkpoint that
            # loaded: after a fallback, an older one than the preflight saw.
            earlier = records_until(out, first - 1, resumed) if resumed is not None else []
            records[:0] = earlier
            started = True
            if rank != 0:
                return
            if resumed is not None:
                print(f"{PROG} train: resuming from step {len(earlier)} ({resumed})", file=stream, flush=True)
                if note := decay_changes(out, len(earlier)):
                    print(note, file=stream, flush=True)
            out.mkdir(parents=True, exist_ok=True)
            # An earlier segment's --check compared only the steps before this one: removed, so
            # the directory never shows a check of less than the run (this run's --check, or
            # dtp check, writes one of all its steps; renamed aside, --overwrite would miss it).
            (out / "check.json").unlink(missing_ok=True)
            # With the flags each earlier segment of a resumed run trained under: dtp check
            # refuses a run no one set of flags retrains (resume.segments_mixed).
            # The torchrun job (--rdzv-id) it trains in: a host that comes back into it, or a
            # requeue of the same job, resumes (dtp.launch.rejoined).
            job = {JOB_KEY: job_id()} if job_id() is not None else {}
            write_json(out / "config.json", {**run_cfg, "layout": layout.name,
                                              "command": shlex.join([PROG, *config.argv()]),
                                              "segments": [segment_record(s) for s in segments], **job})
            # The kept steps once (whole, atomically), then one line appended per step. A
            # fresh run's file appears with its first step (readers take it as "training").
            if earlier:
                atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in earlier))
            else:
                (out / "metrics.jsonl").unlink(missing_ok=True)
            metrics = files.enter_context(_AppendOnFirstWrite(out / "metrics.jsonl"))
            if config.tensorboard:
                board = files.enter_context(_TensorBoard(out / "tensorboard"))

        def on_step(step: int, record: dict[str, Any]) -> None:
            records.append(record)
            if metrics is None:
                return
            # One line per step, flushed: a reader sees every finished step (rewriting the
            # whole file each step, as before, cost O(steps) per step).
            metrics.write(json.dumps(record) + "\n")
            if board is not None:
                board.add(step, record)
            progress.update(step, record)

        def on_note(line: str) -> None:
            if rank == 0:
                print(f"{PROG} train: {line}", file=sys.stderr, flush=True)

        interrupted, code = None, 0
        try:
            with stop_signals(config.save_on_signal) as stop, run_world(config) as mesh:
                try:
                    train_loop(config, mesh, layout, vocab_size=vocab, recompute=_recompute(config), on_step=on_step,
                               checkpoints=checkpoints, on_start=on_start, stop=stop, on_note=on_note)
                except Preempted as e:  # every rank saved the same step: a clean end, said once
                    interrupted, code = why(e), PREEMPTED
                    on_note(str(e))
                    if rank == 0:
                        report_preempted(str(e))  # for the launcher: this run's exit code is PREEMPTED
                del mesh  # the last reference: destroy_process_group then really ends the group
        except BaseException as e:
            interrupted = why(e)
            if isinstance(e, Exception) and not config.debug:
                # Say what happened now, not after the summary and plot below: once one rank
                # has exited the launcher stops the others, and a rank stopped before it
                # spoke would leave only its flight record.
                report_exception(e, "train", config.out)
            raise
        finally:
            if rank == 0 and started and records:
                with sigterm_ignored():  # a stop during the last writes would leave no plot
                    _finish(out, records, run_cfg, interrupted, stream)
    return code


def _finish(out: Path, records: list[dict[str, Any]], run_cfg: Mapping[str, Any], interrupted: str | None,
            stream: TextIO | None) -> None:
    """Rank 0's last files: ``summary.json`` and ``loss.png``; then the summary line."""
    summary = summarize(records)
    if interrupted is not None:
        summary["interrupted"] = interrupted
    write_json(out / "summary.json", summary)
    plot_losses(out, {"loss": [r["loss"] for r in records]}, run_cfg)
    print(format_summary(summary), file=stream, flush=True)


def _print_header(config: RunConfig, cfg: llama.LlamaConfig, layout: Layout, world: int, out: Path,
                  stream: TextIO | None) -> None:
    """The run's first line: model (``cfg``, the one the ranks train) and its parameter
    count, mesh, layout, dtype, directory; then the plan's per-rank memory, when
    :mod:`dtp.plan` provides it (:func:`_plan_memory`)."""
    params = llama.param_count(cfg)
    model = config.init_from if config.init_from else config.model
    print(f"{PROG} train: {model} ({format_count(params)} parameters) on mesh {format_mesh(config.mesh_axes())} "
          f"({world} rank{'s' * (world > 1)}), layout {layout.name}, {config.dtype}"
          f"{f', {config.microbatches} microbatches' if config.microbatches > 1 else ''}, writing {out}",
          file=stream, flush=True)
    memory = _plan_memory(config, cfg)
    if memory:
        print(f"{PROG} train: {memory}", file=stream, flush=True)


def _plan_memory(config: RunConfig, cfg: llama.LlamaConfig) -> str | None:
    """One line with :func:`dtp.plan`'s predicted peak memory per rank of the run with the
    model ``cfg`` (the ranks': its vocabulary grown to the data's ids, as the preflight's
    memory check planned it), for the header; ``None`` if the plan cannot be made (a
    prediction must never stop a run)."""
    try:
        p = plan_of(config, model=cfg)
    except Exception:  # noqa: BLE001 -- e.g. a configuration the plan does not model (double ring)
        return None
    worst = p.worst
    return (f"plan: peak {format_bytes(p.peak)} per rank (parameters {format_bytes(worst.params)}, optimizer "
            f"{format_bytes(worst.optimizer)}, activations {format_bytes(worst.activations)}); dtp plan for the "
            f"table")


class _AppendOnFirstWrite:
    """A text file opened for appending at its first :meth:`write` (not before); flushed
    after each write, closed on exit."""

    def __init__(self, path: Path) -> None:
        self.path, self.file = path, None

    def write(self, text: str) -> None:
        if self.file is None:
            self.file = open(self.path, "a")
        self.file.write(text)
        self.file.flush()

    def __enter__(self) -> "_AppendOnFirstWrite":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()


class _TensorBoard:
    """``--tensorboard``: each step's scalars as TensorBoard events (rank 0), beside
    ``metrics.jsonl``: loss, eval loss, lr, grad norm, tokens/s, MFU, comm bytes per axis."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the optional dependency, checked by validate

        self.writer = SummaryWriter(log_dir=str(directory))

    def add(self, step: int, record: Mapping[str, Any]) -> None:
        for key, tag in (("loss", "loss/train"), ("eval_loss", "loss/eval"), ("lr", "optim/lr"),
                         ("grad_norm", "optim/grad_norm"), ("tokens_per_s", "perf/tokens_per_s"),
                         ("mfu", "perf/mfu"), ("step_time", "perf/step_time")):
            if record.get(key) is not None:
                self.writer.add_scalar(tag, float(record[key]), step)
        for axis, kinds in (record.get("comm_bytes") or {}).items():
            self.writer.add_scalar(f"comm_bytes/{axis}", float(sum(kinds.values())), step)

    def __enter__(self) -> "_TensorBoard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.writer.close()


def _recompute(config: RunConfig) -> str | None:
    return None if config.recompute == "none" else config.recompute


def _moe_metrics(aux: Any) -> dict[str, Any]:
    """An MoE model's routing health per step: the cross-entropy alone, the aux and z
    losses, the load imbalance (max / mean tokens per expert, worst block) and the
    dropped fraction (mean over blocks). With microbatches (one aux each) the step's: the
    loads summed (what aux-loss-free balancing reads), the rest averaged. Nothing for a
    dense model."""
    if isinstance(aux, tuple) and aux and all(isinstance(a, dict) and "tokens_per_expert" in a for a in aux):
        aux = {k: (sum(a[k] for a in aux) if k == "tokens_per_expert" else sum(a[k] for a in aux) / len(aux))
               for k in ("lm_loss", "aux_loss", "z_loss", "tokens_per_expert", "dropped_fraction")}
    if not isinstance(aux, dict) or "tokens_per_expert" not in aux:
        return {}
    load = aux["tokens_per_expert"].to(torch.float64)
    imbalance = float((load.max(-1).values / load.mean(-1).clamp(min=1e-12)).max())
    return {"lm_loss": float(aux["lm_loss"]), "aux_loss": float(aux["aux_loss"]), "z_loss": float(aux["z_loss"]),
            "expert_imbalance": imbalance, "dropped_fraction": float(aux["dropped_fraction"].mean())}
