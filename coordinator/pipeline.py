"""Stage 0's decision, carried down each replica's pipeline chain.

With ``pp_sync: chain`` the stage-0 leader of each replica decides, and the
decision travels point to point ``stage k -> stage k+1`` every step. One
message of at most ``HEADER + window`` int64 words::

    word 0   MAGIC_DECISION
    word 1   step           checked by the receiver against its own step
    word 2   clock_ms       agreed clock
    word 3   n_ready
    word 4   n_failed
    word 5   n_poison       records that follow in a second message
    body     n_ready words (seq << 16), then n_failed words (seq << 16 | reason)

Only the used words are sent: the receiver posts the full-size buffer and
reads the counts from the header (gloo accepts a message shorter than the
posted buffer), so an empty decision costs as much as a 6-word ping.

The poison records shared this step (``gramcoord.coordinator.poison_share``) follow
in a second message only when there are any, so later stages poison the
same keys as stage 0. Sends are asynchronous; the runtime drains the
earlier send before each new one. A gloo send completes once the receiver
has posted its receive, so at most one decision is in flight per hop and
stage 0 runs at most one step ahead of stage 1. A middle stage forwards the
bytes it received before it applies them.
"""

from __future__ import annotations

import logging

import numpy as np

from gramcoord.coordinator.comm import Comm
from gramcoord.coordinator.errors import DivergenceError
from gramcoord.coordinator.poison_share import RECORD_WORDS, pack_records, unpack_records
from gramcoord.coordinator.status import Decision, PoisonRecord

logger = logging.getLogger(__name__)

MAGIC_DECISION = 0x67636F6F72640201
HEADER = 6
REASON_BITS = 16
TAG_DECISION = 17
TAG_POISON = 18


class DecisionCodec:
    """Fixed-size decision messages for a window of ``window`` requests."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.size = HEADER + window

    def encode(self, decision: Decision, n_poison: int, out: np.ndarray) -> int:
        """Write the message into ``out``; returns the number of words used."""
        n_ready, n_failed = len(decision.ready), len(decision.failed)
        assert n_ready + n_failed <= self.window, "decision larger than the window"
        out[:HEADER] = (
            MAGIC_DECISION,
            decision.step,
            decision.clock_ms,
            n_ready,
            n_failed,
            n_poison,
        )
        body = out[HEADER:]
        body[:] = 0
        body[:n_ready] = np.asarray(decision.ready, dtype=np.int64) << REASON_BITS
        if n_failed:
            pairs = np.asarray(decision.failed, dtype=np.int64)
            body[n_ready : n_ready + n_failed] = (pairs[:, 0] << REASON_BITS) | pairs[:, 1]
        return HEADER + n_ready + n_failed

    def decode(self, msg: np.ndarray) -> tuple[Decision, int]:
        """-> (decision, number of poison records that follow)."""
        assert int(msg[0]) == MAGIC_DECISION, "not a decision message"
        step, clock_ms, n_ready, n_failed, n_poison = (int(x) for x in msg[1:HEADER])
        body = msg[HEADER : HEADER + n_ready + n_failed]
        ready = (body[:n_ready] >> REASON_BITS).tolist()
        failed = body[n_ready:]
        reasons = (failed & ((1 << REASON_BITS) - 1)).tolist()
        seqs = (failed >> REASON_BITS).tolist()
        decision = Decision(
            step=step,
            ready=tuple(ready),
            failed=tuple(zip(seqs, reasons)),
            clock_ms=clock_ms,
        )
        return decision, n_poison


class Chain:
    """One stage leader's place in its replica's decision chain.

    Parameters
    ----------
    comm:
        The runtime (group ``"pp_chain"``).
    rank:
        This stage leader's global rank.
    prev, next:
        Global ranks of the previous and next stage leaders (``None`` at the
        ends), from ``ParallelLayout.chain_prev`` / ``chain_next``.
    window:
        The pending window; fixes the message size.
    """

    def __init__(
        self, comm: Comm, *, rank: int, prev: int | None, next: int | None, window: int
    ) -> None:
        self.rank = rank
        self.prev = prev
        self.next = next
        self._comm = comm
        self._codec = DecisionCodec(window)
        self._msg = np.zeros(self._codec.size, dtype=np.int64)
        self.hops = 0

    def send(self, decision: Decision, poison: tuple[PoisonRecord, ...] = ()) -> None:
        """Stage 0: send this step's decision (and poison) to stage 1."""
        assert self.next is not None and self.prev is None
        used = self._codec.encode(decision, len(poison), self._msg)
        self._forward(decision.step, self._msg[:used], pack_records(poison) if poison else None)

    def _forward(self, step: int, msg: np.ndarray, poison: np.ndarray | None) -> None:
        assert self.next is not None
        self._comm.send(
            "pp_chain", self.next, msg, tag=TAG_DECISION, operation="pp_chain send", step=step
        )
        if poison is not None:
            self._comm.send(
                "pp_chain", self.next, poison, tag=TAG_POISON, operation="pp_chain send", step=step
            )
        self.hops += 1

    def receive(self, step: int) -> tuple[Decision, tuple[PoisonRecord, ...]]:
        """Later stage: receive step ``step``'s decision, forward it, return it.

        Raises
        ------
        DivergenceError
            If the message is for another step.
        PeerLostError
            If the previous stage died or hung.
        """
        assert self.prev is not None
        self._comm.recv(
            "pp_chain", self.prev, self._msg, tag=TAG_DECISION, operation="pp_chain recv", step=step
        )
        sent_step = int(self._msg[1])
        if int(self._msg[0]) != MAGIC_DECISION or sent_step != step:
            raise DivergenceError(
                f"[rank {self.rank}] pp chain out of step: rank {self.prev} sent a decision "
                f"for step {sent_step} while this stage is at step {step}",
                step=step,
                ranks=(self.prev,),
            )
        decision, n_poison = self._codec.decode(self._msg)
        used = HEADER + len(decision.ready) + len(decision.failed)
        words = None
        if n_poison:
            words = np.zeros(n_poison * RECORD_WORDS, dtype=np.int64)
            self._comm.recv(
                "pp_chain", self.prev, words, tag=TAG_POISON, operation="pp_chain recv", step=step
            )
        if self.next is not None:
            self._forward(step, self._msg[:used], words)
        return decision, tuple(unpack_records(words)) if words is not None else ()
