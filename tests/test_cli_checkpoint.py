"""`dtp train --save-every/--keep/--async-save/--resume` end to end: a run resumed under
other parallel flags continues the uninterrupted run's loss curve exactly (fp64), and
metrics.jsonl, summary.json and loss.png cover the whole run; a resume that cannot work
(another dtype, model, data order; --check against steps trained under other flags) is
refused before any rank starts, and one whose checkpoint fails to load changes nothing."""

import argparse
import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

import cli_pool
from dtp import cli
from dtp.cli import loop, parse_args


_env = cli_pool.process_env


_FLAGS = ("--model", "tiny", "--steps", "6", "--batch", "4", "--seq", "16", "--dtype", "float64", "--log-every", "3")


def _dtp_train(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dtp.cli", "train", *_FLAGS, *flags]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)


def _pooled_train(monkeypatch: pytest.MonkeyPatch, *flags: str) -> cli_pool.Result:
    """:func:`_dtp_train` with the ranks from the test pool (tests/cli_pool.py)."""
    return cli_pool.train(monkeypatch, *_FLAGS, *flags)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_under_other_flags_continues_the_loss_curve_exactly(tmp_path, monkeypatch) -> None:
    whole = tmp_path / "whole"
    # Real ranks here: their async saves must be on disk before each rank's os._exit.
    proc = _dtp_train("--nproc", "2", "--dp", "2", "--zero", "1", "--save-every", "3", "--keep", "2", "--async-save",
                      "--out", str(whole))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]

    # The run as if it had died after its step-3 checkpoint: that checkpoint, and metrics
    # up to step 3 plus a step-4 line written just before it died.
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n")

    proc = _pooled_train(monkeypatch, "--nproc", "2", "--tp", "2", "--sp", "--resume", "--save-every", "3",
                         "--check", "--out", str(cut))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resuming from step 3" in proc.stdout and ": OK" in proc.stdout  # the whole curve vs 1 process
    got, want = _losses(cut), _losses(whole)
    assert len(got) == 6 and [json.loads(line)["step"] for line in (cut / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3, 4, 5, 6]
    assert got == pytest.approx(want, rel=1e-10, abs=0)
    assert json.loads((cut / "summary.json").read_text())["steps"] == 6
    # Which flags trained which steps, as dtp check reads them (the lr and the rest kept).
    segments = json.loads((cut / "config.json").read_text())["segments"]
    assert [s["first"] for s in segments] == [1, 4] and segments[0]["run"] == segments[1]["run"]


def test_check_of_a_run_resumed_under_another_lr_is_one_line(tmp_path, capsys) -> None:
    """A resume may change --lr (without --check); dtp check of the finished run then
    refuses, naming both, instead of a numeric FAILED against a reference that trains
    every step with the last lr."""
    from dtp.cli import main

    run = {"first": 1, "run": {"lr": 0.003, "steps": 4, "warmup_from_step_one": True}, "model": {}}
    later = {**run, "first": 5, "run": {**run["run"], "lr": 0.001, "steps": 8}}
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float64", "steps": 8, "segments": [run, later]}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 5.0}) + "\n" for i in range(1, 9)))
    assert main(["check", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dtp check: error: {tmp_path}: steps 1-4 trained with --steps 4 --lr 0.003, steps 5-8 with "
                   f"--steps 8 --lr 0.001; --check's one-process reference trains all steps with one set of flags, "
                   f"so it cannot check this run"], err


def test_check_of_an_older_run_resumed_under_the_matrices_only_decay_is_one_line(tmp_path, capsys) -> None:
    """A run recorded before --weight-decay decayed every parameter; resumed by this dtp,
    its later steps decay only the matrices: dtp check names the change instead of a
    numeric FAILED against a reference that trains one rule."""
    from dtp.cli import main

    run = {"first": 1, "run": {"lr": 0.003, "steps": 4, "warmup_from_step_one": True}, "model": {}}
    later = {"first": 3, "run": {**run["run"], "weight_decay": 0.1}, "model": {}}
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float64", "steps": 4, "segments": [run, later]}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 5.0}) + "\n" for i in range(1, 5)))
    assert main(["check", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dtp check: error: {tmp_path}: steps 1-2 decayed every parameter (dtp's weight decay before "
                   f"--weight-decay, which exempts norms and biases as Megatron does), later steps only the "
                   f"matrices; --check's one-process reference trains all steps with one rule, so it cannot check "
                   f"this run"], err


def test_a_resume_of_an_older_run_says_its_decay_rule_changes(tmp_path) -> None:
    from dtp.cli.optimizer import decay_changes

    (tmp_path / "config.json").write_text(json.dumps({"lr": 0.003}))
    assert decay_changes(tmp_path, 2) == (
        "dtp train: note: steps 1-2 decayed every parameter (dtp before --weight-decay); from step 3 only the weight "
        "matrices and embeddings are decayed (Megatron's rule), so dtp check cannot check this run")
    (tmp_path / "config.json").write_text(json.dumps({"lr": 0.003, "weight_decay": 0.1}))
    assert decay_changes(tmp_path, 2) is None


@pytest.mark.parametrize("dropped", [("weight_decay",), ("warmup_from_step_one",),
                                     ("weight_decay", "warmup_from_step_one", "max_skipped")])
def test_check_of_an_older_run_retrains_it_under_its_rules(tmp_path, capsys, dropped) -> None:
    """A config.json an older dtp wrote lacks the fields of the rules that came later (the
    lr schedule from step one, decay on the matrices only, --max-skipped): dtp check
    retrains it under the rules it ran (check.run_of_record), which train other losses than
    today's, so a check under today's would fail."""
    from dtp import RunConfig, layouts
    from dtp.cli.optimizer import OptimizerRules

    config = RunConfig(model="tiny", steps=3, batch=4, seq=16, dtype="float64", out=str(tmp_path))
    older = OptimizerRules(warmup_from_step_one="warmup_from_step_one" not in dropped,
                           decay_matrices_only="weight_decay" not in dropped)
    vocab = loop._vocab_size(config, loop._load_data(config))
    with loop.single_process_world() as mesh:
        then, now = [loop.train_loop(config, mesh, layouts.data(), vocab_size=vocab, recompute=None, rules=rules)
                     for rules in (older, OptimizerRules())]
    assert [r["loss"] for r in then] != [r["loss"] for r in now]  # the rules differ where the record is silent
    record = {k: v for k, v in loop.run_record(config, vocab_size=vocab, world_size=1).items() if k not in dropped}
    (tmp_path / "config.json").write_text(json.dumps(record))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in then))
    assert cli.main(["check", str(tmp_path)]) == 0, capsys.readouterr().out
    assert json.loads((tmp_path / "check.json").read_text())["max_rel_diff"] <= 1e-9


def test_resume_without_a_checkpoint_is_one_line(tmp_path) -> None:
    proc = _dtp_train("--resume", "--out", str(tmp_path / "empty"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"dtp train: error: --resume: no checkpoint in {tmp_path / 'empty' / 'checkpoints'} "
        f"(save some with --save-every N)"]


@pytest.mark.parametrize("flags, match", [
    (["--async-save"], "--async-save needs --save-every N"),
    (["--resume"], "--resume continues the run in --out"),
])
def test_checkpoint_flag_combinations(flags, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_args(["train", *flags])


def test_a_negative_save_every_is_refused_by_its_field(capsys) -> None:
    # The bound is the field's (RunConfig's check), and so its flag's type check too.
    from dtp.config import RunConfig

    with pytest.raises(ValueError, match=r"^RunConfig: save_every must be >= 0, got -1$"):
        RunConfig(save_every=-1)
    assert cli.main(["train", "--save-every", "-1"]) == 2
    assert "argument --save-every: expected an integer >= 0, got -1" in capsys.readouterr().err


# A run of 4 one-rank steps with checkpoints at 2 and 4, trained in this process (no ranks
# to start): what the resume tests below continue, each in a copy of it.
_SMALL = ("--model", "tiny", "--batch", "2", "--seq", "16", "--save-every", "2", "--log-every", "4")
_CORPUS = (resources.files("dtp.data") / "assets" / "corpus.txt").read_bytes()  # the bundled corpus: byte tokens


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("small") / "run"
    assert cli.main(["train", *_SMALL, "--steps", "4", "--out", str(out)]) == 0
    return out


def _contents(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_resume_whose_checkpoint_fails_to_load_changes_nothing(small_run, tmp_path, capsys) -> None:
    """The checkpoint is read inside the rank (here: a truncated data file): until it has
    loaded, config.json, metrics.jsonl, summary.json and loss.png stay the earlier run's
    (before, the failed run's config replaced config.json, metrics.jsonl was cut back to
    the checkpoint's step and summary.json said "interrupted" of a run that trained nothing)."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    data = next((run / "checkpoints" / "step_00000002").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    before = _contents(run)
    capsys.readouterr()
    # --warmup 4 as trained (else a note says the default's 5 first: _note_changes)
    assert cli.main(["train", *_SMALL, "--steps", "6", "--warmup", "4", "--resume", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "truncated or replaced" in err, err
    assert _contents(run) == before


def _refuses_before_the_ranks(monkeypatch) -> None:
    def train_rank(*args, **kwargs):
        raise AssertionError("a rank started")

    monkeypatch.setattr(loop, "train_rank", train_rank)


@pytest.mark.parametrize("flags, message", [
    (["--steps", "4", "--dtype", "float64"],
     "was trained with --dtype float32; resume with --dtype float32 (a checkpoint is never cast)"),
    (["--steps", "4", "--model", "small"], "was trained with --model tiny, this run asks for --model small "
     "(embed is (256, 64) there, (256, 256) here); resume with --model tiny (a checkpoint is never reshaped)"),
    (["--steps", "4", "--model", "tiny-moe"], "was trained with --model tiny, this run asks for --model tiny-moe"),
    (["--steps", "4", "--seed", "1"], "was trained with --seed 0, this run asks for --seed 1: its data position "
     "is one of that order of batches; resume with --seed 0"),
    (["--steps", "8", "--check"], "--resume --check: the checkpoint in RUN: steps 1-4 trained with --steps 4 "
     "--warmup 4, this run asks for --steps 8 --warmup 5: --check retrains all steps on one process with this run's "
     "flags, so those would differ by design; resume with --steps 4 --warmup 4, or drop --check"),
    (["--steps", "4", "--lr", "0.01", "--check"], "trained with --lr 0.003, this run asks for --lr 0.01"),
    # the mask changes every loss: the reference would retrain steps 1-4 with it
    (["--steps", "4", "--document-mask", "--check"],
     "trained with no --document-mask, this run asks for --document-mask: --check retrains all steps on one process "
     "with this run's flags, so those would differ by design; resume without --document-mask, or drop --check"),
    (["--steps", "4"], "is at step 4, and --steps 4 leaves nothing to train: resume with --steps above 4"),
    # the training split: a resume's loader refused it on the ranks ("TokenLoader state does not match")
    (["--steps", "4", "--eval-every", "2"], "was trained with no --eval-every, so the whole corpus trained: its data "
     "position is one of that split's batches; resume without --eval-every"),
    (["--steps", "4", "--data", "TOKENS"], "tokens, this run's --data TOKENS has 4000: resume with "
     "the --data it was trained on (the bundled corpus)"),
    # as many tokens, other ids (the bundled corpus backwards): before, it resumed at a
    # position of the corpus's batches in text it never saw
    (["--steps", "4", "--data", "REVERSED"], "trained on the bundled corpus, this run's --data REVERSED holds as many "
     "tokens but other ids (another fingerprint): its data position means nothing there; resume without --data"),
], ids=["dtype", "model", "moe model", "seed", "steps with check", "lr with check", "document mask with check",
        "nothing to train", "eval split", "other data", "other data of the same length"])
def test_a_resume_that_cannot_work_is_refused_before_any_rank(small_run, tmp_path, monkeypatch, capsys,
                                                              flags, message) -> None:
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    tokens = tmp_path / "tokens.npy"
    np = pytest.importorskip("numpy")
    np.save(tokens, np.arange(4000, dtype=np.int64) % 256)
    reversed_text = tmp_path / "reversed.txt"
    reversed_text.write_bytes(_CORPUS[::-1])
    paths = {"TOKENS": str(tokens), "REVERSED": str(reversed_text)}
    before = _contents(run)
    _refuses_before_the_ranks(monkeypatch)
    capsys.readouterr()
    assert cli.main(["train", *_SMALL, "--resume", "--out", str(run), *[paths.get(f, f) for f in flags]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dtp train: error: --resume"), err
    assert message.replace("RUN", str(run)).replace("TOKENS", str(tokens)).replace("REVERSED", str(reversed_text)) \
        in err
    assert _contents(run) == before


def test_a_checkpoint_without_a_fingerprint_resumes_on_data_of_its_length(small_run, tmp_path, monkeypatch,
                                                                          capsys) -> None:
    """A checkpoint from before the loader recorded its tokens' fingerprint: only the count
    is checked, as then (the preflight passes and the rank starts)."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    manifest = run / "checkpoints" / "step_00000004" / "manifest.json"
    record = json.loads(manifest.read_text())
    del record["extra"]["loader"]["fingerprint"]
    manifest.write_text(json.dumps(record))
    (tmp_path / "reversed.txt").write_bytes(_CORPUS[::-1])
    _refuses_before_the_ranks(monkeypatch)
    capsys.readouterr()
    assert cli.main(["train", *_SMALL, "--steps", "6", "--resume", "--data", str(tmp_path / "reversed.txt"),
                     "--out", str(run)]) == 1
    err = capsys.readouterr().err
    assert "rank 0 failed: AssertionError: a rank started" in err, err


@pytest.mark.parametrize("eval_every", [0, 2])
def test_the_fingerprint_is_of_the_ids_the_checkpoint_trained_on(tmp_path, eval_every) -> None:
    """The loader's fingerprint is of its training split: under --eval-every, ids changed in
    the held-out tail resume, ids changed in what trained are refused (the same path: the
    line asks whether the file changed); without it, both are refused."""
    from dtp.data.token_files import open_tokens, training_split
    from dtp.cli.resume import UsageError, _check_split

    np = pytest.importorskip("numpy")
    ids = np.arange(4000, dtype=np.uint16) % 256
    data = tmp_path / "tokens.npy"
    np.save(data, ids)
    train = training_split(open_tokens(data), bool(eval_every))[0]
    loader = {"num_tokens": len(train), "fingerprint": train.fingerprint()}
    args = argparse.Namespace(data=str(data), data_dtype=None, eos_id=None, tokenizer=None, eval_every=eval_every,
                              document_mask=False)
    saved_run = {"data": str(data), "tokenizer": None, "data_dtype": None}
    for where in (len(ids) - 1, 0):  # the last id (held out under --eval-every), the first (trained)
        changed = ids.copy()
        changed[where] += 1
        np.save(data, changed)
        if eval_every and where == len(ids) - 1:
            _check_split(args, saved_run, loader, len(ids), "--resume: RUN")
            continue
        with pytest.raises(UsageError) as e:
            _check_split(args, saved_run, loader, len(ids), "--resume: RUN")
        assert str(e.value) == (f"--resume: RUN trained on other ids than this run's --data {data}"
                                f"{' (its training split)' if eval_every else ''} holds now (as many, but another "
                                f"fingerprint): has it changed since? resume with the data it was trained on")
    _check_split(args, saved_run, {"num_tokens": len(train)}, len(ids), "--resume: RUN")  # no record: unchecked


def test_a_tokenized_resume_that_toggles_the_document_mask_names_the_mask() -> None:
    """With --tokenizer the mask decides the ids (each line ended by the EOS, or the text
    encoded whole), so the token count differs: the line names the mask, not another --data."""
    from dtp.cli import resume

    args = parse_args(["train", "--data", "corpus.txt", "--tokenizer", "tokenizer.json", "--resume", "--out", "run"])
    saved = {"data": args.data, "tokenizer": args.tokenizer, "document_mask": True}  # recorded resolved, as parsed
    with pytest.raises(cli.UsageError, match=r"^--resume: RUN was trained with --document-mask, which with "
                                             r"--tokenizer decides the ids .*; resume with --document-mask$"):
        resume._check_split(args, saved, {"num_tokens": 2160}, 2040, "--resume: RUN")
    moved = {**saved, "data": "/elsewhere/corpus.txt"}  # the text moved since: the mask is still what to change
    with pytest.raises(cli.UsageError, match=r"; resume with --document-mask$"):
        resume._check_split(args, moved, {"num_tokens": 2160}, 2040, "--resume: RUN")


def test_a_tokenized_resume_of_as_many_ids_names_the_eos_or_mask_that_changed_them(tmp_path) -> None:
    """With --tokenizer and --document-mask the EOS that ends each line is part of the ids:
    another --eos-id keeps the count (one EOS a line) but not the ids, and a toggled mask can
    keep the count too (a tokenizer whose newline is one token). The line names that flag;
    before, it asked whether the unchanged file had changed since."""
    pytest.importorskip("tokenizers")
    from test_token_files import TEXT, make_tokenizer

    from dtp.data.token_files import open_tokens
    from dtp.cli.resume import _check_split

    tokenizer = make_tokenizer(tmp_path / "tokenizer.json", ("[UNK]", "[EOS]", "<|endoftext|>"))
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    trained = open_tokens(text, tokenizer=tokenizer, documents=True)  # ended by <|endoftext|>, the usual one
    loader = {"num_tokens": len(trained), "fingerprint": trained.fingerprint()}
    saved = {"data": str(text), "tokenizer": str(tokenizer), "data_dtype": None, "document_mask": True,
             "eos_id": None}
    flags = ["train", "--data", str(text), "--tokenizer", str(tokenizer), "--resume", "--out", "run"]
    with pytest.raises(cli.UsageError, match=r"; resume without --eos-id$"):
        _check_split(parse_args([*flags, "--document-mask", "--eos-id", "1"]), saved, loader, len(trained), "RUN")
    # as many ids unmasked as masked (as the saved count says): the mask is named
    with pytest.raises(cli.UsageError, match=r"; resume with --document-mask$"):
        _check_split(parse_args(flags), saved, loader, len(trained), "RUN")


@pytest.mark.parametrize("change, remedy", [
    (["--tokenizer", "/t/b.json", "--document-mask"], "resume with --tokenizer /t/a.json"),  # a vocabulary as large
    (["--tokenizer", "/t/b.json"], "resume with --tokenizer /t/a.json --document-mask")])
def test_a_resume_of_other_token_count_names_the_tokenizer_that_changed_it(change, remedy) -> None:
    """The same --data through another tokenizer.json of the same vocabulary size: another
    token count. The line names the tokenizer (and a toggled mask with it); before, it said
    to resume with the --data the run already names, or named the mask alone."""
    from dtp.cli import resume

    args = parse_args(["train", "--data", "/t/corpus.txt", *change, "--resume", "--out", "run"])
    saved = {"data": "/t/corpus.txt", "tokenizer": "/t/a.json", "data_dtype": None, "document_mask": True}
    with pytest.raises(cli.UsageError) as e:
        resume._check_split(args, saved, {"num_tokens": 2160}, 2040, "--resume: RUN")
    assert str(e.value).endswith(remedy), str(e.value)


def test_a_resume_that_would_drop_the_router_biases_is_refused(tmp_path, monkeypatch, capsys) -> None:
    """Router biases (aux-loss-free balancing) live in the checkpoint as buffers; a run
    without --router-bias-update has no place for them and would load without them."""
    run = tmp_path / "run"
    moe = ("--model", "tiny-moe", "--batch", "2", "--seq", "16", "--save-every", "2", "--steps", "2")
    assert cli.main(["train", *moe, "--router-bias-update", "0.001", "--out", str(run)]) == 0
    before = _contents(run)
    _refuses_before_the_ranks(monkeypatch)
    capsys.readouterr()
    assert cli.main(["train", *moe, "--resume", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds router biases (trained with --router-bias-update 0.001), which this run " \
        "would drop; resume with --router-bias-update 0.001" in err, err
    assert _contents(run) == before


def test_a_moe_resume_with_other_microbatches_refuses_check(tmp_path, monkeypatch, capsys) -> None:
    """A model with experts takes its load-balancing loss per microbatch, so --check's
    reference cannot retrain steps trained at --microbatches 2 at 4 (measured: 9.5e-6 off in
    fp64, FAILED). A dense model's microbatches may change (the loss is the same sum)."""
    run = tmp_path / "run"
    moe = ("--model", "tiny-moe", "--batch", "4", "--seq", "16", "--save-every", "2", "--steps", "2")
    assert cli.main(["train", *moe, "--microbatches", "2", "--out", str(run)]) == 0
    _refuses_before_the_ranks(monkeypatch)
    capsys.readouterr()
    assert cli.main(["train", *moe, "--microbatches", "4", "--resume", "--check", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained with --microbatches 2, this run asks for --microbatches 4" in err, err
    # Without --check the resume is the user's word, and what it changes is said first.
    monkeypatch.undo()
    assert cli.main(["train", *moe[:-1], "3", "--warmup", "2", "--microbatches", "4", "--resume", "--out",
                     str(run)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"dtp train: note: the checkpoint in {run} trained with --microbatches 2: a model with experts "
                      f"takes its load-balancing loss per microbatch, so --microbatches 4 goes on from there on "
                      f"another curve"), err


def test_a_damaged_newest_checkpoint_names_the_older_one_to_resume_from(tmp_path) -> None:
    """--resume takes the newest checkpoint; under --keep 1 one whose manifest is damaged is
    refused, and the line says which older one is complete (before: only that the newest
    was unreadable). With more kept the flags are checked against the older one, which the
    ranks fall back to (test_cli_faults.py)."""
    from dtp.cli.resume import UsageError, check_resume, resume_checkpoint
    from dtp.models import config as model_config

    root = tmp_path / "checkpoints"
    for step, text in ((2, json.dumps({"format": 1, "tensors": {}, "extra": {}})), (4, "{cut sh")):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "manifest.json").write_text(text)
    args = argparse.Namespace(out=str(tmp_path), keep=1)
    with pytest.raises(UsageError) as e:
        check_resume(args, resume_checkpoint(tmp_path), model_config.config("tiny"))
    assert str(e.value).startswith(f"--resume: checkpoint: {root / 'step_00000004' / 'manifest.json'} is unreadable")
    assert str(e.value).endswith(f"; step_00000002 before it is complete: move step_00000004 out of {root} to resume "
                                 "from step_00000002 (--keep 1 trusts only the newest)"), e.value
    args.keep = 3  # step_00000002 is checked: its (empty) record holds another model
    with pytest.raises(UsageError, match="holds another model"):
        check_resume(args, resume_checkpoint(tmp_path), model_config.config("tiny"))


_PURE_REFUSED = ("trained pure bf16 (--precision pure, an older dtp's default without --zero); this run's default, "
                 "--precision mixed, would start fp32 master weights from the bf16 parameters: resume with "
                 "--precision pure to go on as it did, or --precision mixed to change it")


@pytest.mark.parametrize("saved, zero, refused", [
    (dict(zero=1, precision=None), 0, None),  # an older record: ZeRO's master weights, mixed now as then
    (dict(zero=0, precision=None), 0, _PURE_REFUSED), (dict(zero=0, precision=None), 1, _PURE_REFUSED),
    (dict(zero=0, precision="pure"), 0, _PURE_REFUSED.replace(", an older dtp's default without --zero", "")),
    (dict(zero=1, precision=None), 2, None), (dict(zero=0, precision="mixed"), 1, None)],
    ids=["old zero1 -> none", "old none -> none", "old none -> zero1", "pure -> default", "old zero1 -> zero2",
         "mixed -> zero1"])
def test_a_bf16_resume_keeps_the_precision_it_trained_with(saved, zero, refused) -> None:
    """The default --precision is mixed; a checkpoint that trained pure bf16 (named, or an
    older dtp's default without --zero, whose records say None) resumed under it would
    start fp32 master weights from the bf16 parameters silently: refused, naming both."""

    from dtp.cli.resume import UsageError, _check_precision

    args = argparse.Namespace(precision=None, dtype="bfloat16", zero=zero)
    if refused is None:
        _check_precision(args, {"dtype": "bfloat16", **saved}, "--resume: RUN")
        return
    with pytest.raises(UsageError) as e:
        _check_precision(args, {"dtype": "bfloat16", **saved}, "--resume: RUN")
    assert refused in str(e.value), e.value


def test_check_of_a_run_stopped_early_retrains_the_steps_it_trained(small_run, tmp_path, capsys) -> None:
    """A run stopped after step 3 of 4 (Ctrl-C, a stall): dtp check retrains those 3 under
    the 4-step lr schedule and passes (before: it retrained all 4, then failed on the count)."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    capsys.readouterr()
    assert cli.main(["check", str(run)]) == 0
    out = capsys.readouterr().out
    assert "retraining 3 steps of 4 (the run stopped after step 3)" in out and "check: 3 steps" in out, out


def test_a_resume_removes_the_check_of_the_steps_before_it(small_run, tmp_path, capsys) -> None:
    """A run checked (--check, or dtp check) then resumed without --check: before, its
    check.json stayed, comparing only steps 1-4 of a run of 6 as if it were the run's."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    assert cli.main(["check", str(run)]) == 0 and json.loads((run / "check.json").read_text())["steps"] == 4
    assert cli.main(["train", *_SMALL, "--resume", "--steps", "6", "--out", str(run)]) == 0
    assert not (run / "check.json").exists() and len(_losses(run)) == 6


def test_check_refuses_a_run_whose_steps_ran_under_other_steps(small_run, tmp_path, monkeypatch, capsys) -> None:
    """--steps may change on resume (4 -> 6: steps 5-6 train); --check then cannot retrain
    steps 1-4 and 5-6 with one set of flags, and says so before any rank starts."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    assert cli.main(["train", *_SMALL, "--resume", "--steps", "6", "--out", str(run)]) == 0
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    _refuses_before_the_ranks(monkeypatch)
    capsys.readouterr()
    assert cli.main(["train", *_SMALL, "--resume", "--steps", "6", "--check", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "steps 1-4 trained with --steps 4 --warmup 4, steps 5-6 with --steps 6 " \
        "--warmup 5; --check's one-process reference trains all steps with one set of flags" in err, err


def _rank_pids(out: Path) -> dict[int, int]:
    """pid of each rank process of the run writing ``out`` (by its command line and RANK)."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if str(out).encode() in cmd and b"RANK" in env and b"-m" in cmd:
            pids[int(env[b"RANK"])] = int(proc.name)
    return pids


def test_a_killed_rank_restarts_from_the_last_checkpoint_and_the_curve_is_whole(tmp_path) -> None:
    """2 tp ranks; rank 1 is SIGKILLed after the step-2 checkpoint: torchrun's agent stops
    rank 0 and starts both again, they resume from the newest checkpoint, and the whole
    loss curve equals the 1-process reference (--check, fp64). (Resuming under other
    layouts, dp and ZeRO included: the pooled tests above.)"""
    import signal
    import time

    out = tmp_path / "run"
    # 16 steps: the kill comes at step 3, 13 steps (6 checkpoints) before the end. 30 took
    # 64 s under the suite, measured on torch 2.13 (2 cores under load), ~30 s of it --check
    # retraining the 30 steps on one process.
    cmd = [sys.executable, "-m", "dtp.cli", "train", "--nproc", "2", "--tp", "2", "--model", "tiny",
           "--steps", "16", "--batch", "4", "--seq", "16", "--dtype", "float64", "--save-every", "2",
           "--max-restarts", "1", "--check", "--log-every", "10", "--out", str(out)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if (out / "checkpoints" / "step_00000002" / "manifest.json").exists() and metrics.exists() \
                    and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        victim = _rank_pids(out).get(1)
        assert victim is not None and proc.poll() is None, "the run ended before a rank could be killed"
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    assert "resuming from step" in stdout and ": OK" in stdout, stdout + stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 17))


def test_a_pure_resume_of_a_mixed_checkpoint_says_what_it_drops(capsys) -> None:
    """``--precision pure`` asked of a checkpoint with fp32 master weights is allowed (the
    user's word) but was silent: the masters were dropped and Adam's moments narrowed to
    bf16 (measured: 1.1e-3 relative off the mixed run's loss 4 steps later)."""
    from dtp.cli.resume import _note_changes
    from dtp.models import config as model_config

    args = argparse.Namespace(precision="pure", dtype="bfloat16", zero=0, microbatches=1)
    tiny = model_config.config("tiny")
    _note_changes(args, {"dtype": "bfloat16", "zero": 0, "precision": "mixed"}, tiny, "the checkpoint in RUN")
    assert capsys.readouterr().err == ("dtp train: note: the checkpoint in RUN kept fp32 master weights (--precision "
                                       "mixed); --precision pure drops them and goes on from the bf16 parameters, "
                                       "its optimizer state narrowed to bf16\n")
    _note_changes(args, {"dtype": "bfloat16", "zero": 0, "precision": "pure"}, tiny, "the checkpoint in RUN")
    assert capsys.readouterr().err == ""


def test_a_resume_says_which_flags_it_takes_other_values_of(small_run, tmp_path, capsys) -> None:
    """A resume takes its own flags: one not given again is its default. --lr 0.001 --clip
    0.5 --warmup 2 resumed as --lr 0.003 --clip 1.0 --warmup 5 (the loss 8x off) and
    --save-every 4 as no more checkpoints, with nothing said: now a note names them."""
    from dtp.cli import flags
    from dtp.cli.resume import _note_changes
    from dtp.models import config as model_config

    saved = {"lr": 0.001, "clip": 0.5, "warmup": 2, "save_every": 4, "weight_decay": 0.1, "dtype": "float32"}
    args = cli.parse_args(["train", "--steps", "8", "--out", str(tmp_path / "run")])
    _note_changes(args, saved, model_config.config("tiny"), "the checkpoint in RUN")
    assert capsys.readouterr().err == ("dtp train: note: the checkpoint in RUN trained with --lr 0.001 --warmup 2 "
                                       "--clip 0.5 --save-every 4; this run has --lr 0.003 --warmup 5 --clip 1.0 "
                                       "--save-every 0 (a flag not given is its default): give them again to go on as "
                                       "it did\n")
    args = cli.parse_args(["train", "--steps", "8", "--lr", "0.001", "--clip", "0.5", "--warmup", "2",
                             "--save-every", "4", "--out", str(tmp_path / "run")])
    _note_changes(args, saved, model_config.config("tiny"), "the checkpoint in RUN")
    assert capsys.readouterr().err == ""


def test_a_resume_keeps_the_init_from_its_steps_started_from(small_run, tmp_path, monkeypatch, capsys) -> None:
    """A run fine-tuned from --init-from H, resumed without it (the same shapes), trained on
    but recorded no source, and --check / dtp check retrained from a random init (FAILED
    at 0.21): refused, naming the source."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    manifest = run / "checkpoints" / "step_00000004" / "manifest.json"
    record = json.loads(manifest.read_text())
    record["extra"]["run"]["init_from"] = "hf-dir"
    manifest.write_text(json.dumps(record))
    _refuses_before_the_ranks(monkeypatch)
    capsys.readouterr()
    assert cli.main(["train", *_SMALL, "--steps", "6", "--resume", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err == (f"dtp train: error: --resume: the checkpoint in {run} started from --init-from hf-dir; resume "
                   f"with --init-from hf-dir (--check and dtp check retrain its steps from there)\n"), err


def test_check_refuses_steps_that_dropped_tokens_per_rank(tmp_path, monkeypatch, capsys) -> None:
    """With --capacity-factor each rank drops by its own tokens, so steps trained on a batch
    split over ranks are not one process's: dtp check, and --resume --check on one
    process, gave a numeric FAILED (3.3e-4) for a run that is right; now one line. (The ep2
    run's ranks are pooled, tests/cli_pool.py: what is checked is its record, not its
    processes; the test took 4.8 s with a process tree, 2.5 s pooled, measured on torch 2.13,
    2 cores.)"""
    run = tmp_path / "run"
    moe = ("--model", "tiny-moe", "--batch", "4", "--seq", "16", "--capacity-factor", "1.25", "--save-every", "2")
    trained = cli_pool.train(monkeypatch, *moe, "--ep", "2", "--steps", "2", "--out", str(run))
    assert trained.returncode == 0, trained.stdout + trained.stderr
    capsys.readouterr()
    why = ("steps 1-2 trained with --capacity-factor 1.25 on a batch split 2 ways (--dp × --ep × --cp): each rank "
           "dropped by its own tokens (Megatron's rule), which one process does not, so --check's one-process "
           "reference cannot check this run")
    assert cli.main(["check", str(run)]) == 2
    assert why in capsys.readouterr().err
    _refuses_before_the_ranks(monkeypatch)
    assert cli.main(["train", *moe, "--steps", "4", "--resume", "--check", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err, err
