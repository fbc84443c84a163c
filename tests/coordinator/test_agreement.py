"""Agreement scenarios with in-process members (threads over an injected gather)."""

from __future__ import annotations

import numpy as np
import pytest

from gramcoord.coordinator.agreement import Agreement
from gramcoord.coordinator.errors import CoordinatorError, DivergenceError
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.status import LocalStatus, PendingState
from tests.coordinator.fakes import Cluster

P, R, F = PendingState.PENDING, PendingState.READY, PendingState.FAILED
TIMEOUT = 21  # rank_worker ErrorCode.grammar_timeout
INVALID = 20

OPS = [pytest.param("all_gather", id="gather"), pytest.param("all_reduce", id="reduce")]


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def replicated(dp: int = 2, **kw) -> ParallelLayout:
    return ParallelLayout(dp=dp, pp=1, tp=1, requests="replicated", **kw)


@pytest.fixture
def cluster_factory():
    made = []

    def make(layout, **kw):
        c = Cluster(layout, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("op", OPS)
def test_ready_waits_for_every_rank(cluster_factory, op):
    c = cluster_factory(replicated(), agreement_op=op)
    a, b = c.members[0], c.members[1]
    a.add(0, key(0), R)
    b.add(0, key(0), P)
    for step in (1, 2):
        res = c.step(step)
        assert res[0].decision == res[1].decision
        assert res[0].decision.ready == ()
        assert a.admitted == b.admitted == []
    b.set(0, R)
    res = c.step(3)
    assert res[0].decision.ready == res[1].decision.ready == (0,)
    assert a.admitted == b.admitted == [0]


@pytest.mark.parametrize("op", OPS)
def test_failure_anywhere_fails_and_poisons_everywhere(cluster_factory, op):
    c = cluster_factory(replicated(), agreement_op=op)
    a, b = c.members[0], c.members[1]
    a.add(0, key(7), P)
    b.add(0, key(7), F, TIMEOUT)
    res = c.step(1)
    assert res[0].decision.failed == res[1].decision.failed == ((0, TIMEOUT),)
    assert a.failed == b.failed == [(0, TIMEOUT)]
    assert key(7) in a.poisoned and key(7) in b.poisoned
    # A's compile succeeding afterwards changes nothing; a repeat fails at once.
    a.set(0, R)
    res = c.step(2)
    assert res[0].decision.ready == () and a.admitted == []
    assert a.add(1, key(7)) == b.add(1, key(7)) == "failed"


@pytest.mark.parametrize("op", OPS)
def test_mixed_queue_keeps_order_and_identical_remainder(cluster_factory, op):
    c = cluster_factory(replicated(), agreement_op=op)
    a, b = c.members[0], c.members[1]
    table = [  # seq: (state on A, state on B)
        (R, R),
        (P, R),
        (R, (F, INVALID)),
        (R, P),
        ((F, TIMEOUT), (F, INVALID)),
        (R, R),
        (P, P),
    ]
    for seq, (sa, sb) in enumerate(table):
        for m, s in ((a, sa), (b, sb)):
            state, reason = s if isinstance(s, tuple) else (s, 0)
            m.add(seq, key(seq), state, reason)
    res = c.step(1)
    d = res[0].decision
    assert d == res[1].decision
    assert d.ready == (0, 5)
    # Failed wins; of two reasons the lowest code wins.
    assert d.failed == ((2, INVALID), (4, INVALID))
    assert a.admitted == b.admitted == [0, 5]
    assert sorted(a.pending) == sorted(b.pending) == [1, 3, 6]
    a.set(1, R), b.set(3, R)
    c.step(2)
    assert a.admitted == b.admitted == [0, 5, 1, 3]
    assert list(a.pending) == list(b.pending) == [6]


@pytest.mark.parametrize("op", OPS)
def test_abort_while_queued(cluster_factory, op):
    c = cluster_factory(replicated(), agreement_op=op)
    a, b = c.members[0], c.members[1]
    for m in (a, b):
        for seq in range(3):
            m.add(seq, key(seq), P)
    c.step(1)
    for m in (a, b):  # the abort is part of the stream: same step everywhere
        m.abort(1)
        m.set(0, R), m.set(2, R)
    res = c.step(2)
    assert res[0].decision.ready == res[1].decision.ready == (0, 2)
    assert 1 not in a.admitted and not a.pending and not b.pending


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    ("a_seqs", "b_seqs", "first"),
    [
        pytest.param((0, 1, 2), (0, 2), 1, id="abort-on-one-rank"),
        pytest.param((0, 1), (0, 1, 2), 2, id="extra-request"),
        pytest.param((3,), (4,), 3, id="different-request"),
    ],
)
def test_fingerprint_mismatch_raises(cluster_factory, op, a_seqs, b_seqs, first):
    c = cluster_factory(replicated(), agreement_op=op)
    for m, seqs in ((c.members[0], a_seqs), (c.members[1], b_seqs)):
        for s in seqs:
            m.add(s, key(s), R)
    with pytest.raises(DivergenceError) as info:
        c.step(1)
    err = info.value
    assert err.ranks == (1,) and err.seq == first and err.step == 1
    assert f"seq {first}" in str(err) and "ranks [1]" in str(err)
    assert c.members[0].admitted == c.members[1].admitted == []


