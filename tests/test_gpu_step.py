"""``benchmarks/gpu_step.py`` is run where a GPU is lent, which is seldom: its CPU smoke run
here keeps it from rotting between those sessions (both sides train, the JSON is written)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_step.py"


def test_the_gpu_benchmark_runs_its_cpu_smoke_command(tmp_path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--batch", "2",
           "--seq", "16", "--steps", "2", "--skip", "1", "--compile", "none", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads((tmp_path / "gpu_step.json").read_text())
    assert set(info["runs"]) == {"dtp eager", "torch eager"}
    # The same model from the same init: the first losses agree (different batches, so loosely).
    first = [info["runs"][side]["loss"][0] for side in ("dtp eager", "torch eager")]
    assert all(abs(f - 5.55) < 0.1 for f in first), first  # ln(256) = 5.545: an untrained byte model
    assert all(r["tokens_per_s"] > 0 and r["mfu_matmul"] > 0 for r in info["runs"].values())
    assert "dtp / torch step time (eager)" in proc.stdout
