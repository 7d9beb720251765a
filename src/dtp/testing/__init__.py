"""Run functions on N gloo ranks from pytest or a notebook, and check parity.

``run(fn, *args, world_size=N)`` calls ``fn(*args)`` on every rank of a pool of N worker
processes with an initialised gloo process group, and returns the per-rank results.
Pools are started once per world size and reused (spawning a rank costs seconds; a
test costs milliseconds). Functions travel with cloudpickle, so functions defined in a
notebook cell or a test module work.

A rank that raises makes :func:`run` raise :class:`RankError` with that rank's
traceback; a pool that does not answer within ``timeout`` seconds is killed and
:class:`RankTimeout` says which ranks were silent. Either way the pool is replaced, so
one broken test cannot hang or poison the rest of the suite. Ctrl-C (or a notebook's
interrupt) reaches only the caller, never the ranks: an interrupted :func:`run` replaces
the pool; an idle pool survives it, and its ranks leave quietly when the caller exits.

:func:`simulate` is the one-process alternative: N ranks simulated with
``LocalTensorMode`` on the "fake" backend, for quick layout checks in a notebook.

Reference oracles for context-parallel attention (:func:`merge`, :func:`causal_work`,
:func:`simulate_ring_attention`) come from :mod:`dtp.testing.oracles`.

Not run as a doctest (starting ranks costs seconds; tests/test_testing.py does it):

>>> def hello():
...     import torch.distributed as dist
...     return dist.get_rank()
>>> run(hello, world_size=2)                                   # doctest: +SKIP
[0, 1]
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Callable, Iterator

import cloudpickle
import torch

from ..core import comm
from ..core._rules import STEP_TOLERANCE
from .oracles import causal_work, merge, simulate_ring_attention
from ..core._torch import LocalTensorMode, fake_store, local_tensors
from ..core.mesh.devices import clear_mesh_cache

__all__ = ["run", "RankError", "RankTimeout", "simulate", "shutdown", "assert_close", "tolerance", "rank_values",
           "merge", "causal_work", "simulate_ring_attention"]

DEFAULT_TIMEOUT = float(os.environ.get("DTP_TEST_TIMEOUT", "180"))
# Starting N ranks means N cold imports of torch on however many cores CI has.
START_TIMEOUT = float(os.environ.get("DTP_POOL_START_TIMEOUT", "300"))
_FAILURE_GRACE = 3.0
_WORKER_COMMAND = [sys.executable, "-m", "dtp.testing._worker"]


class RankError(RuntimeError):
    """A function raised on one or more ranks."""


class RankTimeout(RuntimeError):
    """Ranks did not answer in time; the pool was killed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, plus module *subclasses* by name.

    For a function pickled by value (a notebook cell's, ``__main__``'s) cloudpickle also
    sends the submodules its code might reach through a global module: with ``torch`` a
    global and ``distributed`` and ``config`` among the names the code uses (``import
    torch.distributed as dist`` ... ``llama.config(...)``), that is
    ``torch.distributed.config``, an instance of a ``ModuleType`` subclass (torch's
    ``ConfigModule``). cloudpickle's rule "imported modules travel by name" is looked up
    by exact type, so it tried to copy that one by value and failed. Same rule here for
    subclasses (modules registered to travel by value still do).
    """

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType
                and sys.modules.get(obj.__name__) is obj and not _by_value(obj)):
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def _by_value(module: types.ModuleType) -> bool:
    registered = getattr(cloudpickle.cloudpickle, "_is_registered_pickle_by_value", None)
    return bool(registered and registered(module))


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


class _Pool:
    """N worker processes forming one gloo world, each connected to us by a pipe."""

    def __init__(self, world_size: int, start_timeout: float = START_TIMEOUT):
        self.world_size = world_size
        authkey = secrets.token_bytes(16)
        # All ranks connect at once. With Listener's default backlog of 1 the kernel drops
        # the SYNs that find the queue full and those connects back off exponentially
        # (1, 2, 4 ... 64 s): a suspect for an 8-rank pool that failed to start in 120 s in CI.
        listener = Listener(("127.0.0.1", 0), authkey=authkey, backlog=world_size)
        env = dict(os.environ)
        # Workers import what this process can: the test modules, the notebook's paths.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # A temporary directory of the pool's own, removed with it: workers end by kill(),
        # so what they leave in TMPDIR (dtp.comm.board's files) is not removed at their exit.
        self.tmp = tempfile.mkdtemp(prefix="dtp-pool-")
        env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), TMPDIR=self.tmp,
                   WORLD_SIZE=str(world_size), DTP_POOL_ADDRESS=f"127.0.0.1:{listener.address[1]}",
                   DTP_POOL_AUTHKEY=authkey.hex())
        # Each worker in a session of its own: a terminal's Ctrl-C and a Jupyter kernel's
        # interrupt (jupyter_client sends SIGINT to the kernel's whole process group, also
        # when it shuts the kernel down) are for this process, not for the ranks: in the
        # group, every idle worker died of it printing a KeyboardInterrupt traceback. This
        # process stops them itself (kill(), at exit), and they leave on their own when
        # its end of the pipe goes (_worker_main).
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection | None] = [None] * world_size
        deadline = time.monotonic() + start_timeout
        try:
            for r in range(world_size):
                self.procs.append(subprocess.Popen(_WORKER_COMMAND, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                                   start_new_session=True))
            for _ in range(world_size):
                while not _wait_readable(listener, 0.5):
                    if not self.alive():
                        raise RankTimeout(f"dtp.testing: a rank of {world_size} exited while starting: {self.exits()}")
                    if time.monotonic() > deadline:
                        raise RankTimeout(f"dtp.testing: {world_size} gloo ranks did not start within {start_timeout:.0f}s")
                try:
                    conn = listener.accept()
                    if not conn.poll(max(0.0, deadline - time.monotonic())):
                        raise RankTimeout(f"dtp.testing: a rank of {world_size} connected but never said who it is")
                    self.conns[conn.recv()] = conn  # workers say who they are before joining gloo
                except (EOFError, OSError, AuthenticationError) as e:
                    raise RankTimeout(f"dtp.testing: a rank of {world_size} failed while connecting "
                                      f"({type(e).__name__}: {e}; {self.exits()})") from e
            # Then each joins the gloo world and reports ready; poll, never block.
            for rank, conn in enumerate(self.conns):
                while not conn.poll(0.05):
                    if time.monotonic() > deadline or not self.alive():
                        raise RankTimeout(
                            f"dtp.testing: rank {rank} of {world_size} did not join the gloo group ({self.exits()})"
                        )
                if conn.recv() != "ready":
                    raise RankTimeout(f"dtp.testing: rank {rank} sent an unexpected start-up message")
        except BaseException:
            self.kill()
            raise
        finally:
            listener.close()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def exits(self) -> str:
        """Which worker processes have exited, and how (for start-up errors)."""
        codes = {r: p.poll() for r, p in enumerate(self.procs) if p.poll() is not None}
        return f"exit codes by rank {codes}" if codes else "all ranks still running"

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=10)
        for c in self.conns:
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _wait_readable(listener: Listener, timeout: float) -> bool:
    sock = listener._listener._socket  # the only way to wait on accept() with a deadline
    sock.settimeout(None)
    import select

    r, _, _ = select.select([sock], [], [], timeout)
    return bool(r)


_pools: dict[int, _Pool] = {}


def _pool(world_size: int) -> _Pool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        try:
            pool = _Pool(world_size)
        except RankTimeout as e:
            # A pool start is N cold interpreter starts on a shared machine: try once more
            # before failing the test, and say so.
            print(f"{e}; starting the pool again", file=sys.stderr)
            pool = _Pool(world_size)
        _pools[world_size] = pool
    return pool


def shutdown() -> None:
    """Stop every worker pool (also runs at interpreter exit)."""
    for ws in list(_pools):
        _pools.pop(ws).kill()


atexit.register(shutdown)


def run(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float | None = None, **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    The process group is initialised in every worker (``dtp.make_mesh`` picks it up).
    Results must be picklable; tensors come back by value.

    Not run as a doctest: starting ranks costs seconds (tests/test_testing.py does it).

    >>> run(lambda: 1 + 1, world_size=2)                       # doctest: +SKIP
    [2, 2]
    """
    if world_size < 1:
        raise ValueError(f"dtp.testing.run: world_size must be >= 1, got {world_size}")
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    pool = _pool(world_size)
    payload = _dumps((fn, args, kwargs))
    results: list[Any] = [None] * world_size
    errors: dict[int, str] = {}
    waiting = set(range(world_size))
    try:
        for conn in pool.conns:
            conn.send_bytes(payload)
        deadline = time.monotonic() + timeout
        while waiting:
            ready = [r for r in waiting if pool.conns[r].poll(0)]
            if not ready:
                if time.monotonic() >= deadline or not pool.alive():
                    break
                time.sleep(0.002)
                continue
            for r in ready:
                waiting.discard(r)
                try:
                    ok, value = cloudpickle.loads(pool.conns[r].recv_bytes())
                except (EOFError, OSError):
                    errors[r] = "worker process died"
                    continue
                if ok:
                    results[r] = value
                else:
                    if not errors:
                        # The others usually block in a collective with the failed rank: give
                        # them a short grace period to report too, then kill the pool.
                        deadline = min(deadline, time.monotonic() + _FAILURE_GRACE)
                    errors[r] = value
    except BaseException:
        # Interrupted (Ctrl-C, a kernel interrupt): the ranks, which the interrupt does not
        # reach, are still running fn and would answer the next call with this one's results.
        _pools.pop(world_size, None)
        pool.kill()
        raise
    # Every rank raised and came back (validation errors do that, before any collective):
    # keep the pool if it still answers a barrier; otherwise replace it.
    if waiting or (errors and not _healthy(pool)):
        _pools.pop(world_size, None)
        pool.kill()
    if errors:
        first = min(errors)
        silent = f"; ranks {sorted(waiting)} did not finish (killed)" if waiting else ""
        raise RankError(f"{fn.__qualname__} failed on ranks {sorted(errors)}{silent}. Rank {first}:\n{errors[first]}")
    if waiting:
        raise RankTimeout(
            f"{fn.__qualname__} did not finish within {timeout:.0f}s on ranks {sorted(waiting)} of {world_size}; "
            "the pool was killed (a collective some ranks never joined?)"
        )
    return results


