"""The per-engine-step agreement of gramcoord inside vLLM (no vLLM import here).

vLLM promotes a request that waits for its grammar as soon as the grammar
``Future`` is done. Here that ``Future`` is ours, and only ``step`` resolves
it: every rank that runs a scheduler over the same request stream (vLLM's
TP group under ``external_launcher``) reports its pending window in one
fixed-shape int64 ``all_gather`` on a gloo group, and the ranks decide
together (ready = intersection, failed = union; docs/design.md, The
agreement). So every
rank promotes or fails the same request in the same ``schedule()`` call and
compiles stay asynchronous.

``step`` costs nothing while no request is pending (no collective: the
pending set is identical on every rank, since every rank adds the same
requests between the same steps, which vLLM's external launcher requires
anyway). ``wait`` blocks briefly on the compile pool, so an engine loop
whose only requests wait for grammars sleeps instead of spinning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from gramcoord.coordinator.coordinator import wall_clock_ms
from gramcoord.coordinator.status import Decision, decide_alone
from gramcoord.integrations.pending_report import PendingDivergence, gather_decision, slot_id
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.outcome import Outcome

__all__ = ["Agreement", "AgreementDivergence", "GrammarInitError"]

logger = logging.getLogger(__name__)


class GrammarInitError(RuntimeError):
    """Why a request's grammar will never be ready; the same text on every rank."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"gramcoord: request {request_id!r}: {code}: {message}")
        self.request_id = request_id
        self.code = code


# The ranks of the agreement group hold different pending requests.
AgreementDivergence = PendingDivergence


# Builds the host's grammar object for an admitted request (runs under the lock).
AdmitFn = Callable[[str], Any]


class Agreement:
    """One rank's pending grammars, their ``Future``\\s, and the per-step decision.

    Parameters
    ----------
    manager:
        The rank's ``GrammarManager`` (validation, keys, caches, compile pool).
    group:
        The gloo group of ranks with schedulers over the same request stream;
        ``None`` (or a group of one) decides alone.
    """

    def __init__(self, manager: GrammarManager, group: Any | None = None) -> None:
        self.manager = manager
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}
        self._admit: dict[str, AdmitFn] = {}
        self._step = 0
        self.num_collectives = 0

    # -- arrival and end -------------------------------------------------------

    def submit(self, request_id: str, spec: dict[str, Any], admit: AdmitFn) -> Future:
        """Queue one request's compile; its ``Future`` resolves only in ``step``.

        A spec the manager refuses at once (identically on every rank) gets its
        error on the spot; vLLM then fails the request at its next schedule.
        """
        future: Future = Future()
        with self._lock:
            outcome = self.manager.add(request_id, spec)
            if outcome.status == "failed":
                future.set_exception(self._error(outcome, ()))
            else:
                self._futures[request_id] = future
                self._admit[request_id] = admit
        return future

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed): drop all its state."""
        with self._lock:
            self._admit.pop(request_id, None)
            future = self._futures.pop(request_id, None)
            if future is not None and not future.done():
                future.cancel()
            self.manager.abort(request_id)

    @property
    def num_undecided(self) -> int:
        """Requests whose ``Future`` no decision resolved yet."""
        return len(self._futures)

    @property
    def num_live(self) -> int:
        """Every request still held here (undecided or running); 0 when idle."""
        with self._lock:
            return max(len(self._futures), self.manager.num_live)

    # -- the per-step decision -------------------------------------------------

    def wait(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s`` on the oldest pending compile (never spins)."""
        if self._futures:
            self.manager.wait_pending(timeout_s)

    def step(self) -> int:
        """Agree on this engine step's admissions; returns the requests decided."""
        if not self._futures:
            return 0
        with self._lock:
            self._step += 1
            status = self.manager.local_status()
            clock = wall_clock_ms()
            if self.size == 1:
                decision = decide_alone(self._step, status, clock)
                failing: dict[int, tuple[int, ...]] = {}
            else:
                decision, failing = self._gather(status, clock)
            outcomes = self.manager.apply_decision(decision)
            for o in outcomes:
                self._resolve(o, failing.get(o.seq, ()))
            return len(outcomes)

    def _gather(self, status: Any, clock: int) -> tuple[Decision, dict[int, tuple[int, ...]]]:
        decision, failing = gather_decision(
            self._step,
            status,
            clock,
            [slot_id(seq, self.manager.pending_key(seq)) for seq in status.seqs],
            width=self.manager.config.max_pending,
            group=self.group,
            size=self.size,
            where="vLLM's agreement group",
        )
        self.num_collectives += 1
        return decision, failing

    def _resolve(self, outcome: Outcome, failing: tuple[int, ...]) -> None:
        rid = outcome.request_id
        future = self._futures.pop(rid, None)
        admit = self._admit.pop(rid, None)
        if future is None or future.done():
            return
        if outcome.status == "admitted" and admit is not None:
            try:
                future.set_result(admit(rid))
            except Exception as exc:  # building the matcher failed: this request only
                logger.exception("gramcoord: request %s: building its grammar failed", rid)
                future.set_exception(exc)
        else:
            future.set_exception(self._error(outcome, failing))

    def _error(self, outcome: Outcome, failing: tuple[int, ...]) -> GrammarInitError:
        code = outcome.code or ErrorCode.grammar_internal.name
        if self.size == 1 or not failing:
            return GrammarInitError(outcome.request_id, code, outcome.message)
        # Only agreed facts, so every rank raises the same text; the rank
        # that failed logs its own message.
        if self.rank in failing:
            logger.warning("gramcoord: request %s failed here: %s", outcome.request_id, outcome)
        return GrammarInitError(
            outcome.request_id,
            code,
            f"the grammar failed on rank(s) {list(failing)} of the agreement group",
        )
