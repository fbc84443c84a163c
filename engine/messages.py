"""The step loop's messages between ranks, as typed msgspec structs.

Per step ``n``, in the order every receiver posts them:

1. ``Arrivals`` (stage-0 leader -> next stage leader -> ...): the requests
   stage 0 submitted, with their sequence numbers, so every stage leader
   adds the same requests in the same order before the decision names them.
2. the coordinator's decision (its own chain message);
3. ``BatchFrame`` (stage 0 -> its TP workers and the next stage; every rank
   of stage ``s`` -> the rank of stage ``s + 1`` with the same tp index): the
   batch, the tokens each request gained since the last frame, the drafts
   to verify, and the requests that finished;
4. ``StepResults`` (last-stage leader -> stage-0 leader): sampled and
   jump-forward tokens, next drafts, and finished requests.

Everything is encoded with msgpack through one encoder and one typed decoder
per message type; nothing is pickled.
"""

from __future__ import annotations

import msgspec


class Submitted(msgspec.Struct, frozen=True, array_like=True):
    """A constrained request as stage 0 submitted it."""

    request_id: str
    seq: int
    # The structured_outputs mapping as JSON text.
    spec_json: str
    # The request's token budget (admission refuses unreachable ends).
    max_tokens: int = 0


class Arrivals(msgspec.Struct, frozen=True, tag=True):
    step: int
    requests: tuple[Submitted, ...] = ()


class NewRequest(msgspec.Struct, frozen=True, array_like=True):
    """What every rank of the last stage must know of a request to run it."""

    request_id: str
    constrained: bool
    prompt_ids: tuple[int, ...]
    reference: str | None
    max_tokens: int


class Scheduled(msgspec.Struct, frozen=True, array_like=True):
    """One request of a batch."""

    request_id: str
    # Drop this many output tokens, then append ``new_tokens`` (the change
    # since the previous frame, jump-forward retokenization included).
    rollback: int
    new_tokens: tuple[int, ...]
    # Draft tokens to verify this step (already trimmed to the grammar).
    drafts: tuple[int, ...]


class StageFailure(msgspec.Struct, frozen=True, array_like=True):
    """A request a later stage could not run (e.g. ``grammar_stage_timeout``)."""

    request_id: str
    code: str
    message: str


class BatchFrame(msgspec.Struct, frozen=True, tag=True):
    step: int
    # Requests scheduled for the first time.
    started: tuple[NewRequest, ...] = ()
    batch: tuple[Scheduled, ...] = ()
    # Requests that finished since the previous frame (stage leaders forget them).
    finished: tuple[str, ...] = ()
    # Failures found by stage leaders between stage 0 and the last stage.
    failed_upstream: tuple[StageFailure, ...] = ()
    # The run is over: every rank leaves the loop after this step.
    done: bool = False


class TokenResult(msgspec.Struct, frozen=True, array_like=True):
    """One request's change after a step, computed by the last-stage leader."""

    request_id: str
    rollback: int
    tokens: tuple[int, ...]
    # Drafts for the next step (empty without speculation).
    drafts: tuple[int, ...] = ()
    # stop | grammar_end | length | error, or None while running.
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str = ""
    # Model steps jump-forward saved this step.
    jumped: int = 0


class StepResults(msgspec.Struct, frozen=True, tag=True):
    step: int
    results: tuple[TokenResult, ...] = ()


Message = Arrivals | BatchFrame | StepResults

_encoder = msgspec.msgpack.Encoder()
_decoders = {t: msgspec.msgpack.Decoder(t) for t in (Arrivals, BatchFrame, StepResults)}


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, kind: type[Message]) -> Message:
    """Decode one message of type ``kind``; raises ``msgspec.DecodeError`` otherwise."""
    return _decoders[kind].decode(data)
