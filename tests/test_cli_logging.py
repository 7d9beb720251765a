"""What ``dtp train`` logs: metrics.jsonl grows by a line per step (never rewritten),
the warm-up trains from step 1, the held-out loss (``--eval-every``) is a forward-only
mean that does not depend on the layout, TensorBoard events (``--tensorboard``) carry
the same scalars, and the console shows the parameter count, tokens/s and an ETA."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import cli_pool
from dtp import cli, launch
from dtp.cli import loop, report

SMALL = ["--batch", "4", "--seq", "16", "--dtype", "float64"]


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", launch.ERROR_DIR_ENV):
        monkeypatch.delenv(k, raising=False)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_metrics_are_appended_a_line_per_step(tmp_path, monkeypatch, capsys) -> None:
    """No whole-file rewrite per step (quadratic in the steps): the atomic writer never
    touches metrics.jsonl in a fresh run, and each step adds exactly one line."""
    written, sizes = [], []
    real_write, real_update = loop.atomic_write_text, report.Progress.update
    monkeypatch.setattr(loop, "atomic_write_text", lambda path, text: (written.append(path.name),
                                                                       real_write(path, text)))

    def update(self, step, metrics):  # the file as the progress line is drawn, after each step
        sizes.append(len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()))
        real_update(self, step, metrics)

    monkeypatch.setattr(report.Progress, "update", update)
    assert cli.main(["train", "--steps", "4", *SMALL, "--out", str(tmp_path / "run")]) == 0
    assert "metrics.jsonl" not in written
    assert sizes == [1, 2, 3, 4]
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2, 3, 4]


def test_warmup_trains_from_step_one(tmp_path, capsys) -> None:
    """Step 1 runs at lr/warmup (it ran at lr 0 before: an update that moved nothing), the
    warm-up's last step at the peak, and the last step above 0."""
    out = tmp_path / "run"
    assert cli.main(["train", "--steps", "6", "--warmup", "4", "--lr", "1e-3", *SMALL, "--out", str(out)]) == 0
    lrs = [r["lr"] for r in _records(out)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert 0 < lrs[-1] < lrs[-2] < 1e-3


def test_header_and_progress_line(tmp_path, capsys) -> None:
    assert cli.main(["train", "--steps", "3", *SMALL, "--out", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("dtp train: tiny (106.8k parameters) on mesh dp=1 (1 rank)")
    assert lines[1].startswith("dtp train: plan: peak ") and " per rank " in lines[1]  # dtp.plan's prediction
    assert " tok/s " in lines[2] and " eta " in lines[2] and lines[2].startswith("step 1/3")
    assert " eta " not in lines[4]  # the last step: nothing left


def test_a_launched_ranks_header_plans_the_model_it_trains(tmp_path, monkeypatch, capsys) -> None:
    """The header's plan line plans the model the ranks train, its vocabulary grown to the
    data's ids (1000 here, the preset's 256): before, a launched rank (which runs no
    preflight) planned the preset's, a quarter of the embedding, beside the model line's
    parameter count; one rank (the launcher's process) planned the grown one."""
    import numpy as np

    data = tmp_path / "tokens.bin"
    (np.arange(4000) % 1000).astype(np.uint16).tofile(data)
    flags = ["--steps", "1", *SMALL, "--data", str(data)]
    assert cli.main(["train", *flags, "--out", str(tmp_path / "one")]) == 0
    one = capsys.readouterr().out
    proc = cli_pool.train(monkeypatch, *flags, "--dp", "2", "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def planned(out: str) -> str:  # the plan's parameter bytes per rank (dp replicates them all)
        return next(line for line in out.splitlines() if "plan: peak" in line).split("(parameters ")[1].split(",")[0]

    assert planned(proc.stdout) == planned(one) == "1.6MB"  # 205.1k parameters in fp64


def test_eval_loss_is_forward_only_and_layout_independent(tmp_path, monkeypatch) -> None:
    """--eval-every 2 over 3 steps evaluates at steps 2 and 3 (the last), on the corpus's
    held-out tenth; 2 ranks under ZeRO-3 (parameters gathered for it) give the 1-process
    run's held-out losses to fp64 precision, and evaluating does not change training."""
    one, two, plain = tmp_path / "one", tmp_path / "two", tmp_path / "plain"
    flags = ["train", "--steps", "3", *SMALL]
    assert cli.main([*flags, "--eval-every", "2", "--out", str(one)]) == 0
    assert cli.main([*flags, "--out", str(plain)]) == 0
    proc = cli_pool.train(monkeypatch, *flags[1:], "--eval-every", "2", "--dp", "2", "--zero", "3", "--out", str(two))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = _records(one), _records(two)
    assert [r.get("eval_loss") is not None for r in a] == [False, True, True]
    assert [r["eval_loss"] for r in a[1:]] == pytest.approx([r["eval_loss"] for r in b[1:]], rel=1e-10, abs=0)
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-10, abs=0)
    # Held out: the training batches come from the first nine tenths, so the curve differs
    # from a run without the split; and the summary reports the last held-out loss.
    assert a[0]["loss"] != _records(plain)[0]["loss"]
    assert json.loads((one / "summary.json").read_text())["eval_loss"] == a[-1]["eval_loss"]
    assert "eval" in proc.stdout.splitlines()[-2]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_events_hold_the_scalars(tmp_path, capsys) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert cli.main(["train", "--steps", "2", "--eval-every", "1", "--tensorboard", *SMALL, "--out", str(out)]) == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/train", "loss/eval", "optim/lr", "optim/grad_norm", "perf/tokens_per_s", "perf/mfu"} <= tags
    assert [e.step for e in events.Scalars("loss/train")] == [1, 2]
    assert events.Scalars("loss/train")[0].value == pytest.approx(_records(out)[0]["loss"])


def test_tensorboard_missing_is_one_line(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match="^--tensorboard needs the tensorboard package: pip install tensorboard$"):
        cli.parse_args(["train", "--tensorboard"])


def test_a_half_written_last_line_is_skipped(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert report.read_metrics(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(json.JSONDecodeError):
        report.read_metrics(path)
