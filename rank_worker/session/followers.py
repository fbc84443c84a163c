"""TP workers that run a scheduler of their own and follow their leader.

SGLang runs a scheduler on every TP rank, and so does vLLM under its
external launcher. With ``parallel.tp_followers`` set, each TP worker's
session takes the same ``submit`` calls as its leader's (same requests, same
order, so the same sequence numbers), and its ``step`` receives the leader's
``FollowerNote`` instead of agreeing: the outcome of every request the
leader decided this step, and the decision and poison behind them.

- ``read``: the worker compiles nothing; ``bitmask(..., step=n)`` returns the
  rows the leader published for step ``n`` (shared memory), to ``release``
  after applying them.
- ``fill``: the worker compiles and fills its own rows, as SGLang's TP ranks
  do today (sglang#13809); its manager applies the leader's poison and
  decision, so its caches evolve as the leader's do. A request the leader
  admitted but this worker could not compile within
  ``grammar.compile_timeout_s`` is returned in ``stage_failed``; the host
  must end it everywhere.

Followers call ``release`` for the same requests on the same step as their
leader, like every other call of the scheduler. The leader's side is
``NoteSender``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any, Literal

import msgspec

from gramcoord.coordinator.byte_link import ByteLink
from gramcoord.coordinator.errors import CoordinatorError
from gramcoord.coordinator.status import Decision, PoisonRecord
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.outcome import Outcome
from gramcoord.rank_worker.session.leader import StepOutcome

logger = logging.getLogger(__name__)


class DecidedRequest(msgspec.Struct, frozen=True, array_like=True):
    """How the leader decided one request this step."""

    seq: int
    status: Literal["admitted", "failed"]
    code: str | None = None
    message: str = ""


class FollowerNote(msgspec.Struct, frozen=True, tag=True):
    """What a TP leader sends each of its followers after every ``step``."""

    step: int
    decided: tuple[DecidedRequest, ...] = ()
    # The decision and the poison the leader applied (fill followers apply
    # them to their own manager).
    decision: Decision | None = None
    poison: tuple[PoisonRecord, ...] = ()


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(FollowerNote)


def encode_note(note: FollowerNote) -> bytes:
    """msgpack bytes of ``note``."""
    return _encoder.encode(note)


def decode_note(data: bytes) -> FollowerNote:
    """The ``FollowerNote`` in ``data``; raises ``msgspec.DecodeError`` otherwise."""
    return _decoder.decode(data)


def decided(outcomes: list[Outcome]) -> tuple[DecidedRequest, ...]:
    """The leader's outcomes of one step (admitted and failed), for followers."""
    return tuple(
        DecidedRequest(o.seq, o.status, o.code, o.message)
        for o in outcomes
        if o.status in ("admitted", "failed") and o.seq >= 0
    )


class NoteSender:
    """The TP leader's side: one ``FollowerNote`` to every follower after each step."""

    def __init__(self, link: ByteLink, ranks: tuple[int, ...]) -> None:
        self._link, self._ranks = link, ranks
        self._refused: list[Outcome] = []

    def refused(self, outcome: Outcome) -> None:
        """A request ``submit`` failed at once: the followers learn it with the next note."""
        self._refused.append(outcome)

    def send(self, step: int, outcomes: list[Outcome], decision: Any, poison: Any) -> None:
        """Send this step's outcomes, with the decision and poison behind them."""
        note = FollowerNote(
            step=step,
            decided=decided(self._refused + outcomes),
            decision=decision,
            poison=poison,
        )
        self._refused = []
        data = encode_note(note)
        for r in self._ranks:
            self._link.send(r, data, operation="follower note", step=step)


class FollowerBook:
    """A ``read`` follower's requests: sequence numbers it gave, in submit order."""

    def __init__(self) -> None:
        self._next = 0
        self._pending: dict[int, str] = {}
        self._seq_of: dict[str, int] = {}
        self.running: set[str] = set()

    def add(self, request_id: str, seq: int | None) -> Outcome:
        """Record a submitted request under the next (or the given) sequence number."""
        seq = self._next if seq is None else seq
        self._next = seq + 1
        self._pending[seq] = request_id
        self._seq_of[request_id] = seq
        return Outcome(request_id=request_id, seq=seq, status="pending")

    def resolve(self, note: FollowerNote) -> tuple[list[Outcome], list[Outcome]]:
        """Admitted and failed outcomes of this worker's requests, per the note."""
        admitted, failed = [], []
        for d in note.decided:
            rid = self._pending.pop(d.seq, None)
            if rid is None:
                continue
            o = Outcome(request_id=rid, seq=d.seq, status=d.status, code=d.code, message=d.message)
            if d.status == "admitted":
                self.running.add(rid)
                admitted.append(o)
            else:
                self._seq_of.pop(rid, None)
                failed.append(o)
        return admitted, failed

    def state_of(self, request_id: str) -> str:
        """``running``, ``pending`` or ``unknown``."""
        if request_id in self.running:
            return "running"
        return "pending" if request_id in self._seq_of else "unknown"

    def forget(self, request_id: str) -> bool:
        """Drop a finished or aborted request; whether it was known."""
        seq = self._seq_of.pop(request_id, None)
        self.running.discard(request_id)
        if seq is not None:
            self._pending.pop(seq, None)
        return seq is not None


