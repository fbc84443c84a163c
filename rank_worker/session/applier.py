"""Apply a step's bitmask rows to its logits, and digest what was applied.

One ``MaskApplier`` per rank that masks logits: the last stage's leader
applies the rows it built, each TP worker the rows it received. Both go
through this class, so every rank aligns, applies and digests identically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gramcoord.rank_worker.masks.logits_apply import LogitsMasker, RowPlan, plan_rows
from gramcoord.rank_worker.session.digest import MaskDigests, combine, row_digest


class MaskApplier:
    """Align, apply and digest bitmask rows for one step at a time.

    Parameters
    ----------
    width:
        Words per bitmask row, ``ceil(V / 32)``.
    max_num_seqs:
        Most requests in a step.
    num_speculative_tokens:
        K; each constrained request owns ``K + 1`` bitmask rows.
    """

    def __init__(self, width: int, *, max_num_seqs: int, num_speculative_tokens: int) -> None:
        self.rows_per_request = num_speculative_tokens + 1
        self.masker = LogitsMasker(width, max_num_seqs * self.rows_per_request)
        self.digests = MaskDigests()

    def plan(
        self,
        batch: Sequence[str],
        constrained: Sequence[str],
        num_drafts: Mapping[str, int],
    ) -> RowPlan:
        """Which bitmask row goes to which logit row this step (``plan_rows``)."""
        return plan_rows(batch, constrained, num_drafts, self.rows_per_request)

    def apply(
        self,
        logits: torch.Tensor,
        bitmask: np.ndarray,
        *,
        batch: Sequence[str],
        constrained: Sequence[str],
        num_drafts: Mapping[str, int],
    ) -> tuple[int, dict[str, tuple[int, ...]]]:
        """Mask ``logits`` in place and digest every applied row.

        Parameters
        ----------
        logits:
            ``[rows, V]``: one row per request plus one per draft, in
            ``batch`` order.
        bitmask:
            int32 rows, ``K + 1`` per constrained request in ``constrained``
            order (only the first ``1 + drafts`` of each are applied).

        Returns
        -------
        step_digest:
            Order-sensitive digest of every row applied this step (ranks
            that applied the same rows agree on it).
        row_digests:
            Per constrained request, the digests of its applied rows; pass
            the accepted ones to :meth:`commit`.
        """
        plan = self.plan(batch, constrained, num_drafts)
        self.masker.apply(logits, bitmask, plan)
        rpr = self.rows_per_request
        per_request: dict[str, tuple[int, ...]] = {}
        for j, rid in enumerate(constrained):
            n = 1 + num_drafts.get(rid, 0)
            per_request[rid] = tuple(row_digest(r) for r in bitmask[j * rpr : j * rpr + n])
        self.digests.steps += 1
        return combine(d for rid in constrained for d in per_request[rid]), per_request

    def commit(self, request_id: str, position: int, digests: Sequence[int]) -> None:
        """Record the rows whose draft prefix was accepted, from ``position``.

        Row ``i`` masks output position ``position + i`` only if drafts
        ``0..i-1`` were accepted, so a step commits rows ``0..accepted``:
        then K > 0 records exactly the digests a K = 0 run records.
        """
        for i, d in enumerate(digests):
            self.digests.record(request_id, position + i, d)


class AppliesRows:
    """The row calls of every role that masks logits (last-stage ranks).

    The roles hold a ``MaskApplier`` as ``_applier`` and the session's
    counters as ``_stats``; through these calls every last-stage rank aligns,
    applies, digests and forgets rows alike.
    """

    _applier: MaskApplier
    _stats: Any

    def apply(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        *,
        batch: Sequence[str],
        constrained: Sequence[str],
        num_drafts: Mapping[str, int],
    ) -> tuple[int, dict[str, tuple[int, ...]]]:
        """Mask ``logits`` in place with ``rows``; see ``MaskApplier.apply``."""
        out = self._applier.apply(
            logits, rows, batch=batch, constrained=constrained, num_drafts=num_drafts
        )
        self._stats.rows_applied += sum(1 + num_drafts.get(r, 0) for r in constrained)
        return out

    def commit(self, request_id: str, position: int, digests: Sequence[int]) -> None:
        """Record the digests of the rows whose drafts were accepted (``MaskApplier.commit``)."""
        self._applier.commit(request_id, position, digests)

    def truncate(self, request_id: str, length: int) -> None:
        """Forget the digests of ``request_id`` from output position ``length`` on.

        After retokenization replaced output tokens: those positions are
        masked again from the new tokens, on every rank alike.
        """
        self._applier.digests.truncate(request_id, length)

    @property
    def digests(self) -> MaskDigests:
        """Every row digest this rank committed (read it after the run)."""
        return self._applier.digests
