"""How slow this machine is right now, and deadlines that grow with it.

A test that must observe a timeout or a lost peer waits against deadlines;
on a machine busy with other work its processes get a fraction of a core,
and a fixed deadline turns a slow run into a red one. ``factor()`` says how
much slower than a quiet machine this one runs now (1 when quiet), and
``scaled`` and ``step_timeout`` give deadlines that grow with it: the test
gets slower under load, never red.

The factor is the larger of two measurements, each at least 1:

- the **run queue per core**: the 1-minute load average over the cores
  this process may run on (it lags, but it sees the other work);
- the **share of a core this process gets now**: busy loops of ``SPIN_S``
  of wall time, whose own CPU time says what fraction of a core they got
  (a tenth of a core: factor 10); the median of ``SAMPLES`` loops.

It is measured at most every ``REMEASURE_S`` seconds and capped at
``MAX_FACTOR``. ``GRAMCOORD_LOAD_FACTOR`` overrides it (a number >= 1): to
check a test's deadlines as if the machine were that much slower, or to
hold them still.
"""

from __future__ import annotations

import math
import os
import threading
import time

ENV = "GRAMCOORD_LOAD_FACTOR"
SPIN_S = 0.05
SAMPLES = 3
REMEASURE_S = 10.0
MAX_FACTOR = 40.0

_lock = threading.Lock()
_last: tuple[float, float] | None = None  # (monotonic time measured, factor)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def queue_factor(load1: float | None = None, ncores: int | None = None) -> float:
    """The 1-minute run queue per core, at least 1."""
    if load1 is None:
        try:
            load1 = os.getloadavg()[0]
        except OSError:  # no load average here
            return 1.0
    return max(1.0, load1 / (ncores or cores()))


def share_factor(spin_s: float = SPIN_S, samples: int = SAMPLES) -> float:
    """1 / the share of a core a busy loop gets: the median over ``samples``
    loops of ``spin_s`` (wall time over CPU time), a little apart.

    One 50 ms loop is a small sample. In a quiet ``make test`` (load
    average 2-10 on 2 cores) the cross-host stall test took 430 s, where its
    waits come to about 10 x the factor + 11 s (81 s at a fixed factor 7):
    a factor at the cap, 40, from one loop that was kept off the CPU."""
    got = []
    for i in range(samples):
        if i:
            time.sleep(spin_s / 5)
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        end = wall0 + spin_s
        while time.perf_counter() < end:
            pass
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        got.append(max(1.0, wall / max(cpu, 1e-6)))
    return sorted(got)[len(got) // 2]


def _override() -> float | None:
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{ENV}={text!r} is not a number") from None
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{ENV}={text!r} must be a finite number >= 1")
    return value


def factor() -> float:
    """How many times slower than a quiet machine this one runs now (>= 1)."""
    global _last
    fixed = _override()
    if fixed is not None:
        return fixed
    with _lock:
        now = time.monotonic()
        if _last is None or now - _last[0] > REMEASURE_S:
            _last = (now, min(MAX_FACTOR, max(queue_factor(), share_factor())))
        return _last[1]


def scaled(seconds: float, load: float | None = None) -> float:
    """``seconds`` on a quiet machine, as long as it takes now."""
    return seconds * (factor() if load is None else load)


def step_timeout(quiet_s: float, load: float | None = None) -> float:
    """A ``distributed.step_timeout_s`` of ``quiet_s`` on a quiet machine, scaled
    and rounded up to a tenth of a second (it goes on a command line)."""
    return math.ceil(scaled(quiet_s, load) * 10) / 10
