"""Launchers that run one per-rank entry point: inline, torchrun (elastic API), ray.

The contract every launcher shares:

- ``entry`` is a ``"module:function"`` path to ``entry(job: bytes) -> bytes``,
  imported and called once in each rank's process after ``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` are set. It returns the rank's encoded report or raises.
- A launcher returns one ``RankOutcome`` per rank, in rank order; it does not
  raise for a failed rank. ``check_outcomes`` turns failures into a
  ``LaunchError`` whose message lists every failed rank, earliest first.
- ``deadline_s`` bounds the whole launch; when it passes, every rank still
  running is killed and reported with ``error_type == "deadline"``.
- No process or actor outlives the call, whatever way it ends (success, a
  failed rank, the deadline, ``KeyboardInterrupt``).

``launch_ray`` lives in ``gramcoord.launch.ray_launcher`` (it imports ray).
The ``external`` launcher needs no code here: the user's own ``torchrun``
starts the per-rank program.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from gramcoord.launch import warm_fork
from gramcoord.launch.procs import (
    child_env,
    format_failures,
    free_port,
    patched_environ,
    reap,
    resolve,
)

__all__ = [
    "LaunchError",
    "RankOutcome",
    "check_outcomes",
    "launch_inline",
    "launch_torchrun",
    "rank_env",
    "run_entry",
    "run_rank",
]

# error_type of ranks that the launcher stopped: after another rank failed,
# or because the deadline passed.
TERMINATED = "terminated"
DEADLINE = "deadline"
# Seconds torch's agent waits after SIGTERM before SIGKILL (a rank failed).
SHUTDOWN_S = 5
# Seconds a rank gets between SIGTERM and SIGKILL at the deadline.
STOP_S = 2.0
# Torch loggers whose records go to the launch's log file, not the console.
_TORCH_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.multiprocessing",
    "torchelastic-events-null",
)


class RankOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank ended with."""

    rank: int
    ok: bool
    # The entry's return value (its encoded report) when ok.
    value: bytes | None = None
    # Exception type name (or ``terminated``, ``deadline``, ``died``) and the
    # formatted traceback or explanation, when not ok.
    error_type: str = ""
    traceback: str = ""
    # Process exit status where the launcher saw one (negative: a signal).
    exitcode: int | None = None
    # time.time() when the rank finished or failed; 0 when unknown.
    finished_at: float = 0.0


class LaunchError(RuntimeError):
    """Some ranks failed; ``outcomes`` holds every rank's ``RankOutcome``."""

    def __init__(self, outcomes: list[RankOutcome], reason: str = "ranks failed") -> None:
        self.outcomes = outcomes
        super().__init__(format_failures(outcomes, reason))


def check_outcomes(outcomes: list[RankOutcome]) -> list[bytes]:
    """Every rank's value, or ``LaunchError`` (failures earliest first)."""
    if not outcomes or not all(o.ok for o in outcomes):
        raise LaunchError(outcomes, "no rank ran" if not outcomes else "ranks failed")
    return [o.value or b"" for o in outcomes]


