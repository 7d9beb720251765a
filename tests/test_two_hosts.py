"""``dtp train`` across two hosts for real: each host a process in its own network, pid
and mount namespaces, joined to the other by veth pairs on a bridge, with its own
address; on each, ``torchrun --nnodes 2`` (c10d rendezvous on host 1) runs one rank of
the job, gloo bound to that host's veth (``GLOO_SOCKET_IFNAME``).

Checked: a dp, a tp and a pp run across the hosts train the loss curve of the same run on
one host (``dtp train --nproc 2``) bit for bit (fp64), and the bytes the hosts sent over
their veths cover the collectives' bytes dtp counted; and a host killed mid-run (every
process on it, by SIGKILL of its namespace's init) comes back, the survivor's agent
having waited for it in a re-rendezvous, and the job resumes from the newest checkpoint:
the whole loss curve equals the uninterrupted run's.

Needs root (namespaces, veths); skipped where ``unshare --net`` or ``ip link`` is not
permitted. The filesystem stays shared: one run directory serves both hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.slow

_SUBNET = "10.77.0"  # host i is 10.77.0.i; every address and port is inside the namespaces
_PORT = 29477  # the rendezvous endpoint's port, on host 1 (its own port space: no clash with the machine's)
_FLAGS = ("--model", "tiny", "--dtype", "float64", "--batch", "4", "--seq", "16", "--log-every", "3")
_LAYOUTS = {"dp": ("--dp", "2"), "tp": ("--tp", "2"), "pp": ("--pp", "2")}


def _env(**extra: str) -> dict[str, str]:
    """The test's environment less any torchrun variables (a rank would join their world),
    one CPU thread a rank (2 cores in all)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for k in list(env):
        if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT") \
                or k.startswith("TORCHELASTIC_"):
            env.pop(k)
    return env


def _ip(*argv: str, netns: int | None = None) -> None:
    """``ip argv``, in the network namespace of process ``netns`` (else this one's)."""
    cmd = ["ip", *argv] if netns is None else ["nsenter", "--target", str(netns), "--net", "ip", *argv]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10)


class _Namespace:
    """A ``sleep`` as the init of new namespaces: the network's only, or the network's,
    pid's and mount's (its own ``/proc``). Killing the init (SIGKILL) ends the namespace:
    with a pid namespace, every process in it dies with the init (the kernel kills them),
    and the network namespace and its veths go once no process is left in it."""

    def __init__(self, *, pid_ns: bool) -> None:
        # --kill-child: unshare killed (its init unknown yet), the init dies with it.
        argv = ["unshare", "--net", *(["--pid", "--fork", "--kill-child", "--mount-proc"] if pid_ns else []),
                "sleep", "infinity"]
        self.outer = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True)
        try:
            self.pid = self._init(pid_ns)
        except BaseException:
            self.kill()
            raise

    def _init(self, pid_ns: bool) -> int:
        ours = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.outer.poll() is not None:
                err = self.outer.stderr.read().decode().strip()
                raise OSError(f"unshare: {err} (exit code {self.outer.returncode})")
            with contextlib.suppress(OSError, ValueError, IndexError):  # not there yet
                pid = self.outer.pid
                if pid_ns:  # unshare --fork waits for its child, the namespace's pid 1
                    pid = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
                # Up once the init is sleep, in a network namespace of its own.
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == b"sleep" \
                        and os.readlink(f"/proc/{pid}/ns/net") != ours:
                    return pid
            time.sleep(0.01)
        raise OSError("unshare: the namespace's init did not start within 10 s")

    def kill(self) -> None:
        if self.outer.returncode is not None:
            return  # killed already: its pid may be another process's by now
        with contextlib.suppress(ProcessLookupError, AttributeError):  # AttributeError: no init yet
            os.kill(self.pid, signal.SIGKILL)  # not reaped before unshare is (its parent, waited below)
        with contextlib.suppress(ProcessLookupError):
            self.outer.kill()  # unshare itself, which would follow its child anyway
        self.outer.wait(timeout=10)
        self.outer.stderr.close()


