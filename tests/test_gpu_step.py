"""``benchmarks/gpu_step.py`` is run where a GPU is lent, which is seldom: its CPU smoke run
here keeps it from rotting between those sessions (both sides train, the JSON is written).
The script's ``main`` runs in the test process, as ``python benchmarks/gpu_step.py …`` would
run it (its dtp side is still the ``dtp train`` process the script starts): one interpreter
start and import of torch fewer than running the script as a command."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_step.py"


def test_the_gpu_benchmark_runs_its_cpu_smoke_command(tmp_path, monkeypatch, capsys) -> None:
    argv = [str(SCRIPT), "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--batch", "2",
            "--seq", "16", "--steps", "2", "--skip", "1", "--compile", "none", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ first: undone after
    before = set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location("benchmarks_gpu_step", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main()
    finally:
        for name in set(sys.modules) - before:  # benchmarks/' modules (tp_vs_torch, _common): gone with its path
            if str(SCRIPT.parent) in str(getattr(sys.modules[name], "__file__", None) or ""):
                del sys.modules[name]
    stdout = capsys.readouterr().out
    info = json.loads((tmp_path / "gpu_step.json").read_text())
    assert set(info["runs"]) == {"dtp eager", "torch eager"}
    # The same model from the same init: the first losses agree (different batches, so loosely).
    first = [info["runs"][side]["loss"][0] for side in ("dtp eager", "torch eager")]
    assert all(abs(f - 5.55) < 0.1 for f in first), first  # ln(256) = 5.545: an untrained byte model
    assert all(r["tokens_per_s"] > 0 and r["mfu_matmul"] > 0 for r in info["runs"].values())
    assert "dtp / torch step time (eager)" in stdout
