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

Where the files are missing (another OS, a kernel without
``CONFIG_SCHED_INFO``) there is no reading and the deadline is the wall
clock. Our compiles are single-threaded (``max_threads=1``: the compile
runs on the pool's thread), so the thread's times are the compile's.
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


# tid -> the thread's times, or None where the kernel does not say.
ThreadReader = Callable[[int], "ThreadTimes | None"]


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


def no_reading(tid: int) -> ThreadTimes | None:
    """No kernel reading: the deadline is the (injected) clock."""
    return None


class CompileJob:
    """One compile of one key; requests that share the key join it."""

    def __init__(self, spec: GrammarSpec) -> None:
        self.spec = spec
        self.started_at: float | None = None
        # The worker thread's native id, and its times at the start.
        self.tid = 0
        self.times_at_start: ThreadTimes | None = None
        # The last own time known exactly, and the thread's CPU time then:
        # while the thread is runnable, its own time is at least that plus
        # the CPU it has had since.
        self._exact_own_s = 0.0
        self._exact_cpu_s = 0.0
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

    def start(self, tid: int, now: float, times: ThreadTimes | None) -> None:
        """The worker thread ``tid`` starts the compile at ``now``."""
        self.tid = tid
        self.started_at = now
        self.times_at_start = times
        self._exact_own_s = 0.0
        self._exact_cpu_s = times.cpu_s if times is not None else 0.0

    def own_time(self, wall: float, times: ThreadTimes | None) -> float:
        """The compile's own time after ``wall`` seconds, given its thread's
        ``times`` read at that moment: never more than it really was."""
        start = self.times_at_start
        if times is None or start is None:
            return wall
        if not times.runnable:
            own = wall - (times.waited_s - start.waited_s)
            self._exact_own_s, self._exact_cpu_s = own, times.cpu_s
            return own
        return self._exact_own_s + max(0.0, times.cpu_s - self._exact_cpu_s)

    def overrun(
        self,
        now: float,
        timeout_s: float,
        wall_timeout_s: float,
        read: ThreadReader,
        names: tuple[str, str] = ("grammar.compile_timeout_s", "grammar.compile_wall_timeout_s"),
    ) -> str | None:
        """Why this job is past its deadline at ``now``, or None if it is not.

        The thread is read only once the wall clock alone has passed
        ``timeout_s`` (the common case costs nothing).
        ``wall_timeout_s`` bounds the wall clock itself. ``names`` are how
        the two options are named on this host.
        """
        wall = now - (self.started_at if self.started_at is not None else now)
        if wall <= timeout_s:
            return None
        own = self.own_time(wall, read(self.tid))
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
