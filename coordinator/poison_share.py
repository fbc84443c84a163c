"""Newly failed grammar keys and the end-of-run vote, shared across DP leaders off the step.

Replicas with partitioned streams share nothing but this: which grammar
keys failed (so a bad schema is poisoned on every replica) and, for
gramcoord's own loop, whether any replica still has work. Each step every
member of the poison group **posts** one fixed-size ``all_gather`` and
goes on; the exchange posted at step ``s`` is settled (waited for and
applied) at step ``s + lag``, identically on every member. A member
therefore never waits for its peers inside a step unless it runs more than
``lag`` steps ahead of the slowest one.

A row is ``[step, records, clock ms, busy, record words...]``: up to
``max_records_per_step`` records of ``RECORD_WORDS`` int64 words (the
16-byte key as two little-endian words, the reason code, the clock, then
the message: up to ``MESSAGE_BYTES`` of UTF-8, zero-padded). Records beyond the cap
wait in order for the next posts; none is dropped. ``busy`` is the
end-of-run vote: 1 or 0, or -1 when the member does not vote (a later
pipeline stage, which learns of the end from stage 0's frame).

Guarantees, on every member alike:

- a failure passed to ``exchange`` at step ``s > first`` is in the union
  settled at step ``s + lag + q // max_records_per_step``, ``q`` the records queued
  before it on its member;
- the settled clock (the members' maximum) and vote (any member busy) are
  the same everywhere, so TTL expiry and the end of the run happen at one
  step on all replicas;
- the first exchange settles in its own step (so the agreed clock starts
  from the members' clocks); the next ``lag`` steps settle nothing;
- ``lag == 0`` settles each exchange in its own step (blocking).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from gramcoord.coordinator.errors import DivergenceError
from gramcoord.coordinator.status import PoisonRecord

logger = logging.getLogger(__name__)

# A record's message travels in this many bytes (cut at a character).
MESSAGE_BYTES = 256
RECORD_WORDS = 4 + MESSAGE_BYTES // 8
KEY_BYTES = 16
HEADER_WORDS = 4  # step, records, clock ms, busy
NO_VOTE = -1


def _message_bytes(message: str) -> bytes:
    data = message.encode("utf-8", "replace")[:MESSAGE_BYTES]
    return data.decode("utf-8", "ignore").encode("utf-8")  # never half a character


def pack_records(records: Sequence[PoisonRecord], out: np.ndarray | None = None) -> np.ndarray:
    """Records -> int64[len(records) * RECORD_WORDS] (or into ``out``, padded with zeros)."""
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
        text = _message_bytes(rec.message)
        view[i, 4:].view(np.uint8)[: len(text)] = np.frombuffer(text, dtype=np.uint8)
    return out


def unpack_records(words: np.ndarray) -> list[PoisonRecord]:
    """int64[n * RECORD_WORDS] -> records; all-zero slots (padding) are skipped."""
    view = np.ascontiguousarray(words, dtype=np.int64).reshape(-1, RECORD_WORDS)
    return [
        PoisonRecord(
            key=row[:2].astype("<i8").tobytes(),
            reason=int(row[2]),
            clock_ms=int(row[3]),
            message=row[4:].tobytes().rstrip(b"\0").decode("utf-8", "replace"),
        )
        for row in view
        if row[2] != 0
    ]


class Posted(Protocol):
    """A collective in flight: ``wait()`` returns every member's row."""

    def wait(self) -> np.ndarray: ...


Post = Callable[[np.ndarray], Posted]
"""row int64[n] -> the group's all_gather of it, posted without waiting."""


class Settled(NamedTuple):
    """One exchange, settled: identical on every member."""

    # The step that posted it.
    step: int
    # The union of every member's records, sorted by (clock_ms, key).
    records: tuple[PoisonRecord, ...]
    # The members' maximum clock at that step.
    clock_ms: int
    # Whether any voting member was busy at that step; None: none voted.
    busy: bool | None


