"""What the grammar manager says of a request, and its counters.

``Outcome`` is the one record of a request's admission that every layer
passes around (the session, our step loop, the integrations, ``check``);
``ManagerStats`` are the manager's counters, read by ``summary.json``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

CacheStatus = Literal["miss", "hit", "joined", "poisoned", "none"]


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
