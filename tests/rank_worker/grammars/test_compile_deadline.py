"""A compile's deadline counts its own time, not the time a busy machine kept it
waiting for a CPU (``compile_job``); ``compile_wall_timeout_s`` bounds the wall time."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.compile_job import CompileJob, run_queue_wait_s
from gramcoord.rank_worker.grammars.compile_service import CompileService
from gramcoord.rank_worker.grammars.spec import validate_spec

SPEC = validate_spec({"regex": "ab+"}, GrammarConfig())


class Clocks:
    """A test-driven wall clock and CPU wait (per thread: one compile here)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.waited = 0.0

    def clock(self) -> float:
        return self.now

    def cpu_wait(self, tid: int) -> float:
        return self.waited


def _running_job(config: GrammarConfig, clocks: Clocks):
    """A service whose one job is running (its compile blocks until released)."""
    started, release = threading.Event(), threading.Event()

    def compile_fn(spec):
        started.set()
        release.wait(60)
        return object()

    service = CompileService(config, compile_fn, clock=clocks.clock, cpu_wait=clocks.cpu_wait)
    job, _ = service.submit(SPEC)
    assert started.wait(60)
    return service, job, release


@pytest.mark.parametrize(
    ("elapsed", "waited", "error"),
    [
        # 5 s on the wall clock, 4.5 of them waiting for a CPU: 0.5 s its own.
        (5.0, 4.5, None),
        # 5 s, 3 of them waiting: 2 s its own, past the 1 s deadline.
        (5.0, 3.0, "compile ran past grammar.compile_timeout_s=1s"),
        # A compile that never waited (computing, or blocked): the wall clock.
        (1.5, 0.0, "compile ran past grammar.compile_timeout_s=1s"),
        # Past the wall-clock bound, however long it waited.
        (20.5, 20.0, "compile ran past grammar.compile_wall_timeout_s=20s"),
    ],
)
def test_the_deadline_is_the_compiles_own_time(elapsed, waited, error):
    clocks = Clocks()
    config = GrammarConfig(num_compile_workers=1, compile_timeout_s=1.0, compile_wall_timeout_s=20)
    service, job, release = _running_job(config, clocks)
    try:
        clocks.now += elapsed
        clocks.waited += waited
        service.poll()
        if error is None:
            assert not job.done.is_set() and service.num_stuck() == 0
        else:
            assert job.error is not None
            assert (job.error[0], job.error[1].split(" (")[0]) == (ErrorCode.grammar_timeout, error)
            assert service.num_stuck() == 1
    finally:
        release.set()
        service.close()


def test_the_wall_clock_bound_defaults_to_ten_deadlines_and_is_checked():
    assert GrammarConfig(compile_timeout_s=3).wall_timeout_s == 30
    assert GrammarConfig(compile_timeout_s=3, compile_wall_timeout_s=4).wall_timeout_s == 4
    with pytest.raises(msgspec.ValidationError, match=r"compile_wall_timeout_s \(2\) is below"):
        msgspec.convert({"compile_timeout_s": 3, "compile_wall_timeout_s": 2}, GrammarConfig)


def test_a_thread_that_does_not_exist_has_waited_nothing():
    assert run_queue_wait_s(2**31 - 1) == 0.0


def _spin_cpu_s(seconds: float) -> None:
    """Burn about ``seconds`` of this thread's CPU in one native call that
    releases the GIL throughout, as xgrammar's compile does.

    A Python loop of short calls would take the GIL back between them, and
    every time the test's polling thread held it (itself kept off a busy
    CPU) the compile thread would sleep on the GIL: time that is the
    compile's own, not a wait for a CPU. On a loaded CI machine that sleep
    alone passed the 1 s deadline.
    """
    probe = 20_000
    start = time.thread_time()
    hashlib.pbkdf2_hmac("sha256", b"gramcoord", b"salt", probe)
    per_iteration = max(time.thread_time() - start, 1e-6) / probe
    hashlib.pbkdf2_hmac("sha256", b"gramcoord", b"salt", max(int(seconds / per_iteration), 1))


def _starved_compile(cpu: int, deadline_s: float) -> tuple[CompileJob, float, float]:
    """One compile of ``0.3 * deadline_s`` CPU-seconds at nice +10, pinned to
    ``cpu`` (where a nice-0 process spins), under ``deadline_s``. Returns the
    job once its compile function has returned, its wall time and the part
    of it its thread waited for the CPU, both measured inside the compile."""
    seen: dict[str, float] = {}
    returned = threading.Event()

    def compile_fn(spec):
        os.sched_setaffinity(0, {cpu})  # this thread only
        tid = threading.get_native_id()
        waited, start = run_queue_wait_s(tid), time.monotonic()
        _spin_cpu_s(0.3 * deadline_s)
        seen["wall"] = time.monotonic() - start
        seen["waited"] = run_queue_wait_s(tid) - waited
        returned.set()
        return object()

    config = GrammarConfig(
        num_compile_workers=1,
        compile_timeout_s=deadline_s,
        compile_wall_timeout_s=3600,
        compile_nice=10,
    )
    service = CompileService(config, compile_fn)
    try:
        job, _ = service.submit(SPEC)
        while not job.done.wait(0.2):
            service.poll()
        assert returned.wait(600)
    finally:
        service.close()
    return job, seen["wall"], seen["waited"]


@pytest.mark.skipif(
    not os.path.exists(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat"),
    reason="the kernel does not report run-queue waits",
)
def test_a_starved_compile_finishes_instead_of_timing_out():
    """A real starved compile: 0.3 deadlines of CPU at nice +10, pinned to one
    CPU beside a nice-0 process that never stops computing, gets at most a
    tenth of that CPU (CFS weights 110 against 1024), so it takes at least
    three deadlines on the wall clock. It compiles, and its thread's wait,
    which the deadline did not count, is most of its time.

    Whether its own time stays under the deadline is the machine's: a VM
    whose host takes the CPU away (steal) charges that to the running
    thread. So a timeout is accepted only where the compile's own time,
    measured inside it, really passed the deadline, and the demonstration
    is repeated with a longer deadline (and as much longer a compile)."""
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.stdout.write('go\\n'); sys.stdout.flush()\nwhile True: pass",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        assert hog.stdout.readline() == b"go\n"
        own_times = []
        for deadline_s in (1.0, 2.0, 4.0):
            job, wall, waited = _starved_compile(cpu, deadline_s)
            assert waited > 0  # a thread pinned beside a spinning one waited
            if job.error is None:
                assert wall > deadline_s  # the wall clock alone would have timed it out
                assert waited > wall / 2
                return
            # Timed out: right only if its own time passed the deadline.
            assert job.error[0] == ErrorCode.grammar_timeout, job.error
            assert wall - waited > deadline_s, (job.error, wall, waited)
            own_times.append(f"{wall - waited:.2f} s of {deadline_s:g} s")
        pytest.skip(f"this machine ran each compile past its deadline on its own: {own_times}")
    finally:
        hog.kill()
        hog.wait()
