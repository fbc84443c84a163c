"""A compile job: one compile of one key, shared by the requests that joined it,
and its deadline.

The deadline (``CompileJob.overrun``) runs from the moment a worker starts
the compile and bounds the compile, not the machine: measured on the wall
clock alone, a one-second compile on a loaded host (the compile threads run
at nice +10 inside the engines, beside dozens of nice-0 tasks) took minutes
and failed with ``grammar_timeout`` although xgrammar would have finished it
in a second of CPU. So ``grammar.compile_timeout_s`` counts the compile's
*own time*: the time it computed or blocked (a hung native call, an
injected delay), not the time its thread sat runnable waiting for a CPU.
``grammar.compile_wall_timeout_s`` still bounds the wall time, so a starved
compile cannot hold its request for ever.

Linux reports per thread (``/proc/<pid>/task/<tid>/``) the time on a CPU
and the run-queue waits in ``schedstat``, and the state in ``stat``. The
kernel adds a wait to ``schedstat`` only when it *ends* (the thread gets a
CPU): read while the thread is still queued, the wait in progress is
missing, and wall-clock-less-waits counts it as the compile's own time. At
nice +10 among busy nice-0 tasks single waits last seconds, so a poll that
landed in one timed out compiles that had computed a fraction of their
deadline. Hence two readings:

- the thread is not runnable (sleeping, blocked): no wait is in progress,
  so wall clock less the waits is exact;
- the thread is runnable (on a CPU, or queued for one, which ``stat`` does
  not tell apart): only a lower bound is certain, the last exact own time
  plus the CPU time since. A queued thread's CPU time does not move, so a
  poll inside a wait of any length charges it nothing; a thread that
  computes is charged every CPU-second. A compile that slept since the last
  exact reading is charged that sleep at the next one.

A compile may run on more threads than the pool's: vLLM's lone compile
gives xgrammar every CPU, and xgrammar starts its threads inside the call
while the pool thread sleeps until they end. Read alone, that sleeping
thread charged the compile every second its workers spent queued for a
CPU: with six busy processes beside vLLM's server, a dev schema that
compiles in seconds timed out at its 20-second deadline. So the reading
covers the compile's threads (``read_compile_threads``): the one that
called the compile and every thread started since under its name (a new
thread inherits its creator's name, and ``name_compile_thread`` gives each
compile thread one of its own, built from its thread id). Both rules above
hold for a set, each a lower bound:

- no thread is runnable: the wall clock less the sum of the waits that
  ended (two waits at once are subtracted twice: less, never more);
- else the last bound plus the most CPU any one thread had since: while a
  thread was on a CPU the compile was not waiting for one. While it
  computes, a compile is charged no more than its busiest thread, so never
  more than one thread doing all the work would be.

A thread that ended keeps its last reading (a wait after it is missed).
Where the files are missing (another OS, a kernel without
``CONFIG_SCHED_INFO``) there is no reading and the deadline is the wall
clock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from gramcoord.coordinator.status import PendingState
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.spec import GrammarSpec


class ThreadTimes(NamedTuple):
    """What the kernel says of one thread, in seconds since it started."""

    cpu_s: float
    # Run-queue waits that have ended; a wait in progress is not in it.
    waited_s: float
    # Running or queued for a CPU (state R): a wait may be in progress.
    runnable: bool


# (the compile thread's id, the threads alive when the compile started) ->
# the times of the compile's threads by id, or None where the kernel does
# not say.
ThreadReader = Callable[[int, frozenset[int]], "dict[int, ThreadTimes] | None"]

# Names of compile threads: this prefix and the thread's id in base 36,
# which no other live thread has (ids stay below 2**22, five digits; Linux
# keeps 15 bytes of a name). A counter would wrap or be cut to 15 bytes in
# a process that replaced enough stuck workers, and names would repeat.
THREAD_NAME = "gramcoord-"
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_named = threading.local()


def _base36(n: int) -> str:
    out = ""
    while True:
        n, digit = divmod(n, 36)
        out = _DIGITS[digit] + out
        if n == 0:
            return out


def name_compile_thread() -> None:
    """Give the calling thread a name no other live thread has (once), so the
    threads a compile starts on it, which inherit it, can be told apart from
    every other thread; a no-op where Linux's ``/proc`` is missing."""
    if getattr(_named, "done", False):
        return
    _named.done = True
    try:
        with open("/proc/thread-self/comm", "w") as f:
            f.write(THREAD_NAME + _base36(threading.get_native_id()))
    except OSError:
        pass


def thread_ids() -> frozenset[int]:
    """This process's threads now (none where ``/proc`` is missing)."""
    try:
        return frozenset(int(name) for name in os.listdir("/proc/self/task"))
    except (OSError, ValueError):
        return frozenset()


def _thread_name(tid: int) -> bytes | None:
    try:
        with open(f"/proc/self/task/{tid}/comm", "rb") as f:
            return f.read().rstrip(b"\n")
    except OSError:
        return None


def read_thread_times(tid: int) -> ThreadTimes | None:
    """Thread ``tid`` of this process as the kernel reports it, or None.

    The state is read before the times: a thread seen not runnable had no
    wait in progress up to the read (one that began after it is not part
    of the caller's clock reading, taken before).
    """
    base = f"/proc/{os.getpid()}/task/{tid}/"
    try:
        with open(base + "stat", "rb") as f:
            # "pid (comm) S ...": comm may hold spaces and parentheses.
            state = f.read().rsplit(b")", 1)[1].split(None, 1)[0]
        with open(base + "schedstat", "rb") as f:
            fields = f.read().split()
        return ThreadTimes(int(fields[0]) / 1e9, int(fields[1]) / 1e9, state == b"R")
    except (OSError, IndexError, ValueError):
        return None