def rank_env(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> dict[str, str]:
    """The torch.distributed ``env://`` variables of one rank."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def run_entry(entry: str, job: bytes) -> bytes:
    """Import ``entry`` and call it on ``job``; its value must be bytes."""
    value = resolve(entry)(job)
    if isinstance(value, (bytearray, memoryview)):
        value = bytes(value)
    if not isinstance(value, bytes):
        raise TypeError(f"{entry} returned {type(value).__name__}, expected bytes")
    return value


def failed_outcome(rank: int, exc: BaseException) -> RankOutcome:
    """The outcome of a rank whose entry raised ``exc`` in this process."""
    code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else None
    return RankOutcome(
        rank=rank,
        ok=False,
        error_type=type(exc).__name__,
        traceback="".join(traceback.format_exception(exc)),
        exitcode=code,
        finished_at=time.time(),
    )


def run_rank(rank: int, entry: str, job: bytes) -> RankOutcome:
    """Run the entry here and report how it ended (``KeyboardInterrupt`` propagates)."""
    try:
        value = run_entry(entry, job)
    except (Exception, SystemExit) as exc:
        return failed_outcome(rank, exc)
    return RankOutcome(rank=rank, ok=True, value=value, finished_at=time.time())


# -- inline ---------------------------------------------------------------------


def launch_inline(entry: str, job: bytes, *, master_addr: str = "127.0.0.1") -> list[RankOutcome]:
    """Run the entry in this process as rank 0 of a world of 1.

    The rank variables are set for the call (``MASTER_PORT`` a free port) and
    restored afterwards. There is no deadline: nothing here can stop a call
    in this process.
    """
    env = rank_env(0, 1, master_addr, free_port(master_addr))
    with patched_environ(env):
        return [run_rank(0, entry, job)]


# -- torchrun -------------------------------------------------------------------


def _torchrun_rank(entry: str, job: bytes) -> bytes:
    """The function torch's agent runs in each worker (module level: picklable).

    ``record`` writes an uncaught exception and its traceback to the error
    file the agent reads back into ``ChildFailedError``.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    from gramcoord.launch.rank_process import status_of, worker
    from gramcoord.rank_worker.grammars import native_exit

    warm_fork.after_start()
    worker()  # torch's exit of this process leaves with os._exit (rank_process)
    # The status torch's wrapper exits with, told first: a forked worker runs
    # its exit hooks before that wrapper's sys.exit is read (warm_fork).
    try:
        value = record(run_entry)(entry, job)
    except SystemExit as exc:
        native_exit.exiting(status_of(exc.code))
        raise
    except BaseException:
        native_exit.exiting(1)
        raise
    native_exit.exiting(0)
    return value


class _QuietFileHandler(logging.FileHandler):
    """A log file that never complains on the console (an abandoned agent may
    still log after the launch closed it)."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


@contextmanager
def _torch_logs_to(path: str) -> Iterator[None]:
    """Send torch's launcher/agent log records to ``path`` instead of the console."""
    handler = _QuietFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in _TORCH_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.propagate))
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, propagate in saved:
            lg.removeHandler(handler)
            lg.propagate = propagate
        handler.close()


def _failure_outcome(rank: int, failure: Any, deadline_hit: bool) -> RankOutcome:
    """A ``RankOutcome`` from one of torch's ``ProcessFailure`` records."""
    message = failure.message
    if isinstance(message, dict):  # written by ``record``: our traceback
        text = str(message.get("message", ""))
        tb = str(message.get("extraInfo", {}).get("py_callstack", "")) or text
        error_type = text.split(":", 1)[0] or "error"
    elif deadline_hit and failure.exitcode < 0:
        error_type, tb = DEADLINE, f"killed at the deadline ({message})"
    else:
        error_type = "died" if failure.exitcode < 0 else "exited"
        tb = f"{message} (exit code {failure.exitcode})"
    return RankOutcome(
        rank=rank,
        ok=False,
        error_type=error_type,
        traceback=tb,
        exitcode=failure.exitcode,
        finished_at=float(failure.timestamp or 0),
    )


def _workers(before: set[int]) -> list[mp.process.BaseProcess]:
    """Live multiprocessing children started since ``before``: the agent's workers.

    Nothing else in a started process tells torch's workers apart, so a host
    that starts its own multiprocessing children while a launch runs would
    see them stopped with the workers at the deadline.
    """
    return [p for p in mp.active_children() if p.pid not in before]


