"""A deadline that passes names each rank still running and what it waits in."""

from __future__ import annotations

import select
import time

from gramcoord.launch import stack_dump
from gramcoord.launch.procs import ProcGroup, run_procs


def _blocked_in_select(ready, path):
    stack_dump.arm(path)
    r, _w = __import__("os").pipe()
    ready.set()
    select.select([r], [], [])  # never readable: the "collective" nobody joins


def _blocked_forever(rank, n):
    while True:
        time.sleep(1)


def test_dump_names_the_blocking_call_and_our_frame(tmp_path):
    path = tmp_path / "rank0.txt"
    with ProcGroup() as group:
        ready = group.event()
        proc = group.start(_blocked_in_select, ready, str(path))
        assert ready.wait(120)
        # The event is set just before the call: until the child is inside
        # select, a dump may catch it in Event.set. Wait for that state (a
        # condition that must come, not a timing bet); then the innermost
        # Python frame is the function blocked in (C) select.
        end = time.monotonic() + 120
        line = ""
        while not line.startswith("waiting in _blocked_in_select") and time.monotonic() < end:
            line = stack_dump.waiting_in(stack_dump.dump({0: proc.pid}, {0: path})[0])
    assert line.startswith("waiting in _blocked_in_select (tests/launch/test_stack_dump.py:")


def _not_armed_yet(ready, go):
    ready.set()  # still "starting": no handler, so SIGUSR1 would kill it
    go.wait(120)


def test_dump_leaves_a_process_that_has_not_armed_alone(tmp_path):
    # Under load a deadline can pass while a child is still starting, before
    # it armed: signalling it then killed it (exit -SIGUSR1, a loaded run).
    path = tmp_path / "rank0.txt"
    with ProcGroup() as group:
        ready, go = group.event(), group.event()
        proc = group.start(_not_armed_yet, ready, go)
        assert ready.wait(120)
        assert stack_dump.dump({0: proc.pid}, {0: path}) == {0: ""}
        assert proc.is_alive()
        go.set()
        proc.join(120)
    assert proc.exitcode == 0


def test_arm_makes_the_file_once_the_handler_is_in_place_and_disarm_removes_it(tmp_path):
    path = tmp_path / "rank0.txt"
    stack_dump.arm(path)
    try:
        assert path.is_file() and not (tmp_path / "rank0.txt.arming").exists()
    finally:
        stack_dump.disarm()
    assert not path.exists()


def test_waiting_in_reads_the_current_thread_of_a_faulthandler_dump():
    text = (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/x/lib/python3.11/threading.py", line 320 in wait\n'
        "\n"
        "Current thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 3950 in all_gather\n'
        f'  File "{stack_dump._ROOT}coordinator/agreement.py", line 118 in _exchange\n'
        f'  File "{stack_dump._ROOT}launch/procs.py", line 210 in _child\n'
    )
    assert stack_dump.waiting_in(text) == (
        "waiting in all_gather (torch/distributed/distributed_c10d.py:3950)"
        " from coordinator/agreement.py:118 in _exchange"
    )
    assert stack_dump.waiting_in("") == "no stack (it did not answer the dump signal)"


def test_run_procs_deadline_lists_every_rank_still_running():
    results = run_procs(_blocked_forever, 2, timeout=3, check=False)
    assert [r.error_type for r in results] == ["timeout", "timeout"]
    try:
        run_procs(_blocked_forever, 2, timeout=3)
    except Exception as exc:  # SpawnError
        text = str(exc)
    head = text.splitlines()[:3]
    assert head[0] == "deadline of 3s passed"
    assert head[1].startswith("  rank 0 ") and head[2].startswith("  rank 1 ")


def test_a_rank_writes_its_stacks_on_sigusr1_and_leaves_no_empty_file(tmp_path):
    import os
    import signal

    from gramcoord.launch.rank_main import _RankLogs

    with _RankLogs(tmp_path, 3):
        os.kill(os.getpid(), signal.SIGUSR1)
        text = stack_dump.collect([tmp_path / "logs" / "rank3.stacks"])
    assert "Current thread" in next(iter(text.values()))
    assert "test_a_rank_writes_its_stacks" in stack_dump.waiting_in(next(iter(text.values())))
    with _RankLogs(tmp_path, 4):
        pass  # never signalled: no file is left behind
    assert not (tmp_path / "logs" / "rank4.stacks").exists()


_HUNG_RANK = """
import pathlib, select, sys, os
from gramcoord.launch import stack_dump
logs = pathlib.Path(sys.argv[1]) / "logs"
logs.mkdir(parents=True)
stack_dump.arm(logs / "rank0.stacks")
def wait_for_peer():
    (logs / "ready").write_text("1")
    select.select([os.pipe()[0]], [], [])
wait_for_peer()
"""


def test_e2e_deadline_names_where_each_rank_waits(tmp_path):
    import subprocess
    import sys

    from tests.launch.e2e_support import _kill_group, _where_ranks_wait

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _HUNG_RANK, str(out)], start_new_session=True)
    try:
        end = time.monotonic() + 120
        while not (out / "logs" / "ready").exists() and time.monotonic() < end:
            time.sleep(0.05)
        line = ""
        while "wait_for_peer" not in line and time.monotonic() < end:
            line = _where_ranks_wait(proc.pid, ["run", "--out", str(out)])
    finally:
        _kill_group(proc.pid)
        proc.wait()
    assert line.startswith("; where each rank waits:\n  rank0 waiting in wait_for_peer (")