@pytest.mark.parametrize("op", OPS)
def test_pending_window_overflow_waits(cluster_factory, op):
    c = cluster_factory(replicated(), agreement_op=op, window=4)
    for m in c.members.values():
        for seq in range(10):
            m.add(seq, key(seq), R)
    seen = []
    for step in (1, 2, 3):
        res = c.step(step)
        assert res[0].decision == res[1].decision
        seen.append(res[0].decision.ready)
    assert seen == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert c.members[0].admitted == list(range(10))


@pytest.mark.parametrize(
    ("requests", "admitted_a", "collectives"),
    [
        pytest.param("replicated", [], 1, id="replicated-waits-for-peer"),
        pytest.param("partitioned", [0], 0, id="partitioned-decides-alone"),
    ],
)
def test_replicated_vs_partitioned(cluster_factory, requests, admitted_a, collectives):
    layout = ParallelLayout(dp=2, pp=1, tp=1, requests=requests)
    c = cluster_factory(layout)
    c.members[0].add(0, key(0), R)
    c.members[1].add(0, key(0), P)
    c.step(1)
    assert c.members[0].admitted == admitted_a
    assert c.coords[0].agreement.collectives == collectives


@pytest.mark.parametrize("op", OPS)
def test_empty_pending_skips_collective_except_clock_steps(cluster_factory, op):
    clocks = {0: lambda: 5000, 1: lambda: 7000}
    c = cluster_factory(replicated(), agreement_op=op, clocks=clocks, clock_sync_steps=4)
    for step in (1, 2, 3):
        res = c.step(step)
        assert res[0].decision.clock_ms == res[1].decision.clock_ms == 0
    assert c.coords[0].agreement.collectives == 0
    res = c.step(4)  # clock step: an empty report still travels
    assert c.coords[0].agreement.collectives == 1
    # gather agrees on the maximum; reduce on the group's first member.
    expected = 7000 if op == "all_gather" else 5000
    assert res[0].decision.clock_ms == res[1].decision.clock_ms == expected


def test_poison_ttl_expires_at_the_agreed_clock(cluster_factory):
    now = {0: 1000, 1: 1300}
    c = cluster_factory(
        replicated(), clocks={r: (lambda r=r: now[r]) for r in (0, 1)}, clock_sync_steps=1
    )
    a, b = c.members[0], c.members[1]
    for m in (a, b):
        m.add(0, key(9), F, TIMEOUT)
    c.step(1)
    assert a.poisoned[key(9)] == b.poisoned[key(9)] == (TIMEOUT, 1300)
    now[0] = 2299  # rank 0's own clock has not passed the TTL, rank 1's has
    now[1] = 2400
    c.step(2)
    assert a.agreed_ms == b.agreed_ms == 2400
    assert a.add(1, key(9)) == b.add(1, key(9)) == "pending"


def test_sync_mode_decides_locally_and_rejects_pending(cluster_factory):
    c = cluster_factory(replicated(), compile_mode="sync", clock_sync_steps=100)
    for m in c.members.values():
        m.add(0, key(0), R)
        m.add(1, key(1), F, INVALID)
    res = c.step(1)
    assert res[0].decision.ready == (0,) and res[0].decision.failed == ((1, INVALID),)
    assert c.coords[0].agreement.collectives == 0
    c.members[0].add(2, key(2), P)
    c.members[1].add(2, key(2), P)
    with pytest.raises(CoordinatorError, match="compile_mode is sync but seq 2"):
        c.step(2)


@pytest.mark.parametrize(
    ("status", "message"),
    [
        pytest.param(
            LocalStatus(seqs=(2, 1), states=(R, R), reasons=(0, 0)), "ascending", id="order"
        ),
        pytest.param(
            LocalStatus(seqs=(1,), states=(F,), reasons=(0,)), "reason code 0", id="no-reason"
        ),
        pytest.param(LocalStatus(seqs=(1,), states=(7,), reasons=(0,)), "unknown", id="bad-state"),
    ],
)
def test_bad_status_is_rejected(status, message):
    agreement = Agreement(members=(0,), rank=0, window=8, gather=None)
    with pytest.raises(ValueError, match=message):
        agreement.decide(1, status, clock_ms=0)


def test_injected_gather_sees_one_row_per_member():
    rows_seen = []

    def gather(row):
        rows_seen.append(row.copy())
        other = row.copy()
        return np.stack([row, other])

    agreement = Agreement(members=(0, 1), rank=0, window=8, gather=gather)
    status = LocalStatus(seqs=(4, 5), states=(R, P), reasons=(0, 0))
    d = agreement.decide(1, status, clock_ms=123)
    assert d.ready == (4,) and d.failed == () and d.clock_ms == 123
    assert len(rows_seen) == 1 and rows_seen[0].dtype == np.int64
