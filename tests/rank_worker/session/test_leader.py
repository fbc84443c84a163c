"""The stage leader role: real GrammarManagers driven by coordinators over in-process ranks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.session.leader import StageLeader
from tests.coordinator.fakes import ThreadComm, ThreadHub

SPEC_A = {"regex": "[a-z]+"}
SPEC_B = {"regex": "[0-9]+"}


class Gate:
    """The real backend; compiles of gated specs wait until the gate opens."""

    def __init__(self, tokenizer, gated: set[str]) -> None:
        self.real = XGrammarBackend(tokenizer)
        self.gated = gated
        self.open = threading.Event()

    def __call__(self, spec):
        if spec.text in self.gated:
            assert self.open.wait(30), "test never opened the gate"
        return self.real(spec)


class Ranks:
    def __init__(self, tokenizer, layout, gated_by_rank, **grammar) -> None:
        hub = ThreadHub()
        self.gates = {r: Gate(tokenizer, gated_by_rank.get(r, set())) for r in gated_by_rank}
        self.managers, self.leaders = {}, {}
        config = GrammarConfig(max_pending=8, num_compile_workers=2, **grammar)
        for r in gated_by_rank:
            m = GrammarManager(config, tokenizer, compile_fn=self.gates[r])
            comm = ThreadComm(hub, layout, r)
            self.managers[r] = m
            self.leaders[r] = StageLeader.build(m, layout, comm, DistributedConfig())
        self.pool = ThreadPoolExecutor(len(gated_by_rank))

    def step(self, step):
        futures = {r: self.pool.submit(a.step, step) for r, a in self.leaders.items()}
        return {r: f.result(timeout=30) for r, f in futures.items()}

    def close(self):
        for g in self.gates.values():
            g.open.set()
        for m in self.managers.values():
            m.close()
        self.pool.shutdown()


@pytest.fixture
def make_ranks(tiny_tokenizer):
    made = []

    def make(layout, gated, **grammar):
        made.append(Ranks(tiny_tokenizer, layout, gated, **grammar))
        return made[-1]

    yield make
    for r in made:
        r.close()


def statuses(step_outcome):
    got = list(step_outcome.admitted) + list(step_outcome.failed)
    return sorted((o.request_id, o.status, o.code) for o in got)


def test_replicated_ranks_admit_only_when_both_compiled(make_ranks):
    layout = ParallelLayout(dp=2, pp=1, tp=1, requests="replicated")
    ranks = make_ranks(layout, {0: set(), 1: {"[a-z]+"}})
    for m in ranks.managers.values():
        m.add("a", SPEC_A, seq=0)
        m.add("b", SPEC_B, seq=1)
    step, admitted = 0, {0: [], 1: []}
    while not admitted[0] or admitted[0][-1] != "a":
        step += 1
        out = ranks.step(step)
        assert statuses(out[0]) == statuses(out[1])
        for r in (0, 1):
            admitted[r] += [o.request_id for o in out[r].admitted]
        if admitted[0] == ["b"]:
            assert ranks.managers[0].num_pending == ranks.managers[1].num_pending == 1
            ranks.gates[1].open.set()
        assert step < 2000, "never settled"
        time.sleep(0.005)
    assert admitted[0] == admitted[1] == ["b", "a"]


def test_later_stage_fails_with_stage_timeout_instead_of_hanging(make_ranks):
    layout = ParallelLayout(dp=1, pp=2, tp=1)
    ranks = make_ranks(layout, {0: set(), 1: {"[a-z]+"}})
    ranks.managers[1].follow(0.2)
    for m in ranks.managers.values():
        m.add("a", SPEC_A, seq=0)
        m.add("b", SPEC_B, seq=1)
    seen = {0: [], 1: []}
    for step in range(1, 200):
        out = ranks.step(step)
        for r in (0, 1):
            seen[r] += statuses(out[r])
        if len(seen[0]) == 2:
            break
        time.sleep(0.005)
    # Stage 0 compiles both concurrently, so under load either may come first.
    assert sorted(seen[0]) == [("a", "admitted", None), ("b", "admitted", None)]
    assert ("a", "failed", "grammar_stage_timeout") in seen[1]
    assert ("b", "admitted", None) in seen[1]
    assert ranks.leaders[1].follows and not ranks.leaders[0].follows
    # This stage alone failed "a": the decision admitted it.
    assert ranks.managers[1].follow_wait_s == 0.2


def test_single_rank_falls_back_to_manager_step(tiny_tokenizer):
    layout = ParallelLayout(dp=1, pp=1, tp=1)
    manager = GrammarManager(GrammarConfig(compile_mode="sync"), tiny_tokenizer)
    comm = ThreadComm(ThreadHub(), layout, 0)
    leader = StageLeader.build(manager, layout, comm, DistributedConfig())
    assert not leader.follows and leader.poison_lag_steps == 0
    leader.submit("a", SPEC_A, seq=0)
    assert statuses(leader.step(1)) == [("a", "admitted", None)]
    manager.close()


def test_a_sequence_number_that_does_not_increase_fails_only_that_request(tiny_tokenizer):
    layout = ParallelLayout(dp=1, pp=1, tp=1)
    manager = GrammarManager(GrammarConfig(compile_mode="sync"), tiny_tokenizer)
    leader = StageLeader.build(manager, layout, None, DistributedConfig())
    assert leader.submit("a", SPEC_A, seq=5).status == "pending"
    bad = leader.submit("b", SPEC_B, seq=5)
    assert (bad.status, bad.code) == ("failed", "bad_request_id")
    assert "must increase" in bad.message
    assert leader.submit("c", SPEC_B, seq=6).status == "pending"
    assert statuses(leader.step(1)) == [("a", "admitted", None), ("c", "admitted", None)]
    manager.close()


@pytest.mark.parametrize(
    ("stage", "compile_timeout_s", "step_timeout_s", "wait"),
    [
        pytest.param(1, 30.0, 30.0, 15.0, id="capped-at-half-step-timeout"),
        pytest.param(1, 5.0, 30.0, 5.0, id="compile-timeout-fits"),
        pytest.param(0, 30.0, 30.0, None, id="stage-0-decides-and-never-waits"),
    ],
)
def test_stage_wait_never_outlasts_the_step_timeout(
    tiny_tokenizer, stage, compile_timeout_s, step_timeout_s, wait
):
    layout = ParallelLayout(dp=2, pp=2, tp=1)
    config = GrammarConfig(compile_mode="sync", compile_timeout_s=compile_timeout_s)
    manager = GrammarManager(config, tiny_tokenizer)
    comm = ThreadComm(ThreadHub(), layout, layout.leader(0, stage))
    leader = StageLeader.build(
        manager, layout, comm, DistributedConfig(step_timeout_s=step_timeout_s)
    )
    assert leader.follows == (stage > 0)
    assert manager.follow_wait_s == wait
    manager.close()