class TpFollower:
    """A TP worker with a scheduler of its own: ``submit``, ``step``, ``finish``, ``abort``.

    ``session.follower``; the calls mirror the leader's ``StageLeader`` and
    come in the same order. ``step`` receives the leader's note instead of
    agreeing.

    Parameters
    ----------
    link, leader:
        The byte link and the leader's rank the notes come from.
    book:
        ``read`` mode: the requests, by sequence number (no compiles here).
    manager:
        ``fill`` mode: this worker's grammar manager (it follows the
        leader's decisions; see ``GrammarManager.follow``).
    on_admitted, on_end:
        The last stage's ``StageMasks.start`` / ``forget`` (``fill``).
    """

    def __init__(
        self,
        link: ByteLink,
        leader: int,
        *,
        rank: int,
        book: FollowerBook | None = None,
        manager: GrammarManager | None = None,
        on_admitted: Callable[[list[Outcome]], None] | None = None,
        on_end: Callable[[str], None] | None = None,
    ) -> None:
        if (book is None) == (manager is None):
            raise ValueError("a TP follower reads (a book) or fills (a manager), not both")
        self._link = link
        self._leader = leader
        self.rank = rank
        self._book = book
        self._manager = manager
        self._on_admitted = on_admitted
        self._on_end = on_end

    @property
    def running(self) -> Collection[str]:
        """The requests the leader admitted that have not ended (``read`` mode)."""
        return self._book.running if self._book is not None else ()

    def submit(
        self, request_id: str, spec: Any, *, seq: int | None = None, max_tokens: int | None = None
    ) -> Outcome:
        """Take the same request as the leader, in the same order; never raises for bad input."""
        if self._book is not None:
            return self._book.add(request_id, seq)
        return self._manager.add(request_id, spec, seq=seq, max_tokens=max_tokens)

    def step(self, step: int) -> StepOutcome:
        """Receive the leader's note for ``step`` and apply it.

        Returns
        -------
        StepOutcome
            What the leader decided for this worker's requests;
            ``stage_failed`` (``fill``) lists those the leader admitted that
            this worker could not compile in time: the host must end them
            everywhere.

        Raises
        ------
        CoordinatorError
            The note is for another step (the schedulers diverged).
        PeerLostError
            The leader died or hung.
        """
        data = self._link.recv(self._leader, operation="follower note", step=step)
        note = decode_note(data)
        if note.step != step:
            raise CoordinatorError(
                f"[rank {self.rank}] follower at step {step} got the leader's step {note.step}"
            )
        if self._book is not None:
            admitted, failed = self._book.resolve(note)
            return StepOutcome(admitted, failed, [])
        manager = self._manager
        if note.poison:
            manager.apply_poison(note.poison)
        outcomes = manager.apply_decision(note.decision) if note.decision is not None else []
        leader = {d.seq: d for d in note.decided}
        admitted = [o for o in outcomes if o.status == "admitted"]
        failed = [o for o in outcomes if o.status == "failed"]
        stage_failed = [o for o in failed if o.seq in leader and leader[o.seq].status == "admitted"]
        if admitted and self._on_admitted is not None:
            self._on_admitted(admitted)
        return StepOutcome(admitted, failed, stage_failed)

    def request_state(self, request_id: str) -> str:
        """``waiting`` | ``pending`` | ``running`` | ``unknown``, as on the leader."""
        if self._book is not None:
            return self._book.state_of(request_id)
        return self._manager.state_of(request_id)

    def release(self, request_id: str) -> bool:
        """The request ended (the same step as the leader): drop it; whether it was live."""
        if self._on_end is not None:
            self._on_end(request_id)
        if self._book is not None:
            return self._book.forget(request_id)
        return self._manager.release(request_id)

    def close(self) -> None:
        """Stop the compile pool (``fill``)."""
        if self._manager is not None:
            self._manager.close()
