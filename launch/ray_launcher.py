"""The ray launcher: one actor per rank in a placement group.

Rank 0's actor reports its node's address and picks a free port there; every
actor then gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` and runs the entry (the contract is in
``gramcoord.launch.launchers``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gramcoord.launch.launchers import (
    DEADLINE,
    TERMINATED,
    RankOutcome,
    rank_env,
    run_rank,
)
from gramcoord.launch.ports import free_port
from gramcoord.launch.procs import match_priority
from gramcoord.launch.resources import parent_pid

__all__ = ["launch_ray"]

# Object store of a private local instance: ranks pass only small reports.
OBJECT_STORE_BYTES = 100 * 1024 * 1024
# Says at every local start that token authentication is on (the default).
_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class _RankActor:
    """One rank's process. The driver's ``sys.path`` comes along, so the entry
    imports the same way as in the driver."""

    def __init__(self, sys_path: list[str], nice: int) -> None:
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        self.nice = nice

    def where(self, pick_port: bool) -> tuple[str, str, int]:
        """This actor's node id and address, and a free port there if asked."""
        ip = ray.util.get_node_ip_address()
        port = free_port(ip) if pick_port else 0
        return ray.get_runtime_context().get_node_id(), ip, port

    def run(self, rank: int, entry: str, job: bytes, env: dict[str, str]) -> RankOutcome:
        os.environ.update(env)
        why = match_priority(self.nice)
        if why:
            print(f"gramcoord: rank {rank}: {why}", file=sys.stderr, flush=True)
        return run_rank(rank, entry, job)


def _init_kwargs(address: str, num_cpus: float, node_ip: str | None) -> dict[str, Any]:
    """``ray.init``'s arguments: a local cluster's workers run at the driver's priority."""
    quiet: dict[str, Any] = {
        "log_to_driver": False,
        "logging_level": logging.WARNING,
        "include_dashboard": False,
        "configure_logging": True,
    }
    if address != "local":
        return {"address": address, **quiet}
    local = {
        "address": "local",
        "num_cpus": num_cpus,
        "num_gpus": 0,
        "object_store_memory": OBJECT_STORE_BYTES,
        "_system_config": {"worker_niceness": os.getpriority(os.PRIO_PROCESS, 0)},
    }
    if node_ip:
        local["_node_ip_address"] = node_ip
    return {**local, **quiet}


def launch_ray(
    entry: str,
    job: bytes,
    *,
    nproc: int,
    deadline_s: float,
    address: str = "local",
    num_cpus_per_rank: float = 1.0,
    strategy: str = "PACK",
    node_ip: str | None = "127.0.0.1",
) -> list[RankOutcome]:
    """Run ``nproc`` ranks as ray actors, one per placement-group bundle.

    ``address="local"`` starts a private local ray instance sized to the job
    (``nproc * num_cpus_per_rank`` CPUs, a 100 MB object store; ``node_ip``
    is its address) and stops it afterwards; any other address connects to
    that cluster (``"auto"``, ``"ray://..."``, ``"host:port"``). If this
    process is already connected to ray, that connection is used and kept.
    ``strategy`` is the placement group's: ``PACK`` on one node,
    ``STRICT_SPREAD`` / ``SPREAD`` across nodes.

    The deadline covers starting ray, reserving the bundles and running the
    ranks. At the first failed rank, or at the deadline, the remaining actors
    are killed (``terminated`` / ``deadline``). Every actor is killed and the
    placement group removed in every exit path, and a ray instance started
    here is shut down.
    """
    deadline = time.monotonic() + deadline_s
    started = not ray.is_initialized()
    placed: dict[str, Any] = {"pg": None, "actors": []}
    outcomes: dict[int, RankOutcome] = {}
    try:
        if started:
            _init(_init_kwargs(address, nproc * num_cpus_per_rank, node_ip), deadline)
        _run(entry, job, nproc, num_cpus_per_rank, strategy, deadline, deadline_s, placed, outcomes)
    except Exception as exc:  # ray itself failed (start, placement, an actor's start)
        why = "".join(traceback.format_exception(exc))
        _unfinished(range(nproc), outcomes, type(exc).__name__, why)
    finally:
        for actor in placed["actors"]:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if placed["pg"] is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(placed["pg"])
        if started:
            ray.shutdown()
    return [outcomes[r] for r in range(nproc)]


# Ray waits a fixed 30 s for its own raylet to register with the GCS
# (``ray._private.node``); a loaded machine can take longer. Such a start is
# tried again while the run's deadline leaves room for one.
STARTUP_TIMED_OUT = "timed out during startup"
START_ATTEMPTS = 3
START_ROOM_S = 40.0

_log = logging.getLogger(__name__)