def _barrier() -> bool:
    comm.barrier(tag="pool health")
    return True


def _healthy(pool: _Pool, timeout: float = 10.0) -> bool:
    payload = cloudpickle.dumps((_barrier, (), {}))
    try:
        for conn in pool.conns:
            conn.send_bytes(payload)
        deadline = time.monotonic() + timeout
        for conn in pool.conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                return False
            if cloudpickle.loads(conn.recv_bytes()) != (True, True):
                return False
    except (EOFError, OSError):
        return False
    return True


def _worker_main() -> None:
    """Entry point of a pool worker (``python -m dtp.testing._worker``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    host, port = os.environ["DTP_POOL_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["DTP_POOL_AUTHKEY"]))
    conn.send(rank)
    dist.init_process_group("gloo")
    conn.send("ready")
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            _leave_after_owner()
            break  # the pool's owner has gone: leave quietly
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            reply = (True, fn(*args, **kwargs))
            data = cloudpickle.dumps(reply)
        except BaseException:  # report everything, including assertion failures
            data = cloudpickle.dumps((False, traceback.format_exc()))
        try:
            conn.send_bytes(data)
        except OSError:
            _leave_after_owner()
            break  # the owner went while fn ran


def _leave_after_owner() -> None:
    """A killed owner (SIGKILL: Jupyter's last resort) cannot remove the pool's temporary
    directory; its ranks, which noticed, do. Every rank tries: the last to leave removes what
    the others were still writing."""
    tmp = os.environ.get("TMPDIR", "")
    if os.path.basename(tmp).startswith("dtp-pool-"):
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def simulate(world_size: int) -> Iterator[None]:
    """Simulate ``world_size`` ranks in this one process (LocalTensorMode, "fake" backend).

    Per-rank values come back as ``LocalTensor``s; :func:`rank_values` unpacks them.

    >>> with simulate(4):
    ...     mesh = dtp.make_mesh(dp=2, tp=2)
    ...     x = dtp.shard(torch.arange(8.0), mesh, P(("dp", "tp")))
    ...     rank_values(x.to_local())
    [tensor([0., 1.]), tensor([2., 3.]), tensor([4., 5.]), tensor([6., 7.])]
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("dtp.testing.simulate needs a process with no process group initialised")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=fake_store())
    try:
        with LocalTensorMode(world_size):
            yield
    finally:
        comm.drain()  # nothing of this world left in flight (nor in dtp.comm's records of it)
        clear_mesh_cache()
        dist.destroy_process_group()


