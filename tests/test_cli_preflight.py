"""``dtp train`` answers a bad run before torch is imported and before any rank starts (the
whole configuration: mesh, model sizes against the layout, pipeline, sequence, corpus,
run directory), in one line; a crash or an interruption is one line too, with the
run's summary and plot still written; help texts state each default once."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dtp import cli, launch
from dtp.cli import loop, optimizer, report

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", launch.ERROR_DIR_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", launch.ERROR_DIR_ENV):
        monkeypatch.delenv(k, raising=False)


# Each case: the flags, and what its one line says. None of them may import torch.
BAD_RUNS = {
    "mesh vs nproc": (["--dp", "3", "--nproc", "4"], "--nproc 4 does not match the mesh dp=3: it needs 3 ranks"),
    "heads vs tp": (["--tp", "3"], "--model tiny on the mesh dp=1 × tp=3: heads=4 is not divisible by tp=3 (--tp "
                                   "splits the heads); choose a model with heads a multiple of 3 (--model, --init-from), "
                                   "or a smaller --tp\n"),
    "heads vs ulysses × tp": (["--cp", "2", "--cp-algo", "ulysses", "--tp", "4", "--nproc", "8"],
                             "heads=4 must be divisible by the Ulysses degree 2 × tp=4 = 8 for ulysses context "
                             "parallel; choose a model with heads a multiple of 8 (--model, --init-from), or a "
                             "smaller --cp or --tp, or --cp-algo ring\n"),
    "heads vs hybrid ulysses × tp": (["--cp", "4", "--cp-algo", "hybrid", "--ulysses-degree", "2", "--tp", "4",
                                     "--nproc", "16"],
                                    "choose a model with heads a multiple of 8 (--model, --init-from), or a smaller "
                                    "--ulysses-degree or --tp, or --cp-algo ring\n"),
    "kv heads vs head chunks": (["--cp", "2", "--cp-head-chunks", "3"], "--cp-head-chunks 3 must divide the 2 kv heads"),
    "seq vs cp": (["--cp", "2", "--seq", "30"], "--seq 30: --cp 2 cuts the sequence into 4 equal chunks (2 per "
                                               "rank: zigzag load balancing of causal attention); use a --seq that "
                                               "is a multiple of 4"),
    "seq vs sp": (["--tp", "2", "--sp", "--seq", "31"],
                  "--seq 31: --sp over --tp splits the sequence 2 ways (tp=2); use a --seq that is a multiple of 2"),
    "batch vs dp": (["--batch", "6", "--dp", "4"], "divisible by --dp × --microbatches"),
    "seq vs the model": (["--seq", "1024"], "--seq 1024: longer than the 512 tokens --model tiny takes"),
    # argparse's own errors: one line too (no usage block before it)
    "memory budget": (["--memory-gb", "0"], "argument --memory-gb: expected a finite number > 0, got '0' (see dtp train --help)"),
    "bucket size": (["--zero", "1", "--dp", "2", "--nproc", "2", "--bucket-mb", "0"], "argument --bucket-mb: expected a finite number > 0"),
    "experts vs ep": (["--model", "tiny-moe", "--num-experts", "3", "--ep", "2"],
                      "--num-experts 3 is not divisible by ep=2 (--ep splits the experts); choose --num-experts a "
                      "multiple of 2, or a smaller --ep\n"),
    # moe_ffn's check (ExpertOptions.check_tokens) failed on the ranks in the first step; under a pipeline its peers hung up
    "multi-data past a microbatch's tokens": (["--model", "tiny-moe", "--ep", "2", "--pipe-experts", "--multi-data", "17",
                                               "--microbatches", "2", "--batch", "4", "--seq", "16"],
                                              "--multi-data 17: --pipe-experts cuts each local expert's rows into 17 "
                                              "pieces, more than the 16 tokens a rank routes in a microbatch (--batch 4 "
                                              "/ --ep 2 / --microbatches 2 = 1 row × --seq 16); use --multi-data <= 16, "
                                              "or a larger --batch or --seq, or fewer --microbatches\n"),
    "multi-data past a pipeline microbatch's tokens": (
        ["--model", "tiny-moe", "--pp", "2", "--ep", "2", "--pipe-experts", "--multi-data", "17", "--microbatches", "2",
         "--batch", "4", "--seq", "16"], "(--batch 4 / --ep 2 / --microbatches 2 = 1 row × --seq 16); use "
                                         "--multi-data <= 16, or a larger --batch or --seq\n"),  # 1f1b runs no fewer than 2
    "multi-data past a dp x ep shard's tokens": (
        ["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--pipe-experts", "--multi-data", "33", "--batch", "8",
         "--seq", "16"], "(--batch 8 / (--dp 2 × --ep 2) = 2 rows × --seq 16); use --multi-data <= 32, "
                         "or a larger --batch or --seq\n"),
    "multi-data past a cp shard's tokens": (["--model", "tiny-moe", "--ep", "2", "--cp", "2", "--pipe-experts",
                                             "--multi-data", "17", "--batch", "4", "--seq", "16"],
                                            "(--batch 4 / --ep 2 = 2 rows × (--seq 16 / --cp 2 = 8)); use "
                                            "--multi-data <= 16"),
    "top-k past the experts": (["--model", "tiny-moe", "--top-k", "5"], "--top-k must be in [1, --num-experts 4], got 5"),
    "group-limited routing half given": (["--model", "tiny-moe", "--n-groups", "2"],
                                         "--n-groups and --topk-group go together (group-limited routing), got "
                                         "--n-groups 2 and --topk-group not given"),
    "expert flags on a dense model": (["--ep", "2", "--top-k", "2"], "--ep 2 --top-k: --model tiny has no experts (a "
                                      "dense model); add --num-experts E, or train --model tiny-moe, or use --dp"),
    "expert flags on experts turned off": (["--model", "tiny-moe", "--num-experts", "0", "--ep", "2"],
                                           "--ep 2: --model tiny-moe has no experts (a dense model); drop "
                                           "--num-experts 0 (it removes the preset's experts), or use --dp"),
    "layers vs stages": (["--pp", "8", "--microbatches", "8"], "--pp 8 --virtual-stages 1: 8 pipeline stages, but "
                                                               "--model tiny cuts into 4 layers"),
    # A V schedule's two chunks a rank are the schedule's, not a --virtual-stages given: said so, with 8 stages.
    "layers vs a V schedule's stages": (["--nproc", "4", "--pp", "4", "--pp-schedule", "zbv", "--model", "small",
                                         "--microbatches", "8"],
                                        "--pp 4 --pp-schedule zbv: 8 pipeline stages, but --model small cuts into 6 "
                                        "layers (the embedding, its 4 blocks, the head) and every stage needs one; "
                                        "use fewer stages\n"),
    "corpus vs batch": (["--batch", "6000"], "the corpus has 383157 tokens, 5986 windows of 64 + 1 tokens, fewer"),
    "held-out split vs batch": (["--batch", "600", "--eval-every", "5"], "the held-out split (its last tenth"),
    "lr past float32 in AdamW's step": (["--lr", "6.47e37", "--warmup", "2"],
                                        "--lr 6.47e+37: AdamW's step size at step 2 (the lr over its bias correction "
                                        "1 - 0.9^2) is 3.41e+38, past float32's largest number (3.4e+38), which torch "
                                        "refuses in a --dtype float32 run; use --lr <= 6.46e+37, or --dtype float64\n"),
    "sp without tp": (["--sp"], "--sp (sequence parallel) splits the sequence over the tp group: it needs --tp > 1"),
    "out not writable": (["--out", "/proc/nonexistent/run"], "--out /proc/nonexistent/run: cannot create or write it"),
    "data missing": (["--data", "/nonexistent/tokens.bin"], "--data /nonexistent/tokens.bin: No such file or directory"),
    # TOKENS's uint16 ids read as uint32: ids in the billions, an embedding of terabytes
    "data read with a wider dtype": (["--data", "TOKENS", "--data-dtype", "uint32"],
                                     "past the 1048576 ids any tokenizer has: is --data-dtype uint32 the dtype"),
    # SIDECAR_TOKENS: ids 0-349 under a sidecar of vocab_size 300 (the model pads to 384, so they fitted)
    "data past its sidecar's vocab_size": (["--data", "SIDECAR_TOKENS"],
                                           "SIDECAR_TOKENS holds token id 349, but its sidecar SIDECAR_TOKENS.json says "
                                           "vocab_size 300 (ids 0 to 299); fix the data (another tokenizer's ids?) or "
                                           "the sidecar's vocab_size\n"),
    "data dtype of text": (["--data-dtype", "uint32"],
                           "--data: the bundled corpus: --data-dtype is for .bin token files, not text"),
    "data dtype and tokenizer": (["--data-dtype", "uint32", "--tokenizer", "t.json"],
                                 "--data-dtype describes a token file and --tokenizer tokenizes text: choose one"),
    "tokenizer not one": (["--tokenizer", "/nonexistent/tokenizer.json"],
                          "--tokenizer /nonexistent/tokenizer.json: not a tokenizer.json"),
    # The pipeline's composition rules (layouts.pipeline's check_composition), before any rank:
    "pp with zero 3": (["--pp", "2", "--dp", "2", "--zero", "3", "--microbatches", "2"],
                       "--pp 2: --zero 3 with a pipeline is not supported: stage 3 frees"),
    "pp with overlapped grad reduce": (["--pp", "2", "--dp", "2", "--zero", "1", "--overlap-grad-reduce",
                                        "--microbatches", "2"], "--overlap-grad-reduce with a pipeline is not supported"),
    "pp with zero and tied embeddings": (["--pp", "2", "--dp", "2", "--zero", "1", "--model", "1b", "--microbatches",
                                          "2", "--ignore-memory-check"],
                                         "--zero with a pipeline and tied embeddings is not supported"),
    "check with capacity on a split batch": (["--model", "tiny-moe", "--ep", "2", "--capacity-factor", "1.5",
                                              "--check"], "each rank drops by its own tokens"),
    # --init-from (HF_DIR: a config.json of 100 token ids, made by the fixture; no weights are read)
    "init-from with model": (["--init-from", "HF_DIR", "--model", "small"],
                             "--model small and --init-from both choose the model"),
    "init-from missing": (["--init-from", "/nonexistent/hf"], "--init-from /nonexistent/hf: No such file"),
    "init-from vocab vs data": (["--init-from", "HF_DIR"], "has 100 token ids; tokenize the data with its tokenizer"),
    "init-from config without a key": (["--init-from", "HF_NO_VOCAB"],
                                       "its config.json has no 'vocab_size', which a Llama config needs"),
    # the weights, read by the ranks, are checked first too (before: every rank failed after
    # starting; dtp plan still plans from config.json alone)
    "init-from without weights": (["--init-from", "HF_DIR", "--data", "HF_IDS", "--batch", "2", "--seq", "16"],
                                  "no *.safetensors file in"),
    "init-from a file": (["--init-from", "HF_CONFIG_FILE", "--data", "HF_IDS", "--batch", "2", "--seq", "16"],
                         "is not a directory (a Hugging Face model directory holds config.json and *.safetensors)"),
    # not JSON: was "Expecting value: line 1 column 1 (char 0)", json's words
    "init-from a token file": (["--init-from", "HF_IDS"],
                               "is not a directory (a Hugging Face model directory holds config.json and *.safetensors)"),
    # packed documents in a token file with no EOS id (TOKENS: a .bin file of 200 ids the fixture makes)
    "document mask without an eos id": (["--document-mask", "--data", "TOKENS"],
                                        "--document-mask needs the id that ends a document: pass --eos-id"),
    "document mask with an eos id the data lacks": (["--document-mask", "--data", "TOKENS", "--eos-id", "65535"],
                                                    "--document-mask: --eos-id 65535 never occurs in the 400 tokens"),
    # --resume against the checkpoint's manifest (RESUMED: a run directory whose step-2
    # checkpoint is a manifest of --model tiny in float32, made by the fixture; no tensors)
    "resume with another dtype": (["--resume", "--out", "RESUMED", "--dtype", "float64"],
                                  "was trained with --dtype float32; resume with --dtype float32 (a checkpoint is "
                                  "never cast)"),
    "resume with another model": (["--resume", "--out", "RESUMED", "--model", "small"],
                                  "was trained with --model tiny, this run asks for --model small"),
    "resume --check with other steps": (["--resume", "--out", "RESUMED", "--steps", "8", "--check"],
                                        "this run asks for --steps 8 --warmup 5: --check retrains all steps"),
    "resume without a checkpoint": (["--resume", "--out", "HF_DIR"], "--resume: no checkpoint in "),
    # HF_TINY: tiny's shapes, another norm_eps (before: resumed, the checkpoint's parameters
    # then trained in another model with nothing said)
    "resume with another model of the same shapes": (["--resume", "--out", "RESUMED", "--init-from", "HF_TINY"],
                                                     "(norm_eps is 1e-05 there, 1e-06 here); resume without "
                                                     "--init-from"),
}
# The cases that are the run's shape and data alone: ``dtp plan`` refuses them with train's line.
PLAN_CASES = ("mesh vs nproc", "lr past float32 in AdamW's step", "data missing", "data read with a wider dtype",
              "data past its sidecar's vocab_size",
              "document mask with an eos id the data lacks", "heads vs tp", "kv heads vs head chunks", "seq vs cp",
              "seq vs sp", "seq vs the model", "experts vs ep", "expert flags on a dense model", "layers vs stages", "sp without tp", "pp with zero 3",
              "multi-data past a microbatch's tokens", "multi-data past a cp shard's tokens",
              "multi-data past a pipeline microbatch's tokens", "multi-data past a dp x ep shard's tokens",
              "pp with overlapped grad reduce", "init-from a token file")
_HF_CONFIG = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4}

_PROBE = """
import contextlib, io, json, sys
from dtp.cli import main
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", *argv])
    results[name] = [code, err.getvalue()]
    if name in json.loads(sys.argv[2]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["plan", *argv])
        results["plan: " + name] = [code, err.getvalue()]