def _init(kwargs: dict[str, Any], deadline: float | None = None) -> None:
    """``ray.init(**kwargs)``; a local start Ray timed out is tried again before ``deadline``.

    A start that fails part-way has its processes ended before it is tried
    again or the error is raised.
    """
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            _init_once(kwargs)
            return
        except Exception as exc:
            room = deadline is None or deadline - time.monotonic() > START_ROOM_S
            if STARTUP_TIMED_OUT not in str(exc) or attempt == START_ATTEMPTS or not room:
                raise
            _log.warning("ray start %d of %d: %s; trying again", attempt, START_ATTEMPTS, exc)


def _init_once(kwargs: dict[str, Any]) -> None:
    auth_log = logging.getLogger(_AUTH_LOGGER)
    level = auth_log.level
    auth_log.setLevel(logging.ERROR)
    before = _children()
    try:
        ray.init(**kwargs)
    except BaseException:
        # A start that failed part-way (a timeout on a loaded machine) leaves
        # the head's processes (gcs_server, raylet, dashboard, monitors)
        # running with no ray instance that would stop them: end them here.
        with contextlib.suppress(Exception):
            ray.shutdown()
        for pid in _children() - before:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        raise
    finally:
        auth_log.setLevel(level)


def _children() -> set[int]:
    """The pids of this process's children (Linux ``/proc``; empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return set()
    me = os.getpid()
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and parent_pid(p) == me}


def _run(entry, job, nproc, num_cpus_per_rank, strategy, deadline, deadline_s, placed, outcomes):
    """Reserve the bundles, start one actor per rank, run the entry on each.

    ``placed`` receives the placement group and actors as they are made, so
    the caller removes them whatever happens here.
    """
    pg = placed["pg"] = placement_group([{"CPU": num_cpus_per_rank}] * nproc, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=max(0.0, deadline - time.monotonic()))
    except GetTimeoutError:
        why = f"placement group of {nproc} bundles not ready by the deadline"
        _unfinished(range(nproc), outcomes, DEADLINE, why)
        return
    actor_cls = ray.remote(num_cpus=num_cpus_per_rank, max_restarts=0)(_RankActor)
    for rank in range(nproc):
        strategy_ = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
        actor = actor_cls.options(scheduling_strategy=strategy_).remote(
            list(sys.path), os.getpriority(os.PRIO_PROCESS, 0)
        )
        placed["actors"].append(actor)
    actors = placed["actors"]
    where_refs = [a.where.remote(rank == 0) for rank, a in enumerate(actors)]
    try:
        where = ray.get(where_refs, timeout=max(0.0, deadline - time.monotonic()))
    except GetTimeoutError:
        _unfinished(range(nproc), outcomes, DEADLINE, "actors not up by the deadline")
        return
    master_addr, master_port = where[0][1], where[0][2]
    nodes = [node for node, _, _ in where]
    refs = {}
    for rank, actor in enumerate(actors):
        same_node = [r for r in range(nproc) if nodes[r] == nodes[rank]]
        env = rank_env(
            rank,
            nproc,
            master_addr,
            master_port,
            local_rank=same_node.index(rank),
            local_world_size=len(same_node),
        )
        refs[actor.run.remote(rank, entry, job, env)] = rank
    _collect(refs, outcomes, deadline, deadline_s)


def _collect(refs: dict, outcomes: dict[int, RankOutcome], deadline: float, deadline_s: float):
    """Wait for the ranks' outcomes until the first failure or the deadline."""
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            why = f"still running at the deadline of {deadline_s:g}s"
            _unfinished([refs[r] for r in pending], outcomes, DEADLINE, why)
            return
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        failed = False
        for ref in done:
            outcome = _get(ref, refs[ref])
            outcomes[outcome.rank] = outcome
            failed = failed or not outcome.ok
        if failed:
            # Take what is already done, then stop the rest.
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            for ref in done:
                outcome = _get(ref, refs[ref])
                outcomes[outcome.rank] = outcome
            why = "stopped by the launcher after another rank failed"
            _unfinished([refs[r] for r in pending], outcomes, TERMINATED, why)
            return


def _get(ref, rank: int) -> RankOutcome:
    try:
        return ray.get(ref)
    except RayActorError as exc:  # the actor's process died
        kind, exc_ = "died", exc
    except Exception as exc:
        kind, exc_ = type(exc).__name__, exc
    tb = "".join(traceback.format_exception(exc_))
    return RankOutcome(rank=rank, ok=False, error_type=kind, traceback=tb, finished_at=time.time())


def _unfinished(ranks, outcomes: dict[int, RankOutcome], kind: str, why: str) -> None:
    """Record ``kind`` for each of ``ranks`` that has no outcome yet."""
    for rank in ranks:
        outcomes.setdefault(rank, RankOutcome(rank=rank, ok=False, error_type=kind, traceback=why))
