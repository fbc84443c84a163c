"""Two-level agreement: inside each host first, then one leader per host.

With ``distributed.agreement_levels: host`` an agreement group that spans
several hosts runs each step's collective in three rounds instead of one:

1. inside each host, the members send their report row to the host's leader
   (its first member in group order) -- one ``gather`` on the host group;
2. the leaders run the flat collective among themselves: an ``all_gather``
   of their host's rows, or an ``all_reduce`` of the host's partial report
   (the leader folds its host's rows with the same bitwise op first);
3. each leader broadcasts the result back inside its host.

The result is the array the flat collective returns -- the same rows in
group order, or the same reduced row -- so ``Agreement`` encodes, combines
and decides exactly as it does flat, and every decision is identical.

Why: the flat exchange sends ``members x (members - 1)`` messages per step,
most of them across hosts; two levels send ``2 (members - hosts)`` inside
hosts plus ``hosts x (hosts - 1)`` across, for two extra rounds. What that
cost on simulated hosts is in docs/scaling.md.

Failures: each round is one runtime call with its own deadline, so every
survivor still raises ``PeerLostError`` within the step timeout. Only the
lost rank's host-mates name it, though: elsewhere the loss shows as its
host's leader (or the own host's leader) leaving, and the roll call names
that leader or no one (``tests/coordinator/test_two_level.py``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from gramcoord.coordinator.comm import Comm
from gramcoord.coordinator.layout import HostLevels

HOST_GROUP = "agreement_host"
LEADER_GROUP = "agreement_leaders"

_FOLD = {"band": np.bitwise_and.reduce, "max": np.maximum.reduce}


class TwoLevel:
    """One rank's two-level gather and reduce for its agreement group.

    Parameters
    ----------
    comm:
        The runtime, built with ``agreement_levels: host`` so that it holds
        the ``agreement_host`` and ``agreement_leaders`` groups.
    levels:
        This rank's agreement group split by host
        (``ParallelLayout.host_levels``).
    """

    def __init__(self, comm: Comm, levels: HostLevels) -> None:
        rank = comm.rank
        assert rank in levels.group, f"rank {rank} is not in {levels.group}"
        self._comm = comm
        self.levels = levels
        block = levels.block_of(rank)
        self.leader = block[0]
        self.is_leader = rank == self.leader
        self._alone = len(block) == 1  # no host group: rounds 1 and 3 are skipped
        self._widest = max(len(b) for b in levels.blocks)
        host_order = [r for b in levels.blocks for r in b]
        # rows in host order -> rows in group order
        self._to_group = np.array([host_order.index(r) for r in levels.group])
        self._identity = host_order == list(levels.group)
        self._out: dict[tuple[int, int], np.ndarray] = {}

    def _buffer(self, shape: tuple[int, int]) -> np.ndarray:
        # Reused across steps, like the runtime's: valid until the next call.
        buf = self._out.get(shape)
        if buf is None:
            buf = self._out[shape] = np.empty(shape, dtype=np.int64)
        return buf

    def _host_rows(self, row: np.ndarray, operation: str, step: int) -> np.ndarray | None:
        """Round 1: this host's rows on the leader (None on the other members)."""
        if self._alone:
            return row.reshape(1, -1)
        return self._comm.gather(HOST_GROUP, row, self.leader, operation=operation, step=step)

    def all_gather(self, row: np.ndarray, *, operation: str, step: int) -> np.ndarray:
        """Every member's ``row`` as int64[members, len(row)] in group order (the flat result)."""
        n = row.size
        rows = self._buffer((len(self.levels.group), n))
        host = self._host_rows(row, operation, step)
        if self.is_leader:
            assert host is not None
            # Round 2: hosts may hold different counts; pad to the widest.
            block = np.zeros(self._widest * n, dtype=np.int64)
            block[: host.size] = host.ravel()
            every = self._comm.all_gather(LEADER_GROUP, block, operation=operation, step=step)
            at = 0
            for i, b in enumerate(self.levels.blocks):
                rows[at : at + len(b)] = every[i, : len(b) * n].reshape(len(b), n)
                at += len(b)
        if not self._alone:  # round 3
            self._comm.broadcast(HOST_GROUP, rows, self.leader, operation=operation, step=step)
        return rows if self._identity else rows[self._to_group]

    def all_reduce(
        self, row: np.ndarray, op: Literal["band", "max"], *, operation: str, step: int
    ) -> np.ndarray:
        """The element-wise ``op`` of every member's ``row`` (the flat result)."""
        out = self._buffer((1, row.size))[0]
        host = self._host_rows(row, operation, step)
        if self.is_leader:
            assert host is not None
            partial = _FOLD[op](host, axis=0)
            out[:] = self._comm.all_reduce(
                LEADER_GROUP, partial, op, operation=operation, step=step
            )
        if not self._alone:
            self._comm.broadcast(HOST_GROUP, out, self.leader, operation=operation, step=step)
        return out