def rank_values(t: torch.Tensor) -> list[torch.Tensor]:
    """Per-rank tensors of a ``LocalTensor`` (a plain tensor is every rank's value).

    >>> with simulate(2):
    ...     rank_values(dtp.shard(torch.arange(4.0), make_mesh(dp=2), P("dp")).to_local())
    [tensor([0., 1.]), tensor([2., 3.])]
    >>> rank_values(torch.ones(1))
    [tensor([1.])]
    """
    locals_ = local_tensors(t)
    return [locals_[r] for r in sorted(locals_)] if locals_ is not None else [t]


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) of the correctness bar: fp64 ~1e-10, fp32 ~1e-5, bf16/fp16 looser.

    >>> tolerance(torch.float64)
    (1e-10, 1e-12)
    """
    return STEP_TOLERANCE.get(dtype, (0.0, 0.0))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "tensor",
                 rtol: float | None = None, atol: float | None = None) -> None:
    """Compare a (D)Tensor with a single-device reference at the dtype's tolerance.

    DTensors are gathered with ``full_tensor()`` first (a collective: call on all ranks).
    ``rtol`` / ``atol``: the bound, default :func:`tolerance` of ``expected``'s dtype.

    Raises: ``AssertionError`` starting with ``name``.

    >>> with simulate(2):
    ...     x = dtp.shard(torch.arange(4.0, dtype=torch.float64), make_mesh(dp=2), P("dp"))
    ...     assert_close(x, torch.arange(4.0, dtype=torch.float64), name="x")  # passes
    ...     assert_close(x * (1 + 1e-9), torch.arange(4.0, dtype=torch.float64), name="x")
    Traceback (most recent call last):
    AssertionError: x: Tensor-likes are not close!
    ...
    """
    from torch.distributed.tensor import DTensor

    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    if isinstance(expected, DTensor):
        expected = expected.full_tensor()
    r, a = tolerance(expected.dtype)
    try:
        torch.testing.assert_close(actual, expected, rtol=r if rtol is None else rtol, atol=a if atol is None else atol)
    except AssertionError as e:
        raise AssertionError(f"{name}: {e}") from None


def reference_value_and_grad(loss_fn: Callable[[Any, Any], Any], params: Any, batch: Any) -> tuple[float, Any]:
    """The single-device run: loss and gradients of ``loss_fn`` on plain global tensors.

    >>> from functools import partial
    >>> cfg = llama.config("tiny", n_layers=1)
    >>> batch = {"tokens": torch.zeros(2, 16, dtype=torch.long), "targets": torch.zeros(2, 16, dtype=torch.long)}
    >>> loss, grads = reference_value_and_grad(partial(llama.loss, cfg=cfg), llama.init(cfg), batch)
    >>> type(loss).__name__, sorted(grads)
    ('float', ['embed', 'final_norm', 'layers', 'lm_head'])
    """
    import optree

    leaves, treedef = optree.tree_flatten(params)
    leaves = [x.detach().requires_grad_(True) for x in leaves]
    out = loss_fn(optree.tree_unflatten(treedef, leaves), batch)
    loss = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(loss, leaves)
    return float(loss.detach()), optree.tree_unflatten(treedef, list(grads))


def assert_tree_close(actual: Any, expected: Any, *, name: str = "tree", rtol: float | None = None,
                      atol: float | None = None) -> None:
    """:func:`assert_close` leaf by leaf (DTensors gathered; a collective on all ranks),
    naming the first leaf that differs by its path."""
    import optree

    paths = [".".join(map(str, p)) for p in optree.tree_paths(expected)]
    for path, a, e in zip(paths, optree.tree_leaves(actual), optree.tree_leaves(expected)):
        assert_close(a, e, name=f"{name}.{path}", rtol=rtol, atol=atol)
