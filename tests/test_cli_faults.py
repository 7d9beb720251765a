"""What clusters do to a run, injected into ``dtp train``: a preemption signal
(``--save-on-signal``: every rank finishes its step, they save it and exit 75), a damaged
newest checkpoint (``--resume`` falls back to the one before, renamed aside and said), a
disk that fills during a save (one line on every rank, the checkpoint before it intact,
training goes on unless it was the last save). Each run's loss curve is held against the
uninterrupted run's of the same layout, bit for bit (fp64). Two hosts and a lost host:
``tests/test_two_hosts.py`` (``-m slow``)."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import cli_pool
from dtp import checkpoint

_FLAGS = ("--model", "tiny", "--batch", "4", "--seq", "16", "--dtype", "float64", "--log-every", "1000",
          "--timeout", "60")


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _params(path: Path) -> dict[str, Any]:
    reader = checkpoint.ParamReader(path)
    return {name: reader.read(name) for name in reader.names()}


@functools.lru_cache(maxsize=None)
def _reference(tmp: str, *flags: str) -> tuple[list[float], dict[str, Any]]:
    """The uninterrupted run of ``flags`` (pooled ranks): its curve and last checkpoint's parameters."""
    out = Path(tmp) / f"reference-{abs(hash(flags))}"
    with pytest.MonkeyPatch.context() as mp:
        result = cli_pool.train(mp, *_FLAGS, *flags, "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    return _losses(out), _params(checkpoint.latest(out / "checkpoints"))


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("reference"))


@contextlib.contextmanager
def _when(ready: Any, action: Any, timeout: float = 120) -> Iterator[None]:
    """``action()`` once ``ready()`` holds (polled every 5 ms from a thread), if it does
    while the block runs: never after it (a stray signal would stop whatever runs next)."""
    done = threading.Event()

    def run() -> None:
        deadline = time.monotonic() + timeout
        while not done.is_set() and time.monotonic() < deadline:
            if ready():
                action()
                return
            time.sleep(0.005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# --------------------------------------------------------------------------- preemption


def test_a_signal_saves_the_step_in_flight_and_the_resume_is_bit_identical(tmp_path, reference_dir) -> None:
    """One process: SIGTERM lands mid-run; the step in flight finishes, it is saved, the run
    exits 75 with one line saying so; --resume then trains the rest, and the whole curve
    and the last parameters equal the uninterrupted run's exactly."""
    steps = ("--steps", "100", "--save-every", "100")
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp, _when(lambda: _steps(out) >= 3, lambda: os.kill(os.getpid(),
                                                                                           signal.SIGTERM)):
        stopped = cli_pool.train(mp, *_FLAGS, *steps, "--save-on-signal", "--out", str(out))
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    k = _steps(out)
    assert 3 <= k < 100 and _names(out) == [f"step_{k:08d}"]  # the step it was in, and only it
    assert stopped.stderr == (f"dtp train: stopped by SIGTERM after step {k}: saved step_{k:08d}; continue with "
                              f"--resume\n"), stopped.stderr
    assert json.loads((out / "summary.json").read_text())["interrupted"] == f"SIGTERM, saved step_{k:08d}"
    with pytest.MonkeyPatch.context() as mp:
        resumed = cli_pool.train(mp, *_FLAGS, *steps, "--save-on-signal", "--resume", "--out", str(out))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    losses, params = _reference(reference_dir, *steps)
    assert _losses(out) == losses
    got = _params(checkpoint.latest(out / "checkpoints"))
    assert all(bool((got[k] == params[k]).all()) for k in params)


_env = cli_pool.process_env


@contextlib.contextmanager
def signal_after(out: str, steps: int, rank: int, name: str) -> Iterator[None]:
    """In the ranks: ``rank`` alone sends itself ``name`` once ``out`` shows ``steps`` steps."""
    if int(os.environ.get("RANK", "0")) != rank:
        yield
        return
    with _when(lambda: _steps(Path(out)) >= steps, lambda: os.kill(os.getpid(), getattr(signal, name))):
        yield


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, monkeypatch, reference_dir) -> None:
    """dp 2 (pooled ranks): SIGTERM reaches rank 1 alone; rank 0 never sees it, yet both
    finish the same step, save it and exit 75 (they agree at each step boundary); the
    resume continues the uninterrupted curve exactly."""
    steps = ("--nproc", "2", "--dp", "2", "--steps", "40", "--save-every", "40")
    out = tmp_path / "run"
    stopped = cli_pool.train(monkeypatch, *_FLAGS, *steps, "--save-on-signal", "--out", str(out),
                             in_ranks=functools.partial(signal_after, str(out), 3, 1, "SIGTERM"))
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    k = _steps(out)
    assert 3 <= k < 40 and _names(out) == [f"step_{k:08d}"], (k, _names(out))
    assert f"dtp train: stopped by SIGTERM after step {k}: saved step_{k:08d}" in stopped.stderr, stopped.stderr
    resumed = cli_pool.train(monkeypatch, *_FLAGS, *steps, "--resume", "--out", str(out))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _losses(out) == _reference(reference_dir, *steps)[0]


