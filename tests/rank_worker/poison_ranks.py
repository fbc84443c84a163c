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
