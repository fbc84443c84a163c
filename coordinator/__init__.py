"""Cross-rank agreement on grammar readiness, failures and poison.

The coordinator sees only sequence numbers, states, integer reason codes and
16-byte keys; ``rank_worker`` owns what they mean.
"""

from gramcoord.coordinator.agreement import Agreement
from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.coordinator.coordinator import Coordinator, Member, StepResult, wall_clock_ms
from gramcoord.coordinator.errors import (
    CoordinatorError,
    DivergenceError,
    LayoutError,
    PeerLostError,
)
from gramcoord.coordinator.external import FORCED_COMPILE_MODE, ExternalWorld, attach_external
from gramcoord.coordinator.layout import Coords, HostLevels, ParallelLayout
from gramcoord.coordinator.levels import TwoLevel
from gramcoord.coordinator.pipeline import Chain, DecisionCodec
from gramcoord.coordinator.poison_share import PoisonShare, pack_records, unpack_records
from gramcoord.coordinator.report import GatherCodec, ReduceCodec, fingerprint
from gramcoord.coordinator.runtime import Comm, Runtime
from gramcoord.coordinator.status import Decision, LocalStatus, PendingState, PoisonRecord

__all__ = [
    "FORCED_COMPILE_MODE",
    "Agreement",
    "Chain",
    "Comm",
    "Coordinator",
    "CoordinatorError",
    "Coords",
    "Decision",
    "DecisionCodec",
    "DistributedConfig",
    "DivergenceError",
    "ExternalWorld",
    "GatherCodec",
    "HostLevels",
    "LayoutError",
    "LocalStatus",
    "Member",
    "ParallelConfig",
    "ParallelLayout",
    "PeerLostError",
    "PendingState",
    "PoisonRecord",
    "PoisonShare",
    "ReduceCodec",
    "Runtime",
    "StepResult",
    "TwoLevel",
    "attach_external",
    "fingerprint",
    "pack_records",
    "unpack_records",
    "wall_clock_ms",
]
