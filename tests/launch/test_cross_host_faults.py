"""Faults that only exist across hosts.

Two simulated hosts (network namespaces), one rank on each under its own
``torchrun --nnodes 2`` (c10d rendezvous, ``launcher: external``, gloo over
the veth link), dp=2 with replicated requests and a 5 s step timeout. While
the step loop runs, host B is

1. cut off the switch (a partition): both ranks are survivors;
2. stalled (every process SIGSTOPped past the step timeout, then resumed);
3. killed with all its ranks at once (SIGKILL).

Each survivor must exit non-zero within ``step_timeout_s + 10 s`` of the
fault (both scaled by the load measured when the test starts,
``tests/load.py``), naming the lost rank (``gramcoord: PeerLostError: ... rank N lost``);
nothing may hang, and closing the hosts leaves no namespace, process or
``/dev/shm`` segment of the run.

This file is also the rank program: run as a script (by torchrun) it slows
every model call by ``GRAMCOORD_TEST_STEP_SLEEP`` seconds, so that the run
is still in its step loop when the fault hits, then hands over to
``gramcoord.launch.rank_main.main``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

# On a quiet machine; each test scales them by the load at its start (Limits).
STEP_TIMEOUT_S = 5.0
SLACK_S = 10.0  # survivors exit within step timeout + this after the fault
AGENT_GRACE_S = 30.0  # torchrun's agent gets this long after its rank exited
# ... except an agent the test expects to hang (the partition's host B waits on
# the store it lost): it is killed this long after its rank, unscaled, since
# its exit proves nothing and a scaled 30 s would only be waited out.
HUNG_AGENT_GRACE_S = 2.0
START_S = 150.0  # until both ranks are in their step loop
STEP_SLEEP_S = "0.1"  # ~140 steps: ~15 s of step loop, > 8 s


def _rank_program() -> int:
    """torchrun's worker: rank_main, with a slowed model."""
    import faulthandler

    import gramcoord.launch.rank_main as rank_main

    # SIGUSR1 dumps the rank's stacks (into OUT/logs/native-rankN.log).
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    delay = float(os.environ.get("GRAMCOORD_TEST_STEP_SLEEP", "0"))
    make_model = rank_main.make_model

    class Slow:
        def __init__(self, inner) -> None:
            self._inner = inner

        def logits(self, rows):
            time.sleep(delay)
            return self._inner.logits(rows)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    rank_main.make_model = lambda *a, **kw: Slow(make_model(*a, **kw))
    return rank_main.main()


if __name__ == "__main__":
    from gramcoord.launch.rank_process import rank_process

    rank_process(_rank_program)


import pytest  # noqa: E402

from tests import load  # noqa: E402
from tests.launch.e2e_support import aborts  # noqa: E402
from tests.simulated_hosts import SimulatedHosts, available  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class Limits(NamedTuple):
    """This test's deadlines: the quiet ones scaled by the load at its start."""

    step_timeout_s: float
    bound_s: float  # survivors exit within this long after the fault
    agent_grace_s: float
    start_s: float

    @classmethod
    def now(cls) -> Limits:
        f = load.factor()
        step = load.step_timeout(STEP_TIMEOUT_S, f)
        return cls(
            step,
            step + load.scaled(SLACK_S, f),
            load.scaled(AGENT_GRACE_S, f),
            load.scaled(START_S, f),
        )


def _config(limits: Limits) -> str:
    return f"""\
launcher: external
parallel: {{dp: 2, pp: 1, tp: 1, requests: replicated}}
distributed: {{step_timeout_s: {limits.step_timeout_s}, nnodes: 2, clock_sync_steps: 8}}
grammar: {{compile_mode: sync, compile_timeout_s: 10}}
workload: {{path: {ROOT / "configs" / "workload.jsonl"}, limit: 20, arrival: per_step, per_step: 1, max_tokens: 256}}
"""


# -- processes, by /proc -------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _ns_pids(ns: str) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in res.stdout.split()]


def _namespaces() -> set[str]:
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return {ln.split()[0] for ln in res.stdout.splitlines() if ln.strip()}


