"""What a run holds and leaves behind: memory, threads, processes, /dev/shm.

Each rank samples its resident set size every ``SAMPLE_EVERY`` steps while
it runs (a read of ``/proc/self/statm``: microseconds) and, after its
session closed, writes ``logs/rank<N>.resources.json`` with the samples and
the Python threads still alive. Once every rank has exited, the launching
process (``gramcoord run``) adds what only it can see: ``/dev/shm`` entries
named after the run and processes of the run still alive. The result is the
``resources`` section of ``summary.json``.

*Warm-up* is the first sample at or after ``WARM_SHARE`` of the run's steps:
by then every distinct grammar of a cycled workload has been compiled and
the caches hold what they will hold. A run whose end RSS is within
``RSS_SLACK`` of its warm-up RSS does not grow with the number of requests.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import msgspec

from gramcoord.launch import fork_server
from gramcoord.rank_worker.grammars import native_exit

SAMPLE_EVERY = 25
WARM_SHARE = 0.1
RSS_SLACK = 0.10
SHM = Path("/dev/shm")
_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def rss_kb() -> int:
    """This process's resident set size in KiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_KB


def native_threads() -> int:
    """Every thread of this process, Python's or not."""
    return len(os.listdir("/proc/self/task"))


class RankResources(msgspec.Struct, kw_only=True):
    rank: int
    # (step, RSS KiB) every SAMPLE_EVERY steps, and at the last step.
    rss_kb: list[tuple[int, int]] = msgspec.field(default_factory=list)
    rss_warm_kb: int = 0
    warm_step: int = 0
    rss_end_kb: int = 0
    # Python threads before the session started and after it closed (the
    # main thread included); a stuck compile's thread shows up here.
    threads_start: int = 0
    threads_after_close: int = 0
    # Names of the threads alive after close that were not there at start,
    # less those still inside a compile (``compiling_after_close`` of them).
    new_threads: list[str] = msgspec.field(default_factory=list)
    compiling_after_close: int = 0
    native_threads_after_close: int = 0


class ResourceProbe:
    """One rank's sampler: ``start()``, ``on_step(step)`` each step, ``finish(...)``."""

    def __init__(self, rank: int) -> None:
        self.res = RankResources(rank=rank)
        self._before: set[int] = set()

    def start(self) -> None:
        self._before = {t.ident for t in threading.enumerate() if t.ident is not None}
        self.res.threads_start = len(self._before)

    def on_step(self, step: int) -> None:
        if step % SAMPLE_EVERY == 0:
            self.res.rss_kb.append((step, rss_kb()))

    def end_of_loop(self, steps: int) -> None:
        """After the last step, before the session closes."""
        res = self.res
        res.rss_end_kb = rss_kb()
        res.rss_kb.append((steps, res.rss_end_kb))
        warm_at = int(steps * WARM_SHARE)
        warm = next((s for s in res.rss_kb if s[0] >= warm_at), res.rss_kb[-1])
        res.warm_step, res.rss_warm_kb = warm

    def after_close(self, logs: Path) -> RankResources:
        """After the session closed: threads left; writes ``rank<N>.resources.json``."""
        res = self.res
        # A compile past its deadline cannot be stopped: its daemon thread ends
        # when xgrammar returns. Those (seen before the threads are listed, so
        # one that just returned is still among them) are not leaks.
        compiling = native_exit.threads_in_calls()
        alive = [t for t in threading.enumerate() if t.is_alive()]
        res.threads_after_close = len(alive)
        res.compiling_after_close = sum(t.ident in compiling for t in alive)
        res.new_threads = sorted(
            t.name for t in alive if t.ident not in self._before and t.ident not in compiling
        )
        res.native_threads_after_close = native_threads()
        logs.mkdir(parents=True, exist_ok=True)
        path = logs / f"rank{res.rank}.resources.json"
        path.write_bytes(msgspec.json.encode(res))
        return res


RUN_ID_ENV = "GRAMCOORD_RUN_ID"


def parent_pid(pid: int | str) -> int:
    """The parent of ``pid`` (Linux ``/proc``), -1 when it is gone or unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    # "pid (comm) state ppid ...": comm may hold spaces, so split after it.
    return int(stat.rsplit(")", 1)[1].split()[1])


# A rank's janitor (sync/janitor.py) exits once the rank's pipe closes; on a
# loaded machine it may still be on its way out when the run is collected.
JANITOR_GRACE_S = 10.0


def _run_processes(run_id: str, grace_s: float = JANITOR_GRACE_S) -> list[str]:
    """Live processes (not this one) whose command line or environment names
    the run: ``gramcoord run`` exports ``GRAMCOORD_RUN_ID`` to its ranks.

    Janitors of ranks that ended get ``grace_s`` to finish their exit.
    """
    deadline = time.monotonic() + grace_s
    while True:
        found = _scan(run_id)
        if not any("janitor.py" in f for f in found) or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def _scan(run_id: str) -> list[str]:
    found = []
    me = os.getpid()
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.resource_tracker" in cmd and parent_pid(pid) == me:
            continue  # this process's own tracker: it ends when this process does
        if int(pid) == fork_server.server_pid():
            continue  # this process's fork server: the same (its children count)
        if needle in cmd or needle in env:
            text = cmd.replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(f"{pid} {text}")
    return found


def collect(out_dir: Path, run_id: str, world: int) -> dict:
    """The ``resources`` section: every rank's file, plus the run's leftovers."""
    ranks = []
    for r in range(world):
        path = out_dir / "logs" / f"rank{r}.resources.json"
        if path.is_file():
            ranks.append(msgspec.json.decode(path.read_bytes(), type=RankResources))
    shm = sorted(p.name for p in SHM.iterdir() if run_id in p.name) if SHM.is_dir() else []
    growth = [
        round(r.rss_end_kb / r.rss_warm_kb - 1, 4) for r in ranks if r.rss_warm_kb and r.rss_end_kb
    ]
    return {
        "ranks": [msgspec.to_builtins(r) for r in ranks],
        "rss_growth_max": max(growth, default=0.0),
        "rss_within_slack": all(g <= RSS_SLACK for g in growth),
        "new_threads": sum(len(r.new_threads) for r in ranks),
        "leaked_shm": shm,
        "leftover_processes": _run_processes(run_id),
    }
