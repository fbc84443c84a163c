"""Digests of the mask rows every rank applied: the determinism evidence.

Each rank that applies bitmask rows to logits (the last stage's leader and
its TP workers, or the one inline process) records, per request and output
position, an 8-byte blake2b digest of the row it applied. Ranks that applied
the same rows hold equal digests, and so does the one-process reference run
on the same workload; ``gramcoord verify`` and the run summary compare them.

Positions are output positions: row ``i`` of a request with ``n`` output
tokens so far masks the token at position ``n + i`` (the bonus row and draft
rows included). A row that is rebuilt for the same position after a rejected
draft must digest the same, so the first digest is kept and a different one
is counted as a self-mismatch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import msgspec
import numpy as np


def row_digest(row: np.ndarray) -> int:
    """A signed 64-bit blake2b digest of one int32 bitmask row."""
    d = hashlib.blake2b(np.ascontiguousarray(row).data, digest_size=8).digest()
    return int.from_bytes(d, "little", signed=True)


class DigestRecord(msgspec.Struct, frozen=True, array_like=True):
    """One applied row: request id, output position, digest."""

    request_id: str
    position: int
    digest: int


class MaskDigests:
    """The digests one rank recorded, per request in the order it applied them."""

    def __init__(self) -> None:
        # request id -> position -> digest.
        self._rows: dict[str, dict[int, int]] = {}
        self._count = 0
        self.self_mismatches: list[tuple[str, int]] = []
        self.steps = 0

    def __len__(self) -> int:
        return self._count

    def record(self, request_id: str, position: int, digest: int) -> None:
        """Keep the first digest of ``(request_id, position)``; count a different one."""
        rows = self._rows.setdefault(request_id, {})
        old = rows.get(position)
        if old is None:
            rows[position] = digest
            self._count += 1
        elif old != digest:
            self.self_mismatches.append((request_id, position))

    def truncate(self, request_id: str, length: int) -> None:
        """Forget ``request_id``'s rows at positions ``>= length``.

        Called when retokenization replaced output tokens: those positions
        are masked again from the new tokens, on every rank alike.
        """
        rows = self._rows.get(request_id, {})
        for pos in [p for p in rows if p >= length]:
            del rows[pos]
            self._count -= 1

    def rows_of(self, request_id: str) -> list[tuple[int, int]]:
        """``(position, digest)`` of every row of ``request_id``, by position."""
        return sorted(self._rows.get(request_id, {}).items())

    def records(self) -> list[DigestRecord]:
        """Every recorded row, request by request in the order first applied."""
        return [DigestRecord(r, p, d) for r, rows in self._rows.items() for p, d in rows.items()]

    @staticmethod
    def index(records: Iterable[DigestRecord]) -> dict[tuple[str, int], int]:
        """``(request_id, position) -> digest`` of ``records``."""
        return {(r.request_id, r.position): r.digest for r in records}


def combine(digests: Iterable[int]) -> int:
    """Order-sensitive signed 64-bit combination of row digests (one per step)."""
    h = hashlib.blake2b(digest_size=8)
    for d in digests:
        h.update(int(d).to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little", signed=True)
