"""Helpers shared by the session and step-loop tests (not a test module)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import numpy as np

from gramcoord.rank_worker.config import GrammarConfig, SpeculativeConfig
from gramcoord.rank_worker.grammars.outcome import Outcome
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.session.session import RankSession, SessionConfig

# Step numbers only have to increase; one counter for the whole process.
_steps = itertools.count(1)


def session_config(k: int = 0, **grammar) -> SessionConfig:
    """A one-process config: one compile worker (2-core machines), ``k`` drafts."""
    return SessionConfig(
        grammar=GrammarConfig(num_compile_workers=1, **grammar),
        speculative=SpeculativeConfig(num_tokens=k),
    )


def local_session(tokenizer: Tokenizer, k: int = 0, **grammar) -> RankSession:
    return RankSession.local(tokenizer, session_config(k, **grammar))


def settle(session: RankSession, timeout_s: float = 30.0) -> tuple[list[Outcome], list[Outcome]]:
    """Step until nothing is pending or waiting; every admitted and failed outcome."""
    admitted: list[Outcome] = []
    failed: list[Outcome] = []
    deadline = time.monotonic() + timeout_s
    while True:
        out = session.leader.step(next(_steps))
        admitted += out.admitted
        failed += out.failed
        if not session.leader.num_undecided:
            return admitted, failed
        assert time.monotonic() < deadline, "compiles never settled"
        time.sleep(0.002)


def admit(session: RankSession, requests: Iterable[tuple[str, object]]) -> list[Outcome]:
    """Submit ``(request_id, spec)`` pairs and step until all are admitted."""
    ids = []
    for rid, spec in requests:
        outcome = session.leader.submit(rid, spec)
        assert outcome.status == "pending", outcome
        ids.append(rid)
    admitted, failed = settle(session)
    assert not failed, failed
    assert sorted(o.request_id for o in admitted) == sorted(ids)
    return admitted


def allowed(row: np.ndarray, vocab_size: int) -> set[int]:
    """Token ids whose bit is set in one int32 bitmask row (padding bits ignored)."""
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:vocab_size]).tolist())
