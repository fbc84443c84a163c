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

Followers call ``finish`` / ``abort`` for the same requests on the same step
as their leader, like every other call of the scheduler.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gramcoord.coordinator.status import Decision, PoisonRecord
from gramcoord.rank_worker.grammars.manager import Outcome


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