class PoisonShare:
    """One member's side of the posted poison exchange (see the module docstring).

    Parameters
    ----------
    members:
        Global ranks of the poison group, in group order.
    post:
        The group's all_gather, posted (see ``Post``).
    lag_steps:
        Steps between posting an exchange and settling it (>= 0).
    max_records_per_step:
        Most records one member posts per step.
    """

    def __init__(
        self,
        *,
        members: tuple[int, ...],
        post: Post,
        lag_steps: int = 2,
        max_records_per_step: int = 16,
    ) -> None:
        if lag_steps < 0:
            raise ValueError(f"lag_steps must be >= 0, got {lag_steps}")
        if max_records_per_step < 1:
            raise ValueError(f"max_records_per_step must be >= 1, got {max_records_per_step}")
        self.members = members
        self.lag_steps = lag_steps
        self.max_records_per_step = max_records_per_step
        self._post = post
        self._queue: deque[PoisonRecord] = deque()
        self._queued: set[bytes] = set()
        self._in_flight: deque[tuple[int, Posted]] = deque()
        # The first exchange settles in its own step: the agreed clock starts
        # from the members' clocks, not from zero.
        self._started = False
        # Exchanges settled that carried at least one record.
        self.exchanges = 0

    @property
    def waiting(self) -> int:
        """Own records not posted yet."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Exchanges posted and not settled yet."""
        return len(self._in_flight)

    def exchange(
        self, step: int, new: Sequence[PoisonRecord], clock_ms: int, *, busy: bool | None = None
    ) -> Settled | None:
        """Post this step's exchange; settle the one posted ``lag_steps`` ago.

        Parameters
        ----------
        step:
            This step; it labels the row, and every member must post the
            same steps in the same order.
        new:
            Failures found since the last call (duplicates are dropped).
        clock_ms:
            This member's wall clock.
        busy:
            This member's end-of-run vote, or None when it does not vote.

        Returns
        -------
        Settled or None
            The exchange posted ``lag_steps`` calls ago (the first call's
            own); None on the ``lag_steps`` calls after the first.

        Raises
        ------
        PeerLostError
            From the collective, when a member died or hung.
        DivergenceError
            The members posted different steps.
        """
        for rec in new:
            if rec.key not in self._queued:
                self._queue.append(rec)
                self._queued.add(rec.key)
        n = min(len(self._queue), self.max_records_per_step)
        mine = [self._queue.popleft() for _ in range(n)]
        self._queued.difference_update(r.key for r in mine)
        row = np.zeros(HEADER_WORDS + self.max_records_per_step * RECORD_WORDS, dtype=np.int64)
        row[:HEADER_WORDS] = (step, n, clock_ms, NO_VOTE if busy is None else int(bool(busy)))
        pack_records(mine, row[HEADER_WORDS:])
        self._in_flight.append((step, self._post(row)))
        if self._started and len(self._in_flight) <= self.lag_steps:
            return None
        self._started = True
        return self._settle()

    def drain(self) -> list[Settled]:
        """Settle every exchange in flight (at the end of a run, on every member)."""
        out = []
        while self._in_flight:
            out.append(self._settle())
        return out

    def _settle(self) -> Settled:
        step, posted = self._in_flight.popleft()
        rows = np.array(posted.wait())
        steps = rows[:, 0]
        if (steps != steps[0]).any() or steps[0] != step:
            odd = tuple(r for r, s in zip(self.members, steps.tolist()) if s != steps[0])
            posted_by = ", ".join(f"rank {r} step {int(s)}" for r, s in zip(self.members, steps))
            raise DivergenceError(
                f"poison group {list(self.members)} is not in step: {posted_by} "
                f"(this member settles step {step})",
                step=step,
                ranks=odd,
            )
        votes = rows[:, 3]
        busy = None if (votes == NO_VOTE).all() else bool((votes == 1).any())
        union: dict[bytes, PoisonRecord] = {}
        for row in rows:  # group order: the first member to report a key names it
            count = int(row[1])
            words = row[HEADER_WORDS : HEADER_WORDS + count * RECORD_WORDS]
            for rec in unpack_records(words):
                union.setdefault(rec.key, rec)
        records = tuple(sorted(union.values(), key=lambda r: (r.clock_ms, r.key)))
        if records:
            self.exchanges += 1
            logger.debug(
                "step %d: shared %d poisoned keys across %s", step, len(records), self.members
            )
        return Settled(step, records, int(rows[:, 2].max()), busy)
