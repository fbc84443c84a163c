"""Grammar futures: the one door for host engines whose scheduler waits on a ``Future``.

vLLM parks a request until ``request.structured_output_request.grammar`` (a
``concurrent.futures.Future``) is done; SGLang polls ``req.grammar.done()``
and then calls ``result()``. ``GrammarFutures`` gives each submitted request
such a ``Future`` and resolves it only from ``step`` -- the agreement of
``StageLeader.step`` -- so every rank of the host's group admits or fails
the same request at the same point, whenever its own compile finished.

A request that waits long costs an agreement collective every step of the
host's while the others decode (on 2 shared cores: 4.5 ms of a 30 ms vLLM
step). With ``max_gap`` above 1, an agreement that decided nothing spaces
the next ones out: after every 4 such agreements in a row the gap doubles,
up to ``max_gap`` steps, and a new submission or a decision sets it back to
every step. The gap depends only on what every rank of the group holds alike
(the agreed decisions and the submissions, which a lockstep host makes at
the same step on every rank), so every rank skips the same steps; and since
the gap reaches ``2**k`` only after ``4 * (2**k - 1)`` fruitless steps, a
decision comes at most about a quarter later than the time already waited.

A host builds one with :meth:`GrammarFutures.for_host` and calls only its
verbs: ``submit``, ``step``, ``wait``, ``compiled``, ``release``, ``close``,
the cache verbs ``lookup``, ``poison`` and ``clear_cache``, and
``wait_warm`` at start. It supplies
two callbacks: ``admit(outcome)`` makes the value of an admitted request
(its grammar object, over ``compiled(request_id)``), and
``refuse(outcome)`` the value or exception of a failed one. The adapters
(``integrations.vllm.backend``, ``integrations.sglang.backend``) hold one
each and never touch the ``StageLeader`` or the grammar manager under it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.errors import DivergenceError
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.compile_service import CompileFn
from gramcoord.rank_worker.grammars.outcome import Lookup, Outcome
from gramcoord.rank_worker.session.leader import StageLeader

if TYPE_CHECKING:
    from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Makes the value of a decided request; an exception returned by ``refuse``
# is set on the Future as its exception.
Admit = Callable[[Outcome], Any]
Refuse = Callable[[Outcome], Any]


class HostVocabulary(msgspec.Struct, frozen=True):
    """A host engine's vocabulary as the grammar manager needs it: a name.

    Hosts that compile with their own tokenizer info (vLLM, SGLang) pass
    this instead of a ``Tokenizer``. The name is part of every grammar key,
    so it must be identical on every rank and differ between vocabularies.
    """

    name: str


class GrammarFutures:
    """One rank's requests awaiting a decision, as ``Future``\\s; see the module docstring.

    Parameters
    ----------
    leader:
        The rank's ``StageLeader`` (:meth:`for_host` builds it).
    admit:
        The value of an admitted request's Future.
    refuse:
        The value of a failed request's Future (an exception is set as one).
    on_divergence:
        ``"fail"``: when the ranks hold different pending requests, every
        pending request fails here with ``grammar_divergence`` and a message
        naming the ranks (the host aborts them; no rank admits a request
        another lacks). ``"raise"``: the ``DivergenceError`` propagates.
    max_gap:
        The most steps between two agreements while requests wait (1: every
        step); see the module docstring.
    """

    def __init__(
        self,
        leader: StageLeader,
        *,
        admit: Admit,
        refuse: Refuse,
        on_divergence: str = "fail",
        max_gap: int = 1,
    ) -> None:
        if max_gap < 1:
            raise ValueError(f"max_gap must be at least 1, not {max_gap}")
        self.leader = leader
        self._admit = admit
        self._refuse = refuse
        self._on_divergence = on_divergence
        self._lock = threading.RLock()
        self._futures: dict[str, Future] = {}
        self._step = 0
        self._max_gap = max_gap
        # Agreements in a row that decided nothing, calls skipped since the
        # last one, and submissions since the last one: the same on every rank.
        self._fruitless = 0
        self._skipped = 0
        self._new = 0

    @classmethod
    def for_host(
        cls,
        grammar: GrammarConfig,
        vocabulary: Tokenizer | HostVocabulary,
        compile_fn: CompileFn,
        group: Any | None,
        distributed: DistributedConfig | None = None,
        *,
        admit: Admit,
        refuse: Refuse,
        max_gap: int | None = None,
    ) -> GrammarFutures:
        """The door inside a host engine, agreeing over the host's own ``group``.

        ``grammar``, ``vocabulary``, ``compile_fn``, ``group`` and
        ``distributed`` are ``StageLeader.for_host``'s: the host hands over
        what its grammar manager is made of and holds neither the manager
        nor the leader. ``max_gap`` defaults to the agreement's
        ``agree_max_gap_steps``.
        """
        distributed = distributed or DistributedConfig()
        leader = StageLeader.for_host(grammar, vocabulary, compile_fn, group, distributed)
        gap = distributed.agree_max_gap_steps if max_gap is None else max_gap
        door = cls(leader, admit=admit, refuse=refuse, max_gap=gap)
        wait_s = grammar.store.ready_wait_s
        if wait_s > 0 and not door.wait_warm(wait_s):
            logger.warning(
                "gramcoord: the spec store's warm start is still compiling after %s=%gs; "
                "serving meanwhile",
                grammar.option("store.ready_wait_s"),
                wait_s,
            )
        return door

    def submit(self, request_id: str, spec: Any, future: Future | None = None) -> Future:
        """Queue one request; its Future resolves in a later ``step`` (or now, if refused).

        A spec refused at once (invalid, poisoned key) is refused identically
        on every rank, so its Future is resolved on the spot.
        """
        future = Future() if future is None else future
        with self._lock:
            outcome = self.leader.submit(request_id, spec)
            if outcome.status == "failed":
                self._resolve(future, outcome)
            else:
                self._futures[request_id] = future
                self._new += 1
        return future

    def step(self) -> int:
        """Agree on the undecided requests; how many this decided.

        Every rank of the group calls it at the same point of the host's
        loop. No collective runs while nothing is undecided, nor on the
        steps the gap skips (``max_gap``).

        Raises
        ------
        PeerLostError
            A member of the group died or hung.
        DivergenceError
            The members hold different requests and ``on_divergence`` is
            ``"raise"``.
        """
        with self._lock:
            if not self._futures:
                return 0
            if self._new:
                self._fruitless = 0
            elif self._skipped + 1 < self.gap:
                self._skipped += 1
                return 0
            self._skipped = self._new = 0
            self._step += 1
            try:
                decided = self.leader.step(self._step)
            except DivergenceError as exc:
                if self._on_divergence != "fail":
                    raise
                return self._fail_all(exc)
            n = 0
            for outcome in (*decided.admitted, *decided.failed):
                future = self._futures.pop(outcome.request_id, None)
                if future is not None:
                    self._resolve(future, outcome)
                    n += 1
            self._fruitless = 0 if n else self._fruitless + 1
            return n

    @property
    def gap(self) -> int:
        """Steps from one agreement to the next while nothing new arrives."""
        return min(self._max_gap, 2 ** min(self._fruitless // 4, 30))

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted, or its Future was cancelled): drop it."""
        with self._lock:
            future = self._futures.pop(request_id, None)
            if future is not None and not Future.done(future):
                future.cancel()
            self.leader.release(request_id)

    def wait(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s`` on the oldest unfinished compile (never spins).

        Not at all while an undecided request has compiled here: the next
        agreement may decide it (cache hits beside a slow compile, say).
        """
        with self._lock:
            pending = list(self._futures)
        if pending and not any(self.leader.compiled_here(r) for r in pending):
            self.leader.wait_compiles(timeout_s)

    def compiled(self, request_id: str) -> Any:
        """An admitted request's compiled grammar (``xgrammar.CompiledGrammar``).

        The host builds its own matcher over it. Raises ``KeyError`` for a
        request not admitted.
        """
        return self.leader.compiled(request_id)

    def lookup(self, spec: Any) -> Lookup:
        """What the caches hold for ``spec`` now, submitting nothing.

        Its key, and its compiled grammar on a hit or the failed outcome of
        a poisoned key: the same on every rank of the group, so a host may
        serve a hit or refuse a poisoned key without a ``step``.
        """
        return self.leader.lookup(spec)

    def poison(self, spec: Any, code: ErrorCode, message: str) -> bool:
        """Poison ``spec``'s key on this rank (a host's own compile timeout); whether it did."""
        return self.leader.poison(spec, code, message)

    def clear_cache(self) -> None:
        """Drop the compiled grammars (a host's cache flush); poisoned keys stay."""
        self.leader.clear_cache()

    @property
    def group_size(self) -> int:
        """Members of this rank's agreement group (1 when it decides alone)."""
        return self.leader.group_size

    @property
    def num_collectives(self) -> int:
        """Agreement collectives this rank has run."""
        return self.leader.num_collectives

    def wait_warm(self, timeout_s: float) -> bool:
        """Hold the host's start up to ``timeout_s`` while the spec store's warm start
        compiles (``grammar.store.ready_wait_s``); whether it ended."""
        return self.leader.wait_warm(timeout_s)

    def join_replicas(self, replicas: Any) -> None:
        """Share poison with the host's other replicas (a ``ReplicaPoison``) from now on."""
        replicas.attach(self.leader)

    def close(self) -> None:
        """Stop the compile pool (the host is shutting down)."""
        self.leader.close()

    def compiled_here(self, request_id: str) -> bool:
        """Whether this rank's own compile of ``request_id`` ended (SGLang's ``done()``)."""
        with self._lock:
            return request_id not in self._futures or self.leader.compiled_here(request_id)

    def undecided(self, request_id: str) -> bool:
        """Whether ``request_id`` still waits for a decision."""
        return request_id in self._futures

    @property
    def num_undecided(self) -> int:
        """Requests whose Future no decision resolved yet."""
        return len(self._futures)

    @property
    def num_live(self) -> int:
        """Every request still held here (undecided or running); 0 when idle."""
        with self._lock:
            return max(len(self._futures), self.leader.num_live)

    def _resolve(self, future: Future, outcome: Outcome) -> None:
        if Future.done(future):
            return
        try:
            value = self._admit(outcome) if outcome.status == "admitted" else self._refuse(outcome)
        except Exception as exc:  # building the host's grammar failed: this request only
            logger.exception("gramcoord: request %s: making its grammar failed", outcome.request_id)
            failed = Outcome(
                request_id=outcome.request_id,
                seq=outcome.seq,
                status="failed",
                code=ErrorCode.grammar_internal.name,
                message=f"{type(exc).__name__}: {exc}",
            )
            value = self._refuse(failed)
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    def _fail_all(self, exc: DivergenceError) -> int:
        """The members hold different pending requests: fail all of them here."""
        message = f"{exc}; every pending request fails on every rank"
        logger.error("gramcoord: %s", message)
        futures, self._futures = self._futures, {}
        for request_id, future in futures.items():
            self.leader.release(request_id)
            failed = Outcome(
                request_id=request_id,
                seq=-1,
                status="failed",
                code=ErrorCode.grammar_divergence.name,
                message=message,
            )
            self._resolve(future, failed)
        return len(futures)
