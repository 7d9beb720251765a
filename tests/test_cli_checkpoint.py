"""`dtp train --save-every/--keep/--async-save/--resume` end to end: a run resumed under
other parallel flags continues the uninterrupted run's loss curve exactly (fp64), and
metrics.jsonl, summary.json and loss.png cover the whole run."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtp.cli import parse_args


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _dtp_train(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dtp.cli", "train", "--model", "tiny", "--steps", "6", "--batch", "4", "--seq", "16",
           "--dtype", "float64", "--log-every", "3", *flags]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_under_other_flags_continues_the_loss_curve_exactly(tmp_path) -> None:
    whole = tmp_path / "whole"
    proc = _dtp_train("--nproc", "2", "--dp", "2", "--zero", "1", "--save-every", "3", "--keep", "2",
                      "--async-save", "--out", str(whole))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]

    # The run as if it had died after its step-3 checkpoint: that checkpoint, and metrics
    # up to step 3 plus a step-4 line written just before it died.
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n")

    proc = _dtp_train("--nproc", "2", "--tp", "2", "--sp", "--resume", "--save-every", "3", "--check",
                      "--out", str(cut))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resuming from step 3" in proc.stdout and ": OK" in proc.stdout  # the whole curve vs 1 process
    got, want = _losses(cut), _losses(whole)
    assert len(got) == 6 and [json.loads(line)["step"] for line in (cut / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3, 4, 5, 6]
    assert got == pytest.approx(want, rel=1e-10, abs=0)
    assert json.loads((cut / "summary.json").read_text())["steps"] == 6


def test_resume_without_a_checkpoint_is_one_line(tmp_path) -> None:
    proc = _dtp_train("--resume", "--out", str(tmp_path / "empty"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"dtp train: error: --resume: no checkpoint in {tmp_path / 'empty' / 'checkpoints'} "
        f"(save some with --save-every N)"]


@pytest.mark.parametrize("flags, match", [
    (["--async-save"], "--async-save needs --save-every N"),
    (["--save-every", "-1"], "--save-every must be >= 0"),
    (["--resume"], "--resume continues the run in --out"),
])
def test_checkpoint_flag_combinations(flags, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_args(["train", *flags])
