"""The training loop of ``dtp train``: the layout, mesh and state built from the flags,
and the per-rank worker that trains and reports.

``dtp train`` outside torchrun starts the ranks itself through torchrun's machinery
(:func:`dtp.launch.launch`); inside torchrun it joins the world it finds, so multi-node
runs are plain ``torchrun ... -m dtp.cli train ...``. Every rank runs :func:`_train_rank`;
rank 0 shows progress and writes the run directory (:mod:`dtp.cli.report`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shlex
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TextIO

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import Layout, TrainState, checkpoint, comm, layouts, make_mesh, optim, shard_batch, train_step, wait
from ..data import TokenLoader, load_tokens
from ..launch import in_torchrun
from ..mesh import clear_mesh_cache
from ..models import llama
from .flags import PROG, UsageError, mesh_axes, model_overrides, train_argv, zero_layout
from .report import _atomic_write_text, _format_summary, _plot, _Progress, _write_json, summarize

__all__ = ["build_layout", "SkipCounter", "TrainingAborted"]


def build_layout(args: argparse.Namespace) -> Layout:
    """``data() + megatron(sequence_parallel=sp)`` (+ ``context(...)`` with cp > 1, + ``zero``).

    Megatron's rules name the ``tp`` axis; on a mesh without it they are dropped, so the
    same layout serves tp = 1.
    """
    layout = layouts.data() + layouts.megatron(sequence_parallel=args.sp)
    if args.cp > 1:
        options = {k: v for k, v in (("algo", args.cp_algo), ("window", args.cp_window),
                                     ("ulysses_degree", args.ulysses_degree),
                                     ("head_chunks", args.cp_head_chunks)) if v is not None}
        layout = layout + layouts.context(**options)
    layout = layout + zero_layout(args)
    if args.ep > 1:
        layout = layout + layouts.expert(pipe_experts=args.pipe_experts, multi_data=args.multi_data,
                                         multi_stream=args.multi_stream, tp_axis="tp" if args.expert_tp else None)
    if args.pp > 1:
        layout = layout + layouts.pipeline(args.pp_schedule, virtual_stages=args.virtual_stages)
    return layout


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[name]


@functools.lru_cache(maxsize=2)  # the launcher validates with the data, then trains with it
def _load_data(path: str | None) -> torch.Tensor:
    try:
        return load_tokens(path)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise UsageError(f"--data: {e}") from None


def _vocab_size(model: str, tokens: torch.Tensor) -> int:
    """The preset's vocabulary, grown (to a multiple of 128, like nanoGPT's 50304) when the
    data holds larger ids. Independent of tp, so runs under different layouts share a model."""
    preset = llama.config(model).vocab_size
    needed = -(-(int(tokens.max()) + 1) // 128) * 128
    return max(preset, needed)


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """Where and how often ``dtp train`` saves, and the checkpoint it resumes from."""

    root: Path
    every: int = 0  # 0: never
    keep: int = 3
    async_save: bool = False
    resume_from: Path | None = None


def _train(args: Mapping[str, Any], mesh: DeviceMesh, layout: Layout, *, recompute: str | None,
           on_step: Callable[[int, dict[str, Any]], None] | None = None,
           checkpoints: Checkpointing | None = None) -> list[dict[str, Any]]:
    """The training loop every rank runs (and the 1-process reference); returns the
    metrics of the steps it ran (after the resumed one, when resuming)."""
    torch.manual_seed(args["seed"])
    tokens = _load_data(args["data"])
    loader = TokenLoader(tokens, batch_size=args["batch"], seq_len=args["seq"], seed=args["seed"])
    cfg = llama.config(args["model"], vocab_size=args["vocab_size"], **model_overrides(args))
    params = llama.init(cfg, seed=args["seed"], dtype=_torch_dtype(args["dtype"]))
    opt = optim.adamw(optim.warmup_cosine(args["lr"], args["warmup"], args["steps"]), weight_decay=0.1)
    # axis_sizes: the layout's rules (heads per tp × Ulysses degree, kv heads per head
    # chunk, vocab per tp …) are checked here, on every rank, before any collective.
    state = TrainState.create(params, opt, mesh=mesh, layout=layout, axes=llama.param_axes(cfg),
                              axis_sizes=llama.axis_sizes(cfg))
    loss_fn = llama.sequential(cfg)  # the model as layers: a pipeline cuts it into stages; else llama.loss
    clip = args["clip"] if args["clip"] > 0 else None
    skips = SkipCounter(args.get("max_skipped", 0))  # run directories from before the flag: never abort
    first = 1
    if checkpoints is not None and checkpoints.resume_from is not None:
        # The same state and data position whatever the flags it was saved under:
        # checkpoint.load reshards, the loader refuses another seed/batch/seq/corpus.
        state, extra = checkpoint.load(checkpoints.resume_from, like=state)
        loader.load_state_dict((extra or {}).get("loader", {}))
        first = loader.state_dict()["step"] + 1  # iterations, skipped steps included (state.step counts updates)
    records, saving = [], None
    for step in range(first, args["steps"] + 1):
        batch = shard_batch(loader.next_batch(), state)
        state, m = train_step(loss_fn, state, batch, microbatches=args["microbatches"],
                              recompute=recompute, clip_norm=clip)
        step_time = float(m["step_time"])
        skips.add(bool(m["skipped"]))
        record = {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                  "lr": float(m["lr"]), "tokens": int(m["tokens"]), "step_time": step_time,
                  "tokens_per_s": int(m["tokens"]) / step_time if step_time > 0 else None,
                  "comm_bytes": {a: {k: int(b) for k, b in kinds.items()}
                                 for a, kinds in (m.get("comm_bytes") or {}).items()},
                  "skipped": bool(m["skipped"]), "skipped_steps": skips.total, **_moe_metrics(m.get("aux"))}
        records.append(record)
        if on_step is not None:
            on_step(step, record)
        skips.check(step)  # after the record is written: metrics.jsonl shows the steps that led here
        if checkpoints is not None and checkpoints.every and (step % checkpoints.every == 0 or step == args["steps"]):
            if isinstance(saving, checkpoint.AsyncSave):
                saving.wait()  # one save in flight at a time
            saving = checkpoint.save(state, checkpoints.root, keep=checkpoints.keep, async_save=checkpoints.async_save,
                                     extra={"loader": loader.state_dict(), "model": dataclasses.asdict(cfg)})
    if isinstance(saving, checkpoint.AsyncSave):
        saving.wait()
    wait(state)  # the last step's prefetched parameter gathers (overlap_param_gather)
    return records


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
                f"training aborted at step {step}: {self.in_a_row} steps in a row skipped (non-finite loss or "
                f"gradient norm; parameters unchanged since step {step - self.in_a_row}) — --max-skipped "
                f"{self.max_skipped} (0: never abort)")


@contextlib.contextmanager
def _single_process_world() -> Iterator[DeviceMesh]:
    """A 1-rank mesh in this process; the process group it creates is torn down after,
    so ``main()`` called from Python leaves no global state behind."""
    created = not dist.is_initialized()
    try:
        yield make_mesh(dp=1)
    finally:
        if created and dist.is_initialized():
            clear_mesh_cache()
            dist.destroy_process_group()


def _run_config(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if k not in ("command", "check", "nproc")}
    cfg.update(vocab_size=_vocab_size(args.model, _load_data(args.data)), world_size=world_size,
               mesh=mesh_axes(args))
    return cfg


@contextlib.contextmanager
def _world(args: argparse.Namespace) -> Iterator[DeviceMesh]:
    """The run's mesh: from torchrun's environment in a rank, else a world of one here."""
    if not in_torchrun():
        with _single_process_world() as mesh:
            yield mesh
        return
    created = not dist.is_initialized()
    try:
        yield make_mesh(**mesh_axes(args), timeout=args.timeout)
        _quiesce()
    finally:
        # A clean shutdown: torch warns about process groups left to the interpreter exit.
        if created and dist.is_initialized():
            clear_mesh_cache()  # a live DeviceMesh keeps the group and its gloo threads alive (measured)
            dist.destroy_process_group()


def _quiesce() -> None:
    """Before the process group goes: nothing in flight here, nor on any peer.

    Measured on torch 2.13 (gloo; a core dump of an aborted rank): the group outlived
    ``destroy_process_group`` (a live DeviceMesh holds it) into interpreter shutdown, an
    all-gather of the last step completed then on a gloo thread, and its Python completion
    callback (dtp.comm's timing) could not take the GIL: ``pthread_exit`` through C++ →
    ``terminate called without an active exception``. So wait for every handle this rank
    posted (``_train`` already waited for its state's), then a barrier, so no rank closes
    its connections while a peer is still in a collective with it (the issue's
    ``gloo::IoException ... Connection reset by peer``). Only on success: after an error
    the peers may never reach the barrier (the launcher stops them instead).
    """
    comm.drain()
    dist.barrier()


def _train_rank(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Train as one rank of the current world (torchrun's, or a world of one)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(args.out)
    run_cfg = _run_config(args, world)
    layout = build_layout(args)
    progress = _Progress(args.steps, args.log_every, stream) if rank == 0 else None
    checkpoints = _checkpointing(args, out)
    # Resuming: the steps up to the checkpoint stay in metrics.jsonl (the ones after it
    # are run again), so the file, the summary and the loss plot cover the whole run.
    earlier = _records_until(out, checkpoints.resume_from)
    lines: list[str] = [json.dumps(r) for r in earlier]

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "config.json", {**run_cfg, "layout": layout.name,
                                          "command": shlex.join([PROG, *train_argv(args)])})
        mesh = " × ".join(f"{k}={v}" for k, v in run_cfg["mesh"].items())
        print(f"{PROG} train: {args.model} on mesh {mesh} ({world} rank{'s' * (world > 1)}), "
              f"layout {layout.name}, {args.dtype}, writing {out}", file=stream, flush=True)
        if checkpoints.resume_from is not None:
            print(f"{PROG} train: resuming from step {len(earlier)} ({checkpoints.resume_from})",
                  file=stream, flush=True)

    def on_step(step: int, record: dict[str, Any]) -> None:
        if rank != 0:
            return
        lines.append(json.dumps(record))
        # The whole file each step (tmp + rename), so it is always complete; at ~250 bytes a
        # step that is a few ms even after thousands of steps, small next to a step.
        _atomic_write_text(out / "metrics.jsonl", "\n".join(lines) + "\n")
        progress.update(step, record)

    with _world(args) as mesh:
        records = earlier + _train(run_cfg, mesh, layout, recompute=_recompute(args), on_step=on_step,
                                   checkpoints=checkpoints)
        del mesh  # the last reference: destroy_process_group then really ends the group

    if rank == 0:
        summary = summarize(records)
        _write_json(out / "summary.json", summary)
        _plot(out, {"loss": [r["loss"] for r in records]}, run_cfg)
        print(_format_summary(summary), file=stream, flush=True)
    return 0


def _recompute(args: argparse.Namespace) -> str | None:
    return None if args.recompute == "none" else args.recompute


def _checkpointing(args: argparse.Namespace, out: Path) -> Checkpointing:
    """The run's checkpoint settings; with ``--resume`` (or when torchrun restarted the
    ranks after a failure) the newest complete checkpoint in ``out``, found the same way
    on every rank (the directory is shared)."""
    root = out / "checkpoints"
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    resume_from = checkpoint.latest(root) if args.resume or restarted else None
    if args.resume and resume_from is None:
        raise UsageError(f"--resume: no checkpoint in {root} (save some with --save-every N)")
    return Checkpointing(root, args.save_every, args.keep, args.async_save, resume_from)


def _records_until(out: Path, resume_from: Path | None) -> list[dict[str, Any]]:
    """The metrics of the steps a resumed checkpoint already holds (none when not resuming)."""
    if resume_from is None:
        return []
    step = int(checkpoint.read_manifest(resume_from)["extra"]["loader"]["step"])  # iterations, skips included
    path = out / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    kept = [r for r in records if r.get("step", 0) <= step]
    if len(kept) != step:
        raise UsageError(f"--resume: {path} holds {len(kept)} of the {step} steps before {resume_from.name}; "
                         f"the run directory is not the one the checkpoint was saved in")
    return kept


def _moe_metrics(aux: Any) -> dict[str, Any]:
    """An MoE model's routing health per step: the cross-entropy alone, the aux and z
    losses, the load imbalance (max / mean tokens per expert, worst block) and the
    dropped fraction (mean over blocks). Nothing for a dense model."""
    if not isinstance(aux, dict) or "tokens_per_expert" not in aux:
        return {}
    load = aux["tokens_per_expert"].to(torch.float64)
    imbalance = float((load.max(-1).values / load.mean(-1).clamp(min=1e-12)).max())
    return {"lm_loss": float(aux["lm_loss"]), "aux_loss": float(aux["aux_loss"]), "z_loss": float(aux["z_loss"]),
            "expert_imbalance": imbalance, "dropped_fraction": float(aux["dropped_fraction"].mean())}
