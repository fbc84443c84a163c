"""The launchers run one entry per rank and leave nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gramcoord.launch.launchers import (
    LaunchError,
    check_outcomes,
    launch_inline,
    launch_torchrun,
)
from tests.launch.entries import decode, descendants, job, wait_for_no_descendants
from tests.load import scaled

ENTRY = "tests.launch.entries:allreduce"


def assert_nothing_left(before: set[int]) -> None:
    """No process of the launch remains, and torch's agent thread has ended."""
    assert descendants() - before == set()
    assert not [t for t in threading.enumerate() if t.name.startswith("gramcoord-torchrun")]


def assert_all_summed(outcomes, world: int) -> None:
    reports = [decode(v) for v in check_outcomes(outcomes)]
    assert [r.rank for r in reports] == list(range(world))
    assert [r.local_rank for r in reports] == list(range(world))
    assert {r.world_size for r in reports} == {world}
    assert {r.total for r in reports} == {world * (world + 1) // 2}
    assert len({r.pid for r in reports}) == world


def assert_rank_1_raised(outcomes) -> None:
    assert [o.rank for o in outcomes] == [0, 1]
    bad, other = outcomes[1], outcomes[0]
    assert not bad.ok and bad.error_type == "ValueError"
    assert "boom on rank 1" in bad.traceback and "entries.py" in bad.traceback
    assert not other.ok and other.error_type == "terminated"
    with pytest.raises(LaunchError) as info:
        check_outcomes(outcomes)
    text = str(info.value)
    assert text.index("--- rank 1 (ValueError") < text.index("--- rank 0 (terminated")


def test_inline_runs_rank_0_of_1_and_restores_the_environment():
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    outcomes = launch_inline(ENTRY, job())
    assert_all_summed(outcomes, 1)
    assert {k: os.environ.get(k) for k in saved} == saved


def test_inline_reports_a_raising_entry():
    (outcome,) = launch_inline(ENTRY, job(fail_rank=0))
    assert not outcome.ok and outcome.error_type == "ValueError"
    assert "boom on rank 0" in outcome.traceback


def test_entry_must_return_bytes():
    (outcome,) = launch_inline("tests.launch.entries:not_bytes", b"")
    assert outcome.error_type == "TypeError" and "expected bytes" in outcome.traceback


@pytest.mark.parametrize(
    ("kwargs", "deadline_s"),
    [
        pytest.param({}, 90, id="two-ranks"),
        pytest.param({"fail_rank": 1}, 90, id="rank-raises"),
        pytest.param({"hang_rank": 1}, 12, id="rank-hangs"),
    ],
)
@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_torchrun(kwargs, deadline_s):
    if "hang_rank" not in kwargs:
        deadline_s = scaled(deadline_s)  # quiet; a loaded run ran past a fixed 90 s
    # A hang is reported at its deadline whatever the ranks were doing, so
    # that one stays 12 s: scaled, it outlasted rank 0's 60 s gloo init
    # timeout at load 20, and rank 0 ended with DistStoreError instead.
    before = descendants()
    start = time.monotonic()
    outcomes = launch_torchrun(ENTRY, job(**kwargs), nproc=2, deadline_s=deadline_s)
    took = time.monotonic() - start
    # Nothing outlives the launch, not even for a moment.
    assert_nothing_left(before)
    if not kwargs:
        assert_all_summed(outcomes, 2)
    elif "fail_rank" in kwargs:
        assert_rank_1_raised(outcomes)
    else:
        assert [(o.rank, o.ok, o.error_type) for o in outcomes] == [
            (0, False, "deadline"),
            (1, False, "deadline"),
        ]
        assert deadline_s <= took < deadline_s + scaled(10)


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_torchrun_keyboard_interrupt_stops_every_rank():
    before = descendants()
    timer = threading.Timer(5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch_torchrun(ENTRY, job(hang_rank=1), nproc=2, deadline_s=scaled(120))
    finally:
        timer.cancel()
    assert_nothing_left(before)


@pytest.mark.parametrize(
    "kwargs", [pytest.param({}, id="two-ranks"), pytest.param({"fail_rank": 1}, id="rank-raises")]
)
@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_ray(kwargs):
    pytest.importorskip("ray")
    from gramcoord.launch.ray_launcher import launch_ray

    before = descendants()
    outcomes = launch_ray(
        ENTRY, job(**kwargs), nproc=2, deadline_s=scaled(120), num_cpus_per_rank=1
    )
    # Ray's own processes (gcs, raylet, workers) wind down after shutdown.
    assert wait_for_no_descendants(before) == set()
    if kwargs:
        assert_rank_1_raised(outcomes)
    else:
        assert_all_summed(outcomes, 2)
        # Ray starts workers at nice 15; ranks run at the driver's priority
        # (at nice 15 a rank starves next to any busy process).
        driver = os.getpriority(os.PRIO_PROCESS, 0)
        assert {decode(v).nice for v in check_outcomes(outcomes)} == {driver}


@pytest.mark.spawn
@pytest.mark.timeout(120)
def test_a_rank_on_a_niced_ray_worker_takes_the_drivers_priority_back_or_says_why():
    """The path for a cluster started elsewhere (``ray start``, workers at nice 15)."""
    code = (
        "import os, sys\n"
        "from gramcoord.launch.procs import match_priority\n"
        "why = match_priority(0)\n"
        "print(why or 'ok', os.getpriority(os.PRIO_PROCESS, 0))\n"
    )
    res = subprocess.run(
        ["nice", "-n", "15", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=scaled(100),
    )
    assert res.returncode == 0, res.stderr
    if os.geteuid() == 0:  # CAP_SYS_NICE: the priority comes back
        assert res.stdout.split() == ["ok", "0"]
    else:
        assert "start the ray cluster with RAY_worker_niceness=0" in res.stdout
        assert res.stdout.split()[-1] == "15"


def test_a_ray_start_that_fails_part_way_leaves_no_process_behind(monkeypatch):
    """A ``ray.init`` that times out after starting the head's processes: they are ended."""
    from gramcoord.launch import ray_launcher

    started = []

    def failing_init(**kwargs):
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        raise TimeoutError("the head did not come up in time")

    monkeypatch.setattr(ray_launcher.ray, "init", failing_init)
    with pytest.raises(TimeoutError):
        ray_launcher._init({})
    (child,) = started
    assert child.wait(timeout=scaled(10)) == -signal.SIGKILL


def test_a_ray_start_that_ray_timed_out_is_tried_again(monkeypatch):
    """Ray's fixed 30 s wait for its raylet, ran out on a loaded machine: a second start runs."""
    from gramcoord.launch import ray_launcher

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen ...")

    monkeypatch.setattr(ray_launcher.ray, "init", init)
    ray_launcher._init({"address": "local"}, deadline=time.monotonic() + 300)
    assert calls == [{"address": "local"}] * 2


@pytest.mark.parametrize(
    ("message", "room_s"),
    [("some other failure", 300.0), ("The current node timed out during startup.", 5.0)],
    ids=["other-error", "no-room-left"],
)
def test_a_ray_start_is_not_tried_again_for_another_error_or_past_the_deadline(
    monkeypatch, message, room_s
):
    from gramcoord.launch import ray_launcher

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise Exception(message)

    monkeypatch.setattr(ray_launcher.ray, "init", init)
    with pytest.raises(Exception, match=message):
        ray_launcher._init({}, deadline=time.monotonic() + room_s)
    assert len(calls) == 1


def test_a_ray_start_is_tried_at_most_three_times(monkeypatch):
    from gramcoord.launch import ray_launcher

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray_launcher.ray, "init", init)
    with pytest.raises(Exception, match="timed out during startup"):
        ray_launcher._init({}, deadline=time.monotonic() + 3600)
    assert len(calls) == ray_launcher.START_ATTEMPTS == 3