class Host:
    """One host's torchrun agent (the ``popen``) and its rank process."""

    def __init__(self, node: int, agent: subprocess.Popen, log: Path) -> None:
        self.node, self.agent, self.log = node, agent, log
        self.rank_pid: int | None = None
        self.rank_exit: float | None = None  # monotonic
        self.agent_exit: float | None = None
        self.agent_killed = False

    def find_rank(self, hosts: SimulatedHosts) -> int:
        for pid in _ns_pids(hosts.namespaces[self.node]):
            cmd = _cmdline(pid)
            if __file__ in cmd and not any("torch.distributed.run" in c for c in cmd):
                self.rank_pid = pid
                return pid
        raise AssertionError(f"host {self.node}: no rank process yet")

    def poll(self, now: float) -> None:
        if self.rank_exit is None and self.rank_pid is not None and not _alive(self.rank_pid):
            self.rank_exit = now
        if self.agent_exit is None and self.agent.poll() is not None:
            self.agent_exit = now
            if self.rank_exit is None:
                self.rank_exit = now

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _start(hosts: SimulatedHosts, tmp_path: Path, limits: Limits) -> tuple[list[Host], Path, str]:
    cfg = tmp_path / "faults.yaml"
    cfg.write_text(_config(limits))
    out = tmp_path / "out"
    run_id = "xh" + secrets.token_hex(4)
    started = []
    for node in range(2):
        argv = [
            "env", "GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1",
            f"GRAMCOORD_TEST_STEP_SLEEP={STEP_SLEEP_S}",
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-id", run_id,
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.names[0]}:29400",
            "--log-dir", str(tmp_path / f"torchrun{node}"),
            __file__, str(cfg), "--out", str(out),
        ]  # fmt: skip
        log = tmp_path / f"host{node}.txt"
        with log.open("wb") as fh:
            agent = hosts.popen(node, argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        started.append(Host(node, agent, log))
    return started, out, run_id


def _wait_running(hosts: SimulatedHosts, started: list[Host], out: Path, limits: Limits) -> None:
    """Until both ranks are in the step loop (rank_main logs the layout just before)."""
    deadline = time.monotonic() + limits.start_s
    logs = [out / "logs" / f"rank{r}.log" for r in range(2)]
    while time.monotonic() < deadline:
        for h in started:
            if h.agent.poll() is not None:
                raise AssertionError(f"host {h.node} ended before the fault:\n{h.output[-3000:]}")
        if all(p.exists() and "gramcoord.rank: rank " in p.read_text() for p in logs):
            time.sleep(2.0)  # a few steps in
            for h in started:
                h.find_rank(hosts)
            return
        time.sleep(0.1)
    raise AssertionError("the run did not reach its step loop: " + started[0].output[-3000:])


def _watch(
    started: list[Host],
    t_fault: float,
    t_from: float,
    limits: Limits,
    graces: dict[int, float] | None = None,
) -> None:
    """Poll the hosts until every rank and agent ended. A rank gets until
    ``t_from + limits.bound_s``; an agent ``limits.agent_grace_s`` past its
    rank's exit (or ``graces[node]`` where given), after which it is killed
    (``agent_killed``)."""
    graces = graces or {}
    while True:
        now = time.monotonic()
        for h in started:
            h.poll(now)
            grace = graces.get(h.node, limits.agent_grace_s)
            if h.agent_exit is None and h.rank_exit is not None and now - h.rank_exit > grace:
                h.agent_killed = True
                h.agent.kill()
        if all(h.agent_exit is not None for h in started):
            return
        if now > t_from + limits.bound_s and any(h.rank_exit is None for h in started):
            return  # a rank hangs: the caller reports it
        time.sleep(0.05)


def _report(name: str, started: list[Host], t_fault: float, out: Path) -> str:
    lines = [f"[{name}]"]
    for h in started:
        rel = lambda t: None if t is None else round(t - t_fault, 2)  # noqa: E731
        lines.append(
            f"  host{h.node}: rank exited at +{rel(h.rank_exit)} s, agent at "
            f"+{rel(h.agent_exit)} s rc={h.agent.returncode} killed={h.agent_killed}; "
            f"says: {_said(h.output)}"
        )
        if h.rank_pid is not None and _alive(h.rank_pid):  # hung: where?
            os.kill(h.rank_pid, signal.SIGUSR1)
            time.sleep(0.5)
            native = out / "logs" / f"native-rank{h.node}.log"
            lines.append(f"  host{h.node}'s rank hangs in:\n{native.read_text()[-2500:]}")
    text = "\n".join(lines)
    print(text)
    return text


def _said(output: str) -> str:
    keep = [ln for ln in output.splitlines() if "gramcoord" in ln and "Error" in ln]
    keep += [ln.strip() for ln in output.splitlines() if "exitcode" in ln or "error_file" in ln]
    return " | ".join(keep)[:1500]


def _names_lost(h: Host, lost: int) -> bool:
    return f"PeerLostError: [rank {h.node}] rank {lost} lost" in h.output


def _close_clean(hosts: SimulatedHosts, run_id: str) -> None:
    """``close`` kills what is left and removes every namespace and segment of the run."""
    before = [pid for ns in hosts.namespaces for pid in _ns_pids(ns)]
    names = set(hosts.namespaces)
    hosts.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in before):
        time.sleep(0.05)
    assert [p for p in before if _alive(p)] == [], "processes outlived close()"
    assert names & _namespaces() == set()
    shm = sorted(p.name for p in Path("/dev/shm").glob(f"gramcoord-{run_id}-*"))
    assert shm == [], shm


