"""One rank's grammar manager: validate, key, look up, compile, admit.

Requests flow through three places:

- the **waiting** queue, when the pending window (``grammar.max_pending``)
  is full; nothing is dropped;
- the **pending window**, in sequence order, each request either a cache
  hit (ready), a compile job (its own or one it joined), or failed;
- **running**, once a decision admitted it; it owns a matcher factory on
  the shared ``CompiledGrammar``.

Immediate verdicts that are identical on every rank (a spec that fails
validation, a poisoned key) never enter the window. Everything else waits
for a ``Decision``: from the coordinator in multi-rank runs, or from
``decide_locally`` on one rank. Caches change only inside
``apply_decision`` and ``apply_poison``, so ranks that apply the same
decisions hold the same caches.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import xgrammar as xgr

from gramcoord.coordinator.coordinator import wall_clock_ms
from gramcoord.coordinator.status import (
    Decision,
    LocalStatus,
    PendingState,
    PoisonRecord,
    decide_alone,
)
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError
from gramcoord.rank_worker.grammars.caches import CompileCache, PoisonCache, PoisonKind
from gramcoord.rank_worker.grammars.compile_service import (
    CompileFn,
    CompileJob,
    CompileService,
    XGrammarBackend,
)
from gramcoord.rank_worker.grammars.outcome import (
    CacheStatus,
    ManagerStats,
    Outcome,
    refuse_id,
    refuse_seq,
)
from gramcoord.rank_worker.grammars.spec import GrammarSpec, TokenBudget, admit
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The follower wait is capped at this share of the step timeout (see
# ``stage_wait_s``).
STAGE_WAIT_SHARE = 0.5

_POISON_KIND = {
    int(ErrorCode.grammar_invalid): PoisonKind.INVALID,
    int(ErrorCode.grammar_timeout): PoisonKind.TIMEOUT,
}


def stage_wait_s(compile_timeout_s: float, step_timeout_s: float) -> float:
    """How long a rank that follows a decision waits for its own compiles, per step.

    A later pipeline stage and a ``fill`` TP follower both wait up to the
    compile timeout, capped at ``STAGE_WAIT_SHARE`` of the step timeout. A
    gloo send completes only once its receiver has posted the receive, so a
    follower that waits holds the decider back by as long: the decider must
    never take a waiting follower for a lost one.
    """
    return min(compile_timeout_s, step_timeout_s * STAGE_WAIT_SHARE)


@dataclass(eq=False)
class _Entry:
    seq: int
    request_id: str
    spec: GrammarSpec
    cache: CacheStatus
    compiled: Any = None
    job: CompileJob | None = None
    warnings: tuple[str, ...] = ()
    compile_ms: float = 0.0


class GrammarManager:
    """Per-rank grammar lifecycle; see the module docstring.

    Parameters
    ----------
    config:
        The ``grammar`` config section.
    tokenizer:
        The loaded vocabulary (part of every key).
    compile_fn:
        Override the xgrammar backend (tests inject slow or failing ones).
    clock:
        Monotonic seconds for compile deadlines.
    """

    def __init__(
        self,
        config: GrammarConfig,
        tokenizer: Tokenizer,
        *,
        compile_fn: CompileFn | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        backend = compile_fn or XGrammarBackend(
            tokenizer, cache_limit_bytes=int(config.cache_limit_mb * 2**20)
        )
        self.service = CompileService(config, backend, clock=clock)
        self.cache = CompileCache(
            max_bytes=int(config.cache_limit_mb * 2**20), max_entries=config.num_cache_entries
        )
        self.poison = PoisonCache(
            max_entries=config.num_poison_entries, ttl_ms=int(config.poison_ttl_s * 1e3)
        )
        self._pending: dict[int, _Entry] = {}
        self._waiting: deque[_Entry] = deque()
        self._running: dict[str, _Entry] = {}
        self._seq_of: dict[str, int] = {}
        self._deferred: list[Outcome] = []
        self._new_failures: list[PoisonRecord] = []
        self._next_seq = 0
        # Agreed wall clock (ms): the latest decision's. Poison TTLs are
        # judged against it, never against this rank's own clock.
        self.agreed_ms = 0
        self.stats = ManagerStats()
        # Set by follow(): this manager applies decisions made elsewhere.
        self.follow_wait_s: float | None = None

    def follow(self, wait_s: float) -> None:
        """Apply decisions made elsewhere from now on (later stages, ``fill`` followers).

        ``apply_decision`` then waits up to ``wait_s`` per decision for local
        compiles of the requests it admits (one deadline; past it a request
        fails with ``grammar_stage_timeout``), and the failures it records
        are not queued for sharing: the rank that decided shares them.
        """
        self.follow_wait_s = wait_s

    # -- admission --------------------------------------------------------

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add(
        self, request_id: str, spec: Any, *, seq: int | None = None, max_tokens: int | None = None
    ) -> Outcome:
        """Validate, key and look up one request, then submit its compile.

        Never raises for bad input: a rejected spec or a poisoned key comes
        back as a ``failed`` outcome with a code. With ``max_tokens``, a
        grammar whose shortest output needs more tokens fails with
        ``grammar_unreachable_end`` (``grammars.shortest``).
        """
        if seq is None:
            seq = self._next_seq
        refused = refuse_seq(request_id, seq, next_seq=self._next_seq)
        if refused is not None:
            return refused
        self._next_seq = seq + 1
        refused = refuse_id(request_id, seq, live=self._seq_of)
        if refused is not None:
            return refused
        # Hosts that pass only a vocabulary's name never give a budget.
        budget = (
            None if max_tokens is None else TokenBudget(max_tokens, self.tokenizer.max_token_bytes)
        )
        try:
            gspec, why = admit(spec, self.config, vocab=self.tokenizer.name, budget=budget)
        except SpecError as exc:
            self.stats.invalid_spec += 1
            return Outcome(
                request_id=request_id,
                seq=seq,
                status="failed",
                code=exc.code.name,
                message=exc.message,
            )
        entry = _Entry(seq, request_id, gspec, "none", warnings=gspec.warnings)
        if why is not None:
            code = ErrorCode.grammar_unreachable_end.name
            return self._outcome(entry, "failed", code=code, message=why)
        poisoned = self._poisoned_outcome(entry)
        if poisoned is not None:
            return poisoned
        self._seq_of[request_id] = seq
        if len(self._pending) >= self.config.max_pending:
            self._waiting.append(entry)
            return self._outcome(entry, "waiting")
        self._enter_window(entry)
        return self._outcome(entry, "pending")

    def _poisoned_outcome(self, entry: _Entry) -> Outcome | None:
        hit = self.poison.get(entry.spec.key, self.agreed_ms)
        if hit is None:
            return None
        self.stats.poisoned += 1
        entry.cache = "poisoned"
        code = ErrorCode.name_of(hit.reason)
        return self._outcome(entry, "failed", code=code, message=f"poisoned key: {hit.message}")

    def _enter_window(self, entry: _Entry) -> None:
        compiled = self.cache.get(entry.spec.key)
        if compiled is not None:
            entry.cache, entry.compiled = "hit", compiled
        else:
            entry.job, joined = self.service.submit(entry.spec)
            entry.cache = "joined" if joined else "miss"
        setattr(self.stats, entry.cache, getattr(self.stats, entry.cache) + 1)
        self._pending[entry.seq] = entry

    def _fill_window(self) -> None:
        while self._waiting and len(self._pending) < self.config.max_pending:
            entry = self._waiting.popleft()
            poisoned = self._poisoned_outcome(entry)
            if poisoned is not None:
                self._seq_of.pop(entry.request_id, None)
                self._deferred.append(poisoned)
            else:
                self._enter_window(entry)

    # -- agreement interface -----------------------------------------------

    def _state(self, entry: _Entry) -> tuple[PendingState, int]:
        hit = self.poison.get(entry.spec.key, self.agreed_ms)
        if hit is not None:  # poisoned meanwhile, e.g. shared by a DP peer
            return PendingState.FAILED, hit.reason
        if entry.compiled is not None:
            return PendingState.READY, 0
        assert entry.job is not None
        return entry.job.state()

    def pending_key(self, seq: int) -> bytes:
        """The grammar key of pending request ``seq`` (identical on every rank
        that holds the same request); empty if it is not pending."""
        entry = self._pending.get(seq)
        return entry.spec.key if entry is not None else b""

    def local_status(self) -> LocalStatus:
        """This rank's view of the pending window, in sequence order."""
        self.service.poll()
        seqs, states, reasons = [], [], []
        for seq, entry in self._pending.items():
            state, reason = self._state(entry)
            seqs.append(seq)
            states.append(int(state))
            reasons.append(reason)
        return LocalStatus(seqs=tuple(seqs), states=tuple(states), reasons=tuple(reasons))

    def step(self, step: int = 0, *, clock_ms: int | None = None) -> list[Outcome]:
        """Single-process admission: decide alone on the local status, apply it.

        ``clock_ms`` is the agreed clock to decide TTLs with; the wall clock
        (``coordinator.wall_clock_ms``) by default.
        """
        clock = wall_clock_ms() if clock_ms is None else clock_ms
        out = self.apply_decision(decide_alone(step, self.local_status(), clock))
        # No peers to share new poison with.
        self._new_failures.clear()
        return out

    def apply_decision(self, decision: Decision) -> list[Outcome]:
        """Admit and fail requests exactly as decided, in sequence order.

        The ``coordinator.Member`` call. After ``follow(wait_s)``, admitted
        requests whose local compile has not finished are waited for, all
        against one deadline ``wait_s`` away.

        Parameters
        ----------
        decision:
            The agreed decision (identical on every rank of the group).
        """
        wait_s = self.follow_wait_s or 0.0
        deadline = time.monotonic() + wait_s
        # Followers never call local_status, so deadlines and stuck-worker
        # replacement must also advance here.
        self.service.poll()
        self.agreed_ms = max(self.agreed_ms, decision.clock_ms)
        self.poison.expire(self.agreed_ms)
        failed = dict(decision.failed)
        outcomes, self._deferred = self._deferred, []
        for seq in sorted(set(decision.ready) | failed.keys()):
            entry = self._pending.pop(seq, None)
            if entry is None:
                # Aborted here before the decision landed, or a caller bug
                # (a seq this rank never saw): counted, never guessed at.
                self.stats.unknown_seq += 1
                logger.debug("decision %d names seq %d, not pending here", decision.step, seq)
                continue
            if seq in failed:
                outcomes.append(self._fail(entry, failed[seq]))
            else:
                outcomes.append(self._admit(entry, max(0.0, deadline - time.monotonic())))
        self._fill_window()
        if self.follow_wait_s is not None:
            self._new_failures.clear()  # the decider shares these keys
            late = [o.request_id for o in outcomes if o.code == "grammar_stage_timeout"]
            if late:
                logger.warning(
                    "decision %d: %d admitted requests not compiled here within %.1fs: %s",
                    decision.step,
                    len(late),
                    wait_s,
                    late,
                )
        return outcomes

    def _admit(self, entry: _Entry, wait_s: float) -> Outcome:
        if entry.compiled is None:
            job = entry.job
            assert job is not None
            if not job.done.is_set() and wait_s > 0:
                job.done.wait(wait_s)
            if not job.done.is_set() or job.error is not None:
                code = ErrorCode.grammar_stage_timeout
                msg = f"admitted upstream but not compiled here within {wait_s:g}s"
                if job.error is not None:
                    code, msg = job.error
                self.service.release(job)
                self._seq_of.pop(entry.request_id, None)
                self.stats.failed += 1
                return self._outcome(entry, "failed", code=code.name, message=msg)
            entry.compiled = job.result
            entry.compile_ms = job.compile_ms
            self.service.release(job)
        self.cache.put(entry.spec.key, entry.compiled)
        self._running[entry.request_id] = entry
        self.stats.admitted += 1
        return self._outcome(entry, "admitted")

    def _fail(self, entry: _Entry, reason: int) -> Outcome:
        code = ErrorCode.name_of(reason)
        message = f"failed on another rank of the agreement group ({code})"
        job = entry.job
        if job is not None:
            entry.compile_ms = job.compile_ms
            if job.error is not None and int(job.error[0]) == reason:
                message = job.error[1]
            self.service.release(job)
        hit = self.poison.get(entry.spec.key, self.agreed_ms)
        if hit is not None and hit.reason == reason:
            message = f"poisoned key: {hit.message}"
        kind = _POISON_KIND.get(reason)
        if kind is not None and hit is None:
            self.poison.poison(entry.spec.key, kind, reason, message, self.agreed_ms)
            self._new_failures.append(PoisonRecord(entry.spec.key, reason, self.agreed_ms))
        self._seq_of.pop(entry.request_id, None)
        self.stats.failed += 1
        return self._outcome(entry, "failed", code=code, message=message)

    def new_failures(self) -> list[PoisonRecord]:
        """Keys this rank poisoned since the last call (to share with DP peers)."""
        out, self._new_failures = self._new_failures, []
        return out

    def apply_poison(self, records: Iterable[PoisonRecord]) -> None:
        """Poison keys decided elsewhere; TTLs run from each record's clock."""
        for r in records:
            kind = _POISON_KIND.get(r.reason)
            if kind is not None:
                msg = f"{ErrorCode.name_of(r.reason)} (on another replica, or an earlier attempt)"
                self.poison.poison(r.key, kind, r.reason, msg, r.clock_ms)

    # -- running requests ---------------------------------------------------

    def state_of(self, request_id: str) -> Literal["waiting", "pending", "running", "unknown"]:
        """Where a live request is: queued, in the pending window, or admitted."""
        seq = self._seq_of.get(request_id)
        if seq is None:
            return "unknown"
        if seq in self._pending:
            return "pending"
        if request_id in self._running:
            return "running"
        return "waiting"

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; True if it was live."""
        seq = self._seq_of.pop(request_id, None)
        if seq is None:
            return False
        entry = self._pending.pop(seq, None)
        if entry is not None:
            if entry.job is not None:
                self.service.release(entry.job)
        elif self._running.pop(request_id, None) is None:
            self._waiting = deque(e for e in self._waiting if e.seq != seq)
        self._fill_window()
        return True

    def finish(self, request_id: str) -> None:
        """Forget a finished request."""
        if self._running.pop(request_id, None) is not None:
            self._seq_of.pop(request_id, None)

    def matcher(self, request_id: str) -> xgr.GrammarMatcher:
        """A fresh matcher on the request's shared compiled grammar."""
        return xgr.GrammarMatcher(self._running[request_id].compiled)

    def compiled(self, request_id: str) -> xgr.CompiledGrammar:
        """The running request's shared compiled grammar (hosts build their own matchers)."""
        return self._running[request_id].compiled

    @property
    def num_live(self) -> int:
        """Requests held anywhere: queued, pending or running."""
        return len(self._seq_of)

    def wait_pending(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for the oldest unfinished pending compile; True if done."""
        for entry in self._pending.values():
            if entry.job is not None and not entry.job.done.is_set():
                return entry.job.done.wait(timeout_s)
        return True

    def close(self) -> None:
        self.service.close()

    def _outcome(self, entry: _Entry, status: str, *, code: str | None = None, message: str = ""):
        return Outcome(
            request_id=entry.request_id,
            seq=entry.seq,
            status=status,
            cache=entry.cache,
            code=code,
            message=message,
            warnings=entry.warnings,
            compile_ms=round(entry.compile_ms, 3),
            end_check=entry.spec.text if entry.spec.end_check and status == "admitted" else None,
        )
