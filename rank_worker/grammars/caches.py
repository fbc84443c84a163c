"""A rank's grammar caches: compiled grammars and poisoned keys, on the agreed clock.

A **poisoned key** is a grammar key whose compile failed: a request for it
fails at once, with the original code and message, without compiling or
waiting for a collective. ``grammar_invalid`` poisons for ever,
``grammar_timeout`` for ``grammar.poison_ttl_s`` of the **agreed clock**
(the clock the agreement group settled on, ``Decision.clock_ms``), never of
this rank's own.

``GrammarCaches`` is what the ``GrammarManager`` holds: both caches, the
agreed clock, and the newly poisoned keys waiting to be shared with the
other replicas. Everything in it changes only at agreed decision points
(``advance``, ``record_failure``, ``apply``), so every rank of an agreement
group holds the same entries in the same LRU order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from enum import IntEnum
from typing import Any

import msgspec

from gramcoord.coordinator.status import PoisonRecord
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode


class PoisonKind(IntEnum):
    # The spec cannot compile; permanent.
    INVALID = 1
    # The compile ran past its deadline; expires after poison_ttl_s.
    TIMEOUT = 2


# The failures that poison their key, and how.
POISON_KIND = {
    int(ErrorCode.grammar_invalid): PoisonKind.INVALID,
    int(ErrorCode.grammar_timeout): PoisonKind.TIMEOUT,
}


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

    def put(self, key: bytes, compiled: Any, size: int | None = None) -> bool:
        """Insert (or refresh) an entry; returns False if it cannot fit.

        ``size`` is the grammar's ``memory_size_bytes`` where the caller read
        it already. xgrammar computes it by walking the grammar (about 1 ms
        for a 500-property schema, on the engine's request path), so
        refreshing the very grammar cached under ``key`` (every cache-hit
        admission does) only marks it used.
        """
        old = self._items.get(key)
        if old is not None and old[0] is compiled:
            self._items.move_to_end(key)
            return True
        size = _size_of(compiled) if size is None else size
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


class GrammarCaches:
    """One rank's compiled and poisoned keys, and the agreed clock; see the module docstring.

    Parameters
    ----------
    config:
        The ``grammar`` section (cache bounds, ``poison_ttl_s``).
    """

    def __init__(self, config: GrammarConfig) -> None:
        self.compiled = CompileCache(
            max_bytes=int(config.cache_limit_mb * 2**20), max_entries=config.num_cache_entries
        )
        self.poison = PoisonCache(
            max_entries=config.num_poison_entries, ttl_ms=int(config.poison_ttl_s * 1e3)
        )
        # The latest decision's clock (ms): poison TTLs are judged against it.
        self.agreed_ms = 0
        self._new: list[PoisonRecord] = []

    def advance(self, clock_ms: int) -> None:
        """Move the agreed clock to a decision's (never back) and expire poison by it."""
        self.agreed_ms = max(self.agreed_ms, clock_ms)
        self.poison.expire(self.agreed_ms)

    def poisoned(self, key: bytes) -> PoisonEntry | None:
        """The live poison entry of ``key`` at the agreed clock, if any."""
        return self.poison.get(key, self.agreed_ms)

    def record_failure(self, key: bytes, reason: int, message: str, *, share: bool) -> None:
        """An agreed failure of ``key``: poison it if its code poisons and it is not already.

        With ``share``, the record also waits in ``new_failures`` for the
        other replicas (the rank that decided shares; followers do not).
        """
        kind = POISON_KIND.get(reason)
        if kind is None or self.poisoned(key) is not None:
            return
        self.poison.poison(key, kind, reason, message, self.agreed_ms)
        if share:
            self._new.append(PoisonRecord(key, reason, self.agreed_ms, message))

    def poison_here(self, key: bytes, code: ErrorCode, message: str) -> bool:
        """Poison ``key`` at the agreed clock without sharing it; whether its code poisons."""
        kind = POISON_KIND.get(int(code))
        if kind is not None:
            self.poison.poison(key, kind, int(code), message, self.agreed_ms)
        return kind is not None

    def new_failures(self) -> list[PoisonRecord]:
        """Keys poisoned here since the last call, to share with the other replicas."""
        out, self._new = self._new, []
        return out

    def apply(self, records: Iterable[PoisonRecord]) -> None:
        """Poison keys decided elsewhere; TTLs run from each record's clock."""
        for r in records:
            kind = POISON_KIND.get(r.reason)
            if kind is not None:
                # The text of the rank that learnt it: a replica that meets
                # the key fails it exactly as that rank did.
                msg = r.message or f"{ErrorCode.name_of(r.reason)} (on another replica)"
                self.poison.poison(r.key, kind, r.reason, msg, r.clock_ms)

    def clear_compiled(self) -> None:
        """Drop every compiled grammar (a host's cache flush); poison is agreed state, kept."""
        old = self.compiled
        self.compiled = CompileCache(max_bytes=old.max_bytes, max_entries=old.max_entries)
