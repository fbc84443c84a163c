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


def test_poison_shared_across_dp_fails_at_once_on_the_other_replica(make_cluster):
    c = make_cluster(ParallelLayout(dp=2, pp=1, tp=1, requests="partitioned"))
    a, b = c.members[0], c.members[1]
    a.add(0, key(5), F, TIMEOUT)
    b.add(10, key(5), P)  # same schema, other replica's own stream
    c.step(1)
    assert a.failed == [(0, TIMEOUT)] and b.failed == []
    res = c.step(2)  # a's new failure is shared; b fails without its compile
    assert [r.key for r in res[0].poison] == [r.key for r in res[1].poison] == [key(5)]
    assert b.failed == [(10, TIMEOUT)]
    assert b.add(11, key(5)) == "failed"
    assert c.coords[0].poison.exchanges == c.coords[1].poison.exchanges == 1
    res = c.step(3)
    assert res[0].poison == res[1].poison == ()
    assert c.coords[0].poison.exchanges == 1


def test_poison_forwarded_down_each_chain(make_cluster):
    c = make_cluster(ParallelLayout(dp=2, pp=2, tp=1, requests="partitioned"))
    c.members[0].add(0, key(8), F, INVALID)
    for r in (1, 3):
        c.members[r].add(0, key(8), P)
    c.step(1)
    res = c.step(2)
    assert all(key(8) in c.members[r].poisoned for r in (0, 1, 2, 3))
    assert res[3].followed and res[3].poison == res[2].poison


def test_poison_records_beyond_the_cap_wait_for_the_next_step():
    calls = []

    def reduce_max(flag):
        calls.append(int(flag[0]))
        return flag

    share = PoisonShare(
        members=(0,), gather=lambda w: np.stack([w]), reduce_max=reduce_max, max_records_per_step=2
    )
    recs = [PoisonRecord(key(i), TIMEOUT, i) for i in range(5)]
    got = []
    for step in range(1, 5):
        out, _ = share.exchange(step, recs if step == 1 else [], 0)
        got.append([r.clock_ms for r in out])
    assert got == [[0, 1], [2, 3], [4], []]
    assert calls == [5, 3, 1, 0] and share.waiting == 0


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
