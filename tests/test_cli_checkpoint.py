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

import cli_pool
from dtp.cli import parse_args


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


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
    cmd = [sys.executable, "-m", "dtp.cli", "train", "--nproc", "2", "--tp", "2", "--model", "tiny",
           "--steps", "30", "--batch", "4", "--seq", "16", "--dtype", "float64", "--save-every", "2",
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
    assert steps == list(range(1, 31))
