"""The values a ``RankSession`` takes and returns (see ``session.py``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
import numpy as np

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.rank_worker.config import (
    FaultsConfig,
    GrammarConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from gramcoord.rank_worker.errors import GrammarError
from gramcoord.rank_worker.grammars.manager import ManagerStats
from gramcoord.rank_worker.masks.jump_forward import JumpStats
from gramcoord.sync.config import TransportConfig


class StaleGrammarState(RuntimeError):
    """A mask was asked for a request whose sampled tokens were never advanced.

    The rows would describe the grammar one step behind the model (the
    "Failed to advance FSM" bug class of vLLM #45015), so the session
    refuses instead of masking with a stale state.
    """


class VocabularyMismatch(RuntimeError):
    """Ranks of one world attached with different vocabularies.

    Raised on every rank at attach, before any request runs: grammars keyed
    by one vocabulary would mask another's token ids.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


class SessionConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The config sections a session reads (a subset of the cluster config)."""

    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    distributed: DistributedConfig = msgspec.field(default_factory=DistributedConfig)
    grammar: GrammarConfig = msgspec.field(default_factory=GrammarConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    faults: FaultsConfig = msgspec.field(default_factory=FaultsConfig)

    @classmethod
    def of(cls, config: Any) -> SessionConfig:
        """Take the session's sections from a larger config (e.g. ``ClusterConfig``)."""
        return cls(**{f: getattr(config, f) for f in cls.__struct_fields__})


class MaskBatch(NamedTuple):
    """The bitmask rows of one step (view valid until the next ``bitmask`` call)."""

    # int32 [len(request_ids) * (1 + K), W].
    rows: np.ndarray
    request_ids: tuple[str, ...]
    # Draft tokens per request, aligned with request_ids.
    num_drafts: tuple[int, ...]
    # request id -> why its rows are unusable (the request must fail).
    failures: dict[str, GrammarError]


class SessionStats(msgspec.Struct, kw_only=True):
    """Typed counters of one session."""

    manager: ManagerStats | None = None
    jump_forward: JumpStats | None = None
    masks_built: int = 0
    rows_applied: int = 0
    transport_dropped: int = 0
    # Control frames this writer garbled on purpose (faults.corrupt_frames_every).
    transport_corrupted: int = 0


class RoleError(RuntimeError):
    """A call for a role this rank does not hold (the message names its roles)."""
