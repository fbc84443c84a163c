"""The TP check: every TP rank masked (and sampled) alike, proven by digests.

Each TP rank that applies masks keeps ``[step, hash(picks), step digest]``
per step and, every ``every`` steps, posts the window in one ``all_gather``
on its TP group without waiting; the window posted before is settled then.
A rank never waits on its peers here unless it runs a window ahead, and a
difference is found within two windows. Only after a mismatch, one more
exchange of the step's row digests names the first request and position
that differ, on every rank alike.

Two hosts use it: gramcoord's engine (``engine.model_runner``: a mismatch
ends the run with a ``DeterminismError``) and the vLLM plugin under
``external_launcher`` (every TP rank fills its own rows: the mismatched
request fails on every rank, the others run on). ``add`` and ``settle``
return the ``TpMismatch`` they found; the host decides what it costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from gramcoord.coordinator.comm import Comm

# (request, output position, digest) of one digested row.
RowPosition = tuple[str, int, int]
_MASK63 = 0x7FFFFFFFFFFFFFFF


class TpMismatch(NamedTuple):
    """What the TP check found: identical on every rank of the group."""

    step: int
    # The ranks whose step differs from the group's first member.
    ranks: tuple[int, ...]
    # The first differing row's request and output position; ("<sampled
    # tokens>", -1) when the rows match and the sampled tokens differ.
    request_id: str
    position: int

    def describe(self, first: int) -> str:
        """One line naming the step, the ranks and the row."""
        return (
            f"step {self.step}: TP ranks {list(self.ranks)} masked or sampled differently "
            f"from rank {first}; first differing row: request {self.request_id!r}, "
            f"position {self.position}"
        )


class TpCheck:
    """The windowed cross-check of one TP rank; see the module docstring.

    Parameters
    ----------
    comm:
        The runtime, or a host's ``HostGroup``, with the group ``group``.
    rank:
        This rank (labels errors).
    every:
        Steps per posted window (``distributed.tp_check_steps``).
    max_rows:
        Most digested rows in one step (sizes the row exchange).
    group:
        The group's name in ``comm``.
    """

    def __init__(
        self, comm: Comm, rank: int, *, every: int, max_rows: int, group: str = "tp"
    ) -> None:
        self._comm = comm
        self.rank = rank
        self._every = every
        self._max_rows = max_rows
        self._group = group
        self._rows: list[tuple[int, int, int]] = []
        self._positions: list[list[RowPosition]] = []
        self._pending = None

    @property
    def first(self) -> int:
        """The group's first member (a mismatch names the ranks that differ from it)."""
        return self._comm.members(self._group)[0]

    def add(
        self,
        step: int,
        step_digest: int,
        positions: list[RowPosition],
        picks: Sequence[int] = (),
    ) -> TpMismatch | None:
        """Add one step; post the window once it holds ``every`` steps.

        Returns the mismatch of the window settled meanwhile, if any.
        """
        h = hash(tuple(picks)) & _MASK63
        self._rows.append((step, h, step_digest & _MASK63))
        self._positions.append(positions)
        if len(self._rows) >= self._every:
            return self._post()
        return None

    def settle(self) -> TpMismatch | None:
        """Post what is left of the window and wait for it (after the last step)."""
        found = self._post() if self._rows else None
        return found or self._settle_posted()

    def _post(self) -> TpMismatch | None:
        found = self._settle_posted()
        rows, self._rows = self._rows, []
        positions, self._positions = self._positions, []
        flat = np.array(rows, dtype=np.int64).reshape(-1)
        pending = self._comm.all_gather_start(
            self._group, flat, operation="tp sample check", step=rows[-1][0]
        )
        self._pending = (pending, rows, positions)
        return found

    def _settle_posted(self) -> TpMismatch | None:
        if self._pending is None:
            return None
        (pending, rows, positions), self._pending = self._pending, None
        got = pending.wait()
        if (got == got[0]).all():
            return None
        per_step = got.reshape(len(got), len(rows), 3)
        i = int(np.flatnonzero((per_step != per_step[0]).any(axis=(0, 2)))[0])
        step = rows[i][0]
        ranks = self._comm.members(self._group)
        odd = tuple(r for r, g in zip(ranks, per_step[:, i]) if not (g == per_step[0, i]).all())
        rid, pos = self._first_difference(step, positions[i])
        return TpMismatch(step, odd, rid, pos)

    def _first_difference(self, step: int, rows: list[RowPosition]) -> tuple[str, int]:
        """Only after a mismatch: exchange the rows' digests to name the first that differs."""
        flat = np.zeros(self._max_rows, np.int64)
        flat[: len(rows)] = [d & _MASK63 for _, _, d in rows[: self._max_rows]]
        got = self._comm.all_gather(self._group, flat, operation="tp digest exchange", step=step)
        for j, (rid, pos, _) in enumerate(rows[: self._max_rows]):
            if not (got[:, j] == got[0, j]).all():
                return rid, pos
        return ("<sampled tokens>", -1)
