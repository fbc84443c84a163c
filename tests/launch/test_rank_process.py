"""A rank's process ends with its own status, never "terminate called" (``launch.rank_process``).

Each case runs a small rank program in a subprocess that leaves a store
call blocked on a daemon thread, as a roll call on a lost store host does
(``coordinator.runtime.roll_call``), and a finalizer that outlasts the
call's timeout: without ``rank_process`` the call returns into a finalizing
interpreter and the process aborts (SIGABRT, "terminate called without an
active exception") -- the ``plain`` case shows it does.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.load import scaled

ROOT = Path(__file__).resolve().parents[2]

# A store call blocked on a daemon thread, timing out (in C++) while the
# interpreter finalizes.
BLOCKED_STORE = """
import datetime, sys, threading, time
import torch.distributed as dist

class _SlowFinalization:
    def __init__(self):
        self.sleep = time.sleep

    def __del__(self):
        self.sleep(3.0)

_keep = _SlowFinalization()

def blocked_store_call():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                          timeout=datetime.timedelta(seconds=1))
    entering = threading.Event()

    def call():
        entering.set()
        store.get("never")

    threading.Thread(target=call, daemon=True).start()
    entering.wait()
    time.sleep(0.5)  # the thread holds the GIL from here to inside the call
"""

RANK_PROGRAM = (
    BLOCKED_STORE
    + """
from gramcoord.launch.rank_process import rank_process

def main():
    blocked_store_call()
    how = sys.argv[1]
    if how == "interrupted":
        raise KeyboardInterrupt
    if how == "raises":
        raise RuntimeError("the store host is gone\\nmore")
    return 3

if sys.argv[1] == "plain":
    blocked_store_call()
    sys.exit(3)
rank_process(main)
"""
)

# A worker as torch's agent spawns one: multiprocessing's spawn, whose child
# exits through sys.exit.
WORKER_PROGRAM = (
    BLOCKED_STORE
    + """
import multiprocessing as mp

def target(fail):
    from gramcoord.launch.rank_process import worker
    worker()
    blocked_store_call()
    if fail:
        raise RuntimeError("lost peer")

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=target, args=(sys.argv[1] == "raises",))
    p.start()
    p.join(120)
    print("exitcode", p.exitcode, flush=True)
"""
)


def _run(tmp_path: Path, program: str, how: str) -> subprocess.CompletedProcess:
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(program))
    return subprocess.run(
        [sys.executable, str(path), how],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )


@pytest.mark.spawn
@pytest.mark.parametrize(
    ("how", "status", "line"),
    [
        ("returns", 3, None),
        ("interrupted", 130, "gramcoord: rank 0 interrupted"),
        ("raises", 1, "gramcoord: rank 0 failed: RuntimeError: the store host is gone"),
    ],
)
def test_a_rank_leaves_with_its_own_status_under_a_blocked_store_call(tmp_path, how, status, line):
    res = _run(tmp_path, RANK_PROGRAM, how)
    assert "terminate called" not in res.stderr, res.stderr
    assert res.returncode == status, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gramcoord")]
    assert lines == ([line] if line else []), res.stderr


@pytest.mark.spawn
def test_without_it_the_same_program_aborts(tmp_path):
    # The abort needs the store thread inside its call when the interpreter
    # finalizes; on a loaded machine a run can exit first (status 3, nothing
    # on stderr: the call never reached its timeout), so the hazard is shown
    # by the first of three runs that reaches it.
    runs = []
    for _ in range(3):
        res = _run(tmp_path, RANK_PROGRAM, "plain")
        runs.append(res)
        if res.returncode == -signal.SIGABRT and "terminate called" in res.stderr:
            return
    # Every run exited before its store call reached the interpreter's
    # finalization: the hazard did not show on this machine now. That is
    # timing, not a verdict on the code: said, never failed.
    assert all(r.returncode == 3 and not r.stderr.strip() for r in runs), [
        (r.returncode, r.stderr[-300:]) for r in runs
    ]
    pytest.skip("the control run never reached its store call's timeout here (3 of 3 exited 3)")


@pytest.mark.spawn
@pytest.mark.parametrize(("how", "status"), [("returns", 0), ("raises", 1)])
def test_a_spawned_worker_leaves_with_its_own_status(tmp_path, how, status):
    res = _run(tmp_path, WORKER_PROGRAM, how)
    assert "terminate called" not in res.stderr, res.stderr
    assert res.stdout.strip() == f"exitcode {status}", res.stdout + res.stderr
