"""Union of newly failed grammar keys across DP leaders (partitioned streams).

Each step every member of the poison group takes part in one 2-word
``all_reduce(MAX)``: ``[records waiting to be shared, wall clock]``. The
maximum clock is the step's agreed clock, so TTL expiry is decided at the
same instant everywhere. Only when some member has a new failure does a
second call follow: a gather of ``n`` packed records per member, ``n`` the
largest count (capped at ``max_records_per_step``; the rest wait for the
next step, none is dropped). Every member then applies the same union in
the same order.

A record packs into 4 int64 words: the 16-byte key as two little-endian
words, the reason code and the clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from gramcoord.coordinator.status import PoisonRecord

logger = logging.getLogger(__name__)

RECORD_WORDS = 4
KEY_BYTES = 16


def pack_records(records: Sequence[PoisonRecord], out: np.ndarray | None = None) -> np.ndarray:
    """Records -> int64[len(records) * 4] (or into ``out``, padded with zeros)."""
    if out is None:
        out = np.zeros(len(records) * RECORD_WORDS, dtype=np.int64)
    else:
        out[:] = 0
    view = out[: len(records) * RECORD_WORDS].reshape(-1, RECORD_WORDS)
    for i, rec in enumerate(records):
        if len(rec.key) != KEY_BYTES:
            raise ValueError(f"poison keys are {KEY_BYTES} bytes, got {len(rec.key)}")
        if rec.reason < 1:
            raise ValueError(f"poison record reason must be >= 1, got {rec.reason}")
        view[i, :2] = np.frombuffer(rec.key, dtype="<i8")
        view[i, 2] = rec.reason
        view[i, 3] = rec.clock_ms
    return out


def unpack_records(words: np.ndarray) -> list[PoisonRecord]:
    """int64[n * 4] -> records; all-zero slots (padding) are skipped."""
    view = np.ascontiguousarray(words, dtype=np.int64).reshape(-1, RECORD_WORDS)
    return [
        PoisonRecord(key=row[:2].astype("<i8").tobytes(), reason=int(row[2]), clock_ms=int(row[3]))
        for row in view
        if row[2] != 0
    ]


class PoisonShare:
    """One member's side of the per-step poison exchange.

    Parameters
    ----------
    members:
        Global ranks of the poison group, in group order.
    gather:
        The group's all-gather: int64[n] -> int64[members, n].
    reduce_max:
        The group's element-wise ``all_reduce(MAX)``.
    max_records_per_step:
        Most records one member shares per step.
    """

    def __init__(
        self,
        *,
        members: tuple[int, ...],
        gather: Callable[[np.ndarray], np.ndarray],
        reduce_max: Callable[[np.ndarray], np.ndarray],
        max_records_per_step: int = 256,
    ) -> None:
        self.members = members
        self.max_records_per_step = max_records_per_step
        self._gather = gather
        self._reduce_max = reduce_max
        self._queue: list[PoisonRecord] = []
        self._queued: set[bytes] = set()
        # [records waiting, clock ms, busy]: one all_reduce(MAX) per step.
        self._flag = np.zeros(3, dtype=np.int64)
        self.exchanges = 0
        # Set by the owner before an exchange: whether this member still has
        # work (its run's end-of-run vote rides on the exchange's reduce).
        # None: no vote this time. Every member sets it, or none does.
        self.busy: bool | None = None
        # After an exchange: (its step, whether any member was busy).
        self.vote: tuple[int, bool] | None = None

    @property
    def waiting(self) -> int:
        """Own records not shared yet."""
        return len(self._queue)

    def exchange(
        self, step: int, new: Sequence[PoisonRecord], clock_ms: int
    ) -> tuple[tuple[PoisonRecord, ...], int]:
        """Share ``new`` failures and receive everyone's.

        Returns
        -------
        (records, clock_ms)
            The union shared this step (own records included), sorted by
            ``(clock_ms, key)``, and the agreed clock. Both are identical on
            every member.

        Raises
        ------
        PeerLostError
            From the collectives, when a member died or hung.
        """
        for rec in new:
            if rec.key not in self._queued:
                self._queue.append(rec)
                self._queued.add(rec.key)
        self._flag[0] = len(self._queue)
        self._flag[1] = clock_ms
        self._flag[2] = int(bool(self.busy))
        waiting, agreed_clock, busy = (int(x) for x in self._reduce_max(self._flag))
        self.vote = (step, bool(busy)) if self.busy is not None else None
        self.busy = None
        if waiting == 0:
            return (), agreed_clock
        n = min(waiting, self.max_records_per_step)
        mine = self._queue[:n]
        payload = pack_records(mine, np.zeros(n * RECORD_WORDS, dtype=np.int64))
        rows = np.array(self._gather(payload))
        del self._queue[: len(mine)]
        self._queued.difference_update(r.key for r in mine)
        self.exchanges += 1
        union: dict[bytes, PoisonRecord] = {}
        for row in rows:  # group order: the first member to report a key names it
            for rec in unpack_records(row):
                union.setdefault(rec.key, rec)
        records = tuple(sorted(union.values(), key=lambda r: (r.clock_ms, r.key)))
        logger.debug("step %d: shared %d poisoned keys across %s", step, len(records), self.members)
        return records, agreed_clock
