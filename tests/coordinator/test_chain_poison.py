"""PP chain and shared poisoning with in-process stage leaders."""

from __future__ import annotations

import numpy as np
import pytest

from gramcoord.coordinator.errors import DivergenceError, LayoutError
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.pipeline import Chain
from gramcoord.coordinator.poison_share import PoisonShare
from gramcoord.coordinator.status import Decision, PendingState, PoisonRecord
from tests.coordinator.fakes import Cluster, ThreadComm, ThreadHub

P, R, F = PendingState.PENDING, PendingState.READY, PendingState.FAILED
TIMEOUT, INVALID = 21, 20


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def make_cluster():
    made = []

    def make(layout, **kw):
        made.append(Cluster(layout, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize(
    "pp_sync", [pytest.param("chain", id="chain"), pytest.param("collective", id="collective")]
)
def test_later_stages_apply_exactly_stage0s_decision(make_cluster, pp_sync):
    c = make_cluster(ParallelLayout(dp=1, pp=3, tp=1, pp_sync=pp_sync))
    s0, s1, s2 = (c.members[r] for r in (0, 1, 2))
    for m in (s0, s1, s2):
        for seq in range(4):
            m.add(seq, key(seq), P)
    # Later stages' own readiness differs from stage 0's.
    s0.set(0, R), s0.set(1, F, INVALID), s0.set(2, R)
    s1.set(0, R), s1.set(2, P)
    s2.set(3, R)
    history = []
    for step in (1, 2, 3):
        res = c.step(step)
        history.append([res[r].decision for r in (0, 1, 2)])
        for r in (1, 2):
            s = c.members[r]
            s.states = {q: (R, 0) for q in s.pending}  # their compiles finish
        s0.set(3, R)
    for step, (d0, d1, d2) in enumerate(history, start=1):
        assert d0 == d1 == d2 and d0.step == step
    assert s0.admitted == s1.admitted == s2.admitted
    assert s0.failed == s1.failed == s2.failed == [(1, INVALID)]
    if pp_sync == "chain":  # stage 0 alone decides: later readiness is ignored
        assert history[0][0].ready == (0, 2)
        assert c.coords[1].chain.hops == 3 and c.coords[2].chain.hops == 0
    else:  # every stage leader takes part: ready only where all are ready
        assert history[0][0].ready == ()


def test_chain_receiver_checks_the_step():
    layout = ParallelLayout(dp=1, pp=2, tp=1)
    hub = ThreadHub()
    sender = Chain(ThreadComm(hub, layout, 0), rank=0, prev=None, next=1, window=4)
    receiver = Chain(ThreadComm(hub, layout, 1), rank=1, prev=0, next=None, window=4)
    sender.send(Decision(step=5, ready=(1,)))
    with pytest.raises(DivergenceError, match=r"rank 0 sent a decision for step 5 .* at step 6"):
        receiver.receive(6)


def test_chain_forwards_poison_records():
    layout = ParallelLayout(dp=1, pp=3, tp=1)
    hub = ThreadHub()
    chains = [
        Chain(
            ThreadComm(hub, layout, r),
            rank=r,
            prev=layout.chain_prev(r),
            next=layout.chain_next(r),
            window=4,
        )
        for r in range(3)
    ]
    recs = (PoisonRecord(key(1), TIMEOUT, 10), PoisonRecord(key(2), INVALID, 11))
    chains[0].send(Decision(step=1, failed=((3, TIMEOUT),)), recs)
    assert (
        chains[1].receive(1)
        == chains[2].receive(1)
        == (
            Decision(step=1, failed=((3, TIMEOUT),)),
            recs,
        )
    )


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_poison_shared_across_dp_fails_the_other_replica_lag_steps_later(make_cluster, lag):
    c = make_cluster(ParallelLayout(dp=2, pp=1, tp=1, requests="partitioned"), poison_lag_steps=lag)
    a, b = c.members[0], c.members[1]
    a.add(0, key(5), F, TIMEOUT)
    b.add(10, key(5), P)  # same schema, other replica's own stream
    c.step(1)  # a fails its request: the failure is posted with step 2's exchange
    assert a.failed == [(0, TIMEOUT)] and b.failed == []
    for step in range(2, 2 + lag):  # in flight: b still waits for its own compile
        res = c.step(step)
        assert res[0].poison == res[1].poison == () and b.failed == []
    res = c.step(2 + lag)  # settled on both replicas at the same step
    assert [r.key for r in res[0].poison] == [r.key for r in res[1].poison] == [key(5)]
    assert b.failed == [(10, TIMEOUT)]
    assert b.add(11, key(5)) == "failed"
    assert c.coords[0].poison.exchanges == c.coords[1].poison.exchanges == 1
    res = c.step(3 + lag)
    assert res[0].poison == res[1].poison == ()
    assert c.coords[0].poison.exchanges == 1


@pytest.mark.parametrize("lag", [0, 2])
def test_poison_forwarded_down_each_chain(make_cluster, lag):
    c = make_cluster(ParallelLayout(dp=2, pp=2, tp=1, requests="partitioned"), poison_lag_steps=lag)
    c.members[0].add(0, key(8), F, INVALID)
    for r in (1, 3):
        c.members[r].add(0, key(8), P)
    c.step(1)
    for step in range(2, 2 + lag):
        c.step(step)
        assert key(8) not in c.members[2].poisoned
    res = c.step(2 + lag)
    assert all(key(8) in c.members[r].poisoned for r in (0, 1, 2, 3))
    assert res[3].followed and res[3].poison == res[2].poison


@pytest.mark.parametrize("lag", [0, 2])
def test_end_vote_settles_lag_steps_later_the_same_on_every_replica(make_cluster, lag):
    c = make_cluster(ParallelLayout(dp=2, pp=1, tp=1, requests="partitioned"), poison_lag_steps=lag)
    votes = []
    for step in range(1, 8):
        busy = {0: step < 3, 1: step < 5}  # replica 1 is the last to go idle, at step 5
        res = c.step(step, busy)
        assert res[0].vote == res[1].vote
        votes.append(res[0].vote)
    # The first exchange settles at once, then each one lag steps after it.
    want = [(s, s < 5) for s in range(2, 8)]
    assert votes == [(1, True)] + [None] * lag + want[: len(want) - lag]


def test_agreed_clock_is_the_settled_maximum_and_held_in_between(make_cluster):
    late = [7000]
    clocks = {0: lambda: 5000, 1: lambda: late[0]}
    c = make_cluster(
        ParallelLayout(dp=2, pp=1, tp=1, requests="partitioned"), clocks=clocks, poison_lag_steps=2
    )
    got = []
    for s in range(1, 6):
        got.append(tuple(r.decision.clock_ms for r in c.step(s).values()))
        late[0] = 9000
    # The first exchange settles at once: the agreed clock is the maximum
    # (7000). The next two steps hold it; step 2's clock (9000) settles at 4.
    assert got == [(7000, 7000), (7000, 7000), (7000, 7000), (9000, 9000), (9000, 9000)]


def test_members_out_of_step_are_a_divergence():
    rows = np.zeros((2, 4 + 4), dtype=np.int64)
    rows[:, 0] = (4, 5)

    class Posted:
        def wait(self):
            return rows

    share = PoisonShare(members=(0, 2), post=lambda row: Posted(), lag_steps=0)
    with pytest.raises(DivergenceError, match=r"not in step: rank 0 step 4, rank 2 step 5") as e:
        share.exchange(4, [], 0)
    assert e.value.ranks == (2,)


def test_poison_records_beyond_the_cap_wait_for_the_next_step():
    posted = []

    class Posted:
        def __init__(self, row):
            self.row = row

        def wait(self):
            return np.stack([self.row])

    def post(row):
        posted.append(int(row[1]))
        return Posted(row.copy())

    share = PoisonShare(members=(0,), post=post, lag_steps=1, max_records_per_step=2)
    recs = [PoisonRecord(key(i), TIMEOUT, i) for i in range(5)]
    got = []
    for step in range(1, 6):
        settled = share.exchange(step, recs if step == 1 else [], 0)
        got.append(None if settled is None else [r.clock_ms for r in settled.records])
    assert got == [[0, 1], None, [2, 3], [4], []]
    assert posted == [2, 2, 1, 0, 0] and share.waiting == 0
    assert share.in_flight == 1
    assert [s.step for s in share.drain()] == [5] and share.in_flight == 0


def test_bad_lag_and_cap_are_refused():
    with pytest.raises(ValueError, match="lag_steps must be >= 0"):
        PoisonShare(members=(0,), post=lambda r: None, lag_steps=-1)
    with pytest.raises(ValueError, match="max_records_per_step must be >= 1"):
        PoisonShare(members=(0,), post=lambda r: None, max_records_per_step=0)


def test_tp_worker_has_no_coordinator():
    from gramcoord.coordinator.coordinator import Coordinator

    layout = ParallelLayout(dp=1, pp=1, tp=2)
    with pytest.raises(LayoutError, match=r"rank 1 .* is a TP worker"):
        Coordinator(layout, ThreadComm(ThreadHub(), layout, 1), window=4)


def test_steps_must_increase(make_cluster):
    c = make_cluster(ParallelLayout(dp=1, pp=1, tp=1))
    c.step(3)
    with pytest.raises(ValueError, match="step 3 does not follow step 3"):
        c.coords[0].step(3, c.members[0])
