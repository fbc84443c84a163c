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
from gramcoord.rank_worker.grammars.compile_job import (
    THREAD_NAME,
    CompileJob,
    ThreadTimes,
    name_compile_thread,
    read_compile_threads,
    read_thread_times,
    thread_ids,
)
from gramcoord.rank_worker.grammars.compile_service import CompileService
from gramcoord.rank_worker.grammars.spec import validate_spec

SPEC = validate_spec({"regex": "ab+"}, GrammarConfig())
OWN = "compile ran past grammar.compile_timeout_s=1s"
WALL = "compile ran past grammar.compile_wall_timeout_s=20s of wall time"
HAS_SCHEDSTAT = os.path.exists(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat")
needs_schedstat = pytest.mark.skipif(
    not HAS_SCHEDSTAT, reason="the kernel does not report per-thread CPU times and waits"
)


class Clocks:
    """A test-driven wall clock and thread readings (one compile here): the
    compile's thread, and any threads it started (by made-up ids)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.times: ThreadTimes | None = ThreadTimes(0.0, 0.0, True)
        self.started: dict[int, ThreadTimes] = {}

    def clock(self) -> float:
        return self.now

    def read(self, tid: int, before: frozenset[int]) -> dict[int, ThreadTimes] | None:
        if self.times is None:
            return None
        return {tid: self.times, **self.started}


def _running_job(config: GrammarConfig, clocks: Clocks):
    """A service whose one job is running (its compile blocks until released)."""
    started, release = threading.Event(), threading.Event()

    def compile_fn(spec):
        started.set()
        release.wait(60)
        return object()

    service = CompileService(config, compile_fn, clock=clocks.clock, thread_times=clocks.read)
    job, _ = service.submit(SPEC)
    assert started.wait(60)
    return service, job, release


def _config(**kw) -> GrammarConfig:
    return GrammarConfig(
        num_compile_workers=1, compile_timeout_s=1.0, compile_wall_timeout_s=20, **kw
    )


def _error(job: CompileJob) -> str | None:
    if job.error is None:
        return None
    assert job.error[0] == ErrorCode.grammar_timeout
    return job.error[1].split(" (")[0]


# Each case: readings, one poll after each, and the outcome after the last.
# A reading is the wall clock since the start, then (CPU time, ended
# run-queue waits, runnable?) of the compile's thread (None: no reading),
# then the same of each thread it started.
SLEEPS = (0.0, 0.0, False)  # a compile thread that waits for the threads it started
CASES = {
    # Sleeping or blocked: no wait in progress, the waits that ended are exact.
    "blocked, waited most of it": ([(5.0, (0.1, 4.5, False))], None),
    "blocked, own time past": ([(5.0, (0.1, 3.0, False))], OWN),
    "blocked from the start": ([(1.5, (0.0, 0.0, False))], OWN),
    # Runnable: a wait may be in progress that the kernel has not added yet.
    # 5 s of wall clock, 0.5 s of waits ended, 0.3 s of CPU: the other 4.2 s
    # are a wait in progress, not the compile's time (the wall clock less the
    # ended waits timed it out).
    "queued in a long wait": ([(5.0, (0.3, 0.5, True))], None),
    "computing past": ([(1.5, (1.2, 0.0, True))], OWN),
    # An exact reading, then CPU since: 0.5 s exact at 3 s, then 0.4 s and
    # 1.0 s of CPU more while runnable.
    "exact, then computing": (
        [(3.0, (0.2, 2.5, False)), (6.0, (0.6, 2.5, True)), (9.0, (1.2, 2.5, True))],
        OWN,
    ),
    "exact, then queued": ([(3.0, (0.2, 2.5, False)), (9.0, (0.6, 2.5, True))], None),
    # The wall-clock bound, however little the compile had.
    "past the wall bound": ([(20.5, (0.1, 1.0, True))], WALL),
    # A reading that fails after a good one: nothing more is certain.
    "the reading fails": ([(1.5, (0.2, 1.0, False)), (3.0, None)], None),
    # Two started threads do the work (vLLM's lone compile: xgrammar's).
    # Both queued most of the time: the sleeping compile thread read alone
    # (never waiting) would be charged all 3 s.
    "started, queued most of the time": ([(3.0, SLEEPS, (0.8, 2.0, True), (0.8, 2.0, True))], None),
    "started, computing past": ([(3.0, SLEEPS, (1.2, 0.5, True), (0.6, 1.0, True))], OWN),
    # None runnable: the wall clock less every ended wait (both threads').
    "started, blocked, waits ended": ([(3.0, SLEEPS, (0.4, 1.5, False), (0.4, 1.0, False))], None),
    "started, blocked past": ([(3.0, SLEEPS, (0.4, 0.5, False), (0.4, 0.5, False))], OWN),
    # An exact bound, then CPU: 0.5 s at 3 s, then the busier thread's 0.6 s.
    "started, exact, then the busier thread": (
        [
            (3.0, SLEEPS, (0.2, 1.3, False), (0.2, 1.2, False)),
            (6.0, SLEEPS, (0.8, 1.3, True), (0.5, 1.2, True)),
        ],
        OWN,
    ),
    # A thread that ended took its last waits along: across its end only
    # the CPU counts. Here it computed 0.3 s, then sat queued until it ran
    # its last slice and ended; the compile thread, woken, blocks (the GIL):
    # the wall clock less the waits read would charge all 3 s.
    "started, one ended unread": (
        [(1.5, SLEEPS, (0.3, 0.0, True)), (3.0, SLEEPS)],
        None,
    ),
    # Readings with the same threads bound the time between them: 0.5 s at
    # 3 s, then 1 s of wall clock with 0.4 s of waits in all.
    "started, exact twice": (
        [
            (3.0, SLEEPS, (0.2, 1.3, False), (0.2, 1.2, False)),
            (4.0, SLEEPS, (0.2, 1.5, False), (0.2, 1.4, False)),
        ],
        OWN,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_deadline_is_the_compiles_own_time(case):
    readings, expected = CASES[case]
    clocks = Clocks()
    service, job, release = _running_job(_config(), clocks)
    try:
        start = clocks.now
        for wall, thread, *started in readings:
            clocks.now = start + wall
            clocks.times = None if thread is None else ThreadTimes(*thread)
            clocks.started = {-1 - i: ThreadTimes(*t) for i, t in enumerate(started)}
            service.poll()
        assert _error(job) == expected
        assert service.num_stuck() == (expected is not None)
    finally:
        release.set()
        service.close()


def test_without_a_reading_the_deadline_is_the_wall_clock():
    """Another OS (no ``/proc``): no reading from the start."""
    clocks = Clocks()
    clocks.times = None
    service, job, release = _running_job(_config(), clocks)
    try:
        clocks.now += 1.5
        service.poll()
        assert _error(job) == OWN
    finally:
        release.set()
        service.close()


def test_the_wall_clock_bound_defaults_to_ten_deadlines_and_is_checked():
    assert GrammarConfig(compile_timeout_s=3).wall_timeout_s == 30
    assert GrammarConfig(compile_timeout_s=3, compile_wall_timeout_s=4).wall_timeout_s == 4
    with pytest.raises(msgspec.ValidationError, match=r"compile_wall_timeout_s \(2\) is below"):
        msgspec.convert({"compile_timeout_s": 3, "compile_wall_timeout_s": 2}, GrammarConfig)


def test_a_thread_that_does_not_exist_has_no_reading():
    assert read_thread_times(2**31 - 1) is None


@needs_schedstat
def test_the_reading_tells_a_blocked_thread_from_a_runnable_one():
    blocked, tid = threading.Event(), []

    def park():
        tid.append(threading.get_native_id())
        blocked.wait(60)

    parked = threading.Thread(target=park)
    parked.start()
    try:
        while not tid:
            time.sleep(0.001)
        deadline = time.monotonic() + 60
        while (reading := read_thread_times(tid[0])) is None or reading.runnable:
            assert time.monotonic() < deadline  # it parks at once on an idle event
            time.sleep(0.01)
        assert reading.cpu_s > 0 and reading.waited_s >= 0
        assert read_thread_times(threading.get_native_id()).runnable  # this one runs
    finally:
        blocked.set()
        parked.join()


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


@pytest.fixture
def hog_cpu():
    """One CPU where a nice-0 process computes without end, for as long as the
    test runs; yields the CPU's number."""
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
        yield cpu
    finally:
        hog.kill()
        hog.wait()


def _spin_measured(cpu_s: float) -> tuple[float, float]:
    """``_spin_cpu_s`` on the calling thread: (its CPU, its ended waits) meanwhile."""
    tid = threading.get_native_id()
    start = read_thread_times(tid)
    _spin_cpu_s(cpu_s)
    end = read_thread_times(tid)
    return end.cpu_s - start.cpu_s, end.waited_s - start.waited_s


class Starved:
    """One compile of ``cpu_s`` CPU-seconds at ``nice``, pinned to ``cpu``
    beside the hog, under a ``deadline_s`` of its own time; ``should_poll``
    (the moment) says when the test polls the service.

    With ``threads``, the compile starts that many threads that compute
    ``cpu_s`` each and sleeps until they end, as xgrammar's compile with
    several threads does (they inherit its CPU, nice and name); ``seen``
    then holds the busiest thread's CPU and the fewest waits."""

    def __init__(
        self, cpu: int, deadline_s: float, cpu_s: float, nice: int, threads: int = 0
    ) -> None:
        self.seen: dict[str, float] = {}
        self.polls = 0
        # The compile thread, its reading and the clock as it starts to compute.
        self.start: tuple[int, ThreadTimes, float] | None = None
        self.returned = threading.Event()

        def compile_fn(spec):
            os.sched_setaffinity(0, {cpu})  # this thread only
            start, at = read_thread_times(threading.get_native_id()), time.monotonic()
            self.start = (threading.get_native_id(), start, at)
            if threads:
                spent: list[tuple[float, float]] = []
                workers = [
                    threading.Thread(target=lambda: spent.append(_spin_measured(cpu_s)))
                    for _ in range(threads)
                ]
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join()
                cpu_used, waited = max(c for c, _ in spent), min(w for _, w in spent)
            else:
                cpu_used, waited = _spin_measured(cpu_s)
            self.seen.update(wall=time.monotonic() - at, cpu=cpu_used, waited=waited)
            self.returned.set()
            return object()

        config = GrammarConfig(
            num_compile_workers=1,
            compile_timeout_s=deadline_s,
            compile_wall_timeout_s=3600,
            compile_nice=nice,
        )
        self.service = CompileService(config, compile_fn)

    def run(self, should_poll, every_s: float) -> CompileJob:
        try:
            job, _ = self.service.submit(SPEC)
            deadline = time.monotonic() + 600
            while not job.done.wait(every_s):
                assert time.monotonic() < deadline, "the starved compile never ended"
                if self.start is not None and should_poll(time.monotonic()):
                    self.polls += 1
                    self.service.poll()
            # A timed-out compile still runs: its times are read at its end.
            assert self.returned.wait(600), "the starved compile never returned"
        finally:
            self.service.close()
        return job


@needs_schedstat
def test_a_poll_inside_a_long_run_queue_wait_does_not_time_the_compile_out(hog_cpu):
    """The stale read, reproduced: the kernel adds a run-queue wait to the
    thread's total only when the wait ends, so a poll in the middle of one
    saw it as the compile's own time (the wall clock less the ended waits
    timed such compiles out at any load where single waits outlast the
    deadline).

    The compile runs at nice +19 beside the nice-0 hog on its CPU (CFS
    weights 15 against 1024: it waits about 70 slices for each it runs), so
    its waits are long; the test polls *only* while the compile is queued
    in a wait longer than the deadline, as the kernel reports it: runnable,
    the wall clock less the ended waits past the deadline, and its CPU time
    far below it."""
    deadline_s = 0.1
    starved = Starved(hog_cpu, deadline_s, cpu_s=0.3 * deadline_s, nice=19)
    longest = [0.0]

    def inside_a_long_wait(now: float) -> bool:
        tid, start, at = starved.start
        reading = read_thread_times(tid)
        if reading is None or not reading.runnable:
            return False
        waiting = (now - at) - (reading.waited_s - start.waited_s)
        waiting -= reading.cpu_s - start.cpu_s  # what is neither CPU nor an ended wait
        longest[0] = max(longest[0], waiting)
        return waiting > 1.5 * deadline_s and reading.cpu_s - start.cpu_s < deadline_s / 2

    job = starved.run(inside_a_long_wait, every_s=0.005)
    if starved.polls == 0:
        pytest.skip(
            f"no run-queue wait past {1.5 * deadline_s:g} s was seen "
            f"(the longest: {longest[0]:.3f} s): nothing to poll inside"
        )
    if job.error is not None:
        # Only a compile that really computed past its deadline may time out.
        assert starved.seen["cpu"] > deadline_s, (job.error, starved.seen)
        pytest.skip(f"this machine charged the compile {starved.seen['cpu']:.2f} CPU-s")
    assert starved.seen["waited"] > starved.seen["wall"] / 2, starved.seen


@needs_schedstat
def test_a_starved_compile_finishes_instead_of_timing_out(hog_cpu):
    """The engines' case: a compile at nice +10 beside a nice-0 process that
    never stops computing gets at most a tenth of its CPU (CFS weights 110
    against 1024), so 0.3 deadlines of CPU take three or more deadlines on
    the wall clock, and the service is polled every 0.2 s throughout. It
    compiles, and most of its time was the wait the deadline did not count.

    A VM whose host takes the CPU away (steal) may charge that to the
    running thread: a timeout is accepted only where the compile's CPU,
    measured inside it, really passed the deadline."""
    deadline_s = 1.0
    starved = Starved(hog_cpu, deadline_s, cpu_s=0.3 * deadline_s, nice=10)
    job = starved.run(lambda now: True, every_s=0.2)
    seen = starved.seen
    assert seen["waited"] > 0, seen  # a thread pinned beside a spinning one waited
    if job.error is not None:
        assert seen["cpu"] > deadline_s, (job.error, seen)
        pytest.skip(f"this machine charged the compile {seen['cpu']:.2f} CPU-s")
    assert seen["wall"] > deadline_s, seen  # the wall clock alone would have timed it out


@needs_schedstat
def test_a_starved_compile_on_threads_it_started_finishes(hog_cpu):
    """vLLM's lone compile: xgrammar's threads compute while the thread that
    called the compile sleeps until they end. Read alone, that thread waits
    for nothing and is charged the wall clock; the deadline reads the
    threads it started too. Two threads at nice +10 beside the hog need
    three deadlines or more of wall clock for 0.3 deadlines of CPU each."""
    deadline_s = 1.0
    starved = Starved(hog_cpu, deadline_s, cpu_s=0.3 * deadline_s, nice=10, threads=2)
    job = starved.run(lambda now: True, every_s=0.2)
    seen = starved.seen
    assert seen["waited"] > 0, seen
    if job.error is not None:
        assert seen["cpu"] > deadline_s, (job.error, seen)
        pytest.skip(f"this machine charged the compile {seen['cpu']:.2f} CPU-s")
    assert seen["wall"] > deadline_s, seen  # the calling thread alone would have timed it out


@needs_schedstat
def test_the_reading_covers_the_threads_a_compile_thread_started():
    """A compile thread's reading holds it and the threads started on it since
    the compile began (they carry its name), not the process's other
    threads, nor the threads alive before."""
    release, ready = threading.Event(), threading.Event()
    tids: dict[str, int] = {}
    readings: list = []
    names: list[str] = []

    def park(name: str) -> None:
        tids[name] = threading.get_native_id()
        release.wait(60)

    def compile_thread() -> None:
        name_compile_thread()
        tids["compile"] = threading.get_native_id()
        with open("/proc/thread-self/comm") as f:
            names.append(f.read().strip())
        before_child = threading.Thread(target=park, args=("before",))
        before_child.start()
        while "before" not in tids:
            time.sleep(0.001)
        before = thread_ids()
        child = threading.Thread(target=park, args=("child",))
        child.start()
        while "child" not in tids:
            time.sleep(0.001)
        readings.append(read_compile_threads(tids["compile"], before))
        ready.set()
        release.wait(60)
        before_child.join()
        child.join()

    other = threading.Thread(target=park, args=("other",))
    other.start()
    runner = threading.Thread(target=compile_thread)
    runner.start()
    try:
        assert ready.wait(60)
        assert set(readings[0]) == {tids["compile"], tids["child"]}
        # The name is unique among live threads: it holds the thread's id.
        prefix, digits = names[0][: len(THREAD_NAME)], names[0][len(THREAD_NAME) :]
        assert prefix == THREAD_NAME and int(digits, 36) == tids["compile"], names
        # A thread that was never named is read alone.
        assert set(read_compile_threads(threading.get_native_id(), frozenset())) == {
            threading.get_native_id()
        }
    finally:
        release.set()
        runner.join()
        other.join()


@needs_schedstat
def test_a_pool_compile_names_its_thread_and_a_sync_one_leaves_the_callers_name():
    """Sync compiles run on the caller's thread (an engine's main thread,
    whose name ``ps`` shows as the process's): it keeps its name."""
    names: dict[str, str] = {}

    def compile_fn(spec):
        with open("/proc/thread-self/comm") as f:
            names.setdefault("compile", f.read().strip())
        return object()

    def sync_caller() -> None:
        with open("/proc/thread-self/comm", "w") as f:
            f.write("host-main")
        service = CompileService(GrammarConfig(compile_mode="sync"), compile_fn)
        job, _ = service.submit(SPEC)
        assert job.error is None
        with open("/proc/thread-self/comm") as f:
            names["sync caller"] = f.read().strip()

    caller = threading.Thread(target=sync_caller)
    caller.start()
    caller.join(60)
    assert names == {"compile": "host-main", "sync caller": "host-main"}
    names.clear()
    service = CompileService(_config(), compile_fn)
    try:
        job, _ = service.submit(SPEC)
        assert job.done.wait(60) and job.error is None
        assert names["compile"].startswith(THREAD_NAME), names
    finally:
        service.close()


@needs_schedstat
def test_a_blocked_compile_times_out_on_its_deadline():
    """A compile that blocks (a hung native call, a lock) is charged in full:
    it times out while it still blocks."""
    release = threading.Event()

    def compile_fn(spec):
        release.wait(600)
        return object()

    service = CompileService(_config(), compile_fn)
    try:
        job, _ = service.submit(SPEC)
        while not job.done.wait(0.02):
            service.poll()
        assert not release.is_set()
        assert _error(job) == OWN
        assert time.monotonic() - job.started_at > 1.0
    finally:
        release.set()
        service.close()


@needs_schedstat
def test_a_computing_compile_times_out_once_its_cpu_passes_the_deadline():
    """A compile that computes past its deadline times out while it computes,
    whatever the machine's load: a runnable thread is charged its CPU."""
    stop, spent = threading.Event(), []

    def compile_fn(spec):
        tid = threading.get_native_id()
        start = read_thread_times(tid).cpu_s
        limit = time.monotonic() + 600
        while not stop.is_set() and time.monotonic() < limit:
            _spin_cpu_s(0.02)
        spent.append(read_thread_times(tid).cpu_s - start)
        return object()

    deadline_s = 0.2
    config = GrammarConfig(
        num_compile_workers=1, compile_timeout_s=deadline_s, compile_wall_timeout_s=3600
    )
    service = CompileService(config, compile_fn)
    try:
        job, _ = service.submit(SPEC)
        while not job.done.wait(0.02):
            service.poll()
        assert job.error is not None and job.error[0] == ErrorCode.grammar_timeout, job.error
        assert job.error[1].startswith("compile ran past grammar.compile_timeout_s=0.2s")
        assert not spent  # it was still computing
    finally:
        stop.set()
        service.close()
    deadline = time.monotonic() + 600
    while not spent:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert spent[0] > deadline_s
