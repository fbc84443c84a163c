"""CPU wait: how long a thread was ready to run but kept off every CPU.

A compile's deadline (``grammar.compile_timeout_s``) is meant to bound the
compile, not the machine: measured on the wall clock alone, a one-second
compile on a loaded host (the compile threads run at nice +10 inside the
engines, beside dozens of nice-0 tasks) took minutes and failed with
``grammar_timeout`` although xgrammar would have finished it in a second of
CPU. So the deadline counts the compile's time *less the time its thread sat
runnable in the run queue*: a compile that computes or blocks (a hung
native call, an injected delay) is charged in full, a compile that waits for
a CPU is not. ``grammar.compile_wall_timeout_s`` still bounds the wall time,
so a starved compile cannot hold its request for ever.

Linux reports the wait per thread in ``/proc/<pid>/task/<tid>/schedstat``
(its second field, in nanoseconds; kernels built without ``CONFIG_SCHEDSTATS``
or ``CONFIG_TASK_DELAY_ACCT`` still have it through ``CONFIG_SCHED_INFO``).
Where the file is missing (another OS, a kernel without it) the wait reads
0 and the deadline is the wall clock, as before.

Our compiles are single-threaded (``max_threads=1``: the compile runs on the
pool's thread), so the thread's wait is the compile's.
"""

from __future__ import annotations

import os
from collections.abc import Callable

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
