"""What the grammar manager says of a request, and of a spec's place in its caches.

``Outcome`` is the one record of a request's admission that every layer
passes around (the per-rank API, our step loop, the integrations,
``check``); ``Lookup`` is what the caches hold for a spec
(``GrammarManager.lookup``, ``StageLeader.lookup``). The manager's own
records, counters and admission checks are in ``grammars.manager``.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import msgspec

CacheStatus = Literal["miss", "hit", "joined", "warm", "poisoned", "none"]


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
