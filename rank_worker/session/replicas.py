"""Poisoned keys shared across a host engine's data-parallel replicas, at the host's sync point.

A host whose data-parallel replicas each run their own scheduler and grammar
manager (vLLM's replicas under ``external_launcher``) holds one
``ReplicaPoison`` per replica process, over the group vLLM already has
between them. The host calls ``sync`` at a point every replica reaches the
same number of times (vLLM's own data-parallel all_reduce of "any work
left?", once per engine step), and ``ReplicaPoison``:

- posts the keys this replica poisoned since the last call (with their
  codes, clocks and messages) in one fixed-size ``all_gather``, without
  waiting (``coordinator.poison_share.PoisonShare``, the exchange gramcoord's
  own engine posts between its replicas);
- settles the exchange posted ``distributed.poison_lag_steps`` calls ago and
  poisons what every replica learnt on this replica's grammar manager, so a
  replica that meets the key again fails it at once, with the code and the
  message of the replica that learnt it, without compiling.

The host's grammar manager may come later than the first ``sync`` (vLLM
builds its backend at the first structured request): records settled
before it attaches are kept (as many as the poison cache holds) and applied
when it does.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.groups import HostGroup
from gramcoord.coordinator.poison_share import PoisonShare
from gramcoord.coordinator.status import PoisonRecord, wall_clock_ms

logger = logging.getLogger(__name__)

# Records kept for a grammar manager that attaches late.
MAX_KEPT = 4096


class ReplicaPoison:
    """One replica's side of the poison shared between a host's replicas.

    Parameters
    ----------
    group:
        The gloo process group between the replicas (vLLM's data-parallel
        ``cpu_group``); ``None`` or a group of one shares nothing.
    distributed:
        ``step_timeout_s`` (the exchange's deadline) and
        ``poison_lag_steps`` (``sync`` calls between posting and settling).
    """

    def __init__(self, group: Any | None, distributed: DistributedConfig | None = None) -> None:
        distributed = distributed or DistributedConfig()
        self._comm = HostGroup(group, step_timeout_s=distributed.step_timeout_s, names=("poison",))
        self.size = self._comm.size
        self._share = None
        if self.size > 1:
            self._share = PoisonShare(
                members=tuple(range(self.size)),
                post=self._post,
                lag_steps=distributed.poison_lag_steps,
            )
        self._syncs = 0
        self._queue: list[PoisonRecord] = []
        self._kept: deque[PoisonRecord] = deque(maxlen=MAX_KEPT)
        self._targets: list[Any] = []
        # Records settled so far (this replica's own among them).
        self.received = 0

    def _post(self, row: Any) -> Any:
        return self._comm.all_gather_start(
            "poison", row, operation="replica poison", step=self._syncs
        )

    def attach(self, leader: Any) -> None:
        """Apply the shared keys to ``leader`` (a ``StageLeader``) from now on, and those kept."""
        if self._kept:
            leader.carry_poison(list(self._kept))
        self._targets.append(leader)
        leader.share_failures(self.queue)

    def queue(self, records: Iterable[PoisonRecord]) -> None:
        """Keys this replica poisoned: posted with the next ``sync``."""
        self._queue.extend(records)

    def sync(self) -> int:
        """The host's sync point: post this replica's news, settle the exchange due.

        Every replica calls it the same number of times. Returns the keys
        this call poisoned here.

        Raises
        ------
        PeerLostError
            A replica died or hung (within ``step_timeout_s``).
        """
        if self._share is None:
            self._queue.clear()
            return 0
        new, self._queue = self._queue, []
        settled = self._share.exchange(self._syncs, new, wall_clock_ms())
        self._syncs += 1
        if settled is None or not settled.records:
            return 0
        # The union holds this replica's own keys too: poisoning them again
        # with their own record changes nothing.
        records = list(settled.records)
        self._kept.extend(records)
        self.received += len(records)
        for leader in self._targets:
            leader.carry_poison(records)
        logger.info("gramcoord: %d poisoned grammar keys shared by the replicas", len(records))
        return len(records)
