"""The process helper: dotted targets, child environment, deadline, reaping."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from gramcoord.launch import ports
from gramcoord.launch.ports import free_port
from gramcoord.launch.procs import ProcGroup, SpawnError, format_failures, run_procs
from tests.launch.entries import descendants


def _threads(rank, n):
    import torch

    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads(), os.environ.get("TAG")


def _sleep(rank, n):
    while True:
        time.sleep(1)


def _ignore_sigterm(ready):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    while True:
        time.sleep(1)


def test_free_port_is_bindable_on_the_host():
    port = free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_is_never_one_an_outgoing_connection_can_take():
    # The CI failure this guards: bind(0) gave an ephemeral port, and a
    # connect elsewhere took it before the TCPStore listened (EADDRINUSE).
    low = ports.ephemeral_low()
    picked = {free_port("127.0.0.1") for _ in range(50)}
    assert all(20000 <= p < low for p in picked), sorted(picked)
    assert len(picked) > 1


def test_free_port_falls_back_to_the_os_when_no_room_is_left(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: 20500)
    port = free_port("127.0.0.1")
    assert port >= 20500  # the OS's pick, from its own range
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_failures_are_listed_earliest_first():
    def result(rank, ok, at):
        return SimpleNamespace(
            rank=rank, ok=ok, error_type="E", traceback=f"tb{rank}", finished_at=at, exitcode=1
        )

    text = format_failures(
        [
            result(0, False, 0.0),
            result(1, False, 20.0),
            result(2, True, 1.0),
            result(3, False, 10.0),
        ],
        "why",
    )
    assert text.startswith("why\n")
    assert text.index("rank 3") < text.index("rank 1") < text.index("rank 0")
    assert "rank 2" not in text


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_dotted_target_gets_one_omp_thread_from_the_start(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    results = run_procs("tests.launch.test_procs_helper:_threads", 2, env={"TAG": "x"}, timeout=60)
    assert [r.value for r in results] == [("1", 1, "x")] * 2
    assert "OMP_NUM_THREADS" not in os.environ and "TAG" not in os.environ


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_deadline_ends_the_group_and_reaps_every_child():
    before = descendants()
    start = time.monotonic()
    with pytest.raises(SpawnError, match="deadline of 6s passed") as info:
        run_procs(_sleep, 2, timeout=6)
    assert time.monotonic() - start < 6 + 10
    assert [r.error_type for r in info.value.results] == ["timeout", "timeout"]
    assert [r.exitcode for r in info.value.results] == [-signal.SIGTERM] * 2
    assert descendants() - before == set()


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_keyboard_interrupt_reaps_every_child():
    before = descendants()
    timer = threading.Timer(4, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_procs(_sleep, 2, timeout=60)
    finally:
        timer.cancel()
    assert descendants() - before == set()


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_group_kills_a_child_that_ignores_sigterm():
    with ProcGroup() as group:
        ready = group.event()
        proc = group.start(_ignore_sigterm, ready)
        assert ready.wait(60)
        start = time.monotonic()
        group.close(grace_s=1)
        assert 1 <= time.monotonic() - start < 10
    assert proc.exitcode == -signal.SIGKILL


def _state(rank, n):
    import sys

    print(f"child {rank} says hello", flush=True)
    print(f"child {rank} warns", file=sys.stderr, flush=True)
    return (
        os.environ.get("GRAMCOORD_TEST_LATE"),
        os.environ.get("GRAMCOORD_TEST_GONE"),
        os.getcwd(),
        os.getpriority(os.PRIO_PROCESS, 0),
        "torch" in sys.modules,
    )


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_forked_child_gets_what_a_spawned_one_would(tmp_path, monkeypatch, capfd):
    # The fork server is already running (started by an earlier group, with
    # the environment of that moment): what changed since must still reach
    # the child, and what the server preloaded must not have to be imported.
    run_procs(_sleep_briefly, 1, timeout=60)
    monkeypatch.setenv("GRAMCOORD_TEST_LATE", "set-after-the-server-started")
    monkeypatch.delenv("GRAMCOORD_TEST_GONE", raising=False)
    monkeypatch.chdir(tmp_path)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    results = run_procs(_state, 2, timeout=60)
    assert [r.value for r in results] == [
        ("set-after-the-server-started", None, str(tmp_path), nice, True)
    ] * 2
    out, err = capfd.readouterr()
    assert "child 0 says hello" in out and "child 1 says hello" in out
    assert "child 0 warns" in err and "child 1 warns" in err


def _sleep_briefly(rank, n):
    time.sleep(0.1)


def _register_exit_hook(path):
    import atexit

    atexit.register(lambda: open(path, "w").close())


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_a_childs_atexit_hooks_run_when_it_returns(tmp_path):
    # Joined, not reaped: run_procs terminates a child still exiting once its
    # result is in, spawned or forked alike.
    with ProcGroup() as group:
        procs = [group.start(_register_exit_hook, str(tmp_path / f"hook.{i}")) for i in range(2)]
        for proc in procs:
            proc.join(60)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook.0", "hook.1"]
