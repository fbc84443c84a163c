"""Rank bodies for the spawned coordinator tests (importable by spawned children).

Each body runs inside a gloo world made by ``tests.procs.run_ranks`` and
returns plain values for the parent to compare across ranks.
"""

from __future__ import annotations

import time

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.coordinator import Coordinator
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.runtime import Runtime
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.spec import validate_spec
from tests.conftest import make_tiny_tokenizer

SPECS = [{"regex": "[a-z]+"}, {"regex": "[0-9]+"}, {"regex": "(ab)+"}, {"regex": "x+y"}]


class DelayedBackend:
    """The real backend, after a per-spec delay (seconds) chosen per rank."""

    def __init__(self, tokenizer, delays: dict[str, float]) -> None:
        self.real = XGrammarBackend(tokenizer)
        self.delays = delays
        self.calls: dict[str, int] = {}

    def __call__(self, spec):
        self.calls[spec.text] = self.calls.get(spec.text, 0) + 1
        time.sleep(self.delays.get(spec.text, 0.0))
        return self.real(spec)


class RecordingMember:
    """The manager as the coordinator's member; keeps what it reported each step."""

    def __init__(self, manager: GrammarManager) -> None:
        self.manager = manager
        self.reported: list[dict[int, int]] = []

    def local_status(self):
        status = self.manager.local_status()
        self.reported.append(dict(zip(status.seqs, status.states)))
        return status

    def apply_decision(self, decision):
        return self.manager.apply_decision(decision)

    def new_failures(self):
        return self.manager.new_failures()

    def apply_poison(self, records):
        return self.manager.apply_poison(records)


def coordinator_of(manager, layout, runtime, distributed) -> Coordinator:
    """The coordinator a stage leader builds for ``manager`` (``StageLeader.build``)."""
    return Coordinator.from_config(
        layout,
        runtime,
        distributed,
        max_pending=manager.config.max_pending,
        compile_mode=manager.config.compile_mode,
    )


def _setup(rank, layout, grammar: dict, delays: dict, step_timeout_s: float = 10.0):
    tokenizer = make_tiny_tokenizer()
    backend = DelayedBackend(tokenizer, delays)
    manager = GrammarManager(GrammarConfig(**grammar), tokenizer, compile_fn=backend)
    distributed = DistributedConfig(step_timeout_s=step_timeout_s)
    runtime = Runtime.attach(layout, distributed=distributed)
    coordinator = coordinator_of(manager, layout, runtime, distributed)
    return manager, backend, runtime, coordinator, RecordingMember(manager)


def _key(spec) -> str:
    return validate_spec(spec, GrammarConfig(), vocab="tiny").key.hex()


def _summary(decision):
    return (decision.step, decision.ready, decision.failed)


def agreement_body(rank, world, delays_by_rank):
    """Replicated dp=2: same stream, per-rank compile delays; step until settled."""
    layout = ParallelLayout(dp=world, pp=1, tp=1, requests="replicated")
    grammar = dict(max_pending=8, compile_timeout_s=0.8, num_compile_workers=2)
    manager, _backend, runtime, coordinator, member = _setup(
        rank, layout, grammar, delays_by_rank[rank]
    )
    history, outcomes = [], []
    with runtime:
        for i, spec in enumerate(SPECS):
            manager.add(f"r{i}", spec, seq=i)
        step = 0
        while manager.num_pending or manager.num_waiting:
            step += 1
            result = coordinator.step(step, member)
            history.append(_summary(result.decision))
            outcomes += [(o.request_id, o.status, o.code) for o in result.outcome]
            assert step < 2000, "never settled"
            time.sleep(0.01)
        timed_out = [s for s in SPECS if delays_by_rank[rank].get(s["regex"], 0) > 1]
        poisoned = {
            _key(s): manager.caches.poisoned(bytes.fromhex(_key(s))) is not None for s in SPECS
        }
    manager.close()
    return dict(
        history=history,
        reported=member.reported,
        outcomes=sorted(outcomes),
        poisoned=poisoned,
        timed_out=timed_out,
        agreed_ms=manager.caches.agreed_ms,
    )


def pipeline_body(rank, world, delays_by_rank, steps):
    """dp=1 pp=3 chain: stage 0 decides, later stages follow for ``steps`` steps."""
    layout = ParallelLayout(dp=1, pp=world, tp=1)
    grammar = dict(max_pending=8, compile_timeout_s=5.0, num_compile_workers=2, _wait=0.4)
    grammar_cfg = {k: v for k, v in grammar.items() if not k.startswith("_")}
    tokenizer = make_tiny_tokenizer()
    backend = DelayedBackend(tokenizer, delays_by_rank[rank])
    manager = GrammarManager(GrammarConfig(**grammar_cfg), tokenizer, compile_fn=backend)
    distributed = DistributedConfig(step_timeout_s=10.0)
    history, outcomes = [], []
    with Runtime.attach(layout, distributed=distributed) as runtime:
        coordinator = coordinator_of(manager, layout, runtime, distributed)
        if not coordinator.decider:
            manager.follow(grammar["_wait"])
        for i, spec in enumerate(SPECS):
            manager.add(f"r{i}", spec, seq=i)
        for step in range(1, steps + 1):
            result = coordinator.step(step, manager)
            history.append(_summary(result.decision))
            outcomes += [(o.request_id, o.status, o.code) for o in result.outcome]
            time.sleep(0.02)
    manager.close()
    return dict(history=history, outcomes=sorted(outcomes), follower=not coordinator.decider)


def poison_body(rank, world, steps, re_add_step):
    """Partitioned dp=2: a key times out on replica 0; replica 1 fails it with no compile."""
    layout = ParallelLayout(dp=world, pp=1, tp=1, requests="partitioned")
    slow = SPECS[2]["regex"]
    delays = {slow: 1.0} if rank == 0 else {slow: 3.0}
    grammar = dict(max_pending=8, compile_timeout_s=0.3, num_compile_workers=2)
    manager, backend, runtime, coordinator, member = _setup(rank, layout, grammar, delays)
    outcomes, shared_at = [], []
    with runtime:
        manager.add("own-0", SPECS[0], seq=0)
        manager.add("slow-1", SPECS[2], seq=1)
        for step in range(1, steps + 1):
            if step == re_add_step:
                again = manager.add("slow-again", SPECS[2], seq=2)
                outcomes.append((again.request_id, again.status, again.code, again.cache))
            result = coordinator.step(step, member)
            if result.poison:
                shared_at.append(step)
            outcomes += [(o.request_id, o.status, o.code, o.cache) for o in result.outcome]
            time.sleep(0.02)
    manager.close()
    return dict(
        outcomes=outcomes,
        shared_at=shared_at,
        compiles_of_slow=backend.calls.get(slow, 0),
        agreed_ms=manager.caches.agreed_ms,
        poison_exchanges=coordinator.poison.exchanges,
    )
