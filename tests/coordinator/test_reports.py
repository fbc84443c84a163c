"""Report, decision and poison-record codecs: round trips and op equivalence."""

from __future__ import annotations

import numpy as np
import pytest

from gramcoord.coordinator.agreement import GatherCodec, ReduceCodec, fingerprint, window_of
from gramcoord.coordinator.pipeline import DecisionCodec
from gramcoord.coordinator.poison_share import (
    MESSAGE_BYTES,
    RECORD_WORDS,
    pack_records,
    unpack_records,
)
from gramcoord.coordinator.status import Decision, LocalStatus, PendingState, PoisonRecord


def random_statuses(rng, members: int, n: int, window: int):
    seqs = tuple(sorted(rng.choice(10_000, size=n, replace=False).tolist()))
    out = []
    for _ in range(members):
        states = rng.integers(0, 3, size=n).tolist()
        reasons = [int(rng.integers(1, 64)) if s == PendingState.FAILED else 0 for s in states]
        out.append(LocalStatus(seqs=seqs, states=tuple(states), reasons=tuple(reasons)))
    return out


def combine_both(statuses, window, step=3):
    gather, reduce = GatherCodec(window), ReduceCodec(window)
    rows = np.zeros((len(statuses), gather.size), dtype=np.int64)
    red = np.zeros((len(statuses), reduce.size), dtype=np.int64)
    for i, st in enumerate(statuses):
        win = window_of(st, window, 63)
        gather.encode(step, win, 100 + i, i, rows[i])
        reduce.encode(step, win, 100 + i, i, red[i])
    return gather.combine(rows, step), reduce.combine(np.bitwise_and.reduce(red, axis=0), step)


@pytest.mark.parametrize(
    ("members", "n", "window"),
    [
        pytest.param(2, 0, 8, id="empty"),
        pytest.param(2, 5, 8, id="small"),
        pytest.param(3, 64, 64, id="one-word"),
        pytest.param(4, 65, 128, id="word-boundary"),
        pytest.param(4, 512, 512, id="large"),
        pytest.param(2, 40, 16, id="overflow"),
    ],
)
def test_gather_and_reduce_decide_the_same(members, n, window):
    rng = np.random.default_rng(members * 1000 + n)
    statuses = random_statuses(rng, members, n, window)
    g, r = combine_both(statuses, window)
    assert g.consistent and r.consistent
    assert np.array_equal(g.ready, r.ready) and np.array_equal(g.failed, r.failed)
    assert np.array_equal(g.reasons, r.reasons)
    k = min(n, window)
    states = np.array([s.states[:k] for s in statuses]).reshape(members, k)
    codes = np.array([s.reasons[:k] for s in statuses]).reshape(members, k)
    failed = (states == PendingState.FAILED).any(axis=0)
    ready = (states == PendingState.READY).all(axis=0) & ~failed
    assert np.array_equal(g.failed[:k], failed) and np.array_equal(g.ready[:k], ready)
    expected = np.where(failed, np.where(codes > 0, codes, 99).min(axis=0), 0)
    assert np.array_equal(g.reasons[:k], expected)
    assert g.clock_ms == 100 + members - 1 and r.clock_ms == 100


@pytest.mark.parametrize(
    ("other", "field"),
    [
        pytest.param(
            LocalStatus(seqs=(1, 2, 4), states=(1, 1, 1), reasons=(0, 0, 0)), "seqs", id="seqs"
        ),
        pytest.param(LocalStatus(seqs=(1, 2), states=(1, 1), reasons=(0, 0)), "count", id="count"),
    ],
)
def test_inconsistent_windows_are_flagged(other, field):
    mine = LocalStatus(seqs=(1, 2, 3), states=(1, 1, 1), reasons=(0, 0, 0))
    g, r = combine_both([mine, other], 8)
    assert not g.consistent and not r.consistent


def test_step_mismatch_is_flagged():
    codec = GatherCodec(8)
    st = LocalStatus(seqs=(1,), states=(1,), reasons=(0,))
    rows = np.zeros((2, codec.size), dtype=np.int64)
    codec.encode(3, window_of(st, 8, 63), 0, 0, rows[0])
    codec.encode(4, window_of(st, 8, 63), 0, 1, rows[1])
    assert not codec.combine(rows, 3).consistent


def test_fingerprint_is_order_sensitive_and_stable():
    a = fingerprint(np.array([1, 2, 3]))
    assert a == fingerprint(np.array([1, 2, 3], dtype=np.int64))
    assert a != fingerprint(np.array([1, 3, 2])) and a != fingerprint(np.array([1, 2]))
    assert 0 <= a < 2**63


@pytest.mark.parametrize(
    "decision",
    [
        pytest.param(Decision(step=1), id="empty"),
        pytest.param(Decision(step=9, ready=(0, 5, 2**40), clock_ms=77), id="ready"),
        pytest.param(
            Decision(step=2, ready=(3,), failed=((1, 20), (4, 32767)), clock_ms=5), id="mixed"
        ),
    ],
)
def test_decision_round_trip(decision):
    codec = DecisionCodec(8)
    msg = np.full(codec.size, -7, dtype=np.int64)  # stale words past the message
    used = codec.encode(decision, 3, msg)
    assert used == 6 + len(decision.ready) + len(decision.failed)
    stale = np.full(codec.size, 12345, dtype=np.int64)
    stale[:used] = msg[:used]  # the receiver's buffer: a prefix is overwritten
    assert codec.decode(stale) == (decision, 3)


def test_poison_record_round_trip_and_checks():
    recs = [
        PoisonRecord(bytes(range(16)), 21, 123, "compile ran past grammar.compile_timeout_s=2s"),
        PoisonRecord(b"\xff" * 16, 20, 0),
    ]
    words = pack_records(recs)
    assert words.dtype == np.int64 and words.size == 2 * RECORD_WORDS
    assert unpack_records(words) == recs
    padded = pack_records(recs, np.zeros(3 * RECORD_WORDS, dtype=np.int64))
    assert unpack_records(padded) == recs
    # A long message travels cut at a character, never half of one.
    long = PoisonRecord(bytes(16), 20, 0, "é" * MESSAGE_BYTES)
    (got,) = unpack_records(pack_records([long]))
    assert got.message == "é" * (MESSAGE_BYTES // 2)
    with pytest.raises(ValueError, match="16 bytes"):
        pack_records([PoisonRecord(b"short", 1, 0)])
    with pytest.raises(ValueError, match=">= 1"):
        pack_records([PoisonRecord(bytes(16), 0, 0)])


def test_reason_limits_per_codec():
    st = LocalStatus(seqs=(1,), states=(2,), reasons=(64,))
    window_of(st, 4, GatherCodec.max_reason)
    with pytest.raises(ValueError, match=r"codes must be 1\.\.63"):
        window_of(st, 4, ReduceCodec.max_reason)
