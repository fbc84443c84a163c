"""The pending report the engine integrations gather once per decision (no host import).

Each rank of a host's sync group (vLLM's TP group under the external
launcher, SGLang's sync group) reports its pending window in one fixed-shape
int64 row, and every rank decides the same from the gathered rows
(docs/design.md, The agreement): ready = ready on every rank, failed =
failed on any. The row:

==========================  ===============================================
``[0:4]``                   decision round, window length, fingerprint of
                            the ordered slot ids, wall clock (ms)
``[4 : 4+W]``               ``PendingState`` per pending request
``[4+W : 4+2W]``            failure reason per pending request
``[4+2W : 4+3W]``           slot id per pending request (its sequence
                            number, and key where the host has one, hashed)
==========================  ===============================================

``W`` is ``max_pending``. Ranks whose (round, length, fingerprint) differ
hold different pending requests: ``gather_decision`` raises
``PendingDivergence`` naming them and the first differing request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gramcoord.coordinator.status import Decision, PendingState

__all__ = ["PendingDivergence", "gather_decision", "slot_id"]

_HEAD = 4
_MASK = 0x7FFF_FFFF_FFFF_FFFF


class PendingDivergence(RuntimeError):
    """The ranks of the sync group hold different pending requests."""


def slot_id(seq: int, key: bytes = b"") -> int:
    """One int64 for a pending request: its sequence number and key, hashed."""
    h = hashlib.blake2b(seq.to_bytes(8, "little") + key, digest_size=8)
    return int.from_bytes(h.digest(), "little") & _MASK


def _fingerprint(slots: Sequence[int]) -> int:
    h = hashlib.blake2b(np.asarray(slots, dtype=np.int64).tobytes(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & _MASK


def gather_decision(
    round_no: int,
    status: Any,
    clock_ms: int,
    slots: Sequence[int],
    *,
    width: int,
    group: Any,
    size: int,
    where: str,
) -> tuple[Decision, dict[int, tuple[int, ...]]]:
    """All-gather this rank's ``status`` (a ``LocalStatus``) and decide.

    Returns the decision and, per failed sequence number, the group ranks on
    which it failed. ``where`` names the group in a divergence message.
    """
    n = len(status.seqs)
    row = np.zeros(_HEAD + 3 * width, dtype=np.int64)
    row[:_HEAD] = (round_no, n, _fingerprint(slots), clock_ms)
    row[_HEAD : _HEAD + n] = status.states
    row[_HEAD + width : _HEAD + width + n] = status.reasons
    row[_HEAD + 2 * width : _HEAD + 2 * width + n] = slots
    mine = torch.from_numpy(row)
    rows = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(rows, mine, group=group)
    got = torch.stack(rows).numpy()
    odd = [r for r in range(size) if (got[r, :3] != got[0, :3]).any()]
    if odd:
        ids = got[:, _HEAD + 2 * width :]
        lengths = got[:, 1]
        first = next(
            (i for i in range(width) if (ids[:, i] != ids[0, i]).any()), int(lengths.min())
        )
        raise PendingDivergence(
            f"gramcoord: grammar agreement {round_no}: ranks {odd} of {where} report "
            f"(round, pending, fingerprint) {got[odd[0], :3].tolist()} but rank 0 reports "
            f"{got[0, :3].tolist()}; the first differing pending request is number {first} "
            f"(pending per rank: {lengths.tolist()}). Every rank of the group must receive "
            "the same constrained requests in the same order"
        )
    states = got[:, _HEAD : _HEAD + n]
    reasons = got[:, _HEAD + width : _HEAD + width + n]
    ready, failed, failing = [], [], {}
    for i, seq in enumerate(status.seqs):
        bad = tuple(int(r) for r in np.flatnonzero(states[:, i] == PendingState.FAILED))
        if bad:
            failed.append((seq, int(reasons[bad[0], i])))
            failing[seq] = bad
        elif (states[:, i] == PendingState.READY).all():
            ready.append(seq)
    decision = Decision(
        step=round_no, ready=tuple(ready), failed=tuple(failed), clock_ms=int(got[:, 3].max())
    )
    return decision, failing
