"""The two per-rank grammar caches: compiled grammars and poisoned keys.

Both change only through explicit calls (``put``, ``poison``, ``expire``),
made at agreed decision points, so every rank of an agreement group holds
the same entries in the same LRU order. Neither looks at a clock on its
own: the caller passes the agreed time.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import IntEnum
from typing import Any

import msgspec


class PoisonKind(IntEnum):
    # The spec cannot compile; permanent.
    INVALID = 1
    # The compile ran past its deadline; expires after poison_ttl_s.
    TIMEOUT = 2


class PoisonEntry(msgspec.Struct, frozen=True):
    kind: PoisonKind
    # ErrorCode value of the original failure.
    reason: int
    message: str
    # Agreed wall clock (ms) at which it stops applying (0 = never).
    expires_ms: int = 0


def _size_of(value: Any) -> int:
    return int(getattr(value, "memory_size_bytes", 0) or 0)


class CompileCache:
    """LRU of compiled grammars, bounded by bytes and by entries.

    Sizes come from xgrammar's ``CompiledGrammar.memory_size_bytes``. An
    entry larger than the whole byte budget is not cached at all.
    """

    def __init__(self, *, max_bytes: int, max_entries: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._items: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def get(self, key: bytes) -> Any | None:
        """Return the grammar and mark it most recently used."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: bytes, compiled: Any) -> bool:
        """Insert (or refresh) an entry; returns False if it cannot fit."""
        size = _size_of(compiled)
        if size > self.max_bytes:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (compiled, size)
        self.bytes += size
        while self.bytes > self.max_bytes or len(self._items) > self.max_entries:
            _, (_, evicted) = self._items.popitem(last=False)
            self.bytes -= evicted
        return True

    def lru_order(self) -> list[bytes]:
        """Keys, least recently used first."""
        return list(self._items)


class PoisonCache:
    """Typed failures by grammar key, bounded by entries (oldest first out)."""

    def __init__(self, *, max_entries: int, ttl_ms: int) -> None:
        self.max_entries = max_entries
        self.ttl_ms = ttl_ms
        self._items: OrderedDict[bytes, PoisonEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes, now_ms: int) -> PoisonEntry | None:
        """The live entry for ``key`` at agreed time ``now_ms``, if any."""
        entry = self._items.get(key)
        if entry is None:
            return None
        if entry.expires_ms and now_ms >= entry.expires_ms:
            return None
        return entry

    def poison(self, key: bytes, kind: PoisonKind, reason: int, message: str, now_ms: int) -> None:
        expires = now_ms + self.ttl_ms if kind is PoisonKind.TIMEOUT else 0
        current = self._items.get(key)
        # A permanent verdict is never downgraded to a TTL one.
        if current is not None and current.kind is PoisonKind.INVALID:
            return
        self._items.pop(key, None)
        self._items[key] = PoisonEntry(kind, reason, message, expires)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def expire(self, now_ms: int) -> list[bytes]:
        """Drop entries whose TTL ran out by agreed time ``now_ms``."""
        gone = [k for k, e in self._items.items() if e.expires_ms and now_ms >= e.expires_ms]
        for k in gone:
            del self._items[k]
        return gone
