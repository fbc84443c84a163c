"""Rank bodies of the SGLang drop-in tests (imported by the spawned children).

Each body loads the real Qwen2.5 vocabulary, makes its session with
``RankSession.start`` (its own world, async compiles) or
``RankSession.attach`` (inside the world ``run_ranks`` made; compiles forced
sync), runs ``FakeScheduler`` to the end and returns its ``Report``.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.rank_worker.config import GrammarConfig, TokenizerConfig
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
from gramcoord.rank_worker.integrations.sglang_manager import SGLangGrammarManager
from gramcoord.rank_worker.session import RankSession, SessionConfig
from tests.integrations.fake_sglang import FakeScheduler, Report, load_records, to_req

# iteration -> [(request id, workload record id)], per rank (stage-0 leaders).
Plan = dict[int, dict[int, list[tuple[str, str]]]]


def skew_compiles(rank: int, delay_s: float) -> Counter:
    """Count this process's compiles by spec text; delay the keys of this rank's parity.

    Each rank is slower on a different half of the keys, so readiness
    differs between ranks in both directions.
    """
    calls: Counter = Counter()
    real = XGrammarBackend.__call__

    def call(self, spec):
        calls[spec.text] += 1
        if delay_s and spec.key[0] % 2 == rank % 2:
            time.sleep(delay_s)
        return real(self, spec)

    XGrammarBackend.__call__ = call
    return calls


def session_config(parallel: dict[str, Any], step_timeout_s: float) -> SessionConfig:
    return SessionConfig(
        parallel=ParallelConfig(**parallel),
        distributed=DistributedConfig(step_timeout_s=step_timeout_s, init_timeout_s=60.0),
        grammar=GrammarConfig(num_compile_workers=1),
    )


def _arrivals(plan: Plan, rank: int) -> dict[int, list]:
    mine = plan.get(rank, {})
    ids = [rec_id for reqs in mine.values() for _, rec_id in reqs]
    records = load_records(ids)
    return {it: [to_req(records[rec], rid) for rid, rec in reqs] for it, reqs in mine.items()}


def _serve(session: RankSession, plan: Plan, calls: Counter, guard: bool) -> Report:
    manager = SGLangGrammarManager(session)
    try:
        report = FakeScheduler(manager, _arrivals(plan, session.rank), guard=guard).event_loop()
    finally:
        manager.close()
    report.compiles = dict(calls)
    return report


def started(
    rank: int,
    world_size: int,
    parallel: dict[str, Any],
    plan: Plan,
    delay_s: float = 0.0,
    step_timeout_s: float = 30.0,
) -> Report:
    """``RankSession.start`` (run under ``run_procs`` with MASTER_ADDR/MASTER_PORT set)."""
    calls = skew_compiles(rank, delay_s)
    tokenizer = load_tokenizer(TokenizerConfig(name="qwen2.5"))
    session = RankSession.start(tokenizer, session_config(parallel, step_timeout_s), rank=rank)
    return _serve(session, plan, calls, guard=False)


def attached(
    rank: int,
    world_size: int,
    parallel: dict[str, Any],
    plan: Plan,
    delay_s: float = 0.0,
    step_timeout_s: float = 30.0,
    guard: bool = False,
) -> Report:
    """``RankSession.attach`` inside the gloo world of ``run_ranks``."""
    calls = skew_compiles(rank, delay_s)
    tokenizer = load_tokenizer(TokenizerConfig(name="qwen2.5"))
    session = RankSession.attach(tokenizer, session_config(parallel, step_timeout_s))
    assert session.rank == rank
    return _serve(session, plan, calls, guard=guard)
