"""A compile job: one compile of one key, shared by the requests that joined it,
and its deadline.

The deadline (``CompileJob.overrun``) runs from the moment a worker starts
the compile and bounds the compile, not the machine: measured on the wall
clock alone, a one-second compile on a loaded host (the compile threads run
at nice +10 inside the engines, beside dozens of nice-0 tasks) took minutes
and failed with ``grammar_timeout`` although xgrammar would have finished it
in a second of CPU. So ``grammar.compile_timeout_s`` counts the compile's
time *less the time its thread sat runnable in the run queue*: a compile
that computes or blocks (a hung native call, an injected delay) is charged
in full, a compile that waits for a CPU is not.
``grammar.compile_wall_timeout_s`` still bounds the wall time, so a starved
compile cannot hold its request for ever.

Linux reports the wait per thread in ``/proc/<pid>/task/<tid>/schedstat``
(its second field, in nanoseconds; ``CONFIG_SCHED_INFO``). Where the file is
missing (another OS, a kernel without it) the wait reads 0 and the deadline
is the wall clock. Our compiles are single-threaded (``max_threads=1``: the
compile runs on the pool's thread), so the thread's wait is the compile's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from gramcoord.coordinator.status import PendingState
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.spec import GrammarSpec

# tid -> seconds the thread has waited for a CPU since it started.
CpuWait = Callable[[int], float]


def run_queue_wait_s(tid: int) -> float:
    """Seconds thread ``tid`` of this process has spent runnable but not running.

    0.0 where the kernel does not say (the deadline is then the wall clock).
    """
    try:
        with open(f"/proc/{os.getpid()}/task/{tid}/schedstat", "rb") as f:
            fields = f.read().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def no_wait(tid: int) -> float:
    """The wait under an injected clock: none (the test's clock is the deadline)."""
    return 0.0


class CompileJob:
    """One compile of one key; requests that share the key join it."""

    def __init__(self, spec: GrammarSpec) -> None:
        self.spec = spec
        self.started_at: float | None = None
        # The worker thread's native id and its CPU wait at the start.
        self.tid = 0
        self.waited_at_start = 0.0
        self.result: Any = None
        # (ErrorCode, message) once the job failed.
        self.error: tuple[ErrorCode, str] | None = None
        # Set once a spare worker took this (stuck) job's place: its thread
        # exits when the compile returns.
        self.replaced = False
        # Pending requests using this job; at zero the job is released.
        self.users = 0
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

    def overrun(
        self, now: float, timeout_s: float, wall_timeout_s: float, cpu_wait: CpuWait
    ) -> str | None:
        """Why this job is past its deadline at ``now``, or None if it is not.

        Its time is the wall clock since it started less what its thread
        waited for a CPU meanwhile (``cpu_wait``); the wait is read only once
        the wall clock alone has passed ``timeout_s`` (the common case costs
        nothing). ``wall_timeout_s`` bounds the wall clock itself.
        """
        wall = now - (self.started_at if self.started_at is not None else now)
        if wall <= timeout_s:
            return None
        own = wall - (cpu_wait(self.tid) - self.waited_at_start)
        if own > timeout_s:
            return f"compile ran past grammar.compile_timeout_s={timeout_s:g}s"
        if wall > wall_timeout_s:
            return (
                f"compile ran past grammar.compile_wall_timeout_s={wall_timeout_s:g}s "
                f"({wall - own:.0f}s of it waiting for a CPU)"
            )
        return None