class _Host:
    """Host ``i``: new namespaces, ``veth-h<i>`` (address 10.77.0.i/24) plugged into the
    bridge, loopback up. :meth:`start` runs a command on it, :meth:`kill` ends it whole."""

    def __init__(self, lan: "_Lan", i: int) -> None:
        self.i, self.ifname, self.addr = i, f"veth-h{i}", f"{_SUBNET}.{i}"
        self.ns = _Namespace(pid_ns=True)
        self.procs: list[subprocess.Popen] = []
        try:
            # Created in both namespaces at once: no name in this one to clash with. A fixed
            # MAC per host: the one that comes back answers the survivor's cached ARP entry.
            _ip("link", "add", "name", self.ifname, "netns", str(self.ns.pid), "address", f"02:77:00:00:00:{i:02x}",
                "type", "veth", "peer", "name", f"port-h{i}", "netns", str(lan.switch.pid))
            _ip("link", "set", f"port-h{i}", "master", "br0", "up", netns=lan.switch.pid)
            _ip("addr", "add", f"{self.addr}/24", "dev", self.ifname, netns=self.ns.pid)
            _ip("link", "set", self.ifname, "up", netns=self.ns.pid)
            _ip("link", "set", "lo", "up", netns=self.ns.pid)
        except BaseException:
            self.ns.kill()
            raise

    def start(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        """``argv`` on this host (its network, pid and mount namespaces), output to ``log``."""
        with open(log, "w") as f:
            proc = subprocess.Popen(["nsenter", "--target", str(self.ns.pid), "--net", "--pid", "--mount", "--", *argv],
                                    stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def tx_bytes(self) -> int:
        """Bytes sent on this host's veth, read inside its network namespace
        (``/proc/<pid>/net/dev`` is the table of that process's namespace)."""
        for line in Path(f"/proc/{self.ns.pid}/net/dev").read_text().splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == self.ifname:
                return int(fields.split()[8])  # receive: 8 fields, then transmit's bytes
        raise AssertionError(f"{self.ifname} not in host {self.i}'s /proc/net/dev")

    def ranks(self) -> list[int]:
        """pids of the ranks running on this host: processes in its pid namespace that
        torchrun's agent started (``RANK`` in their environment)."""
        ns = os.readlink(f"/proc/{self.ns.pid}/ns/pid")
        pids = []
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if proc.name.isdigit() and os.readlink(proc / "ns/pid") == ns \
                        and b"\0RANK=" in b"\0" + (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
        return pids

    def kill(self) -> None:
        """SIGKILL the namespace's init: every process on the host dies, its veth goes."""
        self.ns.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)  # nsenter, which waited for its child in the namespace


class _Lan:
    """The switch: a network namespace holding bridge ``br0``, which each host's veth pair
    plugs into (nothing is configured in the machine's own namespace)."""

    def __init__(self) -> None:
        self.switch = _Namespace(pid_ns=False)
        self.hosts: list[_Host] = []
        try:
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch.pid)
            _ip("link", "set", "br0", "up", netns=self.switch.pid)
        except BaseException:
            self.switch.kill()
            raise

    def host(self, i: int) -> _Host:
        host = _Host(self, i)
        self.hosts.append(host)
        return host

    def close(self) -> None:
        for host in self.hosts:
            host.kill()
        self.switch.kill()  # its end of every veth pair, and with it the pair


@pytest.fixture
def lan() -> Iterator[_Lan]:
    """A bridge for hosts; skipped where namespaces or veths cannot be made here."""
    if os.geteuid() != 0:
        pytest.skip("needs root: network and pid namespaces, veth pairs (unshare, ip link)")
    try:
        lan = _Lan()
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot make network namespaces and a bridge here: {str(getattr(e, 'stderr', None) or e).strip()}")
    try:
        try:
            lan.host(99).kill()  # one veth pair, made and removed: `ip link` works here
        except (OSError, subprocess.SubprocessError) as e:
            pytest.skip(f"cannot make veth pairs here: {str(getattr(e, 'stderr', None) or e).strip()}")
        lan.hosts.clear()
        yield lan
    finally:
        lan.close()


def _torchrun(host: _Host, out: Path, layout: tuple[str, ...], *flags: str, run_id: str,
              restarts: int = 1) -> list[str]:
    """The command host ``host`` runs: one rank of a 2-host job, c10d rendezvous on host 1."""
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{_SUBNET}.1:{_PORT}", "--rdzv-id", run_id,
            # The address the other host reaches this one at (else the machine's hostname,
            # which both hosts share); torch orders the nodes by it: host 1 is node 0, rank 0.
            "--local-addr", host.addr,
            # Host 1 serves the rendezvous store: told, for torch's guess (the endpoint among the
            # addresses the machine's hostname resolves to) is false on both hosts here.
            "--rdzv-conf", f"is_host={int(host.i == 1)},join_timeout=120",
            "--max-restarts", str(restarts),
            "-m", "dtp.cli", "train", *_FLAGS, *layout, *flags, "--timeout", "60", "--out", str(out)]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _log(path: Path) -> str:
    return f"--- {path.name}:\n{path.read_text()[-4000:]}" if path.exists() else f"--- {path.name}: absent"


