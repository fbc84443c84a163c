"""Ours, for ``gramcoord bench step``: the real step loop on one rank.

Each rank attaches a ``RankSession`` to the bench's gloo world (the
external-launcher path with ``force_sync=False``, so compiles stay async
and the agreement runs every step, as under ``gramcoord run``) and runs
``engine.loop.run_loop``, the loop ``gramcoord run`` runs. The
only change: the logits source and the sampler are wrapped by a ``RunClock``.

Fill strategies (the ``BitmaskBuilder`` of the last-stage leader, K = 0):

- ``default``: the builder as the session builds it (one-thread
  ``BatchGrammarMatcher`` below ``DEFAULT_PARALLEL_THRESHOLD`` requests,
  ``default_fill_threads()`` threads from there on);
- ``batch1``: ``BatchGrammarMatcher(1)`` at every batch size (sequential);
- ``batch2``: ``BatchGrammarMatcher(default_fill_threads())`` at every size;
- ``pool``: the chunked thread pool the builder did not keep (the caller
  plus ``threads - 1`` workers pulling chunks of 16 matchers), at every
  size: ``fill.PoolFill``, which ``gramcoord bench fill`` times alone; here
  it is judged end to end.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from gramcoord.benchmarks._step_common import BenchRequest, Output, RankRun, RunClock
from gramcoord.benchmarks.fill import PoolFill
from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.engine.loop import run_loop
from gramcoord.rank_worker.config import (
    GrammarConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.bitmask import BitmaskBuilder, default_fill_threads
from gramcoord.rank_worker.session.session import RankSession, SessionConfig

STRATEGIES = ("default", "batch1", "batch2", "pool")


class _PoolBuilder(BitmaskBuilder):
    # NOTE: overrides the builder's private engine lookup; the pool is a
    # candidate measured here, not a builder option.
    def close(self) -> None:
        engine = self._engines.get(-1)
        if engine is not None:
            engine.pool.shutdown(wait=True)

    def _engine(self, *, parallel: bool):
        if parallel:
            engine = self._engines.get(-1)
            if engine is None:
                engine = self._engines[-1] = PoolFill(self.num_threads)
            return engine
        return super()._engine(parallel=False)


def make_builder(strategy: str, vocab_size: int, max_num_seqs: int) -> BitmaskBuilder | None:
    """The builder of ``strategy``; None keeps the session's own."""
    threads = default_fill_threads()
    kw = dict(max_num_seqs=max_num_seqs, num_threads=threads)
    if strategy == "default":
        return None
    if strategy == "batch1":
        return BitmaskBuilder(vocab_size, parallel_threshold=max_num_seqs + 1, **kw)
    if strategy == "batch2":
        return BitmaskBuilder(vocab_size, parallel_threshold=1, **kw)
    if strategy == "pool":
        return _PoolBuilder(vocab_size, parallel_threshold=1, **kw)
    raise ValueError(f"unknown fill strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def session_config(max_num_seqs: int, step_timeout_s: float) -> SessionConfig:
    """dp=2 x tp=2 as ``configs/local.yaml``, jump-forward off (neither baseline has it)."""
    return SessionConfig(
        parallel=ParallelConfig(dp=2, tp=2, requests="partitioned"),
        distributed=DistributedConfig(step_timeout_s=step_timeout_s),
        grammar=GrammarConfig(compile_mode="async", compile_timeout_s=60, jump_forward=False),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
    )


def run_ours(
    tokenizer: Tokenizer,
    requests: Sequence[BenchRequest],
    *,
    strategy: str,
    max_num_seqs: int,
    step_timeout_s: float,
    tp_group=None,
    run_id: str = "",
) -> RankRun:
    """This rank's part of one run of ours (every rank of the world calls it)."""
    config = session_config(max_num_seqs, step_timeout_s)
    session = RankSession.attach(
        tokenizer, config, run_id=run_id or f"bstep{secrets.token_hex(3)}", force_sync=False
    )
    ok = False
    builder = None
    clock = RunClock(record_batches=session.is_leader, tp_group=tp_group)
    try:
        if session.has("masks"):
            builder = make_builder(strategy, tokenizer.vocab_size, max_num_seqs)
            if builder is not None:
                session.masks.builder = builder
        report = run_loop(
            session,
            [r.engine_request() for r in requests],
            *clock.timed(tokenizer),
            SpeculativeConfig(),
            per_step=0,
        )
        ok = True
    finally:
        session.close(drain=ok)
        clock.close()
        if isinstance(builder, _PoolBuilder):
            builder.close()
    outputs = {o.id: Output(o.status, o.finish_reason, list(o.token_ids)) for o in report.outputs}
    return clock.result(f"ours_{strategy}", session.rank, outputs, timings=report.timings)
