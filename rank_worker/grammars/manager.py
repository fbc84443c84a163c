"""One rank's grammar manager: validate, key, look up, compile, admit.

Requests flow through three places: the **waiting** queue, when the
pending window (``grammar.max_pending``) is full (nothing is dropped); the
**pending window**, in sequence order, each request a cache hit (ready), a
compile job (its own or one it joined), or failed; **running**, once a
decision admitted it, on the shared ``CompiledGrammar``.

Immediate verdicts that are identical on every rank (a spec that fails
validation, a poisoned key) never enter the window. Everything else waits
for a ``Decision``: from the agreement in multi-rank runs (the manager is
the coordinator's ``Member``), or from ``step`` on one rank. The caches
(``caches.GrammarCaches``) change only inside ``apply_decision`` and
``apply_poison``, so ranks that apply the same decisions hold the same
caches. The rank's per-rank API (``session.leader.StageLeader``) owns one
manager; hosts reach it only through that API.

With a spec store (``grammar.store``: ``spec_store``), the manager keeps
the spec of every admitted request on disk and, at start, compiles the
stored specs and the operator's lists on the store's thread at the lowest
priority (``warm``). Those compiles never touch the caches: each stays a
compile in flight, held until a request for its key joins it (``warm`` in
the request's outcome) and the decision admits it like any compile. So the
caches still change only at agreed points, and every rank of a group holds
the same, whatever each one warmed.

Here too: ``Entry``, a request as the manager holds it; ``ManagerStats``,
its counters (``summary.json`` reads them); and ``refuse_seq`` /
``refuse_id``, the one check of sequence numbers and request ids.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import xgrammar as xgr

from gramcoord.coordinator.status import (
    Decision,
    LocalStatus,
    PendingState,
    PoisonRecord,
    decide_alone,
    wall_clock_ms,
)
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError
from gramcoord.rank_worker.grammars.caches import GrammarCaches
from gramcoord.rank_worker.grammars.compile_service import (
    CompileFn,
    CompileService,
    XGrammarBackend,
)
from gramcoord.rank_worker.grammars.outcome import CacheStatus, Lookup, Outcome
from gramcoord.rank_worker.grammars.spec import GrammarSpec, TokenBudget, admit, validate_spec

if TYPE_CHECKING:  # hosts pass their own vocabulary; our engine a Tokenizer
    from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Longest request id admission takes. The transport's wire bound
# (``sync.messages.MAX_REQUEST_ID_CHARS``) is the same number, so that one
# admitted id can never break a whole batch's publish; the transport is not
# imported here, so a host that never moves masks does not load it.
MAX_REQUEST_ID_CHARS = 1024


@dataclass(eq=False)
class Entry:
    """One request held by the manager: waiting, pending or running."""

    seq: int
    request_id: str
    spec: GrammarSpec
    cache: CacheStatus
    compiled: Any = None
    # The compile job (``compile_job.CompileJob``) while one runs.
    job: Any = None
    warnings: tuple[str, ...] = ()
    compile_ms: float = 0.0
    # The request's spec as the host gave it (kept for the spec store only).
    raw: Any = None

    def outcome(self, status: str, *, code: str | None = None, message: str = "") -> Outcome:
        """This request's ``Outcome`` with ``status``."""
        spec = self.spec
        return Outcome(
            request_id=self.request_id,
            seq=self.seq,
            status=status,  # type: ignore[arg-type]
            cache=self.cache,
            code=code,
            message=message,
            warnings=self.warnings,
            compile_ms=round(self.compile_ms, 3),
            end_check=spec.text if spec.end_check and status == "admitted" else None,
        )


class ManagerStats(msgspec.Struct, kw_only=True):
    """Counters of one manager; ``summary.json`` reads them."""

    # Admissions by cache path: compiled here, cache hit, joined an
    # in-flight compile of the same key, or failed on a poisoned key.
    miss: int = 0
    hit: int = 0
    joined: int = 0
    # Joined a warm-start compile of the spec store.
    warm: int = 0
    poisoned: int = 0
    # Specs rejected by validation (never keyed or compiled).
    invalid_spec: int = 0
    admitted: int = 0
    failed: int = 0
    # Decisions naming a seq this rank does not hold (aborted meanwhile).
    unknown_seq: int = 0


