"""Preempted again and again: one ``dtp train`` run stopped by a signal at random steps,
each time resumed, ends with the parameters of the run nobody stopped — bit for bit.

    python benchmarks/preemption_loop.py --preemptions 10 --steps 120

Real process trees (``dtp train --nproc 2``, the launcher and torchrun's agent between the
signal and the ranks), fp64, ``--save-on-signal`` and a periodic ``--save-every`` with
``--async-save`` so a stop also lands while a save is in flight. Each preemption is
``SIGTERM`` (or ``--signal``) to the launcher once ``metrics.jsonl`` reaches a step drawn
at random (seeded) past the last stop; each stop must exit 75 with the step it was in
saved; each resume is ``--resume`` with the same flags. At the end: the loss curve and the
final checkpoint's every parameter against an uninterrupted run of the same flags,
compared exactly (``==``), and the wall time each stop took (signal to exit). Not a test
(``tests/test_cli_faults.py`` holds one stop of each kind).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAGS = ["--nproc", "2", "--dp", "2", "--model", "tiny", "--batch", "4", "--seq", "16", "--dtype", "float64",
         "--log-every", "1000", "--save-on-signal", "--save-every", "7", "--async-save", "--keep", "2"]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _train(out: Path, steps: int, *, resume: bool, stop_at: int | None, sig: int) -> tuple[int, float | None]:
    """One launch; with ``stop_at``, ``sig`` to the launcher once that many steps are written.
    Returns the exit code and the seconds from the signal to the exit."""
    cmd = [sys.executable, "-m", "dtp.cli", "train", *FLAGS, "--steps", str(steps), "--out", str(out),
           *(["--resume"] if resume else [])]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sent = None
    while proc.poll() is None:
        if stop_at is not None and sent is None and _steps(out) >= stop_at:
            proc.send_signal(sig)
            sent = time.perf_counter()
        time.sleep(0.005)
    stderr = proc.stderr.read()
    if proc.returncode not in (0, 75):
        raise SystemExit(f"launch ended with code {proc.returncode}:\n{stderr}")
    return proc.returncode, (time.perf_counter() - sent if sent is not None else None)


def _params(run: Path) -> dict[str, object]:
    from dtp import checkpoint

    reader = checkpoint.ParamReader(checkpoint.latest(run / "checkpoints"))
    return {name: reader.read(name) for name in reader.names()}


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preemptions", type=int, default=10)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--signal", default="SIGTERM", choices=["SIGTERM", "SIGUSR1"])
    args = ap.parse_args()
    if args.signal != "SIGTERM":
        FLAGS[FLAGS.index("--save-on-signal") + 1:FLAGS.index("--save-on-signal") + 1] = [args.signal]
    sig = getattr(signal, args.signal)
    rng = random.Random(args.seed)
    # Each stop a random number of steps past where the last one saved (at least one: a resume trains).
    gap = max(1, (args.steps - 2) // (2 * (args.preemptions + 1)))  # half the room: a stop lands a step or two late
    with tempfile.TemporaryDirectory(prefix="dtp-preempt-") as tmp:
        reference, run = Path(tmp) / "reference", Path(tmp) / "run"
        t0 = time.perf_counter()
        _train(reference, args.steps, resume=False, stop_at=None, sig=sig)
        print(f"uninterrupted: {args.steps} steps in {time.perf_counter() - t0:.1f} s")
        stopped_at, waits, resume = [], [], False
        while len(stopped_at) < args.preemptions:
            target = _steps(run) + rng.randint(1, 2 * gap - 1)
            if target >= args.steps:
                raise SystemExit(f"--steps {args.steps} leaves no room for {args.preemptions} preemptions")
            code, wait = _train(run, args.steps, resume=resume, stop_at=target, sig=sig)
            if code != 75:
                raise SystemExit(f"the stop at step {target} ended with {code}, not 75")
            stopped_at.append(_steps(run))
            waits.append(wait)
            resume = True
        _train(run, args.steps, resume=True, stop_at=None, sig=sig)
        got, want = _params(run), _params(reference)
        same_params = set(got) == set(want) and all(bool((got[k] == want[k]).all()) for k in want)
        same_curve = _losses(run) == _losses(reference)
    print(f"{len(stopped_at)} preemptions by {args.signal}, stopped after steps {stopped_at}")
    print(f"signal to exit 75: median {statistics.median(waits):.2f} s, max {max(waits):.2f} s")
    print(f"final parameters equal the uninterrupted run's: {same_params}; loss curve equal: {same_curve}")
    if not (same_params and same_curve):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
