"""Every ``dtp train`` combination trains and equals one device: a table of ``--check`` runs.

Each row is ``dtp train <flags> --check`` on a tiny model for a few steps, in float64 with
float64's tolerance unless the dtype is the point of the row; ``--check`` retrains the same
steps on one process and compares every step's loss. fp64 rows must also stay within the
design's bar (1e-10 relative: DESIGN.md §4), tighter than ``--check``'s 1e-9.

Two ways to run the table, the same rows:
- the **default run** takes :data:`SAMPLE` through the launcher's whole path (parsing,
  preflight, the plan's memory check, the rank's loop, the reference), with the ranks taken
  from :mod:`dtp.testing`'s pool instead of new processes (seconds saved per row);
- ``python -m pytest -m slow tests/test_cli_combinations.py`` runs **every row as a real
  ``dtp train`` process tree** (torchrun's agent, fresh ranks, exit codes): a run that
  trains and then crashes at exit fails there.

:func:`test_every_flag_has_a_row` keeps the table honest: a new ``dtp train`` flag fails it
until a row uses it (or :data:`NOT_ROWS` says why no row can).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import cli_pool
from dtp import cli, launch

BASE = ["--model", "tiny", "--steps", "3", "--batch", "8", "--seq", "32", "--dtype", "float64", "--log-every", "1",
        "--timeout", "30"]
FP64_BAR = 1e-10  # DESIGN.md §4: fp64 to ~1e-10 relative

MOE = ["--model", "tiny-moe"]

# id -> flags (after BASE; a later flag overrides BASE's). Ranks: the mesh's product.
ROWS: dict[str, list[str]] = {
    # ---- one process, and data parallel with every ZeRO stage and overlap
    "1 rank, clipped, warm-up, lr, seed": ["--clip", "0.5", "--warmup", "1", "--lr", "0.01", "--seed", "3"],
    "dp2": ["--dp", "2"],
    "dp4 m2": ["--dp", "4", "--microbatches", "2"],
    "dp2 zero1": ["--dp", "2", "--zero", "1"],
    "dp2 zero1 overlap-param-gather": ["--dp", "2", "--zero", "1", "--overlap-param-gather"],
    "dp2 zero2 overlap-grad-reduce m2": ["--dp", "2", "--zero", "2", "--overlap-grad-reduce", "--microbatches", "2"],
    # weight decay on the matrices only: ZeRO's bucket slices mix them with norms
    "dp4 zero3 both overlaps weight-decay 0.3": ["--dp", "4", "--zero", "3", "--overlap-grad-reduce",
                                                 "--overlap-param-gather", "--weight-decay", "0.3"],
    "dp2 zero3 no-reshard prefetch small buckets": ["--dp", "2", "--zero", "3", "--no-reshard-after-forward",
                                                    "--zero-prefetch", "2", "--bucket-mb", "0.05"],
    "dp8 zero1": ["--dp", "8", "--zero", "1"],
    # ---- tensor and sequence parallel
    "tp2": ["--tp", "2"],
    "tp2 sp recompute full": ["--tp", "2", "--sp", "--recompute", "full"],
    "tp2 sp async-tp": ["--tp", "2", "--sp", "--async-tp"],
    # tp4: async tp's rings bidirectional (small: tiny's 2 kv heads do not split over 4)
    "small tp4 sp async-tp": ["--model", "small", "--tp", "4", "--sp", "--async-tp"],
    "dp2 tp2 sp async-tp zero3 recompute full m2": ["--dp", "2", "--tp", "2", "--sp", "--async-tp", "--zero", "3",
                                                     "--recompute", "full", "--microbatches", "2"],
    # compiled regions (dtp.compiled): local_map bodies between dtp's collectives, blocks at rest
    "tp2 sp compile aot_eager recompute full": ["--tp", "2", "--sp", "--compile", "aot_eager", "--recompute", "full"],
    # local batch mode compiled: whole blocks on plain tensors, ZeRO-3's parameters read before each region
    "dp2 zero3 compile aot_eager m2": ["--dp", "2", "--zero", "3", "--compile", "aot_eager", "--microbatches", "2"],
    "dp2 tp2 sp zero2 recompute selective": ["--dp", "2", "--tp", "2", "--sp", "--zero", "2",
                                             "--recompute", "selective"],
    "dp4 tp2 sp zero1 m2": ["--dp", "4", "--tp", "2", "--sp", "--zero", "1", "--microbatches", "2"],
    # ---- context parallel: every algorithm
    "cp2 (default ring)": ["--cp", "2"],
    "cp2 ulysses": ["--cp", "2", "--cp-algo", "ulysses"],
    "cp4 ring": ["--cp", "4", "--cp-algo", "ring"],
    "cp4 double_ring window 2": ["--cp", "4", "--cp-algo", "double_ring", "--cp-window", "2"],
    "cp4 hybrid ulysses 2": ["--cp", "4", "--cp-algo", "hybrid", "--ulysses-degree", "2"],
    "cp2 tp2 sp async-tp ring recompute full": ["--cp", "2", "--tp", "2", "--sp", "--async-tp", "--recompute", "full"],
    # packed documents (lines of the bundled corpus; a uint32 directory's EOS id 1)
    "cp2 ring document-mask": ["--cp", "2", "--cp-algo", "ring", "--document-mask"],
    "dp2 cp2 ulysses document-mask uint32 directory": ["--dp", "2", "--cp", "2", "--cp-algo", "ulysses",
                                                        "--document-mask", "--data", "{uint32_dir}",
                                                        "--data-dtype", "uint32", "--eos-id", "1"],
    "cp4 hybrid ulysses 2 document-mask": ["--cp", "4", "--cp-algo", "hybrid", "--ulysses-degree", "2",
                                           "--document-mask"],
    "pp2 1f1b document-mask, eval": ["--pp", "2", "--microbatches", "2", "--document-mask", "--eval-every", "2"],
    "moe cp2 ring document-mask": [*MOE, "--cp", "2", "--document-mask"],
    "dp2 cp2 tp2 sp head-chunks 1": ["--dp", "2", "--cp", "2", "--tp", "2", "--sp", "--cp-head-chunks", "1"],
    "dp2 cp4 double_ring zero1": ["--dp", "2", "--cp", "4", "--cp-algo", "double_ring", "--cp-window", "2",
                                  "--zero", "1"],
    "cp4 tp2 hybrid ulysses 2": ["--cp", "4", "--tp", "2", "--cp-algo", "hybrid", "--ulysses-degree", "2"],
    # ---- pipelines: every schedule alone, and with dp / tp / cp
    "pp2 1f1b": ["--pp", "2"],  # --pp alone: --microbatches defaults to 2 (every other pp row gives it)
    "pp4 gpipe": ["--pp", "4", "--pp-schedule", "gpipe", "--microbatches", "4"],
    "pp2 interleaved v2": ["--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2",
                           "--microbatches", "2"],
    "pp2 zb-h1": ["--pp", "2", "--pp-schedule", "zb-h1", "--microbatches", "2"],
    "pp2 dp2 zero1 gpipe": ["--pp", "2", "--dp", "2", "--zero", "1", "--pp-schedule", "gpipe", "--microbatches", "2"],
    "pp2 tp2 sp interleaved": ["--pp", "2", "--tp", "2", "--sp", "--pp-schedule", "interleaved",
                               "--virtual-stages", "2", "--microbatches", "4"],
    "pp2 cp2 1f1b recompute full": ["--pp", "2", "--cp", "2", "--microbatches", "2", "--recompute", "full"],
    "pp2 dp2 tp2 zb-h1": ["--pp", "2", "--dp", "2", "--tp", "2", "--pp-schedule", "zb-h1", "--microbatches", "2"],
    "pp2 tp2 sp async-tp 1f1b": ["--pp", "2", "--tp", "2", "--sp", "--async-tp", "--microbatches", "2"],
    "pp2 dp2 tp2 sp async-tp zbv": ["--pp", "2", "--dp", "2", "--tp", "2", "--sp", "--async-tp", "--pp-schedule", "zbv",
                                    "--microbatches", "2"],
    "pp2 dualpipev": ["--pp", "2", "--pp-schedule", "dualpipev", "--microbatches", "4"],
    "pp2 dp2 tp2 sp zbv eval": ["--pp", "2", "--dp", "2", "--tp", "2", "--sp", "--pp-schedule", "zbv",
                                "--microbatches", "2", "--eval-every", "2"],
    # ---- mixture of experts: microbatches under every data axis, ep with and without pipe-experts
    "moe m2": [*MOE, "--microbatches", "2"],
    "moe dp2 m2": [*MOE, "--dp", "2", "--microbatches", "2"],
    "moe ep2 m2": [*MOE, "--ep", "2", "--microbatches", "2"],
    "moe ep2 tp2 sp m2": [*MOE, "--ep", "2", "--tp", "2", "--sp", "--microbatches", "2"],
    "moe cp2 m2": [*MOE, "--cp", "2", "--microbatches", "2"],
    "moe dp2 ep2 zero1": [*MOE, "--dp", "2", "--ep", "2", "--zero", "1"],
    "moe ep4 top-1": [*MOE, "--ep", "4", "--top-k", "1"],
    "moe ep2 pipe-experts multi-data 2": [*MOE, "--ep", "2", "--pipe-experts", "--multi-data", "2"],
    # experts split over tp at ep 1 (Megatron's default without ep): nothing dispatched
    "moe tp2 sp expert-tp": [*MOE, "--tp", "2", "--sp", "--expert-tp"],
    "moe dp2 tp2 expert-tp m2": [*MOE, "--dp", "2", "--tp", "2", "--expert-tp", "--microbatches", "2"],
    "moe ep2 tp2 sp pipe-experts multi-stream expert-tp": [*MOE, "--ep", "2", "--tp", "2", "--sp", "--pipe-experts",
                                                           "--multi-stream", "--expert-tp"],
    # async tp: the attention entries keep their matmul rings, an MoE block's entry is filled by
    # the plain ring before the router reads it; --expert-tp's own tp legs stay collectives
    "moe tp2 sp async-tp m2": [*MOE, "--tp", "2", "--sp", "--async-tp", "--microbatches", "2"],
    "moe ep2 tp2 sp async-tp expert-tp pipe-experts": [*MOE, "--ep", "2", "--tp", "2", "--sp", "--async-tp",
                                                       "--expert-tp", "--pipe-experts"],
    "moe ep2 tp2 sp async-tp expert-tp multi-stream recompute full": [
        *MOE, "--ep", "2", "--tp", "2", "--sp", "--async-tp", "--expert-tp", "--pipe-experts", "--multi-stream",
        "--recompute", "full"],
    "moe ep2 tp2 sp async-tp m4 ep-overlap": [*MOE, "--ep", "2", "--tp", "2", "--sp", "--async-tp", "--microbatches",
                                              "4", "--ep-overlap"],
    "moe pp2 tp2 sp async-tp zbv m2": [*MOE, "--pp", "2", "--tp", "2", "--sp", "--async-tp", "--pp-schedule", "zbv",
                                       "--microbatches", "2"],
    # capacity: tokens split over tp (sp) are gathered before routing; a dp/ep/cp split drops
    # by each rank's tokens (Megatron's rule), which --check refuses (test_cli_preflight.py)
    "moe tp2 sp capacity": [*MOE, "--tp", "2", "--sp", "--capacity-factor", "1.5"],
    "moe tp2 top-1 capacity m2": [*MOE, "--tp", "2", "--top-k", "1", "--capacity-factor", "1.5",
                                  "--microbatches", "2"],
    "moe ep2 8 experts m2": [*MOE, "--ep", "2", "--num-experts", "8", "--microbatches", "2"],
    # DeepSeek-V3's router and aux-loss-free balancing (the bias is TrainState.buffers)
    "moe dp2 zero3 bias-update no aux loss": [*MOE, "--dp", "2", "--zero", "3", "--router-bias-update", "1e-2",
                                              "--aux-loss-coeff", "0"],
    "moe ep2 sigmoid groups scaled bias-update m2": [*MOE, "--ep", "2", "--router-score", "sigmoid", "--n-groups", "2",
                                                     "--topk-group", "1", "--routed-scaling-factor", "2.5",
                                                     "--router-bias-update", "1e-3", "--microbatches", "2"],
    "moe ep2 tp2 sp sigmoid bias-update m2": [*MOE, "--ep", "2", "--tp", "2", "--sp", "--router-score", "sigmoid",
                                              "--router-bias-update", "1e-3", "--microbatches", "2"],
    # ---- MoE inside pipeline stages: the carry holds the aux losses, the bias moves on every stage
    "moe pp2 ep2 1f1b m4": [*MOE, "--pp", "2", "--ep", "2", "--microbatches", "4"],
    "moe pp2 ep2 dualpipev sigmoid bias-update m4, eval": [*MOE, "--pp", "2", "--ep", "2", "--pp-schedule",
                                                           "dualpipev", "--router-score", "sigmoid",
                                                           "--router-bias-update", "1e-3", "--microbatches", "4",
                                                           "--eval-every", "2"],
    "moe dp2 pp2 ep2 interleaved bias-update m2": [*MOE, "--dp", "2", "--pp", "2", "--ep", "2", "--pp-schedule",
                                                   "interleaved", "--virtual-stages", "2",
                                                   "--router-bias-update", "1e-3", "--microbatches", "2"],
    # ---- one microbatch's expert all-to-alls under another's compute (microbatches in lanes)
    "moe ep2 m4 ep-overlap": [*MOE, "--ep", "2", "--microbatches", "4", "--ep-overlap"],
    "moe pp2 ep2 1f1b m4 ep-overlap": [*MOE, "--pp", "2", "--ep", "2", "--microbatches", "4", "--ep-overlap"],
    "moe pp2 ep2 dualpipev bias-update m4 ep-overlap": [*MOE, "--pp", "2", "--ep", "2", "--pp-schedule", "dualpipev",
                                                        "--router-bias-update", "1e-3", "--microbatches", "4",
                                                        "--ep-overlap"],
    "moe pp2 ep2 interleaved m4 ep-overlap": [*MOE, "--pp", "2", "--ep", "2", "--pp-schedule", "interleaved",
                                              "--virtual-stages", "2", "--microbatches", "4", "--ep-overlap"],
    "moe dp2 ep2 zero1 m2 ep-overlap": [*MOE, "--dp", "2", "--ep", "2", "--zero", "1", "--microbatches", "2",
                                        "--ep-overlap"],
    # ---- the dtypes, where the dtype is the point (their own tolerances)
    "fp32 dp2 tp2 sp": ["--dp", "2", "--tp", "2", "--sp", "--dtype", "float32"],
    "bf16 dp2 zero1": ["--dp", "2", "--zero", "1", "--dtype", "bfloat16"],
    # bf16 alone is mixed precision (fp32 master weights, as Megatron's --bf16); pure named
    "bf16 mixed dp2 tp2 sp m2": ["--dp", "2", "--tp", "2", "--sp", "--dtype", "bfloat16", "--microbatches", "2"],
    "bf16 pure tp2 m2": ["--tp", "2", "--dtype", "bfloat16", "--precision", "pure", "--microbatches", "2"],
    # ---- fine-tuning a Hugging Face model (made by _hf_dir): 300 token ids padded to 384 over tp
    "init-from HF dir dp2 tp2 sp": ["--init-from", "HF_DIR", "--dp", "2", "--tp", "2", "--sp"],
    # each rank reads only its flat ZeRO pieces / its stages' blocks (TrainState.from_hf)
    "init-from HF dir dp2 tp2 sp zero3, text through a tokenizer.json": [
        "--init-from", "HF_DIR", "--dp", "2", "--tp", "2", "--sp", "--zero", "3", "--data", "{text}",
        "--tokenizer", "{tokenizer}"],
    "init-from HF dir cp2 ring document-mask, uint32 shard directory": [
        "--init-from", "HF_DIR", "--cp", "2", "--cp-algo", "ring", "--document-mask", "--data", "{uint32_dir_300}",
        "--data-dtype", "uint32", "--eos-id", "1"],
    "init-from HF dir pp2 interleaved v2": ["--init-from", "HF_DIR", "--pp", "2", "--pp-schedule", "interleaved",
                                            "--virtual-stages", "2", "--microbatches", "2"],
    # a Qwen2 (q/k/v biases, split over tp as their weights' output features)
    "init-from Qwen2 dir dp2 tp2 sp": ["--init-from", "QWEN2_DIR", "--dp", "2", "--tp", "2", "--sp"],
    # a Qwen3-MoE (q/k norms; MoE in blocks 1 and 3, not renormalised, narrower experts): its
    # experts over ep, everything else over tp
    "init-from Qwen3-MoE dir ep2 tp2 sp": ["--init-from", "QWEN3_MOE_DIR", "--ep", "2", "--tp", "2", "--sp"],
    # ---- the run's other flags: evaluation, checkpoints, skip budget, memory check, timeouts
    "dp2 eval, checkpoints, async save": ["--dp", "2", "--eval-every", "2", "--save-every", "2", "--keep", "1",
                                          "--async-save", "--max-skipped", "2",
                                          "--memory-gb", "64", "--ignore-memory-check", "--max-restarts", "0"],
    # a signal handler and a step-boundary all-reduce that no signal sets: the curve is the
    # one without them (the signal itself: tests/test_cli_faults.py)
    "dp2 tp2 zero1 save on signal": ["--dp", "2", "--tp", "2", "--zero", "1", "--save-every", "2",
                                     "--save-on-signal", "SIGUSR1", "--shutdown-timeout", "60"],
    # ---- data: {name} is a file :func:`_data_files` makes (token files memory-mapped)
    "dp2 uint32 shard directory, eval": ["--dp", "2", "--data", "{uint32_dir}", "--data-dtype", "uint32",
                                         "--eos-id", "1", "--eval-every", "3"],
    "tp2 sp text through a tokenizer.json": ["--tp", "2", "--sp", "--data", "{text}", "--tokenizer", "{tokenizer}"],
    # each line a document, encoded alone and ended by the EOS its tokenizer_config.json names
    "cp2 ring document-mask, text through a tokenizer.json": ["--cp", "2", "--cp-algo", "ring", "--document-mask",
                                                              "--data", "{text}", "--tokenizer", "{tokenizer}"],
}

# The default run's sample: one row of each family, the defects of issue 20 among them.
# (pp4 gpipe, issue 20's other pipeline defect, is in the slow table: pp2 1f1b covers it by default.)
SAMPLE = ["dp4 zero3 both overlaps weight-decay 0.3", "cp2 ring document-mask", "cp4 double_ring window 2", "cp4 hybrid ulysses 2",
          "pp2 1f1b", "moe dp2 m2", "moe ep2 tp2 sp sigmoid bias-update m2",
          "moe pp2 ep2 dualpipev sigmoid bias-update m4, eval", "dp2 uint32 shard directory, eval",
          "init-from HF dir dp2 tp2 sp zero3, text through a tokenizer.json", "tp2 sp async-tp",
          "cp2 ring document-mask, text through a tokenizer.json"]

# Flags no row sets, and why.
NOT_ROWS = {
    "--nproc": "every row's rank count (the mesh's product) is passed as --nproc",
    "--out": "every row writes its own directory", "--check": "every row checks",
    "--overwrite": "rows write fresh directories",
    "--print-schedule": "prints and exits without training (tests/test_cli_pipeline.py)",
    "--tensorboard": "an optional dependency (tests/test_cli_logging.py)",
    "--resume": "needs a run to resume (tests/test_cli_checkpoint.py)",
    "--debug": "shows tracebacks only",
    "--config": "every launched row's ranks read their run from a --config file; tests/test_config.py",
    "--print-config": "prints the run and exits (tests/test_config.py)",
}


@functools.lru_cache(maxsize=1)
def _data_files() -> dict[str, str]:
    """The files the data rows name, made once per session: a directory of three uint32
    shards (ids past the bundled corpus's bytes, below 512) with its sidecar, one of ids below
    300 for the HF rows, and a text
    with a word-level tokenizer.json trained on it here (tests/test_token_files.py) and a
    tokenizer_config.json beside it that names its EOS (the Hugging Face layout)."""
    import numpy as np

    from test_token_files import TEXT, make_tokenizer

    root = Path(tempfile.mkdtemp(prefix="dtp-data-rows-"))
    shards = root / "shards"
    shards.mkdir()
    ids = np.random.default_rng(0).integers(0, 500, 6000).astype("<u4")
    for i, part in enumerate(np.array_split(ids, 3)):
        part.tofile(shards / f"part_{i}.bin")
    (shards / "tokens.json").write_text(json.dumps({"dtype": "uint32", "eos_id": 1}))
    small = root / "shards_300"  # ids the HF rows' 300-token vocabulary holds
    small.mkdir()
    for i, part in enumerate(np.array_split(ids % 300, 2)):
        part.tofile(small / f"part_{i}.bin")
    (small / "tokens.json").write_text(json.dumps({"dtype": "uint32", "eos_id": 1}))
    (root / "corpus.txt").write_text(TEXT * 40)
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]"}))
    return {"uint32_dir": str(shards), "uint32_dir_300": str(small), "text": str(root / "corpus.txt"),
            "tokenizer": str(make_tokenizer(root / "tokenizer.json"))}


@functools.cache
def _hf_dir(kind: str = "llama") -> str:
    """A tiny Hugging Face Llama (or Qwen2, Qwen3-MoE) directory (dtp's own to_hf: no
    transformers needed) whose 300 token ids do not split over tp until padded; Qwen2's
    biases and Qwen3-MoE's q/k norms drawn away from their zero / one init, so that a bias
    added twice or a norm skipped shows."""
    from dtp.models import hf, llama

    kinds = {"llama": ("tiny", {}), "qwen2": ("tiny", {"qkv_bias": True, "rope_theta": 1e6}),
             "qwen3_moe": ("tiny-moe", {"qk_norm": True, "n_layers": 4, "moe_every": 2, "moe_ffn_dim": 64,
                                        "pre_softmax": True})}
    model, fields = kinds[kind]
    cfg = llama.config(model, vocab_size=300, **fields)
    params = llama.init(cfg, seed=1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)
    for layer in params["layers"]:
        layer.update({n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in layer.items()
                      if n.endswith("bias") or n in ("q_norm", "k_norm")})
    path = Path(tempfile.mkdtemp(prefix="dtp-hf-")) / f"tiny-300-{kind}"
    hf.to_hf(cfg, params, path)
    return str(path)


def _needs(name: str) -> None:
    """Skip a row whose optional package is missing (CI installs the test extra, which has them)."""
    if "--init-from" in ROWS[name]:
        pytest.importorskip("safetensors")
    if "--tokenizer" in ROWS[name]:
        pytest.importorskip("tokenizers")


def _flags(name: str) -> list[str]:
    row = ROWS[name]
    if any("{" in f for f in row):
        row = [f.format(**_data_files()) for f in row]
    dirs = {"HF_DIR": "llama", "QWEN2_DIR": "qwen2", "QWEN3_MOE_DIR": "qwen3_moe"}
    return [_hf_dir(dirs[f]) if f in dirs else f for f in [*BASE, *row]]


def _ranks(flags: list[str]) -> int:
    args = cli.parse_args(["train", *flags])
    return args.nproc


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", launch.ERROR_DIR_ENV):
        monkeypatch.delenv(k, raising=False)


def test_every_flag_has_a_row() -> None:
    parser = cli.build_parser()
    train = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("train"))
    # A flag is its action: a switch's --no- form (for overriding a --config file) sets the
    # field its row trains with, so a row using either string covers both.
    used = {f for row in ROWS.values() for f in row if f.startswith("--")} | set(BASE)
    missing = sorted(action.option_strings[0] for action in train._actions
                     if action.option_strings and action.option_strings[0] != "-h"
                     and not (set(action.option_strings) & (used | set(NOT_ROWS))))
    assert not missing, f"dtp train flags no row of the combination table uses: {missing}"
    assert set(SAMPLE) <= set(ROWS)
    assert {_ranks(_flags(n)) for n in ROWS} >= {1, 2, 4, 8}


def _check_result(out: Path, name: str) -> None:
    result = json.loads((out / "check.json").read_text())
    assert result["ok"], f"{name}: {result}"
    if result["dtype"] == "float64":
        assert result["max_rel_diff"] <= FP64_BAR, f"{name}: max rel {result['max_rel_diff']:.2e} > {FP64_BAR}"
    assert result["steps"] == 3


# --------------------------------------------------------------------------- in the pool


@pytest.mark.parametrize("name", SAMPLE)
def test_sample_row_trains_and_matches_one_process(name, tmp_path, monkeypatch) -> None:
    _needs(name)
    out = tmp_path / "run"
    result = cli_pool.train(monkeypatch, *_flags(name), "--check", "--out", str(out))
    assert result.returncode == 0, f"{name}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert ": OK" in result.stdout
    _check_result(out, name)


# --------------------------------------------------------------------------- real processes


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ROWS))
def test_row_trains_and_matches_one_process(name, tmp_path) -> None:
    _needs(name)
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", launch.ERROR_DIR_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "dtp.cli", "train", *_flags(name), "--check", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{output}"
    for bad in ("terminate called", "Traceback", "IoException", "Connection reset", "Error"):
        assert bad not in output, f"{name}: {bad!r} printed\n{output}"
    _check_result(out, name)
