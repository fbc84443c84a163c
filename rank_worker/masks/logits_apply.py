"""TP-side apply: put bitmask rows on the right logit rows, then mask.

The bitmask arrives in *scheduling order of constrained requests*, with a
fixed ``rows_per_request = 1 + K`` rows each. The logits are in *batch
order of all requests*, and a request with ``d`` scheduled drafts owns
``1 + d`` consecutive logit rows starting at::

    logit_row(request) = batch_index + (drafts of every earlier request)

So for batch ``[a, b, c]`` with drafts ``{a: 2, c: 1}``, ``a`` owns logit
rows 0-2, ``b`` row 3 and ``c`` rows 4-5. If ``[c, a]`` are constrained,
bitmask rows ``c.0, c.1, a.0, a.1, a.2`` go to logit rows ``4, 5, 0, 1, 2``.

``plan_rows`` computes that mapping once per step (a loop over requests,
never over the vocabulary). The mask rows are then laid out at their logit
rows and ``xgrammar.apply_token_bitmask_inplace`` masks only those rows
(``indices``), or every row (``indices=None``) when all are constrained.

- CPU (``LogitsMasker`` with CPU logits): a reusable aligned buffer; rows written by the
  previous call and not by this one are reset, so nothing stale survives.
  Logits that are not float32 are masked through a float32 copy of their
  constrained rows and written back in their own dtype.
- CUDA (``apply_bitmask_cuda`` with a ``CudaMaskStaging``, which
  ``LogitsMasker`` uses for CUDA logits): mask rows and
  indices go through pinned host buffers with ``non_blocking`` copies,
  the alignment is an ``index_copy_`` on the device and the indices stay a
  device tensor, so the host never waits for the GPU.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch
import xgrammar as xgr


class RowPlan(NamedTuple):
    """Which bitmask row goes to which logit row.

    ``src``: bitmask rows, in bitmask order. ``dst``: the logit row of each.
    ``num_logit_rows``: rows of the logits tensor. ``all_rows``: every logit
    row is constrained, so ``indices=None``.
    """

    src: np.ndarray
    dst: np.ndarray
    num_logit_rows: int
    all_rows: bool

    @property
    def indices(self) -> list[int] | None:
        return None if self.all_rows else self.dst.tolist()


def plan_rows(
    batch: Sequence[Hashable],
    constrained: Sequence[Hashable],
    num_drafts: Mapping[Hashable, int],
    rows_per_request: int,
) -> RowPlan:
    """Map bitmask rows to logit rows for one step.

    Parameters
    ----------
    batch:
        Request ids in logit order (every scheduled request).
    constrained:
        Constrained request ids in bitmask order (a subset of ``batch``).
    num_drafts:
        Scheduled draft tokens per request id; missing ids have none.
    rows_per_request:
        Bitmask rows per constrained request (``1 + K``).

    Raises
    ------
    ValueError
        A constrained id not in the batch, a duplicate, or more drafts than
        the bitmask has rows for.
    """
    start: dict[Hashable, int] = {}
    offset = 0
    for index, rid in enumerate(batch):
        if rid in start:
            raise ValueError(f"request {rid!r} appears twice in the batch")
        start[rid] = index + offset
        offset += num_drafts.get(rid, 0)
    num_logit_rows = len(batch) + offset
    src: list[int] = []
    dst: list[int] = []
    seen: set[Hashable] = set()
    for j, rid in enumerate(constrained):
        if rid not in start:
            raise ValueError(f"constrained request {rid!r} is not in the batch")
        if rid in seen:
            raise ValueError(f"constrained request {rid!r} appears twice")
        seen.add(rid)
        n = 1 + num_drafts.get(rid, 0)
        if n > rows_per_request:
            raise ValueError(
                f"request {rid!r} has {n - 1} drafts; the bitmask holds {rows_per_request - 1}"
            )
        base = j * rows_per_request
        src.extend(range(base, base + n))
        dst.extend(range(start[rid], start[rid] + n))
    return RowPlan(
        src=np.asarray(src, dtype=np.int64),
        dst=np.asarray(dst, dtype=np.int64),
        num_logit_rows=num_logit_rows,
        all_rows=len(dst) == num_logit_rows,
    )


def _vocab_size(logits: torch.Tensor, width: int) -> int:
    vocab = logits.shape[-1]
    if vocab > width * 32:
        raise ValueError(
            f"logits have {vocab} columns but the bitmask covers {width * 32} tokens; build the "
            "bitmask for the model's (padded) vocabulary"
        )
    return vocab


class LogitsMasker:
    """Apply with a reusable aligned bitmask buffer (CPU), or staged (CUDA).

    CPU logits are masked through the aligned host buffer; CUDA logits go
    through ``apply_bitmask_cuda`` with a ``CudaMaskStaging`` made for their
    device at the first CUDA call (pinned host slots, ``non_blocking``
    copies, no host sync).

    Parameters
    ----------
    width:
        Bitmask words per row (``ceil(V / 32)``).
    max_rows:
        Most logit rows in one step (``max_num_seqs * (1 + K)``).
    """

    def __init__(self, width: int, max_rows: int) -> None:
        self.width = width
        self._aligned = np.full((max_rows, width), -1, dtype=np.int32)
        self._aligned_t = torch.from_numpy(self._aligned)
        self._written = np.zeros(0, dtype=np.int64)
        # CUDA logits: pinned staging per device, made at the first such call.
        self._staging: dict[torch.device, CudaMaskStaging] = {}

    @property
    def aligned(self) -> np.ndarray:
        """The aligned buffer (logit-row order); read-only use in tests."""
        return self._aligned

    def apply(self, logits: torch.Tensor, bitmask: np.ndarray, plan: RowPlan) -> None:
        """Mask ``logits`` in place.

        Raises
        ------
        ValueError
            Logits of the wrong shape or device, more rows than
            ``max_rows``, or a bitmask of the wrong dtype or width.
        """
        if logits.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"LogitsMasker masks CPU or CUDA logits; logits are on {logits.device}"
            )
        if logits.dim() != 2 or logits.shape[0] != plan.num_logit_rows:
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the plan's "
                f"{plan.num_logit_rows} rows"
            )
        if plan.num_logit_rows > self._aligned.shape[0]:
            raise ValueError(f"{plan.num_logit_rows} logit rows exceed max_rows")
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != self.width:
            raise ValueError(
                f"bitmask must be int32 [rows, {self.width}]; got {bitmask.dtype} "
                f"{tuple(bitmask.shape)}"
            )
        vocab = _vocab_size(logits, bitmask.shape[1])
        if logits.device.type == "cuda":
            apply_bitmask_cuda(logits, bitmask, plan, self._staging_for(logits.device))
            return
        # Reset what the previous step wrote, then lay this step's rows out.
        self._aligned[self._written] = -1
        self._aligned[plan.dst] = bitmask[plan.src]
        self._written = plan.dst
        if len(plan.dst) == 0:
            return
        if logits.dtype == torch.float32:
            aligned = self._aligned_t[: plan.num_logit_rows]
            xgr.apply_token_bitmask_inplace(logits, aligned, vocab_size=vocab, indices=plan.indices)
            return
        # Other dtypes: mask a float32 copy of the constrained rows and write
        # it back, so the caller's dtype (and any row we skip) is untouched.
        dst = torch.from_numpy(plan.dst)
        rows = logits.index_select(0, dst).float()
        xgr.apply_token_bitmask_inplace(
            rows, torch.from_numpy(bitmask[plan.src]), vocab_size=vocab, indices=None
        )
        logits.index_copy_(0, dst, rows.to(logits.dtype))

    def _staging_for(self, device: torch.device) -> CudaMaskStaging:
        staging = self._staging.get(device)
        if staging is None:
            staging = CudaMaskStaging(self.width, self._aligned.shape[0], device)
            self._staging[device] = staging
        return staging


class CudaMaskStaging:
    """Pinned host and device buffers for ``apply_bitmask_cuda``, reused.

    Two pinned slots alternate, each guarded by a CUDA event: a slot is
    rewritten only after the copy that last read it has finished. In steady
    state that copy finished a step ago, so the event query succeeds and the
    host never waits.
    """

    def __init__(self, width: int, max_rows: int, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        self.width = width
        self.max_rows = max_rows
        self._host_mask = [
            torch.empty((max_rows, width), dtype=torch.int32, pin_memory=True) for _ in range(2)
        ]
        self._host_index = [
            torch.empty(max_rows, dtype=torch.int64, pin_memory=True) for _ in range(2)
        ]
        self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._used = [False, False]
        self._slot = 0
        self.mask = torch.empty((max_rows, width), dtype=torch.int32, device=self.device)
        self.index = torch.empty(max_rows, dtype=torch.int64, device=self.device)
        self.aligned = torch.empty((max_rows, width), dtype=torch.int32, device=self.device)

    def next_slot(self) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        slot = self._slot
        self._slot ^= 1
        # query() never blocks; the wait only happens if the host is a whole
        # step ahead of the copy engine.
        if self._used[slot] and not self._events[slot].query():
            self._events[slot].synchronize()
        self._used[slot] = True
        return self._host_mask[slot], self._host_index[slot], self._events[slot]


def apply_bitmask_cuda(
    logits: torch.Tensor, bitmask: np.ndarray, plan: RowPlan, staging: CudaMaskStaging
) -> None:
    """Mask CUDA ``logits`` in place without a host sync.

    The constrained rows (``plan.src``) are gathered into a pinned buffer,
    copied with ``non_blocking=True`` together with their logit rows, and
    scattered on the device into an aligned buffer that starts at ``-1``.
    ``indices`` is that device tensor, or ``None`` when every row is
    constrained.
    """
    m = len(plan.dst)
    if m == 0:
        return
    if plan.num_logit_rows > staging.max_rows or logits.shape[0] != plan.num_logit_rows:
        raise ValueError(
            f"logits rows {logits.shape[0]} / plan rows {plan.num_logit_rows} exceed or "
            f"mismatch the staging's {staging.max_rows}"
        )
    vocab = _vocab_size(logits, bitmask.shape[1])
    host_mask, host_index, done = staging.next_slot()
    np.take(bitmask, plan.src, axis=0, out=host_mask.numpy()[:m])
    host_index.numpy()[:m] = plan.dst
    mask = staging.mask[:m]
    index = staging.index[:m]
    mask.copy_(host_mask[:m], non_blocking=True)
    index.copy_(host_index[:m], non_blocking=True)
    done.record()
    aligned = staging.aligned[: plan.num_logit_rows]
    if not plan.all_rows:
        aligned.fill_(-1)
    aligned.index_copy_(0, index, mask)
    xgr.apply_token_bitmask_inplace(
        logits, aligned, vocab_size=vocab, indices=None if plan.all_rows else index
    )