def launch_torchrun(
    entry: str,
    job: bytes,
    *,
    nproc: int,
    deadline_s: float,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    run_id: str = "gramcoord",
    log_dir: str | None = None,
    max_restarts: int = 0,
) -> list[RankOutcome]:
    """Run ``nproc`` ranks on this node through torch's elastic launcher API.

    This is ``torchrun`` in-process: ``elastic_launch`` with ``max_restarts``
    (after a failed rank the agent restarts the whole group, which resumes
    from the journal; ``TORCHELASTIC_RESTART_COUNT`` tells the ranks)
    and a c10d (or ``static``) rendezvous at ``rdzv_endpoint``, by default
    ``master_addr:master_port`` with a free port when ``master_port`` is 0.
    ``node_rank`` is this node's rank for the static rendezvous; for c10d it
    only says which node hosts the rendezvous store (node 0). Every node of
    a run passes the same ``run_id``. Outcomes cover the ranks this node ran.
    Workers get ``OMP_NUM_THREADS=1`` unless it is set.

    The agent runs in a helper thread (so it installs no signal handlers)
    while this thread waits for it until the deadline. On the deadline or
    ``KeyboardInterrupt`` the workers (children of this process, forked warm
    where that is safe: ``warm_fork``) are
    killed (SIGTERM, then SIGKILL after ``STOP_S``), which ends the agent. A
    failed rank ends the agent too: it stops the other ranks itself (SIGTERM,
    then SIGKILL after ``SHUTDOWN_S``), and only that rank's failure comes
    back; the others are reported ``terminated``.

    With ``log_dir`` the agent's log and each worker's stdout/stderr are kept
    there; otherwise the agent's log goes to a temporary directory that is
    removed, and the workers write to this process's console.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    start = time.monotonic()
    deadline = start + deadline_s
    if rdzv_endpoint is None:
        rdzv_endpoint = f"{master_addr}:{master_port or free_port(master_addr)}"
    rdzv_configs: dict[str, Any] = {"timeout": max(1, math.ceil(deadline_s))}
    if rdzv_backend == "static":
        rdzv_configs["rank"] = node_rank
    elif nnodes > 1:
        rdzv_configs["is_host"] = node_rank == 0
    start_method = warm_fork.start_method()
    if start_method == "fork":
        resolve(entry)  # imported once here, so the forked workers start warm
    run_dir = log_dir or tempfile.mkdtemp(prefix="gramcoord-torchrun-")
    os.makedirs(run_dir, exist_ok=True)
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=run_dir, redirects=Std.ALL if log_dir else Std.NONE),
        local_addr=master_addr if nnodes == 1 else None,
        shutdown_timeout=SHUTDOWN_S,
    )
    box: dict[str, Any] = {}
    # Waiting on an Event, not Thread.join: a join interrupted by Ctrl-C can
    # mark a running thread as finished.
    done = threading.Event()

    def agent() -> None:
        try:
            with warm_fork.forking():
                box["values"] = elastic_launch(config, _torchrun_rank)(entry, job)
        except BaseException as exc:
            box["error"] = exc
        finally:
            box["ended_at"] = time.time()
            done.set()

    before = {p.pid for p in mp.active_children()}
    thread = threading.Thread(target=agent, name="gramcoord-torchrun-agent", daemon=True)
    deadline_hit = False
    try:
        with _torch_logs_to(os.path.join(run_dir, "agent.log")), patched_environ(child_env()):
            thread.start()
            try:
                deadline_hit = not done.wait(max(0.0, deadline - time.monotonic()))
            finally:
                # Deadline or KeyboardInterrupt: stop the workers, which ends
                # the agent; keep sweeping in case it was still starting them.
                # An agent stuck without workers (a multi-node rendezvous or
                # exit barrier) is abandoned: its thread is a daemon.
                give_up = time.monotonic() + STOP_S + SHUTDOWN_S
                while not done.is_set() and time.monotonic() < give_up:
                    reap(_workers(before), grace_s=STOP_S)
                    done.wait(0.2)
                reap(_workers(before), grace_s=STOP_S)
    finally:
        if log_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)

    values: dict[int, bytes] = box.get("values") or {}
    error = box.get("error")
    ended_at = box.get("ended_at", time.time())
    outcomes: dict[int, RankOutcome] = {
        rank: RankOutcome(rank=rank, ok=True, value=bytes(v), exitcode=0, finished_at=ended_at)
        for rank, v in values.items()
    }
    if isinstance(error, ChildFailedError):
        for rank, failure in error.failures.items():
            outcomes[rank] = _failure_outcome(rank, failure, deadline_hit)
    # This node's ranks; exact for one node and the static rendezvous, and for
    # c10d across nodes when the rendezvous numbered the nodes by node_rank.
    for rank in range(node_rank * nproc, (node_rank + 1) * nproc):
        if rank in outcomes:
            continue
        if deadline_hit:
            why, kind = f"still running at the deadline of {deadline_s:g}s", DEADLINE
        elif error is not None and not isinstance(error, ChildFailedError):
            why, kind = "".join(traceback.format_exception(error)), type(error).__name__
        else:
            why, kind = "stopped by the launcher after another rank failed", TERMINATED
        outcomes[rank] = RankOutcome(rank=rank, ok=False, error_type=kind, traceback=why)
    return [outcomes[r] for r in sorted(outcomes)]