def test_the_launcher_signalled_twice_passes_it_on_and_the_save_completes(tmp_path, reference_dir) -> None:
    """Real processes, dp 2, SIGUSR1 twice to the launcher (a scheduler's warning, then its
    stop): torchrun's agent handles it (its default action would end the agent and orphan
    the ranks) and passes it on; the second one, during the save, does not cut it short
    (the agent then stops the ranks with SIGTERM, which --save-on-signal also only notes).
    The launcher exits 75 and the checkpoint resumes bit-identically."""
    steps = ("--nproc", "2", "--dp", "2", "--steps", "40", "--save-every", "40")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dtp.cli", "train", *_FLAGS, *steps, "--save-on-signal", "SIGUSR1",
           "--out", str(out)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def twice() -> None:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.02)
        os.kill(proc.pid, signal.SIGUSR1)

    try:
        with _when(lambda: _steps(out) >= 3 or proc.poll() is not None, twice):
            stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, stdout + stderr
    k = _steps(out)
    assert k < 40 and _names(out) == [f"step_{k:08d}"], (k, _names(out))
    assert f"dtp train: stopped by SIGUSR1 after step {k}: saved step_{k:08d}" in stderr, stderr
    with pytest.MonkeyPatch.context() as mp:  # without the flag this time: the note says so
        resumed = cli_pool.train(mp, *_FLAGS, *steps, "--resume", "--out", str(out))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stderr == (f"dtp train: note: the checkpoint in {out} trained with --save-on-signal SIGUSR1; this "
                              f"run has no --save-on-signal (a flag not given is its default): give them again to go "
                              f"on as it did\n"), resumed.stderr
    assert _losses(out) == _reference(reference_dir, *steps)[0]


# --------------------------------------------------------------------------- a damaged newest checkpoint


