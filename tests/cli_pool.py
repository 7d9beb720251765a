"""``dtp train`` with its ranks taken from :mod:`dtp.testing`'s pool instead of torchrun's
new processes: the launcher's whole path (parsing, preflight, the plan's memory check, the
run shipped as a TOML file, ``--check``'s reference) runs in the test process, and every
rank runs the same ``cli.main`` as under torchrun, with torchrun's variables.

Why: a two-step ``dtp train --nproc 2`` process tree costs 8-11 s on 2 cores, nearly all
of it start-up and exit (a launcher and one fresh interpreter a rank, each importing
torch); a pooled run of the same flags 1-3 s. What only real processes show (the launcher's agent, signals, exit
codes, a crash at exit, restarts) stays in tests that start them: ``test_cli.py``,
``test_cli_checkpoint.py``'s restart, and ``pytest -m slow tests/test_cli_combinations.py``,
which runs every row of the combination table as a process tree.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, ContextManager, NamedTuple

import pytest

from dtp import cli, launch, testing


class Result(NamedTuple):
    """What a ``dtp train`` process would have left: its exit code and output (rank 0's
    console lines and the launcher's, as one process tree prints them)."""

    returncode: int
    stdout: str
    stderr: str


def _rank(argv: list[str], error_dir: str, in_ranks: Callable[[], ContextManager[object]] | None = None
          ) -> tuple[int, str, str]:
    """One rank of a launched run, in a pool worker: the launcher checked the run already,
    so the rank goes straight to training (as under torchrun). ``in_ranks()``: a context
    the rank trains in (a fault a test injects into torch: a pool worker outlives the test,
    so what it changes is undone on the way out)."""
    os.environ[launch.ERROR_DIR_ENV] = error_dir
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                (in_ranks() if in_ranks is not None else contextlib.nullcontext()):
            code = cli.main(argv)
        return code, out.getvalue(), err.getvalue()
    finally:
        del os.environ[launch.ERROR_DIR_ENV]


def pool_launch(nproc: int, argv: list[str], *, max_restarts: int = 0, save_on_signal: str | None = None,
                shutdown_timeout: int = 30, in_ranks: Callable[[], ContextManager[object]] | None = None) -> int:
    """:func:`dtp.launch.launch`'s stand-in: ``argv`` on ``nproc`` pooled ranks; rank 0's
    output is printed here. Unlike the launcher it returns the largest exit code of the
    ranks (not the first failing rank's), prints each distinct error the ranks reported
    (as the launcher) but no account of unreported ranks, and cannot
    restart (a restart test needs real processes: test_cli_checkpoint.py) nor pass on a
    signal (``save_on_signal``, ``shutdown_timeout``: the ranks' own handler is what is
    tested here; the agent's part, test_cli_faults.py's real processes)."""
    assert max_restarts == 0, "pooled ranks cannot be restarted; start real processes"
    error_dir = Path(argv[argv.index("--out") + 1]) / "launch-errors"
    shutil.rmtree(error_dir, ignore_errors=True)  # an earlier run's in the same directory (the launcher's: a temporary one)
    error_dir.mkdir(parents=True)
    # A rank that failed returns at once; its peers wait in a collective until --timeout
    # and then fail too, well inside the pool's own limit.
    results = testing.run(_rank, list(argv), str(error_dir), in_ranks, world_size=nproc, timeout=120)
    code, out, err = results[0]
    sys.stdout.write(out)
    sys.stderr.write(err)
    for message in launch._collect_errors(str(error_dir)):  # the ranks' one-line errors, as the launcher prints them
        print(message, file=sys.stderr)
    return max(code for code, _, _ in results)


def train(monkeypatch: pytest.MonkeyPatch, *flags: str,
          in_ranks: Callable[[], ContextManager[object]] | None = None) -> Result:
    """``dtp train <flags>`` with pooled ranks (``monkeypatch`` undoes the stand-in);
    ``in_ranks``: see :func:`_rank` (a module-level function: it travels to the workers)."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", launch.ERROR_DIR_ENV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launch, "launch", functools.partial(pool_launch, in_ranks=in_ranks))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["train", *flags])
    return Result(code, out.getvalue(), err.getvalue())


def process_env() -> dict[str, str]:
    """The environment of a ``dtp train`` process tree a test starts for real: this one's,
    one thread a rank, and none of torchrun's variables (a pooled rank may have left them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env
