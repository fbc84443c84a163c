"""Rank bodies for the attach-time vocabulary check (run under ``run_ranks``)."""

from __future__ import annotations

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.rank_worker.session.session import RankSession, SessionConfig, VocabularyMismatch
from tests.conftest import make_tiny_tokenizer


def attach_body(rank: int, world: int, names: tuple[str, ...]) -> dict:
    """Attach with vocabulary ``names[rank]``; report what happened."""
    from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

    tiny = make_tiny_tokenizer()
    tok = Tokenizer.from_info(tiny.info, names[rank])
    config = SessionConfig(
        parallel=ParallelConfig(dp=world, requests="replicated"),
        distributed=DistributedConfig(step_timeout_s=20),
    )
    try:
        session = RankSession.attach(tok, config)
    except VocabularyMismatch as exc:
        return {"mismatch": list(exc.ranks), "message": str(exc)}
    try:
        outcome = session.leader.submit("r", {"regex": "[a-z]+"})
        decided = session.leader.step(0)
        return {"mismatch": None, "seq": outcome.seq, "admitted": len(decided.admitted)}
    finally:
        session.close()