def test_a_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, monkeypatch, reference_dir) -> None:
    """dp 2, a run stopped after its step-6 save (step 8's removed) with a byte flipped in
    that checkpoint's data file. --resume skips it in one line, renames it step_6.corrupt
    (never deleted), resumes from step 4 and trains steps 5-8 to the uninterrupted curve.
    --keep 1 trusts only the newest: refused, nothing moved."""
    steps = ("--nproc", "2", "--dp", "2", "--steps", "8", "--save-every", "2")
    out = tmp_path / "run"
    assert cli_pool.train(monkeypatch, *_FLAGS, *steps, "--keep", "4", "--out", str(out)).returncode == 0
    shutil.rmtree(out / "checkpoints" / "step_00000008")
    data = sorted((out / "checkpoints" / "step_00000006").glob("*.distcp"))[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    refused = cli_pool.train(monkeypatch, *_FLAGS, *steps, "--keep", "1", "--resume", "--out", str(out))
    assert refused.returncode == 2 and f"file {data.name} is corrupt" in refused.stderr, refused.stderr
    assert _names(out) == ["step_00000002", "step_00000004", "step_00000006"]
    resumed = cli_pool.train(monkeypatch, *_FLAGS, *steps, "--keep", "4", "--resume", "--out", str(out))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stderr.startswith(f"dtp train: --resume: skipped step_00000006, which does not verify (file "
                                     f"{data.name} is corrupt (CRC32 "), resumed.stderr
    assert resumed.stderr.endswith("); renamed step_00000006.corrupt, resuming from the one before\n")
    assert "resuming from step 4 " in resumed.stdout, resumed.stdout
    assert _names(out) == ["step_00000002", "step_00000004", "step_00000006", "step_00000006.corrupt",
                           "step_00000008"]
    assert _losses(out) == _reference(reference_dir, *steps)[0]


# --------------------------------------------------------------------------- a full disk


class _Filling:
    """A file stream on a disk with ``room`` bytes left: the write past it fails as a full
    disk does (ENOSPC), the bytes that fitted written."""

    def __init__(self, stream: Any, room: int, path: str) -> None:
        self.stream, self.room, self.path = stream, room, path

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            self.stream.write(memoryview(data).cast("B")[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write(2) says it: no file name
        self.room -= size
        return self.stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def full_disk(checkpoint_name: str, rank: int, room: int = 1000) -> Iterator[None]:
    """In the ranks: torch's checkpoint writer, on ``rank``, finds the disk full after
    ``room`` bytes of ``checkpoint_name``'s files (torch's, not dtp's, file stream: what
    dtp does about it is what is tested)."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            if "w" in mode and int(os.environ.get("RANK", "0")) == rank and f"{checkpoint_name}.partial" in str(path):
                yield _Filling(stream, room, str(path))
            else:
                yield stream

    filesystem.FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        filesystem.FileSystem.create_stream = original


@pytest.mark.parametrize("at, flags", [(4, ()), (4, ("--async-save",)), (6, ())],
                         ids=["a save mid-run", "an async save mid-run", "the last save"])
def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_one_before(at, flags, tmp_path, monkeypatch,
                                                                           reference_dir) -> None:
    """dp 2, the disk full for rank 1 during step ``at``'s save: one line (rank 0's), the
    partial directory gone, the checkpoints before it intact and loadable, nothing pruned
    for it. Mid-run training goes on (the next save succeeds) and the curve is the
    uninterrupted one; the last save failing ends the run with code 1."""
    steps = ("--nproc", "2", "--dp", "2", "--steps", "6", "--save-every", "2")
    out = tmp_path / "run"
    result = cli_pool.train(monkeypatch, *_FLAGS, *steps, "--keep", "2", *flags, "--out", str(out),
                            in_ranks=functools.partial(full_disk, f"step_{at:08d}", 1))
    failed = (f"checkpoint.save: {out}/checkpoints/step_{at:08d} was not saved (rank 1: No space left on device); "
              f"step_{at - 2:08d} before it is intact")
    losses, params = _reference(reference_dir, *steps)
    if at < 6:
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stderr == f"dtp train: step {at}: {failed}; training goes on\n", result.stderr
        assert _names(out) == [f"step_{at - 2:08d}", "step_00000006"]  # keep 2: the failed one counted no room
        assert _losses(out) == losses
    else:
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stderr == f"dtp train: {failed}\n", result.stderr
        assert _names(out) == ["step_00000002", "step_00000004"]
    got = _params(out / "checkpoints" / f"step_{at - 2:08d}")
    assert set(got) == set(params) and all(got[k].dtype == params[k].dtype for k in params)


@pytest.mark.slow
def test_a_real_full_disk_keeps_the_checkpoint_before(tmp_path) -> None:
    """A 4 MB tmpfs (a mount namespace of its own: needs root) holds one checkpoint of the
    tiny fp64 model (2.5 MB) and not two: with --keep 1 the step-4 save finds the disk full
    — the step-2 checkpoint is not deleted to make room — so the run says so and goes on,
    and the last save failing ends it with code 1; step 2 still loads."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "run"
    train = [sys.executable, "-m", "dtp.cli", "train", *_FLAGS, "--steps", "6", "--save-every", "2", "--keep", "1",
             "--out", str(out)]
    script = f"mount -t tmpfs -o size=4m tmpfs {disk} && cd {disk} && {' '.join(train)}; code=$?; " \
             f"cp -r {out} {tmp_path}/kept; exit $code"
    if os.geteuid() != 0 or subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root for a mount namespace and a size-limited tmpfs")
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == [f"dtp train: step 4: checkpoint.save: {out}/checkpoints/step_00000004 was not saved (rank 0: No "
                     f"space left on device); step_00000002 before it is intact; training goes on",
                     f"dtp train: checkpoint.save: {out}/checkpoints/step_00000006 was not saved (rank 0: No space "
                     f"left on device); step_00000002 before it is intact"], proc.stderr
    kept = tmp_path / "kept"
    assert _names(kept) == ["step_00000002"]
    assert set(_params(kept / "checkpoints" / "step_00000002")) == set(_reference_names())


def _reference_names() -> list[str]:
    from dtp.models import config as model_config

    return list(model_config.param_shapes(model_config.config("tiny")))


# --------------------------------------------------------------------------- a host that comes back


def test_a_rank_of_the_same_torchrun_job_rejoins_its_run(tmp_path, monkeypatch) -> None:
    """A host that comes back into a job (a fresh torchrun agent: restart count 0), or a
    SLURM requeue of it, runs the same command; its ranks resume as the survivors' do when
    the run directory's config.json records the job's --rdzv-id. Another id, torchrun's
    default "none" or --standalone's uuid (dtp train --nproc) names no job: a new run.
    (The two hosts for real: tests/test_two_hosts.py, -m slow.)"""
    from dtp import launch

    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert not launch.rejoined(tmp_path)  # no run there yet
    (tmp_path / "config.json").write_text(json.dumps({launch.JOB_KEY: "job-7", "segments": []}))
    assert launch.rejoined(tmp_path) and launch.job_id() == "job-7"
    for other in ("job-8", "none", "3f2b8c1e-9a4d-4e0f-8b7a-1c2d3e4f5a6b"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", other)
        assert not launch.rejoined(tmp_path), other
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarted by its own agent: always
    assert launch.rejoined(tmp_path)
