"""dtp.testing: the reusable rank pool, failure and hang handling, simulation."""

import contextlib
import re
import time
import types

import pytest
import torch

import dtp
from dtp import P
from dtp.testing import RankError, RankTimeout, rank_values, run, simulate


def _rank_and_pid():
    import os

    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), os.getpid()


def test_pool_is_reused_and_ranks_are_ordered():
    first = run(_rank_and_pid, world_size=2)
    again = run(_rank_and_pid, world_size=2)
    assert [r[:2] for r in first] == [(0, 2), (1, 2)]
    assert first == again  # same processes: no new spawn per call


def _fails_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ZeroDivisionError("rank one is unhappy")
    dist.barrier()  # rank 0 would wait for rank 1 forever


def test_failure_reports_rank_and_traceback_without_hanging():
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)failed on ranks \[1\].*ZeroDivisionError: rank one is unhappy"):
        run(_fails_on_rank_one, world_size=2)
    assert time.monotonic() - t0 < 60
    assert run(lambda: 7, world_size=2) == [7, 7]  # a fresh pool replaced the broken one


def _sleeps_on_rank_zero():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(120)
    return 1


def test_hang_is_killed_after_timeout():
    with pytest.raises(RankTimeout, match=r"ranks \[0\] of 2"):
        run(_sleeps_on_rank_zero, world_size=2, timeout=2)


def test_a_rank_that_dies_while_starting_is_reported_at_once(monkeypatch):
    import sys

    from dtp import testing

    # A worker that exits before connecting: the start-up must say so, not wait out its timeout.
    monkeypatch.setattr(testing, "_WORKER_COMMAND", [sys.executable, "-c", "raise SystemExit(3)"])
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"exited while starting: exit codes by rank \{\d: 3"):
        testing._Pool(2, start_timeout=120)
    assert time.monotonic() - t0 < 30


# A Jupyter kernel in miniature: SIGINT interrupts the "cell", not the process; a line on
# stdin is the next cell; end of stdin is shutdown (atexit stops the pool).
_KERNEL = """
import os, signal, sys
from dtp.testing import run
signal.signal(signal.SIGINT, lambda *_: None)
print(run(os.getpid, world_size=2), flush=True)
sys.stdin.readline()
print(run(os.getpid, world_size=2), flush=True)
sys.stdin.read()
"""