def _no_aborts(started: list[Host], out: Path) -> None:
    """No rank aborted at exit, whatever it found out (its host's output and the logs)."""
    assert aborts(*(h.output for h in started), out / "logs") == []


@pytest.fixture
def hosts():
    ok, why = available()
    if not ok:
        pytest.skip(why or "simulated hosts unavailable")
    h = SimulatedHosts(2)
    try:
        yield h
    finally:
        h.close()


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_partition_every_side_names_the_other(hosts, tmp_path):
    limits = Limits.now()
    started, out, run_id = _start(hosts, tmp_path, limits)
    _wait_running(hosts, started, out, limits)
    hosts.partition(1)
    t_fault = time.monotonic()
    # Host A's agent must end on its own (asserted below, full grace); host B's
    # may wait on the store it lost, and only has to not report success.
    _watch(started, t_fault, t_fault, limits, graces={1: HUNG_AGENT_GRACE_S})
    report = _report("partition", started, t_fault, out)
    a, b = started
    assert a.rank_exit is not None and a.rank_exit - t_fault <= limits.bound_s, report
    assert a.agent.returncode not in (None, 0) and not a.agent_killed, report
    assert _names_lost(a, 1), report + "\n" + a.output[-3000:]
    b_hung = b.rank_exit is None
    _close_clean(hosts, run_id)  # also ends a hung host B
    # Rank 1 lost the store host: its roll call may still be blocked on it.
    _no_aborts(started, out)
    # Rank 1's roll call asks the store on host A, which the partition cut
    # off: coordinator.runtime.roll_call bounds it on a thread (a blocked TCPStore.check
    # has no deadline of its own).
    assert not b_hung, report
    assert b.rank_exit - t_fault <= limits.bound_s, report
    assert _names_lost(b, 0), report + "\n" + b.output[-3000:]
    # torchrun's agent on host B may itself wait on the lost store (it is
    # killed HUNG_AGENT_GRACE_S after its rank); either way it must not report success.
    assert b.agent.returncode != 0, report


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_stalled_host_is_lost_and_its_ranks_end_when_resumed(hosts, tmp_path):
    limits = Limits.now()
    started, out, run_id = _start(hosts, tmp_path, limits)
    _wait_running(hosts, started, out, limits)
    frozen = _ns_pids(hosts.namespaces[1])
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    t_fault = time.monotonic()
    a, b = started
    # Frozen until the survivor's rank has ended (it named the host lost: a
    # step timeout at least), or past the step timeout by half the slack.
    until = t_fault + (limits.step_timeout_s + limits.bound_s) / 2
    while time.monotonic() < until and a.rank_exit is None:
        a.poll(time.monotonic())
        time.sleep(0.05)
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    t_resume = time.monotonic()
    _watch(started, t_fault, t_resume, limits)
    report = _report("stall", started, t_fault, out)
    print(f"  host B resumed at +{round(t_resume - t_fault, 2)} s")
    assert a.rank_exit is not None and a.rank_exit - t_fault <= limits.bound_s, report
    assert a.agent.returncode not in (None, 0), report
    assert _names_lost(a, 1), report + "\n" + a.output[-3000:]
    # The resumed host's rank ends too, with an error, within the bound.
    assert b.rank_exit is not None and b.rank_exit - t_resume <= limits.bound_s, report
    assert b.agent.returncode not in (None, 0), report
    assert all(not h.agent_killed for h in started), report
    _close_clean(hosts, run_id)
    _no_aborts(started, out)


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_dead_host_is_named_by_the_survivor(hosts, tmp_path):
    limits = Limits.now()
    started, out, run_id = _start(hosts, tmp_path, limits)
    _wait_running(hosts, started, out, limits)
    for pid in _ns_pids(hosts.namespaces[1]):
        os.kill(pid, signal.SIGKILL)
    t_fault = time.monotonic()
    _watch(started, t_fault, t_fault, limits)
    report = _report("host death", started, t_fault, out)
    a, b = started
    assert b.agent.returncode == -signal.SIGKILL, report
    assert a.rank_exit is not None and a.rank_exit - t_fault <= limits.bound_s, report
    assert a.agent.returncode not in (None, 0), report
    assert not a.agent_killed, report
    assert _names_lost(a, 1), report + "\n" + a.output[-3000:]
    _close_clean(hosts, run_id)
    _no_aborts(started, out)