def valid_request_id(request_id: Any) -> bool:
    """Text of 1..MAX_REQUEST_ID_CHARS characters that encodes as UTF-8 (no lone surrogates)."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        return False
    try:
        request_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def refuse_seq(request_id: Any, seq: Any, *, next_seq: int) -> Outcome | None:
    """The ``failed`` outcome of a sequence number that is not an int ``>= next_seq``, or None.

    The refused number is not taken: the next request may use it.
    """
    if not isinstance(seq, int) or seq < next_seq:
        return Outcome(
            request_id=request_id if valid_request_id(request_id) else str(request_id)[:64],
            seq=seq if isinstance(seq, int) else -1,
            status="failed",
            code=ErrorCode.bad_request_id.name,
            message=(
                f"bad sequence number: got {seq!r} after {next_seq - 1}; "
                "sequence numbers must increase"
            ),
        )
    return None


def refuse_id(request_id: Any, seq: int, *, live: Container[str]) -> Outcome | None:
    """The ``failed`` outcome of an id that is not valid text or is ``live``, or None."""
    if not valid_request_id(request_id):
        return Outcome(
            request_id=str(request_id)[:64],
            seq=seq,
            status="failed",
            code=ErrorCode.bad_request_id.name,
            message=(
                f"request ids must be 1..{MAX_REQUEST_ID_CHARS} characters of text "
                "that encodes as UTF-8"
            ),
        )
    if request_id in live:
        return Outcome(
            request_id=request_id,
            seq=seq,
            status="failed",
            code=ErrorCode.duplicate_request_id.name,
            message=f"request id {request_id!r} is already live; ids must be unique",
        )
    return None


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
        self.caches = GrammarCaches(config)
        self._pending: dict[int, Entry] = {}
        self._waiting: deque[Entry] = deque()
        self._running: dict[str, Entry] = {}
        self._seq_of: dict[str, int] = {}
        self._deferred: list[Outcome] = []
        self._next_seq = 0
        self.stats = ManagerStats()
        # Set by follow(): this manager applies decisions made elsewhere.
        self.follow_wait_s: float | None = None
        # Warm-start compiles held for a request, by key, with their grammar's
        # size, and every key admitted here (the store's thread skips those).
        self._held: dict[bytes, tuple[Any, int]] = {}
        self._held_bytes = 0
        self._held_lock = threading.Lock()
        self._admitted_keys: set[bytes] = set()
        # Set by a leader that decides alone: the other engines' verdicts
        # (spec store) apply at once, at admission and at each step.
        self.reads_verdicts = False
        self.store = self._open_store()
        if self.store is not None:
            self.store.start()

    # -- the spec store -----------------------------------------------------

    def _open_store(self) -> Any:
        """The spec store's thread, when ``grammar.store`` names a dir or lists."""
        sc = self.config.store
        if sc.dir is None and not sc.preload:
            return None
        from gramcoord.rank_worker.grammars.spec_store import SpecStore, SpecStoreThread

        store = None
        if sc.dir is not None:
            try:
                store = SpecStore(
                    sc.dir,
                    self.tokenizer.name,
                    max_records=sc.max_records,
                    max_spec_bytes=self.config.max_spec_bytes,
                )
            except OSError as exc:
                logger.warning(
                    "gramcoord spec store %s: cannot open it (%s); none used", sc.dir, exc
                )
        return SpecStoreThread(
            store,
            sc.preload,
            max_spec_bytes=self.config.max_spec_bytes,
            warm=self._warm,
            read_verdicts=sc.share_verdicts,
            poll_s=sc.verdict_poll_s,
        )

    def _warm(self, specs: list[Any]) -> None:
        """Compile ``specs`` (``spec_store.Stored``, on the store's thread) and hold
        each for its requests."""
        budget = self.config.cache_limit_mb * 2**20
        done = 0
        for stored in specs:
            if self.service.closed:
                return
            if len(self._held) >= self.config.num_cache_entries or self._held_bytes >= budget:
                logger.info("gramcoord spec store: warm start stops at the compile cache's bound")
                break
            try:
                spec = validate_spec(stored.spec, self.config, vocab=self.tokenizer.name)
            except SpecError as exc:
                self.store.refuse(stored.where, f"no longer valid ({exc.code.name}): {exc.message}")
                continue
            if stored.key is not None and spec.key != stored.key:
                why = "outdated: its key is not the spec's (another gramcoord or other options)"
                self.store.refuse(stored.where, why)
                continue
            if spec.key in self._admitted_keys:
                continue
            job = self.service.warm(spec)
            if job is None:
                continue
            if job.error is not None:
                self.service.release(job)
                self.store.refuse(stored.where, f"its compile failed: {job.error[1]}")
                continue
            size = getattr(job.result, "memory_size_bytes", 0)
            with self._held_lock:
                if spec.key in self._admitted_keys:  # a request took it meanwhile
                    self.service.release(job)
                    continue
                self._held[spec.key] = (job, size)
                self._held_bytes += size
            done += 1
        logger.info(
            "gramcoord spec store: %d specs compiled at start, %d refused",
            done,
            len(self.store.refused),
        )

    def _take_held(self, key: bytes) -> tuple[Any, int] | None:
        """A request admitted ``key``: the warm-start hold on its compile ends.

        Returns the held grammar and its size (read once, at the warm
        compile: xgrammar walks the grammar to size it), or ``None``.
        """
        with self._held_lock:
            self._admitted_keys.add(key)
            held = self._held.pop(key, None)
            if held is not None:
                self._held_bytes -= held[1]
        if held is None:
            return None
        job, size = held
        self.service.release(job)
        return job.result, size

    def _take_verdicts(self) -> None:
        """The other engines' verdicts read by the store's thread, applied now (alone only)."""
        if self.store is not None and self.reads_verdicts:
            verdicts = self.store.take_verdicts()
            if verdicts:
                self.caches.apply(verdicts)

    def wait_warm(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until the warm start ended; whether it did."""
        return self.store is None or self.store.warmed.wait(timeout_s)

    def follow(self, wait_s: float) -> None:
        """Apply decisions made elsewhere (later stages, ``fill`` followers).

        ``apply_decision`` then waits up to ``wait_s`` per decision for the
        local compiles of what it admits (past it: ``grammar_stage_timeout``)
        and shares no failure: the rank that decided does.
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
        self._take_verdicts()
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
        entry = Entry(seq, request_id, gspec, "none", warnings=gspec.warnings)
        if self.store is not None:
            entry.raw = spec
        if why is not None:
            code = ErrorCode.grammar_unreachable_end.name
            return entry.outcome("failed", code=code, message=why)
        poisoned = self._poisoned_outcome(entry)
        if poisoned is not None:
            return poisoned
        self._seq_of[request_id] = seq
        if len(self._pending) >= self.config.max_pending:
            self._waiting.append(entry)
            return entry.outcome("waiting")
        self._enter_window(entry)
        return entry.outcome("pending")

    def lookup(self, spec: GrammarSpec) -> Lookup:
        """What the caches hold for a validated spec now: a poisoned key's failed
        outcome (counted), a compiled grammar, or neither; nothing is submitted.

        Poison comes first, as in ``add``: a key both compiled and poisoned
        (a host's own timeout, say) is refused by both.
        """
        failed = self._poisoned_outcome(Entry(-1, "", spec, "none"))
        if failed is not None:
            return Lookup(spec.key, None, failed)
        compiled = self.caches.compiled.get(spec.key)
        end_check = spec.text if compiled is not None and spec.end_check else None
        return Lookup(spec.key, compiled, None, end_check)

    def poison_here(self, spec: GrammarSpec, code: ErrorCode, message: str) -> bool:
        """Poison ``spec``'s key on this rank alone (a host's own compile timeout)."""
        return self.caches.poison_here(spec.key, code, message)

    def clear_compiled(self) -> None:
        """Drop the compiled grammars (a host's cache flush); poisoned keys stay."""
        self.caches.clear_compiled()

    def _poisoned_outcome(self, entry: Entry) -> Outcome | None:
        hit = self.caches.poisoned(entry.spec.key)
        if hit is None:
            return None
        self.stats.poisoned += 1
        entry.cache = "poisoned"
        code = ErrorCode.name_of(hit.reason)
        return entry.outcome("failed", code=code, message=self._cached_verdict(hit))

    def _cached_verdict(self, hit: Any) -> str:
        """A poisoned key's failure, said as what it is: a verdict kept from an
        earlier compile of the same grammar, and when a retry can pass."""
        cfg = self.config
        if hit.expires_ms:
            left_s = max(0.0, (hit.expires_ms - self.caches.agreed_ms) / 1e3)
            when = (
                f"a retry compiles it again in about {left_s:.0f}s "
                f"({cfg.option('poison_ttl_s')}={cfg.poison_ttl_s:g}s after the failure)"
            )
        else:
            when = "this grammar never compiles, so a retry fails the same"
        return (
            f"cached verdict, no compile ran for this request: an earlier compile of "
            f"this grammar failed: {hit.message}; {when}"
        )

    def _enter_window(self, entry: Entry) -> None:
        compiled = self.caches.compiled.get(entry.spec.key)
        if compiled is not None:
            entry.cache, entry.compiled = "hit", compiled
        else:
            entry.job, joined = self.service.submit(entry.spec)
            entry.cache = ("warm" if entry.job.warm else "joined") if joined else "miss"
            if entry.cache == "warm":
                logger.info(
                    "request %s joined the warm-start compile of %s (%s)",
                    entry.request_id,
                    entry.spec.key.hex()[:12],
                    "compiled" if entry.job.done.is_set() else "compiling",
                )
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

    def _state(self, entry: Entry) -> tuple[PendingState, int]:
        hit = self.caches.poisoned(entry.spec.key)
        if hit is not None:  # poisoned meanwhile, e.g. shared by a DP peer
            return PendingState.FAILED, hit.reason
        if entry.compiled is not None:
            return PendingState.READY, 0
        assert entry.job is not None
        return entry.job.state()

    def local_status(self) -> LocalStatus:
        """This rank's view of the pending window, in sequence order."""
        self.service.poll()
        entries = self._pending.values()
        states = [self._state(e) for e in entries]
        return LocalStatus(
            seqs=tuple(self._pending),
            states=tuple(int(st) for st, _ in states),
            reasons=tuple(r for _, r in states),
            keys=tuple(e.spec.key for e in entries),
        )

    def step(
        self, step: int = 0, *, clock_ms: int | None = None, keep_failures: bool = False
    ) -> list[Outcome]:
        """Single-process admission: decide alone on the local status, apply it.

        ``clock_ms`` is the clock to decide TTLs with (the wall clock by
        default). New poison is dropped (no peers) unless ``keep_failures``.
        """
        clock = wall_clock_ms() if clock_ms is None else clock_ms
        self.reads_verdicts = True  # deciding alone
        self._take_verdicts()
        out = self.apply_decision(decide_alone(step, self.local_status(), clock))
        if not keep_failures:
            self.new_failures()
        return out

    def apply_decision(self, decision: Decision) -> list[Outcome]:
        """Admit and fail requests exactly as ``decision`` says, in sequence order.

        The ``coordinator.Member`` call; after ``follow(wait_s)``, admitted
        requests not compiled here are waited for against one deadline.
        """
        wait_s = self.follow_wait_s or 0.0
        deadline = time.monotonic() + wait_s
        # Followers never call local_status, so deadlines and stuck-worker
        # replacement must also advance here.
        self.service.poll()
        self.caches.advance(decision.clock_ms)
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
                outcomes.append(self._fail(entry, failed[seq], decision))
            else:
                outcomes.append(self._admit(entry, max(0.0, deadline - time.monotonic())))
        self._fill_window()
        if self.follow_wait_s is not None:
            late = [o.request_id for o in outcomes if o.code == "grammar_stage_timeout"]
            if late:
                msg = "decision %d: %d admitted requests not compiled here within %.1fs: %s"
                logger.warning(msg, decision.step, len(late), wait_s, late)
        return outcomes

    def _admit(self, entry: Entry, wait_s: float) -> Outcome:
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
                return entry.outcome("failed", code=code.name, message=msg)
            entry.compiled = job.result
            entry.compile_ms = job.compile_ms
            self.service.release(job)
        size = None
        if self.store is not None:
            held = self._take_held(entry.spec.key)
            if held is not None and held[0] is entry.compiled:
                size = held[1]
            self.store.used(entry.spec.key, entry.raw)
        self.caches.compiled.put(entry.spec.key, entry.compiled, size)
        self._running[entry.request_id] = entry
        self.stats.admitted += 1
        return entry.outcome("admitted")

    def _fail(self, entry: Entry, reason: int, decision: Decision) -> Outcome:
        """Fail ``entry`` as decided, with a message that is the same on every rank.

        Failed everywhere (or where the report cannot say where): this
        rank's own cause, the same text on every rank that failed alike.
        Failed on some members only: the agreed fact of where, and the
        ranks that failed log their own cause.
        """
        code = ErrorCode.name_of(reason)
        ranks = decision.failed_ranks(entry.seq)
        where = f"rank(s) {list(ranks)}" if ranks else "another rank"
        message = f"failed on {where} of the agreement group ({code})"
        job = entry.job
        if job is not None:
            entry.compile_ms = job.compile_ms
            mine = job.error is not None and int(job.error[0]) == reason
            if mine and (ranks is None or decision.failed_everywhere(entry.seq)):
                message = job.error[1]
            elif mine:
                logger.warning("request %s failed here: %s", entry.request_id, job.error[1])
            self.service.release(job)
        hit = self.caches.poisoned(entry.spec.key)
        kept = message
        if hit is not None and hit.reason == reason:
            kept, message = hit.message, self._cached_verdict(hit)
        # The rank that decided shares the key; a follower's decider does.
        share = self.follow_wait_s is None
        self.caches.record_failure(entry.spec.key, reason, kept, share=share)
        self._seq_of.pop(entry.request_id, None)
        self.stats.failed += 1
        return entry.outcome("failed", code=code, message=message)

    def new_failures(self) -> list[PoisonRecord]:
        """Keys this rank poisoned since the last call (to share with DP peers).

        With a spec store, they go to the other engines on it too.
        """
        out = self.caches.new_failures()
        if out and self.store is not None:
            self.store.failed(out)
        return out

    def apply_poison(self, records: Iterable[PoisonRecord]) -> None:
        """Poison keys decided elsewhere; TTLs run from each record's clock."""
        self.caches.apply(records)

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

    def release(self, request_id: str) -> bool:
        """Drop a request wherever it is (queued, pending or running); whether it was live.

        A finished, aborted or failed request alike: the compiled grammar
        stays in the cache.
        """
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

    def compiled_here(self, request_id: str) -> bool:
        """Whether this rank's compile of a pending request has ended (well or not).

        True as well for a request no longer pending (decided, or unknown):
        only the decision in ``step`` says what becomes of it. Deadlines are
        enforced here too: a host that only polls this (SGLang's ``done()``)
        until every rank says yes sees a compile past its deadline end, as
        ``grammar_timeout``, and never waits on its own cruder timeout.
        """
        self.service.poll()
        seq = self._seq_of.get(request_id)
        entry = self._pending.get(seq) if seq is not None else None
        if entry is None:
            return self.state_of(request_id) != "waiting"
        return self._state(entry)[0] != PendingState.PENDING

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
        if self.store is not None:
            self.store.close()