results["torch imported"] = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps(results))
"""


def _fake_checkpoint(path: Path) -> None:
    """A manifest as ``dtp train --model tiny --steps 4 --save-every 2`` writes it at step 2
    (what the preflight reads of a checkpoint), without its tensor files."""
    from dtp.config import RunConfig
    from dtp.models import config as model_config

    cfg = model_config.config("tiny")
    run = {**RunConfig(steps=4, save_every=2).to_dict(), "vocab_size": cfg.vocab_size, "warmup_from_step_one": True}
    tensors = {f"param/{name}": {"shape": list(shape), "dtype": "float32"}
               for name, shape in model_config.param_shapes(cfg).items()}
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({
        "format": 1, "step": 2, "tensors": tensors,
        "extra": {"loader": {"step": 2}, "model": dataclasses.asdict(cfg), "run": run,
                  "segments": [{"first": 1, "run": run, "model": dataclasses.asdict(cfg)}]}}))


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory) -> dict[str, list]:
    """Every case of :data:`BAD_RUNS` through ``dtp.cli.main`` in one fresh interpreter."""
    import numpy as np

    hf_dir = tmp_path_factory.mktemp("hf")
    (hf_dir / "config.json").write_text(json.dumps(_HF_CONFIG))
    (hf_dir / "tokens.bin").write_bytes(bytes(range(200)) * 4)  # 400 uint16 ids, no sidecar
    no_vocab = tmp_path_factory.mktemp("hf_no_vocab")
    (no_vocab / "config.json").write_text(json.dumps({k: v for k, v in _HF_CONFIG.items() if k != "vocab_size"}))
    sidecar = tmp_path_factory.mktemp("sidecar") / "tokens.bin"
    (np.arange(700) % 350).astype(np.uint16).tofile(sidecar)
    sidecar.with_name("tokens.bin.json").write_text('{"vocab_size": 300}')
    resumed = tmp_path_factory.mktemp("resumed")
    _fake_checkpoint(resumed / "checkpoints" / "step_00000002")
    np.save(hf_dir / "ids.npy", np.arange(400) % 100)  # ids the config's 100 hold
    hf_tiny = tmp_path_factory.mktemp("hf_tiny")
    (hf_tiny / "config.json").write_text(json.dumps({**_HF_CONFIG, "vocab_size": 256, "max_position_embeddings": 512,
                                                     "num_key_value_heads": 2, "rms_norm_eps": 1e-6}))
    (hf_tiny / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"{}      ")  # a header, no tensor
    places = {"HF_DIR": str(hf_dir), "TOKENS": str(hf_dir / "tokens.bin"), "HF_NO_VOCAB": str(no_vocab),
              "HF_IDS": str(hf_dir / "ids.npy"), "HF_TINY": str(hf_tiny), "HF_CONFIG_FILE": str(hf_dir / "config.json"),
              "RESUMED": str(resumed), "SIDECAR_TOKENS": str(sidecar)}
    argv = {name: [places.get(f, f) for f in flags] for name, (flags, _) in BAD_RUNS.items()}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv), json.dumps(PLAN_CASES)], env=_env(), capture_output=True,
                          text=True, timeout=120, cwd=Path(SRC).parent)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_a_bad_run_is_one_line_and_exit_2(bad_runs, case) -> None:
    code, err = bad_runs[case]
    assert code == 2, (case, err)
    assert err.count("\n") == 1 and err.startswith("dtp train: error: "), (case, err)
    assert BAD_RUNS[case][1] in _placed(err), (case, err)


def _placed(err: str) -> str:
    """``err`` with the fixture's file of SIDECAR_TOKENS named by its placeholder."""
    return re.sub(r"\S+/sidecar\d*/tokens\.bin", "SIDECAR_TOKENS", err)


