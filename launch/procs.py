"""The one process helper: spawn, free ports, one deadline, tracebacks, cleanup.

Launchers, tests and benchmarks all start their local processes here.

``run_procs`` starts ``nprocs`` spawned children running
``target(rank, nprocs, *args)``; ``run_ranks`` does the same inside a gloo
process group on 127.0.0.1 with a free port. Both:

- enforce one deadline on the whole group;
- collect each child's result or formatted traceback, failures earliest first;
- terminate, then kill, survivors in every exit path (an error, the deadline,
  ``KeyboardInterrupt``) and reap them;
- give children ``OMP_NUM_THREADS=1`` unless it is set, so 2-core machines are
  not oversubscribed.

With ``check=True`` (default) any failure raises ``SpawnError`` carrying all
tracebacks; with ``check=False`` the per-rank ``ProcResult`` list is returned
so the caller can tell which rank failed and how.

``ProcGroup`` is the lower level both use: processes started one at a time
(any targets) and all reaped on ``close``, for tests whose peers play
different roles. Its children are forked from a server that imported torch
and xgrammar once (``fork_server``), each with the environment, working
directory and stdout/stderr a spawned child would have had.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gramcoord.launch import fork_server, stack_dump
from gramcoord.launch.ports import free_port

__all__ = [
    "ProcGroup",
    "ProcResult",
    "SpawnError",
    "child_env",
    "format_failures",
    "free_port",
    "patched_environ",
    "reap",
    "resolve",
    "run_procs",
    "run_ranks",
]

# Seconds a terminated process gets to exit before it is killed.
GRACE_S = 5.0


@dataclass
class ProcResult:
    rank: int
    ok: bool
    value: Any = None
    # Exception type name and formatted traceback, when not ok.
    error_type: str = ""
    traceback: str = ""
    # time.time() when the child finished or failed (0: never reported).
    finished_at: float = 0.0
    exitcode: int | None = None


def format_failures(results: Iterable[Any], reason: str) -> str:
    """``reason``, then every failed rank's traceback, earliest failure first.

    ``results`` are ``ProcResult``s or anything with the same fields
    (``rank``, ``ok``, ``error_type``, ``traceback``, ``finished_at``,
    ``exitcode``), such as the launchers' ``RankOutcome``.

    Failures that never reported a time (killed, timed out) come last, in rank
    order.
    """
    failed = sorted(
        (r for r in results if not r.ok), key=lambda r: (r.finished_at or float("inf"), r.rank)
    )
    parts = [reason]
    for r in failed:
        parts.append(
            f"--- rank {r.rank} ({r.error_type or 'no report'}, exit {r.exitcode}) ---\n"
            f"{r.traceback}"
        )
    return "\n".join(parts)


class SpawnError(RuntimeError):
    def __init__(self, results: list[ProcResult], reason: str) -> None:
        self.results = results
        super().__init__(format_failures(results, reason))


def resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
    """``target`` itself, or the function a ``"module:function"`` path names."""
    if callable(target):
        return target
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"expected 'module:function', got {target!r}")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{target!r} is not callable")
    return fn


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables children get on top of ours: ``env``, plus one OMP thread."""
    out = dict(env or {})
    if "OMP_NUM_THREADS" not in out and "OMP_NUM_THREADS" not in os.environ:
        out["OMP_NUM_THREADS"] = "1"
    return out


