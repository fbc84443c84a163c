"""Compile-cache LRU bounds and typed poison entries with TTLs."""

from __future__ import annotations

import pytest

from gramcoord.rank_worker.grammars.caches import CompileCache, PoisonCache, PoisonKind


class Blob:
    def __init__(self, size: int) -> None:
        self.memory_size_bytes = size


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.mark.parametrize(
    ("max_bytes", "max_entries", "sizes", "touch", "kept"),
    [
        pytest.param(100, 10, [40, 40, 40], None, [1, 2], id="bytes-evict-lru"),
        pytest.param(100, 10, [40, 40, 40], 0, [0, 2], id="get-refreshes"),
        pytest.param(1000, 2, [1, 1, 1], None, [1, 2], id="entries-evict-lru"),
        pytest.param(100, 10, [60, 50], None, [1], id="big-pushes-out"),
        pytest.param(100, 10, [150, 10], None, [1], id="oversize-not-cached"),
    ],
)
def test_lru(max_bytes, max_entries, sizes, touch, kept):
    cache = CompileCache(max_bytes=max_bytes, max_entries=max_entries)
    for i, size in enumerate(sizes[:2]):
        cache.put(k(i), Blob(size))
    if touch is not None:
        assert cache.get(k(touch)) is not None
    for i, size in enumerate(sizes[2:], start=2):
        cache.put(k(i), Blob(size))
    assert sorted(int.from_bytes(x, "big") for x in cache.lru_order()) == kept
    assert cache.bytes == sum(sizes[i] for i in kept) <= max_bytes


def test_reput_does_not_double_count():
    cache = CompileCache(max_bytes=100, max_entries=10)
    cache.put(k(1), Blob(30))
    cache.put(k(1), Blob(30))
    assert cache.bytes == 30 and len(cache) == 1


class Counted:
    """A grammar whose size is computed on each read, as xgrammar's is."""

    def __init__(self, size: int) -> None:
        self.size, self.reads = size, 0

    @property
    def memory_size_bytes(self) -> int:
        self.reads += 1
        return self.size


def test_refreshing_the_same_grammar_reads_its_size_once():
    cache = CompileCache(max_bytes=100, max_entries=10)
    grammar = Counted(30)
    for _ in range(5):
        assert cache.put(k(1), grammar)
    assert grammar.reads == 1 and cache.bytes == 30
    cache.put(k(2), Blob(10))
    cache.put(k(1), grammar)  # a refresh is a use: k(2) is now the least recent
    assert cache.lru_order() == [k(2), k(1)]
    other = Counted(50)  # another grammar under the same key is sized anew
    cache.put(k(1), other)
    assert other.reads == 1 and cache.bytes == 60


def test_timeout_poison_expires_at_agreed_time():
    p = PoisonCache(max_entries=10, ttl_ms=1000)
    p.poison(k(1), PoisonKind.TIMEOUT, 21, "slow", now_ms=5000)
    assert p.get(k(1), 5999) is not None
    assert p.get(k(1), 6000) is None
    assert p.expire(6000) == [k(1)] and len(p) == 0


def test_invalid_poison_is_permanent_and_never_downgraded():
    p = PoisonCache(max_entries=10, ttl_ms=1000)
    p.poison(k(1), PoisonKind.INVALID, 20, "bad", now_ms=0)
    p.poison(k(1), PoisonKind.TIMEOUT, 21, "slow", now_ms=10)
    entry = p.get(k(1), 10**12)
    assert entry is not None and entry.kind is PoisonKind.INVALID


def test_poison_bounded_oldest_first():
    p = PoisonCache(max_entries=2, ttl_ms=1000)
    for i in range(3):
        p.poison(k(i), PoisonKind.INVALID, 20, "bad", now_ms=i)
    assert p.get(k(0), 0) is None and p.get(k(2), 0) is not None
