"""When a grammar is ready, agreed across SGLang's sync group (no SGLang import here).

SGLang's ``GrammarManager.get_ready_grammar_requests`` polls each queued
request's grammar ``Future``, all_gathers the pickled sets of *queue
indices* whose ``Future`` is done, and then calls ``Future.result()`` on the
intersection, in the same order on every rank of its sync group. The
``Future``\\s here are ours (``AgreedFuture``): ``done()`` means the local
compile finished (well or badly), and ``result()`` is where the ranks agree.
Its first call without a decision reports this rank's pending window in one
fixed-shape int64 ``all_gather`` on the gloo group (``pending_report``:
step, window length, fingerprint of the ordered (seq, key) pairs, wall
clock, then a state and a reason per pending request) and every rank
decides the same: ready = ready everywhere, failed = failed anywhere. So a
compile that fails on one rank fails the request on every rank, with the
same message, and a request is never admitted on one rank and aborted on
another.

Every rank reaches that collective, because SGLang calls ``result()`` only
after its own collective, on the same requests, in the same order, and a
decision (identical everywhere) is only ever computed there. No collective
runs while nothing is pending. Where SGLang's own sync pairs different
requests (queues that differ but are both non-empty), the fingerprints
differ: every rank fails all its pending requests with one message that
names the ranks and the first differing request (``AgreementDivergence``'s
text), so SGLang aborts them and no rank admits the wrong one. Where a rank's queue is empty, SGLang's ``has_waiting_grammars``
guard keeps it out of SGLang's own all_gather; that collective is SGLang's,
before any of ours, and ends only at the group's timeout (see
``backend``'s docstring for why supported setups never get there).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from gramcoord.coordinator.coordinator import wall_clock_ms
from gramcoord.coordinator.status import Decision, PendingState, decide_alone
from gramcoord.integrations.pending_report import PendingDivergence, gather_decision, slot_id
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.outcome import Outcome

__all__ = ["AgreedFuture", "Agreement", "AgreementDivergence"]

logger = logging.getLogger(__name__)


# The ranks of the sync group hold different pending requests.
AgreementDivergence = PendingDivergence

# Builds the host's grammar object: (request id, label given at submit).
BuildFn = Callable[[str, Any], Any]
# Builds the host's invalid-grammar object from an agreed message.
InvalidFn = Callable[[str], Any]


class AgreedFuture(Future):
    """A grammar ``Future`` whose value the ranks agree on in ``result()``."""

    def __init__(self, agreement: Agreement, seq: int) -> None:
        super().__init__()
        self._agreement = agreement
        self.seq = seq

    def done(self) -> bool:
        return super().done() or self._agreement.locally_done(self.seq)

    def result(self, timeout: float | None = None) -> Any:
        if not super().done():
            self._agreement.resolve(self.seq)
        return super().result(timeout)

    def cancel(self) -> bool:
        self._agreement.release(self.seq)
        return super().cancel()


class Agreement:
    """One rank's pending grammars and the decision taken at ``result()``.

    Parameters
    ----------
    manager:
        The rank's ``GrammarManager`` (validation, keys, caches, compile pool).
    build:
        Makes the host grammar object of an admitted request id.
    invalid:
        Makes the host's invalid-grammar object from a message.
    group:
        SGLang's sync group as a gloo process group; ``None`` decides alone.
    """

    def __init__(
        self, manager: GrammarManager, build: BuildFn, invalid: InvalidFn, group: Any = None
    ) -> None:
        self.manager = manager
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self._build = build
        self._invalid = invalid
        self._lock = threading.RLock()
        self._futures: dict[int, AgreedFuture] = {}
        self._keys: dict[int, bytes] = {}
        self._labels: dict[int, Any] = {}
        self._next = 0
        self._step = 0
        self.num_collectives = 0

    # -- arrival and end -------------------------------------------------------

    def submit(self, key: bytes, spec: dict[str, Any], label: Any = None) -> AgreedFuture:
        """Queue one request's compile under ``key`` (a digest of SGLang's key);
        ``label`` is handed to ``build``."""
        with self._lock:
            seq = self._next
            self._next += 1
            future = AgreedFuture(self, seq)
            outcome = self.manager.add(_rid(seq), spec, seq=seq)
            if outcome.status == "failed":  # identical on every rank: no agreement needed
                future.set_result(self._invalid(_message(outcome)))
            else:
                self._futures[seq] = future
                self._keys[seq] = key
                self._labels[seq] = label
            return future

    def release(self, seq: int) -> None:
        """SGLang cancelled the request's ``Future`` (abort, or its poll timeout)."""
        with self._lock:
            self._futures.pop(seq, None)
            self._keys.pop(seq, None)
            self._labels.pop(seq, None)
            self.manager.abort(_rid(seq))

    def locally_done(self, seq: int) -> bool:
        """Whether this rank's compile of ``seq`` finished (the decision may still wait)."""
        if seq not in self._futures:
            return True
        state = self.manager.state_of(_rid(seq))
        if state != "pending":
            return state != "waiting"
        with self._lock:
            status = self.manager.local_status()
        i = status.seqs.index(seq) if seq in status.seqs else -1
        return i < 0 or status.states[i] != PendingState.PENDING

    @property
    def num_pending(self) -> int:
        """Requests whose ``Future`` no decision resolved yet."""
        return len(self._futures)

    # -- the decision ----------------------------------------------------------

    def resolve(self, seq: int) -> None:
        """Decide until ``seq`` is decided; every rank runs the same rounds."""
        while True:
            with self._lock:
                if seq not in self._futures:
                    return
                self._round()
                if seq not in self._futures:
                    return
            # Decided nowhere yet (only if SGLang asked early): wait, never spin.
            self.manager.wait_pending(0.05)
            time.sleep(0.001)

    def _round(self) -> None:
        self._step += 1
        status = self.manager.local_status()
        clock = wall_clock_ms()
        if self.size == 1:
            decision = decide_alone(self._step, status, clock)
            failing: dict[int, tuple[int, ...]] = {}
        else:
            try:
                decision, failing = self._gather(status, clock)
            except PendingDivergence as exc:
                self._fail_all(f"{exc}; the pending requests are failed on every rank")
                return
        for outcome in self.manager.apply_decision(decision):
            self._settle(outcome, failing.get(outcome.seq, ()))

    def _fail_all(self, message: str) -> None:
        """Ranks disagree on what is pending: fail all of it here, so every
        rank's window is empty again and none admits a request another lacks."""
        logger.error("%s", message)
        for seq in list(self._futures):
            future = self._futures.pop(seq)
            self._keys.pop(seq, None)
            self._labels.pop(seq, None)
            self.manager.abort(_rid(seq))
            if not Future.done(future):
                future.set_result(self._invalid(message))

    def _gather(self, status: Any, clock: int) -> tuple[Decision, dict[int, tuple[int, ...]]]:
        decision, failing = gather_decision(
            self._step,
            status,
            clock,
            [slot_id(seq, self._keys.get(seq, b"")) for seq in status.seqs],
            width=self.manager.config.max_pending,
            group=self.group,
            size=self.size,
            where="SGLang's sync group",
        )
        self.num_collectives += 1
        return decision, failing

    def _settle(self, outcome: Outcome, failing: tuple[int, ...]) -> None:
        future = self._futures.pop(outcome.seq, None)
        self._keys.pop(outcome.seq, None)
        label = self._labels.pop(outcome.seq, None)
        if future is None or Future.done(future):
            return
        rid = outcome.request_id
        if outcome.status == "admitted":
            try:
                grammar = self._build(rid, label)
            except Exception as exc:  # building the matcher failed: this request only
                logger.exception("gramcoord: %s: building its grammar failed", rid)
                grammar = self._invalid(f"{ErrorCode.grammar_internal.name}: {exc}")
            finally:
                self.manager.finish(rid)  # the compiled grammar stays in the cache
            future.set_result(grammar)
            return
        if self.size > 1 and failing:
            # Only agreed facts, so every rank aborts with the same text.
            if self.rank in failing:
                logger.warning("gramcoord: %s failed here: %s", rid, outcome.message)
            code = outcome.code or ErrorCode.grammar_internal.name
            message = f"{code}: the grammar failed on rank(s) {list(failing)} of the sync group"
        else:
            message = _message(outcome)
        future.set_result(self._invalid(message))


def _rid(seq: int) -> str:
    return f"sglang-{seq}"


def _message(outcome: Outcome) -> str:
    return f"{outcome.code or ErrorCode.grammar_internal.name}: {outcome.message}"