@contextmanager
def patched_environ(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the block, then restore what was there.

    A spawned child copies the environment when it starts, before it imports
    anything, which is the only point where ``OMP_NUM_THREADS`` still counts.
    """
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def reap(procs: Sequence[mp.process.BaseProcess], grace_s: float = GRACE_S) -> None:
    """Terminate live processes, kill those still alive after ``grace_s``, join all."""
    # A process whose start() raised has no pid and must not be touched.
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


class ProcGroup:
    """Spawned processes, started one at a time, all reaped on ``close``.

    Every child starts with ``child_env(env)`` in its environment. Use it as a
    context manager or call ``close`` in a ``finally``.
    """

    def __init__(self, env: dict[str, str] | None = None, *, daemon: bool = False) -> None:
        self.env = child_env(env)
        self.ctx = fork_server.context(child_env())
        self.daemon = daemon
        self.started: list[mp.process.BaseProcess] = []

    def start(self, target: Callable[..., Any], *args: Any, **kwargs: Any):
        launch = fork_server.Launch.here(target, args, kwargs, self.env)
        proc = self.ctx.Process(target=fork_server.forked_main, args=(launch,), daemon=self.daemon)
        self.started.append(proc)
        proc.start()
        return proc

    def queue(self):
        return self.ctx.Queue()

    def event(self):
        return self.ctx.Event()

    def close(self, grace_s: float = GRACE_S) -> None:
        reap(self.started, grace_s)

    def __enter__(self) -> ProcGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _child(target, rank, nprocs, args, results, stack_path=None) -> None:
    if stack_path is not None:
        stack_dump.arm(stack_path)
    try:
        value = resolve(target)(rank, nprocs, *args)
        results.put(ProcResult(rank, True, value, finished_at=time.time()))
    except BaseException as exc:
        results.put(
            ProcResult(
                rank,
                False,
                error_type=type(exc).__name__,
                traceback=traceback.format_exc(),
                finished_at=time.time(),
            )
        )
        raise SystemExit(1) from None


def _drain(results_q, results: dict[int, ProcResult]) -> None:
    while True:
        try:
            r = results_q.get_nowait()
        except queue.Empty:
            return
        results[r.rank] = r


def _deadline_reason(
    timeout: float,
    procs: Sequence[mp.process.BaseProcess],
    results: dict[int, ProcResult],
    stack_paths: dict[int, Path],
) -> str:
    """Name every rank still running at the deadline and what it waits in.

    Each such rank's stack dump becomes its ``ProcResult.traceback``, so a
    slow machine (a rank deep in a compile) can be told from a hang (a rank
    blocked in a collective its peer never entered).
    """
    live = {i: p.pid for i, p in enumerate(procs) if i not in results and p.is_alive()}
    texts = stack_dump.dump(live, stack_paths)
    lines = [f"deadline of {timeout:.0f}s passed"]
    for rank, text in texts.items():
        lines.append(f"  rank {rank} {stack_dump.waiting_in(text)}")
        results[rank] = ProcResult(rank, False, error_type="timeout", traceback=text)
    if len(lines) == 1:
        lines.append("  (no rank was still running)")
    return "\n".join(lines)


def run_procs(
    target: Callable[..., Any] | str,
    nprocs: int,
    *,
    args: tuple = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> list[ProcResult]:
    """Run ``target(rank, nprocs, *args)`` in ``nprocs`` spawned processes.

    ``target`` is a picklable function or a ``"module:function"`` path that
    the children import (for functions of modules loaded from a file).
    ``timeout`` bounds the whole group, from the first start to the last
    result; results come back in rank order.
    """
    group = ProcGroup(env)
    results_q = group.queue()
    results: dict[int, ProcResult] = {}
    reason = ""
    deadline = time.monotonic() + timeout
    stack_dir = Path(tempfile.mkdtemp(prefix="gramcoord-stacks-"))
    stack_paths = {r: stack_dir / f"rank{r}.txt" for r in range(nprocs)}
    try:
        for r in range(nprocs):
            group.start(_child, target, r, nprocs, args, results_q, stack_paths[r])
        procs = group.started
        while len(results) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                _drain(results_q, results)
                reason = _deadline_reason(timeout, procs, results, stack_paths)
                break
            try:
                r = results_q.get(timeout=min(0.2, left))
                results[r.rank] = r
                continue
            except queue.Empty:
                pass
            # A child that died without reporting (SIGKILL, os._exit).
            silent = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results]
            if silent:
                time.sleep(0.2)  # let an in-flight report land
                _drain(results_q, results)
                for i in silent:
                    if i not in results:
                        results[i] = ProcResult(
                            i, False, error_type="died", finished_at=time.time()
                        )
    finally:
        group.close()
        results_q.close()
        results_q.join_thread()
        shutil.rmtree(stack_dir, ignore_errors=True)
    for i, p in enumerate(group.started):
        r = results.setdefault(i, ProcResult(i, False, error_type="timeout"))
        r.exitcode = p.exitcode if p.pid is not None else None
    ordered = [
        results.get(i) or ProcResult(i, False, error_type="not started") for i in range(nprocs)
    ]
    if check and (reason or not all(r.ok for r in ordered)):
        raise SpawnError(ordered, reason or "a process failed")
    return ordered


def _gloo_child(rank, world_size, fn, init_timeout_s, *args):
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=init_timeout_s),
    )
    try:
        return resolve(fn)(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any] | str,
    world_size: int,
    *,
    args: tuple = (),
    timeout: float = 120.0,
    init_timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> list[ProcResult]:
    """Run ``fn(rank, world_size, *args)`` in a gloo process group on 127.0.0.1."""
    rdv = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    return run_procs(
        _gloo_child,
        world_size,
        args=(fn, init_timeout_s, *args),
        timeout=timeout,
        env=rdv,
        check=check,
    )


def match_priority(nice: int) -> str | None:
    """Run this process at the driver's CPU priority; a reason where it cannot.

    Ray starts worker processes at nice 15 (``RAY_worker_niceness``): on a
    busy node such a rank gets a sliver of the CPU next to ordinary
    processes and misses every deadline. A cluster started here sets it to
    the driver's; on one started elsewhere the rank raises its own priority
    back (every thread: nice is per thread on Linux), which needs
    ``CAP_SYS_NICE`` or the cluster started with ``RAY_worker_niceness=0``.
    """
    if not hasattr(os, "setpriority"):
        return None
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    try:
        for tid in tasks:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) > nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    except ProcessLookupError:  # a thread ended meanwhile
        pass
    except PermissionError:
        now = os.getpriority(os.PRIO_PROCESS, 0)
        return (
            f"runs at nice {now}, the driver at {nice}, and may not raise its priority; "
            "start the ray cluster with RAY_worker_niceness=0"
        )
    return None