def test_a_kernel_interrupt_and_shutdown_leave_the_ranks_quiet():
    """jupyter_client interrupts a kernel's whole process group, also when it shuts the
    kernel down: the pool's ranks must neither die of it with a KeyboardInterrupt traceback
    each (as they did) nor outlive the kernel."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(dtp.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    kernel = subprocess.Popen([sys.executable, "-c", _KERNEL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        first = kernel.stdout.readline()
        os.killpg(kernel.pid, signal.SIGINT)  # what interrupt_kernel / shutdown_kernel send
        kernel.stdin.write("next cell\n")
        kernel.stdin.flush()
        again = kernel.stdout.readline()
        # Shutdown. The ranks write to the same stderr: it ends only when they have exited too.
        _, err = kernel.communicate("", timeout=120)
    finally:
        if kernel.poll() is None:
            kernel.kill()
    assert kernel.returncode == 0, err
    assert first.startswith("[") and again == first, (first, again, err)  # the interrupt left the pool alive
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.slow  # a pool of its own, started and killed (~12 s)
def test_ranks_leave_quietly_when_their_owner_is_killed(tmp_path):
    """Out of the owner's process group, the ranks do not get its SIGKILL (Jupyter's last
    resort): they must notice the pipe close and exit, without a word, and remove the pool's
    temporary directory, which the owner no longer can."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(dtp.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(tmp_path)}
    owner = subprocess.Popen(
        [sys.executable, "-c", "import os, time\nfrom dtp.testing import run\n"
                               "print(run(os.getpid, world_size=2), flush=True)\ntime.sleep(300)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in re.findall(r"\d+", owner.stdout.readline())]
        os.killpg(owner.pid, signal.SIGKILL)
        # The ranks hold the owner's stderr too: it ends once they have exited.
        _, err = owner.communicate(timeout=60)
    finally:
        owner.kill()
        owner.wait()
        for pid in pids:  # ranks that did not leave: stop them (they are this test's)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert len(pids) == 2 and err == "", (pids, err)
    assert not list(tmp_path.glob("dtp-pool-*")), list(tmp_path.iterdir())


def _stale():
    time.sleep(2)
    return "stale"


def test_an_interrupted_run_replaces_the_pool(monkeypatch):
    """Ctrl-C while run() waits: the ranks (which the interrupt does not reach) are still
    in fn, and would answer the next call with this one's result, so the pool goes."""
    import os

    from dtp import testing

    # One rank: the cheapest pool to start twice, and the other tests' pools stay as they are.
    before = run(os.getpid, world_size=1)

    def interrupted(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(testing, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=interrupted))
    with pytest.raises(KeyboardInterrupt):
        run(_stale, world_size=1)
    monkeypatch.undo()
    after = run(os.getpid, world_size=1)
    assert after != ["stale"] and after != before  # a fresh pool, answering this call


def test_functions_from_a_notebook_main_travel_by_value():
    # A notebook cell defines functions in __main__, which workers cannot import.
    ns = {"__name__": "__main__"}
    exec("def cell(x):\n    import torch.distributed as dist\n    return x * (dist.get_rank() + 1)\n", ns)
    assert run(ns["cell"], 3, world_size=2) == [3, 6]


def test_notebook_function_using_torch_distributed_and_llama_config():
    # torch a global of the cell, `import torch.distributed as dist` and `llama.config`
    # in the body: cloudpickle used to try to copy torch.distributed.config by value.
    import torch.distributed.config  # noqa: F401  (imported by torch on first use anyway)

    ns = {"__name__": "__main__", "torch": torch}
    exec("def cell():\n"
         "    import torch.distributed as dist\n"
         "    from dtp.models import llama\n"
         "    return llama.config('tiny').vocab_size + dist.get_rank() + torch.zeros(1).numel()\n", ns)
    from dtp.models import llama

    v = llama.config("tiny").vocab_size
    assert run(ns["cell"], world_size=2) == [v + 1, v + 2]


def test_one_process_simulation():
    with simulate(4):
        mesh = dtp.make_mesh(dp=2, tp=2)
        x = dtp.shard(torch.arange(8.0), mesh, P(("dp", "tp")))
        assert [v.tolist() for v in rank_values(x.to_local())] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        y = dtp.reshard(x, P())
        assert all(torch.equal(v, torch.arange(8.0)) for v in rank_values(y.to_local()))


def test_a_second_simulation_gets_dtensors_on_its_own_mesh():
    # DeviceMesh equality ignores process groups, so session 2's mesh equals session 1's:
    # dtp's shared DTensor specs (keyed by mesh equality) and DTensor's sharding-propagation
    # caches handed session 2 DTensors on session 1's mesh, and local_map refused to mix
    # them with DTensors on the current one ("every DTensor argument must live on the same
    # device mesh").
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for _ in range(2):
        with simulate(4):
            mesh = dtp.make_mesh(dp=2, tp=2)
            x = dtp.shard(torch.arange(8.0).reshape(4, 2), mesh, P("dp"))
            w = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0), Replicate()])  # torch's own: on ``mesh``
            assert x.device_mesh is mesh and (w * 2).device_mesh is mesh and dtp.reshard(x, P()).device_mesh is mesh
            y = dtp.local_map(lambda a, b: a * b, (P("dp"), P("dp")), P("dp"))(x, w * 2)
            assert y.device_mesh is mesh and torch.equal(y.full_tensor(), 2 * torch.arange(8.0).reshape(4, 2))


def test_simulate_leaves_no_per_rank_tensors_in_dtps_caches():
    # RoPE's tables are cached per (head_dim, theta, dtype, device); made under
    # simulate (LocalTensorMode: arange is per-rank), a cached pair reached a later plain
    # run in the same process, whose loss then became a LocalTensor.
    import sys

    from dtp.core._torch import is_local_tensor

    attention = sys.modules["dtp.ops.attention"]  # the module (dtp.ops.attention the attribute is the function)

    x = torch.randn(1, 8, 2, 12)  # a head_dim no other test uses: this test makes its tables
    with simulate(2):
        attention.rotary(torch.randn(1, 8, 2, 12))
    assert not any(is_local_tensor(t) for pair in attention._TABLES.values() for t in pair)
    assert not is_local_tensor(attention.rotary(x))
