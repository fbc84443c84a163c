"""What the grammar manager holds and says of a request, and its counters.

``Entry`` is a request as the manager holds it (``grammars.manager``).
``Outcome`` is the one record of a request's admission that every layer
passes around (the per-rank API, our step loop, the integrations, ``check``);
``ManagerStats`` are the manager's counters, read by ``summary.json``;
``refuse_seq`` and ``refuse_id`` are the one check of sequence numbers and
request ids.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import msgspec

from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.spec import GrammarSpec

CacheStatus = Literal["miss", "hit", "joined", "poisoned", "none"]

# Longest request id admission takes. The transport's wire bound
# (``sync.messages.MAX_REQUEST_ID_CHARS``) is the same number, so that one
# admitted id can never break a whole batch's publish; the transport is not
# imported here, so a host that never moves masks does not load it.
MAX_REQUEST_ID_CHARS = 1024


class Outcome(msgspec.Struct, kw_only=True):
    """What happened to one request: admitted, failed, or still waiting."""

    request_id: str
    seq: int
    status: Literal["admitted", "failed", "pending", "waiting"]
    cache: CacheStatus = "none"
    code: str | None = None
    message: str = ""
    warnings: tuple[str, ...] = ()
    compile_ms: float = 0.0
    # An admitted request whose grammar does not enforce all of its schema:
    # the canonical schema its finished output is validated against
    # (``grammars.end_check``); None when the grammar enforces it all.
    end_check: str | None = None


@dataclass(eq=False)
class Entry:
    """One request held by the manager: waiting, pending or running."""

    seq: int
    request_id: str
    spec: GrammarSpec
    cache: CacheStatus
    compiled: Any = None
    # The compile job (``compile_job.CompileJob``) while one runs.
    job: Any = None
    warnings: tuple[str, ...] = ()
    compile_ms: float = 0.0

    def outcome(self, status: str, *, code: str | None = None, message: str = "") -> Outcome:
        """This request's ``Outcome`` with ``status``."""
        spec = self.spec
        return Outcome(
            request_id=self.request_id,
            seq=self.seq,
            status=status,  # type: ignore[arg-type]
            cache=self.cache,
            code=code,
            message=message,
            warnings=self.warnings,
            compile_ms=round(self.compile_ms, 3),
            end_check=spec.text if spec.end_check and status == "admitted" else None,
        )


class Lookup(NamedTuple):
    """What the caches hold for a spec (``GrammarManager.lookup``), the same on every rank."""

    # The grammar key; None for a spec that fails validation (``add``
    # refuses it with its code).
    key: bytes | None
    # The compiled grammar on a cache hit.
    compiled: Any
    # The failed outcome of a poisoned key.
    failed: Outcome | None
    # On a hit, the schema text a finished output is checked against
    # (``grammars.end_check``); None when the grammar enforces it all.
    end_check: str | None = None


class ManagerStats(msgspec.Struct, kw_only=True):
    """Counters of one manager; ``summary.json`` reads them."""

    # Admissions by cache path: compiled here, cache hit, joined an
    # in-flight compile of the same key, or failed on a poisoned key.
    miss: int = 0
    hit: int = 0
    joined: int = 0
    poisoned: int = 0
    # Specs rejected by validation (never keyed or compiled).
    invalid_spec: int = 0
    admitted: int = 0
    failed: int = 0
    # Decisions naming a seq this rank does not hold (aborted meanwhile).
    unknown_seq: int = 0


def valid_request_id(request_id: Any) -> bool:
    """Text of 1..MAX_REQUEST_ID_CHARS characters that encodes as UTF-8 (no lone surrogates)."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        return False
    try:
        request_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def refuse_seq(request_id: Any, seq: Any, *, next_seq: int) -> Outcome | None:
    """The ``failed`` outcome of a sequence number that is not an int ``>= next_seq``, or None.

    The refused number is not taken: the next request may use it.
    """
    if not isinstance(seq, int) or seq < next_seq:
        return Outcome(
            request_id=request_id if valid_request_id(request_id) else str(request_id)[:64],
            seq=seq if isinstance(seq, int) else -1,
            status="failed",
            code=ErrorCode.bad_request_id.name,
            message=(
                f"bad sequence number: got {seq!r} after {next_seq - 1}; "
                "sequence numbers must increase"
            ),
        )
    return None


def refuse_id(request_id: Any, seq: int, *, live: Container[str]) -> Outcome | None:
    """The ``failed`` outcome of an id that is not valid text or is ``live``, or None."""
    if not valid_request_id(request_id):
        return Outcome(
            request_id=str(request_id)[:64],
            seq=seq,
            status="failed",
            code=ErrorCode.bad_request_id.name,
            message=(
                f"request ids must be 1..{MAX_REQUEST_ID_CHARS} characters of text "
                "that encodes as UTF-8"
            ),
        )
    if request_id in live:
        return Outcome(
            request_id=request_id,
            seq=seq,
            status="failed",
            code=ErrorCode.duplicate_request_id.name,
            message=f"request id {request_id!r} is already live; ids must be unique",
        )
    return None
