"""Start local ranks the torchrun way: ``dtp train --nproc N`` without typing ``torchrun``.

:func:`launch` hands the work to ``torch.distributed.run`` — torchrun's own code: a
standalone c10d rendezvous on localhost, an elastic agent that watches the ranks, and
stops all of them when one fails. Every rank runs ``python -m dtp.cli <argv>`` with
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set, so
:func:`dtp.make_mesh` finds its process group in the environment.

Under an existing torchrun (:func:`in_torchrun`), ``dtp train`` joins that world instead
of launching a new one, so multi-node jobs work exactly as with any torchrun script::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint host:29400 -m dtp.cli train --dp 2 --tp 8

Ranks that fail with a clean, expected error (a bad flag combination, a layout that does
not fit the model) report it through :func:`report_error`; the launcher prints each
distinct message once instead of once per rank, and nothing else.

When a rank dies (a signal, a crash) or a collective is left unfinished (a peer stalled
past the timeout), every rank is accounted for: those that reported say where they were
themselves (:class:`dtp.comm.CollectiveError`), and for each of the others the launcher
prints how it ended and its last collectives, read from the flight record the rank
mirrored to a file (:data:`dtp.comm.FLIGHT_DIR_ENV`; it survives even ``SIGKILL``).

Stopping the launcher (``SIGTERM``, ``SIGINT``/Ctrl-C) stops every rank: torchrun's agent
sends the ranks the same signal, and ``SIGKILL`` to any still alive 30 s later (its
shutdown timeout; measured: 2 ranks of ``dtp train`` are gone 0.5 s after either signal).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import struct
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

__all__ = ["launch", "in_torchrun", "launched", "restarted", "rejoined", "job_id", "JOB_KEY", "report_error", "report_preempted", "default_omp_threads"]

# Set by launch() for its ranks: where a rank leaves its one-line error message.
ERROR_DIR_ENV = "DTP_LAUNCH_ERROR_DIR"


def in_torchrun() -> bool:
    """True inside a rank started by torchrun (or anything that sets its variables).

    >>> in_torchrun()                     # in a plain Python session
    False
    """
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def restarted() -> bool:
    """True inside a rank that torchrun's agent restarted (``--max-restarts``: the same
    command again, after a rank failed), whose run directory holds what the failed attempt
    saved.

    >>> restarted()
    False
    """
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


#: The key of a run's ``config.json`` that holds the torchrun job it belongs to (:func:`job_id`).
JOB_KEY = "torchrun_job"


def job_id() -> str | None:
    """The torchrun job this rank belongs to: its rendezvous id (``--rdzv-id``, the same on
    every host and for every restart, e.g. SLURM's job id), or ``None`` outside torchrun or
    under an id that names no job: torchrun's default ``none``, and ``--standalone``'s (a
    new uuid each launch: ``dtp train --nproc``'s).

    >>> job_id() is None                   # in a plain Python session
    True
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not in_torchrun() or run_id in ("", "none") or _is_uuid(run_id):
        return None
    return run_id


def _is_uuid(text: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", text) is not None


def rejoined(out: str | os.PathLike[str]) -> bool:
    """True inside a rank of the torchrun job that trains in ``out``, started again: restarted
    by its agent (:func:`restarted`), or on a host that came back into the job (a fresh
    agent, its restart count 0) under the same ``--rdzv-id`` that ``out/config.json``
    records (:data:`JOB_KEY`). Either way its ranks resume from the newest checkpoint, as
    its peers' do: a returning host, or a SLURM requeue of the same job, runs the same
    command. Reads only ``config.json`` (every rank alike: the directory is shared).

    >>> rejoined("/nonexistent")
    False
    """
    if restarted():
        return True
    job = job_id()
    if job is None:
        return False
    try:
        record = json.loads((Path(out) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get(JOB_KEY) == job


def launched() -> bool:
    """True inside a rank that :func:`launch` started (the launcher checked the run already).

    >>> launched()
    False
    """
    return in_torchrun() and ERROR_DIR_ENV in os.environ


def default_omp_threads(nproc: int, cpus: int | None = None) -> int:
    """CPU threads per rank: the machine's cores shared evenly by the local ranks.

    torchrun would set 1 for every multi-rank launch; on CPU (the gloo backend), where
    the ranks *are* the compute, using the whole machine is worth it when cores are plenty.

    >>> default_omp_threads(2, cpus=16), default_omp_threads(4, cpus=2)
    (8, 1)
    """
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))  # respects taskset / cgroup cpusets
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, nproc))


def report_error(message: str) -> None:
    """Report an expected, one-line error from this rank.

    Launched by :func:`launch`: the message goes to a file the launcher prints once. Under
    a plain torchrun (or a single process): rank 0 prints it to stderr, the other ranks
    prefix it with their rank, so nothing is lost when only one rank fails.
    """
    rank = int(os.environ.get("RANK", "0"))
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory and Path(directory).is_dir():
        with contextlib.suppress(OSError):
            tmp = Path(directory) / f".rank{rank}.tmp"
            tmp.write_text(message)
            os.replace(tmp, Path(directory) / f"rank{rank}.txt")
            return
    prefix = "" if rank == 0 or _names_rank(message, rank) else f"[rank {rank}] "
    print(f"{prefix}{message}", file=sys.stderr, flush=True)


def report_preempted(message: str) -> None:
    """Rank 0 of a run stopped by ``--save-on-signal`` after its save completed: the launcher
    then exits with the ranks' code (75), not a signal's (:func:`launch`). Outside it: nothing
    (torchrun's agent has the ranks' own exit codes)."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory and Path(directory).is_dir():
        with contextlib.suppress(OSError):
            (Path(directory) / _PREEMPTED).write_text(message)


_PREEMPTED = "preempted.txt"
#: A rank's exit code after its ``--save-on-signal`` save (``dtp.cli.process.PREEMPTED``):
#: EX_TEMPFAIL (sysexits.h), "try again later", which a scheduler's requeue rule can match.
PREEMPTED_CODE = 75


def _names_rank(message: str, rank: int) -> bool:
    # A rank's own account ("rank 3: all_reduce ... failed") needs no "(rank 3)" after it.
    return re.search(rf"\brank {rank}\b", message) is not None


def _collect_errors(directory: str) -> list[str]:
    """Distinct messages from the ranks, each once, ranks listed when they differ."""
    by_message: dict[str, list[int]] = {}
    for f in sorted(Path(directory).glob("rank*.txt")):
        with contextlib.suppress(OSError, ValueError):
            by_message.setdefault(f.read_text().strip(), []).append(int(f.stem[4:]))
    if len(by_message) <= 1:
        return list(by_message)
    return [msg if len(r) == 1 and _names_rank(msg, r[0]) else
            f"{msg} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, sorted(r)))})"
            for msg, r in by_message.items()]


def _unreported_ranks(directory: str, nproc: int, failures: Mapping[int, Any]) -> list[str]:
    """For each rank that reported nothing: how it ended and its last collectives — when a
    rank died by a signal or some rank left a collective unfinished. Nothing otherwise:
    a clean error is raised before any collective, and its message says it all.

    ``failures``: torchrun's ``ProcessFailure`` by rank. Once one rank has failed, the agent
    stops the others with SIGTERM and records them too (exit code -15).
    """
    from ..comm import flight_record, format_flight_record  # torch: only once ranks have run

    reported = {int(f.stem[4:]) for f in Path(directory).glob("rank*.txt") if f.stem[4:].isdigit()}
    records = {}
    for rank in range(nproc):
        with contextlib.suppress(OSError, ValueError, struct.error):
            records[rank] = flight_record(Path(directory) / f"flight-rank{rank}.bin")
    unfinished = any(e.state != "done" for entries in records.values() for e in entries)
    killed = any(f.exitcode < 0 and f.exitcode != -signal.SIGTERM for f in failures.values())
    if not (unfinished or killed):
        return []
    lines = []
    for rank in sorted(set(range(nproc)) - reported):
        failure = failures.get(rank)
        if failure is None or failure.exitcode == -signal.SIGTERM:
            fate = "was stopped by the launcher"
        elif failure.exitcode < 0:
            fate = f"was killed by {failure.signal_name()}"
        else:
            fate = f"exited with code {failure.exitcode}"
        lines.append(f"dtp: rank {rank} {fate}; last collectives: {format_flight_record(records.get(rank, []))}")
    return lines


@contextlib.contextmanager
def _quiet_elastic() -> Iterator[None]:
    # The agent logs every failed rank with pids, error-file hints and a banner; the
    # launcher prints what went wrong itself, so keep the agent to real breakage only.
    # torch sets levels on the agent's own loggers (torch.distributed.elastic.agent.server.api
    # says "Received 2 death signal" at WARNING on Ctrl-C), so quiet each of them, not only
    # their parents.
    prefixes = ("torch.distributed.elastic", "torch.distributed.run")
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(prefixes)]
    loggers = [logging.getLogger(n) for n in (*prefixes, *names)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: The signals torch's elastic agent handles (its TORCHELASTIC_SIGNALS_TO_HANDLE default).
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@contextlib.contextmanager
def _signal_handlers_kept(extra: str | None = None) -> Iterator[None]:
    """The launcher's signal handlers as they were before torchrun's agent ran. Measured on
    torch 2.13: ``PContext.start`` installs its own (raising ``SignalException``) and leaves
    them; Ctrl-C during ``--check``'s reference, after the ranks were done, then read
    "rank 0 failed: SignalException: Process N got signal: 2", exit code 1, not 130."""
    if threading.current_thread() is not threading.main_thread():  # as the agent: only there
        yield
        return
    names = [*_AGENT_SIGNALS, *([extra] if extra and extra not in _AGENT_SIGNALS else [])]
    kept = {name: signal.getsignal(getattr(signal, name)) for name in names if hasattr(signal, name)}
    try:
        yield
    finally:
        for name, handler in kept.items():
            if handler is not None:  # None: a handler set outside Python, which cannot be put back from here
                signal.signal(getattr(signal, name), handler)


def launch(nproc: int, argv: Sequence[str], *, module: str = "dtp.cli", max_restarts: int = 0,
           save_on_signal: str | None = None, shutdown_timeout: int = 30) -> int:
    """Run ``python -m <module> <argv>`` on ``nproc`` local ranks through torchrun's machinery.

    Returns 0 when every rank succeeded, otherwise the exit code of the first rank to
    fail (1 for a rank killed by a signal). Expected errors reported by the ranks with
    :func:`report_error` are printed once to stderr. ``OMP_NUM_THREADS`` defaults to the
    cores per rank (see :func:`default_omp_threads`); a value already set is kept.
    ``max_restarts``: how often torchrun's agent starts every rank again after one died.

    ``save_on_signal`` (``--save-on-signal``): torchrun's agent handles that signal too
    (``SIGUSR1``'s default action would end the agent and leave the ranks orphaned) and
    passes it on; the ranks save and exit 75, which is then this launcher's code (a
    signal's, 128 + N, if their save did not complete). ``shutdown_timeout``: how long
    the agent lets the ranks finish after a signal before it kills them.

    Not run as a doctest: it starts ranks (tests/test_cli.py launches them).

    >>> launch(2, ["train", "--dp", "2", "--steps", "3"])             # doctest: +SKIP
    0
    """
    if nproc < 1:
        raise ValueError(f"launch: nproc must be >= 1, got {nproc}")
    # Imported here: torch.distributed.run pulls in the elastic agent, not needed in ranks;
    # and the module itself stays torch-free, so `dtp train` checks its flags first.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ..comm import FLIGHT_DIR_ENV  # torch: likewise

    torchrun_args = [
        "--standalone",  # single node: c10d rendezvous on a free localhost port
        "--nproc-per-node", str(nproc),
        # 0 by default: a failed step is a bug or a bad flag, not a flaky node. With R > 0 the
        # agent stops every rank when one dies and starts them all again (new rendezvous,
        # TORCHELASTIC_RESTART_COUNT set), and dtp train resumes from its newest checkpoint.
        "--max-restarts", str(max_restarts),
        "--signals-to-handle", ",".join(dict.fromkeys([*_AGENT_SIGNALS, *([save_on_signal] if save_on_signal else [])])),
        "--shutdown-timeout", str(shutdown_timeout),
        "--module", module,
        *argv,
    ]
    threads = os.environ.get("OMP_NUM_THREADS") or str(default_omp_threads(nproc))
    with tempfile.TemporaryDirectory(prefix="dtp-launch-") as errors, _signal_handlers_kept(save_on_signal), \
            _env(OMP_NUM_THREADS=threads, **{ERROR_DIR_ENV: errors, FLIGHT_DIR_ENV: errors}), _quiet_elastic():
        preempted = Path(errors) / _PREEMPTED
        try:
            run(parse_args(torchrun_args))
        except ChildFailedError as e:
            root, first = e.get_first_failure()
            if preempted.exists() and all(f.exitcode in (PREEMPTED_CODE, -signal.SIGTERM) for f in e.failures.values()):
                return PREEMPTED_CODE  # the signal reached the ranks alone; they saved and said so
            messages = _collect_errors(errors)
            others = _unreported_ranks(errors, nproc, e.failures)
            for msg in messages + others:
                print(msg, file=sys.stderr, flush=True)
            if not messages and not others:
                # No clean message: the failing rank's traceback is already on stderr. The
                # agent stops the others (they show up as failures too): name the first only.
                print(f"dtp: rank {root} failed with exit code {first.exitcode}; the other ranks were stopped",
                      file=sys.stderr, flush=True)
            return first.exitcode if first.exitcode > 0 else 1
        except KeyboardInterrupt:
            return 130
        except Exception as e:  # SignalException (SIGTERM to the launcher) and rendezvous failures
            from torch.distributed.elastic.multiprocessing.api import SignalException

            if isinstance(e, SignalException):
                return PREEMPTED_CODE if preempted.exists() else 128 + int(e.sigval)
            raise
    return 0
