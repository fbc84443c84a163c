"""TP mask digests inside vLLM: every TP rank's bitmask rows proven identical.

Under ``external_launcher`` every TP rank runs its own scheduler and fills
its own grammar bitmask from its own grammar state. A difference (a host
bug, a nondeterministic grammar, a rank that missed a token) would be
silent until the outputs differ. ``MaskDigests`` runs right after
``Scheduler.get_grammar_bitmask`` on every TP rank, once per engine step
with structured rows:

- it digests each bitmask row (a row is one request's next-token mask, or
  one draft position's) and the step's rows together. A row's digest is
  the sum of its 64-bit words times fixed odd weights, modulo 2**64 (one
  vectorized product: about 0.04 ms for 16 rows of the 151,665-token
  vocabulary, a sixth of crc32's time): a change in any one word always
  changes it (an odd weight is invertible modulo 2**64), and several
  changes cancel with probability about 2**-64;
- ``rank_worker.session.tp_check.TpCheck`` posts every
  ``distributed.tp_check_steps`` steps' digests in one ``all_gather`` on the
  TP group's ``cpu_group`` without waiting, and settles the window posted
  before. Only after a mismatch does one more exchange name the first
  differing row;
- the mismatched request fails on every rank alike, at the same step, with
  ``tp_mask_mismatch`` and a message naming the step, the request, the
  position and the ranks (``failures.py`` carries it to the client and logs
  one line); the other requests run on.

Steps are the engine steps with structured rows: every TP rank has the
same (the agreement admits the same requests in the same step on every
rank), so every rank digests the same steps, and a step without grammar
requests costs nothing. A window is posted once it holds
``tp_check_steps`` such steps: a difference in a request's last steps is
found with the next structured requests (and logged, the request being
gone), and one in the last window before shutdown is not settled (no
collective runs at shutdown, where a peer may already be gone).
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any

import numpy as np

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.groups import HostGroup
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.session.tp_check import RowPosition, TpCheck, TpMismatch

__all__ = ["MaskDigests", "flip_one_bit", "row_digests"]

logger = logging.getLogger(__name__)


_SEED = 0x6772616D  # the same weights on every rank and every run
_weights: dict[int, np.ndarray] = {}


def row_digests(bitmask: np.ndarray) -> np.ndarray:
    """One uint64 digest per row of an int32 bitmask (see the module docstring)."""
    rows = np.ascontiguousarray(bitmask).view(np.uint32)
    if rows.shape[1] % 2 == 0:
        words = rows.view(np.uint64)
    else:  # an odd number of 32-bit words: widen them
        words = rows.astype(np.uint64)
    n = words.shape[1]
    w = _weights.get(n)
    if w is None:
        draw = np.random.default_rng(_SEED).integers(0, 1 << 63, size=n, dtype=np.uint64)
        w = _weights[n] = draw * np.uint64(2) + np.uint64(1)
    return words @ w


def flip_one_bit(bitmask: np.ndarray) -> int | None:
    """The fault: forbid one allowed token in the first row that allows two or more.

    Returns the row changed, or ``None`` when no row allows two tokens.
    """
    for i, row in enumerate(bitmask):
        words = row.view(np.uint32)
        if sum(int(w).bit_count() for w in words[np.flatnonzero(words)]) < 2:
            continue
        w = int(np.flatnonzero(words)[0])
        word = int(words[w])
        words[w] = word & (word - 1)  # clear the lowest allowed token
        return i
    return None


class MaskDigests:
    """One TP rank's digests of the bitmask rows it fills; see the module docstring.

    Parameters
    ----------
    group:
        vLLM's TP group's gloo ``cpu_group``.
    distributed:
        ``tp_check_steps`` (steps per posted window) and ``step_timeout_s``.
    max_rows:
        Most bitmask rows in one step (``max_num_seqs`` times one plus the
        drafts).
    flip_step:
        The ``faults.flip_mask_bit`` step at which this rank clears one allowed
        bit (``RankFaults.flip_step``); -1 for never.
    """

    def __init__(
        self, group: Any, distributed: DistributedConfig, max_rows: int, flip_step: int = -1
    ) -> None:
        comm = HostGroup(group, step_timeout_s=distributed.step_timeout_s, names=("tp",))
        self.rank = comm.rank
        self._check = TpCheck(comm, comm.rank, every=distributed.tp_check_steps, max_rows=max_rows)
        self._flip_step = flip_step
        self.steps = 0
        # Seconds spent digesting and posting (bench vllm reports the share of the step).
        self.seconds = 0.0
        self.mismatches: list[TpMismatch] = []
        # request id -> the error it failed with (the host reports it).
        self.failed: dict[str, tuple[ErrorCode, str]] = {}

    def observe(self, scheduler: Any, scheduler_output: Any, grammar_output: Any) -> None:
        """After ``get_grammar_bitmask``: digest this step's rows, settle a window's."""
        if grammar_output is None:  # no structured row this step, on any rank
            return
        start = time.perf_counter()
        step, self.steps = self.steps, self.steps + 1
        bitmask = grammar_output.grammar_bitmask
        if step == self._flip_step:
            row = flip_one_bit(bitmask)
            logger.warning("fault: TP rank %d flipped a mask bit in row %s", self.rank, row)
        digests = row_digests(bitmask)
        positions = self._positions(scheduler, scheduler_output, grammar_output, digests)
        found = self._check.add(step, zlib.crc32(digests), positions)
        if found is not None:
            self._fail(scheduler, found)
        self.seconds += time.perf_counter() - start

    @staticmethod
    def _positions(
        scheduler: Any, scheduler_output: Any, out: Any, digests: np.ndarray
    ) -> list[RowPosition]:
        """(request, output position, row digest) of each row, in the bitmask's order."""
        drafts = scheduler_output.scheduled_spec_decode_tokens
        rows: list[RowPosition] = []
        i = 0
        for rid in out.structured_output_request_ids:
            request = scheduler.requests.get(rid)
            at = request.num_output_tokens if request is not None else -1
            for j in range(len(drafts.get(rid, ())) + 1):
                if i >= len(digests):
                    break
                rows.append((rid, at + j, int(digests[i])))
                i += 1
        return rows

    def _fail(self, scheduler: Any, found: TpMismatch) -> None:
        """Fail the request whose rows differ, on every rank (each rank found the same)."""
        self.mismatches.append(found)
        message = found.describe(self._check.first)
        rid = found.request_id
        if rid in scheduler.requests:
            self.failed[rid] = (ErrorCode.tp_mask_mismatch, message)
            # vLLM finishes these with FINISHED_ERROR in update_from_output,
            # where failures.py gives the output its code and message and logs it.
            scheduler.grammar_compile_error_reqs.add(rid)
        else:
            logger.error("gramcoord: request %s (ended): tp_mask_mismatch: %s", rid, message)
