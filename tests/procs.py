"""One helper for every multi-process test: spawn, deadline, tracebacks, cleanup.

``run_procs`` starts ``nprocs`` spawned children running
``target(rank, nprocs, *args)``. ``run_ranks`` does the same inside a gloo
process group on 127.0.0.1 with a free port. Both:

- enforce one deadline on the whole group;
- collect each child's result or traceback, earliest failure first;
- terminate (then kill) survivors in every exit path;
- set ``OMP_NUM_THREADS=1`` so 2-core machines are not oversubscribed.

With ``check=True`` (default) any failure raises ``SpawnError`` carrying all
tracebacks; with ``check=False`` the per-rank ``ProcResult`` list is returned
so a test can assert which rank failed and how.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ProcResult:
    rank: int
    ok: bool
    value: Any = None
    # Exception type name and formatted traceback, when not ok.
    error_type: str = ""
    traceback: str = ""
    # time.time() when the child finished or failed.
    finished_at: float = 0.0
    exitcode: int | None = None


class SpawnError(RuntimeError):
    def __init__(self, results: list[ProcResult], reason: str) -> None:
        self.results = results
        failed = sorted((r for r in results if not r.ok), key=lambda r: r.finished_at or 1e30)
        parts = [reason]
        for r in failed:
            parts.append(
                f"--- rank {r.rank} ({r.error_type or 'no report'}, exit {r.exitcode}) ---\n"
                f"{r.traceback}"
            )
        super().__init__("\n".join(parts))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(target, rank, nprocs, args, env, results) -> None:
    os.environ.update(env)
    try:
        value = target(rank, nprocs, *args)
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
        return fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _reap(procs: list[mp.Process]) -> None:
    # A process whose start() raised has no pid and must not be touched.
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


def run_procs(
    target: Callable[..., Any],
    nprocs: int,
    *,
    args: tuple = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> list[ProcResult]:
    """Run ``target(rank, nprocs, *args)`` in ``nprocs`` spawned processes."""
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(target=_child, args=(target, r, nprocs, args, child_env, results_q))
        for r in range(nprocs)
    ]
    results: dict[int, ProcResult] = {}
    reason = ""
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = f"deadline of {timeout:.0f}s passed"
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
                while True:
                    try:
                        r = results_q.get_nowait()
                        results[r.rank] = r
                    except queue.Empty:
                        break
                for i in silent:
                    if i not in results:
                        results[i] = ProcResult(
                            i, False, error_type="died", finished_at=time.time()
                        )
    finally:
        _reap(procs)
        results_q.close()
        results_q.join_thread()
    for i, p in enumerate(procs):
        r = results.setdefault(i, ProcResult(i, False, error_type="timeout"))
        r.exitcode = p.exitcode if p.pid is not None else None
    ordered = [results[i] for i in range(nprocs)]
    if check and (reason or not all(r.ok for r in ordered)):
        raise SpawnError(ordered, reason or "a process failed")
    return ordered


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    timeout: float = 120.0,
    init_timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> list[ProcResult]:
    """Run ``fn(rank, world_size, *args)`` in a gloo process group."""
    rdv = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    return run_procs(
        _gloo_child,
        world_size,
        args=(fn, init_timeout_s, *args),
        timeout=timeout,
        env=rdv,
        check=check,
    )
