"""Rank bodies for the host-driven poison exchange (run under ``run_ranks``)."""

from __future__ import annotations

import time

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.session.session import RankSession, SessionConfig
from tests.conftest import make_tiny_tokenizer

BAD = {"grammar": "root ::= undefined_rule"}


def host_exchange_body(rank: int, world: int) -> dict:
    """Partitioned replicas step at different rates; poison moves at the host's sync."""
    config = SessionConfig(
        parallel=ParallelConfig(dp=world, requests="partitioned"),
        distributed=DistributedConfig(step_timeout_s=20, poison_exchange="host"),
        grammar=GrammarConfig(compile_mode="async"),
    )
    session = RankSession.attach(make_tiny_tokenizer(), config, force_sync=False)
    try:
        steps = 0
        if rank == 1:
            session.leader.submit("bad-1", BAD)
            failed = []
            while not failed:  # no peer takes part in these steps
                failed = session.leader.step(steps).failed
                steps += 1
                time.sleep(0.01)
        else:
            for _ in range(7):  # a different number of steps than rank 1
                session.leader.step(steps)
                steps += 1
        shared = session.leader.exchange_poison(0)
        # The shared keys apply from the next step on, on every rank alike.
        before = session.leader.submit(f"bad-before-{rank}", BAD)
        session.leader.step(steps)
        steps += 1
        again = session.leader.submit(f"bad-again-{rank}", BAD)
        return {
            "before": before.status if rank == 0 else None,
            "steps": steps,
            "shared": shared,
            "status": again.status,
            "code": again.code,
            "cache": again.cache,
            "message": again.message,
        }
    finally:
        session.close()


def replica_body(rank: int, world: int) -> dict:
    """``ReplicaPoison`` at a host's sync point; rank 1's manager attaches late."""
    import torch.distributed as dist

    from gramcoord.coordinator.config import DistributedConfig
    from gramcoord.rank_worker.grammars.manager import GrammarManager
    from gramcoord.rank_worker.session.leader import StageLeader
    from gramcoord.rank_worker.session.replicas import ReplicaPoison

    replicas = ReplicaPoison(dist.group.WORLD, DistributedConfig(poison_lag_steps=2))
    manager = GrammarManager(GrammarConfig(compile_mode="sync"), make_tiny_tokenizer())
    leader = StageLeader(manager, None)
    try:
        if rank == 0:
            replicas.attach(leader)
            leader.submit("bad-0", BAD)
            (first,) = leader.step(0).failed
        for _ in range(4):  # the host's sync points: the same count everywhere
            replicas.sync()
        if rank == 1:
            replicas.attach(leader)  # the host made its grammar manager late
        again = leader.submit(f"bad-again-{rank}", BAD)
        return {
            "first": (first.status, first.code, first.message) if rank == 0 else None,
            "again": (again.status, again.code, again.cache, again.message),
            "compiles": manager.stats.miss,
            "received": replicas.received,
        }
    finally:
        manager.close()
