"""What a rank reports to the agreement, and what the agreement decides.

These are plain values: the coordinator never sees grammars, only sequence
numbers, grammar keys, states and integer reason codes. ``rank_worker`` owns
the meaning of each reason code; the coordinator only carries them.
``wall_clock_ms`` is the clock every member reports; the agreement turns the
members' readings into the agreed clock (``Decision.clock_ms``).
"""

from __future__ import annotations

import time
from enum import IntEnum

import msgspec


def wall_clock_ms() -> int:
    """This rank's wall clock in milliseconds (what a member reports to its group)."""
    return time.time_ns() // 1_000_000


class PendingState(IntEnum):
    PENDING = 0
    READY = 1
    FAILED = 2


class LocalStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's view of its pending window, in sequence order.

    ``seqs`` are the sequence numbers of every request waiting for
    admission, ascending. ``states`` and ``reasons`` are parallel to it;
    ``reasons[i]`` is 0 unless ``states[i]`` is FAILED. ``keys``, when
    given, holds each request's grammar key (parallel too): the members then
    also agree that they hold the same grammar under each number.
    """

    seqs: tuple[int, ...] = ()
    states: tuple[int, ...] = ()
    reasons: tuple[int, ...] = ()
    keys: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.seqs) == len(self.states) == len(self.reasons)
        assert not self.keys or len(self.keys) == len(self.seqs)


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """The agreed outcome of one step, identical on every rank.

    ``ready`` holds the sequence numbers to admit, ascending; ``failed``
    holds ``(seq, reason)`` pairs, ascending by seq. Failed wins over ready.
    """

    step: int
    ready: tuple[int, ...] = ()
    failed: tuple[tuple[int, int], ...] = ()
    # Agreed wall clock (max over the group), used for poison TTL expiry.
    clock_ms: int = 0
    # Parallel to ``failed``: the global ranks on which each request failed,
    # where the report says (the all_gather form); empty otherwise, and on
    # ranks that received the decision down the pipeline chain.
    failed_on: tuple[tuple[int, ...], ...] = ()
    # The agreement group that decided (global ranks), where known.
    members: tuple[int, ...] = ()

    def failed_ranks(self, seq: int) -> tuple[int, ...] | None:
        """The ranks on which ``seq`` failed, if the decision says (else None)."""
        for (s, _), ranks in zip(self.failed, self.failed_on):
            if s == seq:
                return ranks
        return None

    def failed_everywhere(self, seq: int) -> bool:
        """Whether ``seq`` failed on every member of the group (known from the report)."""
        ranks = self.failed_ranks(seq)
        return ranks is not None and len(ranks) == len(self.members) > 0


class PoisonRecord(msgspec.Struct, frozen=True, array_like=True):
    """A failed grammar key shared across DP leaders."""

    # blake2b-128 digest of the canonical spec (16 bytes).
    key: bytes
    # Reason code (rank_worker.errors), e.g. grammar_timeout.
    reason: int
    # Agreed clock at which the failure was decided.
    clock_ms: int
    # Why it failed, as the rank that learnt it says it (at most
    # ``poison_share.MESSAGE_BYTES`` of UTF-8 travel): every replica that
    # meets the key again fails it with this text.
    message: str = ""


def decide_alone(step: int, status: LocalStatus, clock_ms: int) -> Decision:
    """The decision of a member that decides on its own status (no peers).

    The one single-rank rule: ready requests are admitted, failed ones fail,
    pending ones wait. ``Agreement`` uses it for groups of one (and for
    ``compile_mode: sync``), and ``GrammarManager.step`` for one process.
    """
    ready = tuple(s for s, st in zip(status.seqs, status.states) if st == PendingState.READY)
    failed = tuple(
        (s, r)
        for s, st, r in zip(status.seqs, status.states, status.reasons)
        if st == PendingState.FAILED
    )
    return Decision(step=step, ready=ready, failed=failed, clock_ms=clock_ms)