@pytest.mark.parametrize("case", PLAN_CASES)
def test_dtp_plan_refuses_a_shape_with_trains_line(bad_runs, case) -> None:
    """``dtp plan`` and ``dtp train`` check a run's shape with one function
    (:func:`dtp.cli.shape.check_shape`): the same line, exit 2, before the plan is made."""
    code, err = bad_runs["plan: " + case]
    assert code == 2, (case, err)
    assert err == bad_runs[case][1].replace("dtp train: error: ", "dtp plan: error: ", 1), (case, err)


def test_dtp_plan_reads_a_config_json_file(tmp_path, capsys) -> None:
    """``dtp plan --init-from`` plans from a config.json file alone (no weights needed);
    only a file that is no JSON is refused (above: "init-from a token file")."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**_HF_CONFIG, "vocab_size": 256}))
    assert cli.main(["plan", "--init-from", str(config)]) == 0
    assert "peak" in capsys.readouterr().out


def test_the_docs_plan_of_a_70b_run_needs_no_corpus_of_its_batch(capsys) -> None:
    """docs/planning.md's ``dtp plan`` of Llama 3 70B at --batch 256 --seq 8192: the bundled corpus holds
    46 such windows, which ``dtp train`` refuses, but a plan predicts a step, not the data (it
    was refused with the corpus's line)."""
    page = (Path(__file__).parents[1] / "docs" / "planning.md").read_text()
    lines = iter(page[page.index("dtp plan --model llama3-70b"):].splitlines())
    command = [next(lines)]
    while command[-1].endswith("\\"):  # the command's continuation lines
        command.append(next(lines))
    argv = " ".join(line.rstrip("\\") for line in command).split()[2:]  # after "dtp plan"
    assert "--batch" in argv and "--memory-gb" in argv, argv
    assert cli.main(["plan", *argv]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.splitlines()[-1].startswith("fits: peak 17.85 GiB of 80.00 GiB")
    i = argv.index("--backend")  # dtp plan's: a run's backend is its machine's
    assert argv[i + 1] == "nccl", argv
    assert cli.main(["train", *argv[:i], *argv[i + 2:], "--nproc", "256"]) == 2  # train still needs the windows
    assert "46 windows of 8192 + 1 tokens, fewer than a batch" in capsys.readouterr().err


def test_the_plan_and_the_memory_check_see_the_vocabulary_the_data_grows(tmp_path, capsys) -> None:
    """Ids up to 59997 grow tiny's 256-token vocabulary to 60032 (7.8M parameters, not 107k):
    ``dtp plan`` predicts that model, and ``dtp train``'s memory check refuses by it."""
    import numpy as np

    data = tmp_path / "big.bin"
    (np.arange(10000) * 7 % 60000).astype(np.uint16).tofile(data)
    flags = ["--data", str(data), "--data-dtype", "uint16"]
    assert cli.main(["plan", *flags]) == 0
    assert capsys.readouterr().out.startswith("tiny (7.8M params)")
    assert cli.main(["train", *flags, "--memory-gb", "0.05", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "dtp train: error: DOES NOT FIT: peak 445.48 MiB" in err, err


def test_a_bad_run_never_imports_torch(bad_runs) -> None:
    """The whole configuration is checked before torch is imported: not one torch module
    was loaded in the interpreter that refused every case of the table."""
    assert bad_runs["torch imported"] == []


def test_python_m_dtp_cli_refuses_without_torch(tmp_path) -> None:
    """The console path itself (``python -m dtp.cli``, what ``dtp`` runs): ``-X importtime``
    lists every module imported; torch is not among them, and stderr is the one line."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dtp.cli", "train", "--tp", "3"],
                          env=_env(), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "dtp.cli" in imported and "torch" not in imported
    rest = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert len(rest) == 1 and "heads=4 is not divisible by tp=3 " in rest[0], rest
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made


# -- the run directory ------------------------------------------------------------


def test_a_non_empty_out_needs_resume_or_overwrite(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert cli.main(["train", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty (an earlier run?): add --resume to continue it, --overwrite" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


def test_overwrite_clears_only_what_dtp_wrote(tmp_path) -> None:
    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000002").mkdir(parents=True)
    for name in ("metrics.jsonl", "summary.json", "notes.txt"):
        (out / name).write_text("x")
    report.clear_run_files(out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_overwrite_refuses_a_config_json_no_run_wrote(tmp_path, capsys) -> None:
    """Before, ``--overwrite`` deleted any config.json in --out (one of the run files it
    clears): a Hugging Face model directory lost its config beside its weights."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "llama"}')
    assert cli.main(["train", "--steps", "1", "--out", str(out), "--overwrite"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dtp train: error: --out {out}: its config.json is not a dtp run's (a model directory?); --overwrite "
        f"would delete it: name another --out"]
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'


def test_overwrite_trains_again_in_the_same_out(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    flags = ["train", "--steps", "2", "--batch", "2", "--seq", "16", "--out", str(out)]
    assert cli.main(flags) == 0
    assert cli.main(flags) == 2  # the first run's files are there
    assert cli.main([*flags, "--overwrite"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


# -- help ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "plan"])
def test_help_states_each_default_once(capsys, command: str) -> None:
    """ArgumentDefaultsHelpFormatter appended ``(default: …)`` to every flag: twice where
    the help said it already, ``(default: True)`` on ``--no-reshard-after-forward``,
    ``(default: False)`` on every switch (``dtp plan`` shares train's flags and formatter)."""
    assert cli.main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    flags = text.split(" --")
    for flag in flags:
        assert flag.count("default") <= 1, flag
    for shown in ("(default: True)", "(default: False)", "(default: None)", "(default 1)"):
        assert shown not in text
    assert "--dp DP data-parallel degree (default: 1)" in text
    assert "--reshard-after-forward, --no-reshard-after-forward with --zero 3 (on unless --no-…)" in text
    assert "--sp, --no-sp Megatron sequence parallel" in text  # every switch of the run turns off too


def test_a_switch_turns_off_what_the_config_file_turned_on(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("tp = 2\nsp = true\ndp = 2\nzero = 3\nreshard_after_forward = false\n")
    on = cli.parse_args(["train", "--config", str(path)]).run_config
    off = cli.parse_args(["train", "--config", str(path), "--no-sp", "--reshard-after-forward"]).run_config
    assert (on.sp, on.reshard_after_forward) == (True, False) and (off.sp, off.reshard_after_forward) == (False, True)


# -- failures at run time ------------------------------------------------------------


def _failing_train_step(monkeypatch, exc: BaseException, at_call: int) -> None:
    real, calls = loop.train_step, []

    def step(*a, **k):
        calls.append(1)
        if len(calls) == at_call:
            raise exc
        return real(*a, **k)

    monkeypatch.setattr(loop, "train_step", step)


def test_a_crash_is_one_line_naming_where_and_the_summary_is_written(tmp_path, monkeypatch, capsys) -> None:
    """An exception at step 3 of a 1-rank run: exit 1, one line on stderr (the rank, the
    exception, the line that raised it), the traceback in <out>/logs/rank0.txt, and
    summary.json / loss.png of the 2 steps done, marked interrupted."""
    out = tmp_path / "run"
    _failing_train_step(monkeypatch, RuntimeError("boom"), at_call=3)
    code = cli.main(["train", "--steps", "5", "--batch", "2", "--seq", "16", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dtp train: rank 0 failed: RuntimeError: boom (")
    assert "test_cli_preflight.py:" in lines[0] and f"traceback in {out / 'logs' / 'rank0.txt'}" in lines[0]
    assert "Traceback (most recent call last)" in (out / "logs" / "rank0.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["interrupted"] == "RuntimeError: boom"
    assert (out / "loss.png").exists()


@pytest.mark.parametrize("exc, code, why", [(KeyboardInterrupt(), 130, "Ctrl-C"),
                                             (loop.Terminated("stopped by signal SIGTERM"), 143, "SIGTERM")],
                         ids=["Ctrl-C", "SIGTERM"])
def test_an_interrupted_run_writes_its_summary_quietly(tmp_path, monkeypatch, capsys, exc, code, why) -> None:
    out = tmp_path / "run"
    _failing_train_step(monkeypatch, exc, at_call=4)
    assert cli.main(["train", "--steps", "9", "--batch", "2", "--seq", "16", "--out", str(out)]) == code
    captured = capsys.readouterr()
    assert captured.err == ""  # no traceback
    assert f"stopped ({why}): 3 steps" in captured.out
    assert json.loads((out / "summary.json").read_text())["interrupted"] == why
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3 and (out / "loss.png").exists()


def test_debug_shows_the_traceback(tmp_path, monkeypatch) -> None:
    _failing_train_step(monkeypatch, RuntimeError("boom"), at_call=1)
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["train", "--steps", "2", "--batch", "2", "--seq", "16", "--debug", "--out", str(tmp_path / "r")])


@pytest.mark.parametrize("command", ["train", "plan"])
def test_document_mask_reads_the_sample_once_and_its_note_names_the_command(tmp_path, monkeypatch, capsys,
                                                                             command) -> None:
    """``--document-mask`` on a corpus larger than the sample whose end id the sample
    misses: the preflight reads the sample once (the largest id and the document ends
    together, nothing opened twice) and its note names the command that checks the run."""
    import numpy as np

    from dtp.data import token_files as _token_files
    from dtp.cli import flags

    monkeypatch.setattr(_token_files, "SAMPLE_TOKENS", 64)
    monkeypatch.setattr(flags, "SAMPLE_TOKENS", 64)
    data = tmp_path / "tokens.bin"
    ids = np.arange(10_000, dtype=np.uint16) % 200
    ids[5000] = 250  # the end of a document: once, between the sample's runs
    ids.tofile(data)
    opened, read = [], []
    real_open, real_read = _token_files.open_tokens, _token_files.Tokens.read
    counted_open = lambda *a, **k: opened.append(a) or real_open(*a, **k)  # noqa: E731
    monkeypatch.setattr(_token_files, "open_tokens", counted_open)
    monkeypatch.setattr(flags, "open_tokens", counted_open, raising=False)  # flags opened it by its own name
    monkeypatch.setattr(_token_files.Tokens, "read", lambda self, a, b: read.append(b - a) or real_read(self, a, b))
    argv = [command, "--document-mask", "--eos-id", "250", "--data", str(data), "--batch", "4", "--seq", "16"]
    flags.check_config(cli.parse_args(argv))
    assert len(opened) == 1 and sum(read) == 64, (opened, read)
    assert capsys.readouterr().err == (f"dtp {command}: note: --document-mask: --eos-id 250 does not occur in a sample "
                                       f"of 64 of the 10000 tokens of --data; check the id\n")


def test_document_mask_through_a_tokenizer_that_names_no_eos_is_one_line(tmp_path, capsys) -> None:
    """``--document-mask`` on text through a tokenizer.json with no tokenizer_config.json
    beside it and none of the usual end-of-text tokens: one line naming --eos-id, exit 2,
    before any rank; with --eos-id the same run passes the preflight."""
    pytest.importorskip("tokenizers")
    from test_token_files import TEXT, make_tokenizer

    from dtp.cli import flags

    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "corpus.txt").write_text(TEXT * 4)
    argv = ["train", "--document-mask", "--data", str(tmp_path / "corpus.txt"), "--tokenizer", str(tokenizer),
            "--batch", "2", "--seq", "16", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        f"dtp train: error: --document-mask: --tokenizer {tokenizer} names no end-of-text token to end each line (no "
        f"eos_token in a tokenizer_config.json beside it, none of </s> <|end_of_text|> <|endoftext|> <eos> "
        f"<\uff5cend\u2581of\u2581sentence\uff5c> in its vocabulary); pass --eos-id\n")
    assert not (tmp_path / "run").exists()
    flags.check_config(cli.parse_args([*argv, "--eos-id", "1"]))  # [EOS]: the run is checked, nothing refused


def test_document_mask_on_text_that_holds_the_eos_is_one_line_before_any_rank(tmp_path, capsys) -> None:
    """A line of the text holding the tokenizer's EOS ("</s>" written in the data) would be
    two documents under the mask: ``dtp train`` refuses it in one line naming the file and
    line, exit 2, before any rank starts or the run directory is made."""
    pytest.importorskip("tokenizers")
    from test_token_files import TEXT, make_tokenizer

    tokenizer = make_tokenizer(tmp_path / "tokenizer.json", ("[UNK]", "</s>"))
    (tmp_path / "corpus.txt").write_text(TEXT * 4 + "the cat</s>the dog\n")
    argv = ["train", "--document-mask", "--data", str(tmp_path / "corpus.txt"), "--tokenizer", str(tokenizer),
            "--batch", "2", "--seq", "16", "--nproc", "2", "--dp", "2", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        f"dtp train: error: --document-mask: {tmp_path / 'corpus.txt'}:37 holds '</s>' (id 1), the EOS that ends each "
        f"line: the mask would cut the line there into two documents; remove it from the data, or pass --eos-id an "
        f"id the text never holds\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_the_lr_refused_is_the_lr_torch_refuses(dtype) -> None:
    """The preflight refuses an ``--lr`` exactly when the rank's AdamW (``dtp.cli.loop``'s
    schedule and options) would fail on a step: its step size past float32's largest number
    (torch's "cannot be converted to type float without overflow"); one just below trains on."""
    import torch

    from dtp import optim
    from dtp.core._rules import TRAIN_ADAMW
    from dtp.cli import flags

    for warmup in (0, 1, 2, 5):
        most = flags.FLOAT32_MAX * (1 - TRAIN_ADAMW["b1"] ** max(warmup, 1))
        for lr in (most * (1 - 1e-6), most * (1 + 1e-6), 10 * most):
            args = cli.parse_args(["train", "--lr", repr(lr), "--warmup", str(warmup), "--steps", "8",
                                     "--dtype", dtype])
            try:
                flags._check_lr(flags.run_config(args))
                refused = False
            except flags.UsageError:
                refused = True
            opt = optim.adamw(optimizer.lr_schedule(lr, warmup, 8), **TRAIN_ADAMW)
            params = {"w": torch.ones(2, dtype=getattr(torch, dtype))}
            state, failed = opt.init(params), False
            try:
                for _ in range(8):
                    params, state = opt.apply({"w": torch.full_like(params["w"], 1e-3)}, state, params)
            except RuntimeError as e:
                assert "without overflow" in str(e)
                failed = True
            assert refused == failed, (dtype, warmup, lr, refused, failed)


def test_an_id_past_the_sampled_vocabulary_names_the_sidecar_and_the_sidecar_fixes_it(tmp_path, monkeypatch,
                                                                                        capsys) -> None:
    """A token file whose sample (64 ids here) misses its large ids: the preflight sizes
    the vocabulary by the sample, and the first batch that holds a larger id is refused in
    one line that names the sidecar to write (on one rank this was the embedding's
    IndexError, a crash), and with that sidecar the run trains."""
    import numpy as np

    from dtp.data import token_files as _token_files

    monkeypatch.setattr(_token_files, "SAMPLE_TOKENS", 64)
    monkeypatch.setattr(loop, "SAMPLE_TOKENS", 64)
    n = 10_000
    ids = np.full(n, 1000, dtype=np.uint16)
    for i in range(_token_files.SAMPLE_CHUNKS):  # the sample: one id per run, all small
        ids[(n - 1) * i // (_token_files.SAMPLE_CHUNKS - 1)] = i
    data = tmp_path / "tokens.bin"
    ids.tofile(data)
    argv = ["train", "--data", str(data), "--steps", "2", "--batch", "2", "--seq", "16"]
    assert cli.main([*argv, "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err == (
        f"dtp train: error: --data {data}: step 1's batch holds token id 1000, past the 256 ids of the model, whose "
        f"vocabulary was sized by the largest id in the preflight's sample of the data (64 ids); state the "
        f'vocabulary in the sidecar {data}.json: {{"vocab_size": N}}, N above the largest id\n')
    (tmp_path / "tokens.bin.json").write_text('{"vocab_size": 1001}')
    loop._open_data.cache_clear()  # a run opens its data once per process; this one is a second run
    assert cli.main([*argv, "--out", str(tmp_path / "b")]) == 0, capsys.readouterr().err


def test_an_id_past_the_sidecars_vocab_size_is_refused_in_the_batch_that_holds_it(tmp_path, monkeypatch,
                                                                                  capsys) -> None:
    """The sidecar says vocab_size 300 and the model pads it to 384: an id in [300, 384)
    the preflight's sample (64 ids here) missed is refused by the first batch that holds it,
    in one line that names the file, the id and the sidecar (it trained silently, a data
    bug such as another tokenizer's ids); with ids below 300 the run trains."""
    import numpy as np

    from dtp.data import token_files as _token_files

    monkeypatch.setattr(_token_files, "SAMPLE_TOKENS", 64)
    n = 10_000
    ids = np.full(n, 350, dtype=np.uint16)
    for i in range(_token_files.SAMPLE_CHUNKS):  # the sample: one id per run, all below 300
        ids[(n - 1) * i // (_token_files.SAMPLE_CHUNKS - 1)] = i
    data = tmp_path / "tokens.bin"
    ids.tofile(data)
    (tmp_path / "tokens.bin.json").write_text('{"vocab_size": 300}')
    argv = ["train", "--data", str(data), "--steps", "2", "--batch", "2", "--seq", "16"]
    assert cli.main([*argv, "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err == (
        f"dtp train: error: --data {data}: step 1's batch holds token id 350, but its sidecar {data}.json says "
        f"vocab_size 300 (ids 0 to 299); fix the data (another tokenizer's ids?) or the sidecar's vocab_size\n")
    (ids % 300).astype(np.uint16).tofile(data)
    loop._open_data.cache_clear()  # a run opens its data once per process; this one is a second run
    assert cli.main([*argv, "--out", str(tmp_path / "b")]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("where, env, said", [
    ("one process, or the launcher", {}, True),
    ("rank 0 of an outside torchrun", {"RANK": "0", "LOCAL_RANK": "0"}, True),
    ("rank 1 of an outside torchrun", {"RANK": "1", "LOCAL_RANK": "1"}, False),
    ("rank 0 the launcher started", {"RANK": "0", "LOCAL_RANK": "0", launch.ERROR_DIR_ENV: "/tmp"}, False),
])
def test_a_note_is_said_once_per_run(monkeypatch, capsys, where, env, said) -> None:
    """A note (--zero without dp, --document-mask's end id missing from the sample) comes
    from the process that speaks for the run: under an outside torchrun every rank parses
    and checks the run, and each printed it; the launcher's ranks parse it again too."""
    from dtp.data.token_files import TokenStats
    from dtp.cli import flags

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if env:
        monkeypatch.setenv("WORLD_SIZE", "2")
    args = cli.parse_args(["train", "--zero", "1", "--tp", "2", "--document-mask", "--eos-id", "0"])
    flags._check_document_ends(args, TokenStats(count=2_000_000, largest=255, end=0, end_seen=False))
    notes = ["dtp train: note: --zero 1 has no effect with --dp 1 (ZeRO shards over dp)\n",
             "dtp train: note: --document-mask: --eos-id 0 does not occur in a sample of 1048576 of the 2000000 "
             "tokens of --data; check the id\n"]
    assert capsys.readouterr().err == ("".join(notes) if said else ""), where


@pytest.mark.parametrize("command", ["plan", "train"])
def test_zero_without_dp_is_noted_by_plan_too_and_once(capsys, command) -> None:
    """``dtp plan --pp 2 --zero 3`` printed ``zero=3`` in its header with nothing said (ZeRO
    shards over dp, here 1); ``dtp train --print-config`` checks the run twice (validate,
    then check_config) and said the note twice."""
    from dtp.cli import flags

    flags.check_config(cli.parse_args([command, "--pp", "2", "--zero", "3"]))
    assert capsys.readouterr().err == f"dtp {command}: note: --zero 3 has no effect with --dp 1 (ZeRO shards over dp)\n"