def read_compile_threads(tid: int, before: frozenset[int]) -> dict[int, ThreadTimes] | None:
    """The compile thread ``tid`` and the threads started since ``before`` (the
    threads alive at the compile's start) that carry its name, by id; None
    when ``tid`` has no reading. Only a name ``name_compile_thread`` gave is
    shared this way: otherwise ``tid`` is read alone."""
    times = read_thread_times(tid)
    if times is None:
        return None
    out = {tid: times}
    name = _thread_name(tid)
    if name is None or not name.startswith(THREAD_NAME.encode()):
        return out
    for other in thread_ids() - before - {tid}:
        if _thread_name(other) == name and (reading := read_thread_times(other)) is not None:
            out[other] = reading
    return out


def no_reading(tid: int, before: frozenset[int]) -> dict[int, ThreadTimes] | None:
    """No kernel reading: the deadline is the (injected) clock."""
    return None


class CompileJob:
    """One compile of one key; requests that share the key join it."""

    def __init__(self, spec: GrammarSpec) -> None:
        self.spec = spec
        self.started_at: float | None = None
        # The thread that runs the compile (its native id), the threads
        # alive as it started, and its threads' times then (None: no reading).
        self.tid = 0
        self.threads_before: frozenset[int] = frozenset()
        self.times_at_start: dict[int, ThreadTimes] | None = None
        # Every thread of the compile seen so far, as last read.
        self._seen: dict[int, ThreadTimes] = {}
        # The own time last bounded, and each thread's CPU time then: the
        # own time now is at least that plus the most CPU one had since.
        self._own_floor_s = 0.0
        self._cpu_at_floor: dict[int, float] = {}
        self.result: Any = None
        # (ErrorCode, message) once the job failed.
        self.error: tuple[ErrorCode, str] | None = None
        # Set once a spare worker took this (stuck) job's place: its thread
        # exits when the compile returns.
        self.replaced = False
        # Pending requests using this job; at zero the job is released.
        self.users = 0
        # A warm-start compile (``CompileService.warm``), run on the spec
        # store's thread and held until a request takes it.
        self.warm = False
        # Measured with perf_counter, independent of the (injectable)
        # deadline clock.
        self.compile_ms = 0.0
        self.done = threading.Event()

    @property
    def key(self) -> bytes:
        return self.spec.key

    def state(self) -> tuple[PendingState, int]:
        # ``done`` first: a job that ends is given its error before ``done``
        # is set, so an error read after ``done`` is final. Read the other
        # way round, a job failing between the two reads looks READY, and
        # its request is admitted-then-failed without its key being poisoned.
        if not self.done.is_set():
            return PendingState.PENDING, 0
        error = self.error
        if error is not None:
            return PendingState.FAILED, int(error[0])
        return PendingState.READY, 0

    def fail(self, code: ErrorCode, message: str) -> None:
        if self.error is None and not self.done.is_set():
            self.error = (code, message)
            self.done.set()

    def start(
        self,
        tid: int,
        now: float,
        times: dict[int, ThreadTimes] | None,
        before: frozenset[int] = frozenset(),
    ) -> None:
        """The thread ``tid`` starts the compile at ``now``; ``times`` are its
        threads' times then, ``before`` the process's threads then."""
        self.tid = tid
        self.started_at = now
        self.threads_before = before
        self.times_at_start = times
        self._seen = dict(times) if times is not None else {}
        self._own_floor_s = 0.0
        self._cpu_at_floor = {t: reading.cpu_s for t, reading in self._seen.items()}

    def own_time(self, wall: float, times: dict[int, ThreadTimes] | None) -> float:
        """The compile's own time after ``wall`` seconds, given its threads'
        ``times`` read at that moment: never more than it really was."""
        start = self.times_at_start
        if times is None or start is None:
            return wall
        self._seen.update(times)  # a thread that ended keeps its last reading
        floor = self._cpu_at_floor
        computed = max(reading.cpu_s - floor.get(t, 0.0) for t, reading in self._seen.items())
        own = self._own_floor_s + max(0.0, computed)
        if not any(reading.runnable for reading in times.values()):
            # No wait in progress: the ended waits are all of them.
            waited = sum(
                reading.waited_s - (start[t].waited_s if t in start else 0.0)
                for t, reading in self._seen.items()
            )
            own = max(own, wall - waited)
        self._own_floor_s = own
        self._cpu_at_floor = {t: reading.cpu_s for t, reading in self._seen.items()}
        return own

    def overrun(
        self,
        now: float,
        timeout_s: float,
        wall_timeout_s: float,
        read: ThreadReader,
        names: tuple[str, str] = ("grammar.compile_timeout_s", "grammar.compile_wall_timeout_s"),
    ) -> str | None:
        """Why this job is past its deadline at ``now``, or None if it is not.

        The threads are read only once the wall clock alone has passed
        ``timeout_s`` (the common case costs nothing).
        ``wall_timeout_s`` bounds the wall clock itself. ``names`` are how
        the two options are named on this host.
        """
        wall = now - (self.started_at if self.started_at is not None else now)
        if wall <= timeout_s:
            return None
        own = self.own_time(wall, read(self.tid, self.threads_before))
        if own > timeout_s:
            return (
                f"compile ran past {names[0]}={timeout_s:g}s "
                "(its own time: waits for a CPU are not counted)"
            )
        if wall > wall_timeout_s:
            return (
                f"compile ran past {names[1]}={wall_timeout_s:g}s "
                f"of wall time ({own:.1f}s its own, the rest waiting for a CPU)"
            )
        return None