def _one_host(out: Path, layout: tuple[str, ...], *flags: str) -> list[float]:
    """The reference: the same run on one host, ``dtp train --nproc 2``."""
    cmd = [sys.executable, "-m", "dtp.cli", "train", "--nproc", "2", *_FLAGS, *layout, *flags, "--out", str(out)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return _losses(out)


def _start(host: _Host, out: Path, layout: tuple[str, ...], *flags: str, log: Path,
           restarts: int = 1) -> subprocess.Popen:
    """Host ``host``'s share of the job (:func:`_torchrun`), gloo on its veth."""
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: the ranks' store is rank 0's own, made anew each
    # rendezvous round, not the one node 0's agent keeps from round 0. Measured on torch
    # 2.13: with that shared store, a host that comes back (a fresh agent, in round 1) waits
    # in next_rendezvous for the MASTER_ADDR key under round 1's prefix, which the survivor
    # (node 0, its store made in round 0) never writes again, and the survivor waits for the
    # newcomer's role_info: both agents fail after the 60 s store timeout.
    env = _env(GLOO_SOCKET_IFNAME=host.ifname, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return host.start(_torchrun(host, out, layout, *flags, run_id=out.name, restarts=restarts), log, env)


def _wait(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> list[int]:
    """The exit codes of ``procs``, all ended within ``timeout`` s (else a failure with their
    logs; the fixture kills what is left)."""
    deadline = time.monotonic() + timeout
    try:
        return [proc.wait(timeout=max(0.0, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the hosts did not finish within {timeout:.0f} s\n" + "\n".join(map(_log, logs)))


def _comm_bytes(out: Path) -> int:
    """The bytes rank 0 counted in its collectives, all steps (metrics.jsonl's comm_bytes)."""
    return sum(n for line in (out / "metrics.jsonl").read_text().splitlines()
               for ops in json.loads(line)["comm_bytes"].values() for n in ops.values())


@pytest.mark.parametrize("name", list(_LAYOUTS))
def test_a_run_across_two_hosts_trains_the_one_host_curve(lan, tmp_path, name) -> None:
    """dp, tp or pp of 2 with one rank on each host: the loss curve is the one-host run's
    (``dtp train --nproc 2``, the same flags) bit for bit, and each host's veth sent at
    least the bytes rank 0's collectives moved (measured on torch 2.13, 6 steps: dp 5.35 MB
    sent for 5.13 MB counted, tp 2.11 for 1.98, pp 0.22 for 0.20; each rank sends as much
    as rank 0 in these layouts: pp's backward sends back what its forward received). No
    other way between the hosts exists: the other's address is only on the veths."""
    layout = _LAYOUTS[name]
    hosts = [lan.host(1), lan.host(2)]
    out, logs = tmp_path / f"two-hosts-{name}", [tmp_path / "host1.log", tmp_path / "host2.log"]
    before = [host.tx_bytes() for host in hosts]
    procs = [_start(host, out, layout, "--steps", "6", log=log) for host, log in zip(hosts, logs)]
    assert _wait(procs, logs, timeout=240) == [0, 0], "\n".join(map(_log, logs))
    sent = [host.tx_bytes() - b for host, b in zip(hosts, before)]
    counted = _comm_bytes(out)
    assert counted > 0 and all(s >= counted for s in sent), (sent, counted)
    assert _losses(out) == _one_host(tmp_path / "one-host", layout, "--steps", "6")


# 20 steps, the kill after step 7: 13 steps (about 0.7 s) for the poll below to see it in
# time, even when the ranks keep both cores busy.
_KILL_FLAGS = ("--steps", "20", "--save-every", "2")
_KILL_AFTER = 7


def _kill_host_2_and_bring_it_back(lan: _Lan, tmp_path: Path, *again: str,
                                   restarts: int = 1) -> tuple[Path, list[int], list[Path], int]:
    """The dp run of :data:`_KILL_FLAGS` on hosts 1 and 2; host 2 killed whole once the
    checkpoint before step :data:`_KILL_AFTER` is written and that step logged; once host
    1's rank has failed, its agent is seen to wait, and host 2 comes back (new namespaces,
    the same address and veth name) with the same command plus ``again`` (its torchrun with
    ``--max-restarts restarts``). Returns the run
    directory, the exit codes of both hosts' torchrun (host 1's, host 2's second), their
    logs, and the steps metrics.jsonl held when host 2 was killed."""
    out = tmp_path / "killed"
    logs = [tmp_path / "host1.log", tmp_path / "host2.log", tmp_path / "host2-again.log"]
    host1, host2 = lan.host(1), lan.host(2)
    agent = _start(host1, out, _LAYOUTS["dp"], *_KILL_FLAGS, log=logs[0])
    _start(host2, out, _LAYOUTS["dp"], *_KILL_FLAGS, log=logs[1])
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 180
    checkpoint = out / "checkpoints" / f"step_{_KILL_AFTER - 1:08d}" / "manifest.json"
    while not (checkpoint.exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= _KILL_AFTER):
        assert time.monotonic() < deadline and agent.poll() is None, "\n".join(map(_log, logs[:2]))
        time.sleep(0.05)
    trained = len(metrics.read_text().splitlines())
    assert host1.ranks() and host2.ranks() and trained < 20, "the run ended before host 2 could be killed"
    host2.kill()
    # Host 1's rank fails at once (gloo: "Connection reset by peer"), its agent stops it and,
    # a restart left, goes back to the rendezvous, where it waits for a second node.
    deadline = time.monotonic() + 60
    while host1.ranks():
        assert time.monotonic() < deadline, "host 1's rank outlived its peer by 60 s\n" + _log(logs[0])
        time.sleep(0.05)
    time.sleep(2)
    assert agent.poll() is None and not host1.ranks(), "host 1's agent did not wait for host 2\n" + _log(logs[0])
    host2 = lan.host(2)
    again_proc = _start(host2, out, _LAYOUTS["dp"], *_KILL_FLAGS, *again, log=logs[2], restarts=restarts)
    return out, _wait([agent, again_proc], [logs[0], logs[2]], timeout=240), logs, trained


def test_a_killed_host_comes_back_and_the_job_resumes_from_its_last_checkpoint(lan, tmp_path) -> None:
    """Host 2 (every process on it, by SIGKILL of its namespace's init) dies mid-run; host
    1's agent (``--max-restarts 1``) sees its rank fail and waits in a new rendezvous; host 2
    comes back with the same command, and the job (the same world of 2) resumes from the
    newest checkpoint: the whole loss curve, steps 1-20, equals the uninterrupted one-host
    run's bit for bit (fp64).

    The host killed is not the rendezvous host: host 1's agent serves the c10d store, and
    the store dies with host 1. Measured on torch 2.13: host 2's agent then fails within
    2 s ("The connection to the C10d store has failed"), and a host 1 that comes back waits
    alone for its join_timeout (RendezvousTimeoutError): the job is lost, to be started
    again (``--resume``). torchrun cannot move the store.

    The host that comes back runs a fresh agent, whose ranks see TORCHELASTIC_RESTART_COUNT=0
    (the survivor's see 1), yet the same command, no ``--resume``: its ranks find the job's
    --rdzv-id in the run's config.json (dtp.launch.rejoined) and resume from the newest
    checkpoint as the survivor's do. (Before that rule they started from step 0, the ranks
    disagreed on the checkpoint and the job stopped: "the ranks disagree on checkpoint —
    rank 0: .../step_00000006; rank 1: <absent>".)"""
    out, codes, logs, trained = _kill_host_2_and_bring_it_back(lan, tmp_path)
    assert codes == [0, 0], "\n".join(map(_log, logs))
    resumed = [line for line in logs[0].read_text().splitlines() if "resuming from step" in line]
    assert len(resumed) == 1, _log(logs[0])
    step = int(resumed[0].split("resuming from step ")[1].split()[0])
    assert _KILL_AFTER - 1 <= step <= trained < 20, (step, trained)  # killed mid-run, resumed from before the kill
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))
    assert _losses(out) == _one_host(tmp_path / "one-host", _LAYOUTS["dp"], *_KILL_FLAGS)
