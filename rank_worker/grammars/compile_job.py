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
gives xgrammar every CPU (SGLang's compiler runs xgrammar's default of 8
threads), and xgrammar starts its threads inside the call while the pool
thread sleeps until they end. Read alone, that sleeping thread charged the
compile every second its workers spent queued for a CPU: with six busy
processes beside vLLM's server, a dev schema that compiles in seconds timed
out at its 20-second deadline. So the reading covers the compile's threads
(``read_compile_threads``): the one that called the compile and every
thread started since under its name (a new thread inherits its creator's
name, and ``name_compile_thread`` gives each compile thread one of its own,
built from its thread id). Each reading bounds the own time since the last
one, and the bounds add up:

- the most CPU any one thread had since: while a thread was on a CPU the
  compile was not waiting for one (so a computing compile is never charged
  more than one thread doing all its work would be);
- when no thread is runnable and every thread of the last reading is still
  there: the wall clock since, less every wait since (all have ended; two
  waits at once are subtracted twice: less, never more). A thread that
  ended took its last waits with it, so across its end only the CPU
  counts.

A compile whose threads all started and ended before its first reading
(taken once the wall clock passes the deadline) is read as one thread,
and their waits are charged to it. xgrammar's threads live until its call
returns, so that takes a compile function that blocks after them.

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


def compile_thread_name(tid: int) -> str:
    """The name ``name_compile_thread`` gives thread ``tid``."""
    return THREAD_NAME + _base36(tid)


def name_compile_thread() -> None:
    """Give the calling thread a name no other live thread has (once), so the
    threads a compile starts on it, which inherit it, can be told apart from
    every other thread; a no-op where Linux's ``/proc`` is missing (its
    threads are then read alone: only this exact name is shared)."""
    if getattr(_named, "done", False):
        return
    _named.done = True
    tid = threading.get_native_id()
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(compile_thread_name(tid))
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
    for other in started_threads(tid, before):
        if (reading := read_thread_times(other)) is not None:
            out[other] = reading
    return out


def started_threads(tid: int, before: frozenset[int]) -> list[int]:
    """The threads alive now, not in ``before``, that carry the name
    ``name_compile_thread`` gave thread ``tid``: those it started since
    (none when it has no such name)."""
    name = compile_thread_name(tid).encode()
    if _thread_name(tid) != name:
        return []
    return [other for other in thread_ids() - before - {tid} if _thread_name(other) == name]


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
        # The last reading (the compile's threads alive then), its wall
        # clock, and the own time bounded at it.
        self._last: dict[int, ThreadTimes] = {}
        self._last_wall_s = 0.0
        self._own_floor_s = 0.0
        # Whether every reading so far found the compile thread alone.
        self._alone = True
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
        self._last = dict(times) if times is not None else {}
        self._last_wall_s = 0.0
        self._own_floor_s = 0.0
        self._alone = True

    def own_time(self, wall: float, times: dict[int, ThreadTimes] | None) -> float:
        """The compile's own time after ``wall`` seconds, given its threads'
        ``times`` read at that moment: never more than it really was (see
        the module docstring). Each reading bounds the time since the last
        one, and the bounds add up."""
        start = self.times_at_start
        if start is None:
            return wall  # no reading from the start: the wall clock
        if times is None:
            return self._own_floor_s  # the reading failed: nothing more is certain
        last, floor = self._last, self._own_floor_s
        # While a thread was on a CPU the compile was not waiting for one.
        computed = max(t.cpu_s - (last[i].cpu_s if i in last else 0.0) for i, t in times.items())
        own = floor + max(0.0, computed)
        self._alone = self._alone and times.keys() == {self.tid}
        if not any(t.runnable for t in times.values()):
            if self._alone:
                # One thread throughout: the wall clock less its waits, exactly.
                own = max(own, wall - (times[self.tid].waited_s - start[self.tid].waited_s))
            elif last.keys() <= times.keys():
                # Every thread read last time is still here and none is
                # runnable: every wait since has ended and is counted
                # (a wait in progress then is counted whole: less, never more).
                waited = sum(
                    t.waited_s - (last[i].waited_s if i in last else 0.0) for i, t in times.items()
                )
                own = max(own, floor + (wall - self._last_wall_s) - waited)
            # A thread that ended since took its waits along: the CPU alone.
        self._last, self._last_wall_s, self._own_floor_s = dict(times), wall, own
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
