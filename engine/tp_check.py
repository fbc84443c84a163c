"""The TP determinism check: every TP rank of the last stage sampled and masked alike.

Every TP rank keeps ``[step, hash(picks), step digest]`` per step and,
every ``distributed.tp_check_steps`` steps, posts the window in one
``all_gather`` on the stage's ``tp`` group without waiting; the window
posted before is settled then. A rank never waits on its peers here unless
it runs a window ahead, and a difference is reported within two windows as
a ``DeterminismError`` naming the first step and row that differed (one
more exchange, only after a mismatch, finds the row).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gramcoord.coordinator.comm import Comm
from gramcoord.rank_worker.errors import DeterminismError

# (request, output position, digest) of one digested row.
RowPosition = tuple[str, int, int]


class TpCheck:
    """The windowed cross-check of one last-stage TP rank.

    Parameters
    ----------
    comm:
        The runtime (the ``tp`` group is the stage's TP ranks).
    rank:
        This rank (labels errors).
    every:
        Steps per posted window (``distributed.tp_check_steps``).
    max_rows:
        Most digested rows in one step (sizes the row exchange).
    """

    def __init__(self, comm: Comm, rank: int, *, every: int, max_rows: int) -> None:
        self._comm = comm
        self.rank = rank
        self._every = every
        self._max_rows = max_rows
        self._rows: list[tuple[int, int, int]] = []
        self._positions: list[list[RowPosition]] = []
        self._pending = None

    def add(
        self, step: int, picks: Sequence[int], step_digest: int, positions: list[RowPosition]
    ) -> None:
        """Add one step; post the window once it holds ``every`` steps."""
        h = hash(tuple(picks)) & 0x7FFFFFFFFFFFFFFF
        self._rows.append((step, h, step_digest))
        self._positions.append(positions)
        if len(self._rows) >= self._every:
            self._post()

    def settle(self) -> None:
        """Post what is left of the window and wait for it (after the last step).

        Raises
        ------
        DeterminismError
            A TP rank sampled or masked differently.
        """
        if self._rows:
            self._post()
        self._settle_posted()

    def _post(self) -> None:
        self._settle_posted()
        rows, self._rows = self._rows, []
        positions, self._positions = self._positions, []
        flat = np.array(rows, dtype=np.int64).reshape(-1)
        pending = self._comm.all_gather_start(
            "tp", flat, operation="tp sample check", step=rows[-1][0]
        )
        self._pending = (pending, rows, positions)

    def _settle_posted(self) -> None:
        if self._pending is None:
            return
        (pending, rows, positions), self._pending = self._pending, None
        got = pending.wait()
        if (got == got[0]).all():
            return
        per_step = got.reshape(len(got), len(rows), 3)
        i = int(np.flatnonzero((per_step != per_step[0]).any(axis=(0, 2)))[0])
        step = rows[i][0]
        ranks = self._comm.members("tp")
        odd = tuple(r for r, g in zip(ranks, per_step[:, i]) if not (g == per_step[0, i]).all())
        rid, pos = self._first_difference(step, positions[i])
        raise DeterminismError(
            f"[rank {self.rank}] step {step}: TP ranks {list(odd)} sampled or "
            f"masked differently from rank {ranks[0]}; first differing row: request {rid!r}, "
            f"position {pos}",
            ranks=odd,
            request_id=rid,
            position=pos,
        )

    def _first_difference(self, step: int, rows: list[RowPosition]) -> tuple[str, int]:
        """Only after a mismatch: exchange the rows' digests to name the first that differs."""
        flat = np.zeros(self._max_rows, np.int64)
        flat[: len(rows)] = [d for _, _, d in rows]
        got = self._comm.all_gather("tp", flat, operation="tp digest exchange", step=step)
        for j, (rid, pos, _) in enumerate(rows):
            if not (got[:, j] == got[0, j]).all():
                return rid, pos
        return ("<sampled tokens>", -1)
