"""The per-rank session: submit, step, bitmask, apply, advance, and the TP-side reader.

``RankSession`` is the one object a rank drives (gramcoord's own step loop,
or an engine that embeds it); ``MaskReader`` is its TP-worker side.
"""

from gramcoord.rank_worker.session.reader import MaskReader, ReceivedMask
from gramcoord.rank_worker.session.session import RankSession
from gramcoord.rank_worker.session.types import (
    MaskBatch,
    SessionConfig,
    SessionStats,
    StaleGrammarState,
    StepOutcome,
    VocabularyMismatch,
)

__all__ = [
    "MaskBatch",
    "MaskReader",
    "RankSession",
    "ReceivedMask",
    "SessionConfig",
    "SessionStats",
    "StaleGrammarState",
    "StepOutcome",
    "VocabularyMismatch",
]
