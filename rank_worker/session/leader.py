"""The per-rank API every host uses: submit, step, grammar, release, close.

``StageLeader`` is what a rank that schedules constrained requests calls
(``session.leader``): gramcoord's own engine and Hugging Face ``generate``
directly, the vLLM and SGLang adapters through their door,
``futures.GrammarFutures.for_host`` (``StageLeader.for_host`` over their
engine's process group, underneath). It owns the rank's ``GrammarManager`` and, in a
multi-rank world, the ``Coordinator`` that drives it (the one agreement).
In ``step`` a **decider** (stage 0, or every stage with ``pp_sync:
collective``) posts the poison exchange, agrees with its peers, sends the
decision down the chain and applies it; a **later stage** applies stage 0's
decision, waiting for its own compiles up to ``stage_wait_s``
(what is still not compiled fails here alone: ``StepOutcome.stage_failed``).
Replicas that share poison at the host's own sync point attach it to
``replicas.ReplicaPoison``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError
from gramcoord.rank_worker.grammars.compile_service import CompileFn
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.outcome import Lookup, Outcome
from gramcoord.rank_worker.grammars.spec import GrammarSpec, validate_spec

if TYPE_CHECKING:
    # A leader that decides alone never builds these: they load with the
    # first multi-rank leader (``build``, ``for_host``). The vocabulary is
    # a host's ``HostVocabulary`` or our engine's ``Tokenizer``: a name.
    from gramcoord.coordinator.comm import Comm
    from gramcoord.coordinator.coordinator import Coordinator
    from gramcoord.coordinator.layout import ParallelLayout
    from gramcoord.coordinator.poison_share import PoisonShare
    from gramcoord.coordinator.status import PoisonRecord
    from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
    from gramcoord.rank_worker.session.followers import NoteSender
    from gramcoord.rank_worker.session.futures import HostVocabulary

logger = logging.getLogger(__name__)

# The wait of a rank that follows a decision is capped at this share of the
# step timeout (see ``stage_wait_s``).
STAGE_WAIT_SHARE = 0.5


def stage_wait_s(grammar: GrammarConfig, distributed: DistributedConfig, *, rank: int) -> float:
    """How long a rank that follows a decision waits for its own compiles, per step.

    A later pipeline stage and a ``fill`` TP follower both wait up to the
    compile timeout, capped at ``STAGE_WAIT_SHARE`` of the step timeout. A
    gloo send completes only once its receiver has posted the receive, so a
    follower that waits holds the decider back by as long: the decider must
    never take a waiting follower for a lost one.
    """
    wait = min(grammar.compile_timeout_s, distributed.step_timeout_s * STAGE_WAIT_SHARE)
    if wait < grammar.compile_timeout_s:
        msg = "[rank %d] this rank waits at most %.1fs for compiles, not compile_timeout_s=%.1fs"
        logger.warning(msg, rank, wait, grammar.compile_timeout_s)
    return wait


class StepOutcome(NamedTuple):
    """What ``step`` decided on this rank: requests admitted and failed."""

    admitted: list[Outcome]
    failed: list[Outcome]
    # The failed requests that the decision admitted: they failed on this
    # pipeline stage alone (a later stage's compile did not finish in time),
    # so stage 0 learns of them only from this stage.
    stage_failed: list[Outcome]
    # The end-of-run vote that settled this step (``step(n, busy=...)``):
    # True when no voting replica was busy at the step that voted, False
    # when one was, None when no vote settled. The same on every replica.
    all_idle: bool | None = None


# Called with the requests a step admitted (the last stage starts their
# grammar states), and with each request that ends.
Admitted = Callable[[list[Outcome]], None]
Ended = Callable[[str], None]


class StageLeader:
    """One rank's per-rank API: ``submit``, ``step``, ``compiled``, ``release``, ``close``.

    Build with :meth:`build` (gramcoord's layouts) or :meth:`for_host` (a host
    engine's group). The calls happen in the same order on every leader of
    a chain (and of a replicated group); none raises for bad input, only
    for infrastructure failures.
    """

    def __init__(
        self,
        manager: GrammarManager,
        coordinator: Coordinator | None,
        *,
        rank: int = 0,
        comm: Comm | None = None,
        on_admitted: Admitted | None = None,
        on_end: Ended | None = None,
        notes: NoteSender | None = None,
    ) -> None:
        self._manager = manager
        self._coordinator = coordinator
        # Alone, the rank may take other engines' verdicts at any time.
        manager.reads_verdicts = coordinator is None
        self._comm = comm
        self.rank = rank
        self._on_admitted = on_admitted
        self._on_end = on_end
        self._notes = notes
        # Where this rank's new poison goes when it decides alone
        # (``share_failures``); dropped without one.
        self._share: Callable[[list[PoisonRecord]], None] | None = None

    @classmethod
    def build(
        cls,
        manager: GrammarManager,
        layout: ParallelLayout,
        comm: Comm | None,
        distributed: DistributedConfig,
        **roles: Any,
    ) -> StageLeader:
        """The leader of ``comm.rank``'s stage (one process when ``comm`` is None).

        ``roles`` go to the constructor (``on_admitted``, ``on_end``,
        ``notes``).
        """
        if comm is None or layout.world_size == 1:
            return cls(manager, None, **roles)
        from gramcoord.coordinator.coordinator import Coordinator

        grammar = manager.config
        coordinator = Coordinator.from_config(
            layout,
            comm,
            distributed,
            max_pending=grammar.max_pending,
            compile_mode=grammar.compile_mode,
        )
        if not coordinator.decider:
            manager.follow(stage_wait_s(grammar, distributed, rank=comm.rank))
        return cls(manager, coordinator, rank=comm.rank, comm=comm, **roles)

    @classmethod
    def for_host(
        cls,
        grammar: GrammarConfig,
        vocabulary: Tokenizer | HostVocabulary,
        compile_fn: CompileFn,
        group: Any | None,
        distributed: DistributedConfig | None = None,
    ) -> StageLeader:
        """The per-rank API inside a host engine, agreeing over the host's own group.

        The host hands over what its grammar manager is made of and never
        holds the manager itself: every call goes through this leader.

        Parameters
        ----------
        grammar:
            The manager's options (pool, deadlines, poison TTL, limits).
        vocabulary:
            The host's vocabulary (a ``HostVocabulary`` naming it, when the
            host fills its own masks), part of every grammar key.
        compile_fn:
            Compiles one validated ``GrammarSpec`` as the host's own backend
            would (on the manager's compile thread).
        group:
            The gloo process group of the ranks that schedule the same
            request stream (vLLM's TP group under ``external_launcher``,
            SGLang's sync group); ``None`` or a group of one decides alone.
            Every member runs the same agreement as gramcoord's own engine
            (``coordinator.Agreement``): ready on every member, failed on any,
            the agreed clock, divergence naming the ranks.
        distributed:
            Deadlines (``step_timeout_s``) and the agreement's options.
        """
        manager = GrammarManager(grammar, vocabulary, compile_fn=compile_fn)
        if group is None:
            return cls(manager, None)
        from gramcoord.coordinator.groups import HostGroup
        from gramcoord.coordinator.layout import ParallelLayout

        distributed = distributed or DistributedConfig()
        comm = HostGroup(group, step_timeout_s=distributed.step_timeout_s)
        if comm.size == 1:
            return cls(manager, None)
        layout = ParallelLayout(dp=comm.size, pp=1, tp=1, requests="replicated")
        return cls.build(manager, layout, comm, distributed)

    @property
    def follows(self) -> bool:
        """Whether this stage applies decisions made on stage 0 (``pp_sync: chain``)."""
        return self._coordinator is not None and not self._coordinator.decider

    # -- per request ------------------------------------------------------------

    def submit(
        self, request_id: str, spec: Any, *, seq: int | None = None, max_tokens: int | None = None
    ) -> Outcome:
        """Admit one request for compilation; never raises for bad input.

        Parameters
        ----------
        request_id:
            Unique among live requests, 1..1024 characters.
        spec:
            The ``structured_outputs`` mapping (vLLM names).
        seq:
            Pins the sequence number (later pipeline stages pass stage 0's);
            it must increase.
        max_tokens:
            The request's token budget: a grammar whose shortest output
            needs more fails at once with ``grammar_unreachable_end``.

        Returns
        -------
        Outcome
            ``failed`` at once (bad spec, poisoned key, bad id or seq, with
            a code), else ``pending`` or ``waiting`` until a ``step``
            decides.
        """
        outcome = self._manager.add(request_id, spec, seq=seq, max_tokens=max_tokens)
        if outcome.status == "failed" and self._notes is not None:
            self._notes.refused(outcome)
        return outcome

    def request_state(self, request_id: str) -> str:
        """``waiting`` | ``pending`` (compiling or undecided) | ``running`` | ``unknown``.

        A request leaves ``pending`` only through a ``step`` decision,
        identically on every rank of its group; ``unknown`` covers
        finished, aborted and failed requests.
        """
        return self._manager.state_of(request_id)

    @property
    def num_undecided(self) -> int:
        """Requests submitted and not yet decided (pending or waiting)."""
        return self._manager.num_pending + self._manager.num_waiting

    def release(self, request_id: str) -> bool:
        """The request ended (finished, aborted or failed): drop it wherever it is.

        Call it on every rank of the group at the same point. Unknown ids
        are ignored; the compiled grammar stays in the cache. Returns
        whether the request was live here.
        """
        if self._on_end is not None:
            self._on_end(request_id)
        return self._manager.release(request_id)

    def compiled(self, request_id: str) -> Any:
        """The admitted request's compiled grammar (``xgrammar.CompiledGrammar``).

        Hosts build their own matchers over it (vLLM's and SGLang's grammar
        objects). Raises ``KeyError`` for a request not admitted.
        """
        return self._manager.compiled(request_id)

    def lookup(self, spec: Any) -> Lookup:
        """What the caches hold for ``spec`` now, submitting nothing.

        Its key, and its compiled grammar on a cache hit or the failed
        outcome of a poisoned key. The same on every rank of the group (the
        caches change only at agreed points), so a host may serve a hit or
        refuse a poisoned key without a ``step``.
        """
        gspec = self._validated(spec)
        if gspec is None:
            return Lookup(None, None, None)
        return self._manager.lookup(gspec)

    def poison(self, spec: Any, code: ErrorCode, message: str) -> bool:
        """Poison ``spec``'s key on this rank (a host's own compile timeout); whether it did."""
        gspec = self._validated(spec)
        return gspec is not None and self._manager.poison_here(gspec, code, message)

    def _validated(self, spec: Any) -> GrammarSpec | None:
        m = self._manager
        try:
            return validate_spec(spec, m.config, vocab=m.tokenizer.name)
        except SpecError:
            return None

    def clear_cache(self) -> None:
        """Drop the compiled grammars (a host's cache flush); poisoned keys stay."""
        self._manager.clear_compiled()

    def compiled_here(self, request_id: str) -> bool:
        """Whether this rank's own compile of ``request_id`` ended (the decision may not have)."""
        return self._manager.compiled_here(request_id)

    def wait_warm(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until the spec store's warm start ended; whether it did."""
        return self._manager.wait_warm(timeout_s)

    def wait_compiles(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s`` on the oldest unfinished compile (never spins); whether done."""
        return self._manager.wait_pending(timeout_s)

    @property
    def num_live(self) -> int:
        """Requests held anywhere (queued, pending or running); 0 when idle."""
        return self._manager.num_live

    @property
    def num_collectives(self) -> int:
        """Agreement collectives this rank has run."""
        c = self._coordinator
        return c.agreement.collectives if c is not None and c.agreement is not None else 0

    @property
    def group_size(self) -> int:
        """Members of this rank's agreement group (1 when it decides alone)."""
        c = self._coordinator
        return len(c.agreement.members) if c is not None and c.agreement is not None else 1

    # -- per step ---------------------------------------------------------------

    def step(self, step: int, *, busy: bool | None = None) -> StepOutcome:
        """The per-step collective: agree on readiness and apply the decision.

        Parameters
        ----------
        step:
            The step number; it must increase, and every member of the
            agreement group must be at the same step.
        busy:
            Stage-0 leaders of partitioned replicas: whether this replica
            still has work. The vote rides on the posted poison exchange and
            settles ``distributed.poison_lag_steps`` steps later as
            ``StepOutcome.all_idle``, the same on every replica.

        Returns
        -------
        StepOutcome
            Requests admitted and failed this step, identically on every
            rank of the group; ``stage_failed`` lists those that only this
            pipeline stage could not compile in time.

        Raises
        ------
        PeerLostError, DivergenceError
            Infrastructure failures; they end the run.
        """
        coordinator = self._coordinator
        result = None
        if coordinator is None:
            outcomes = self._manager.step(step, keep_failures=self._share is not None)
            if self._share is not None:
                self._share(self._manager.new_failures())
            ready: frozenset[int] = frozenset()
        else:
            result = coordinator.step(step, self._manager, busy=busy)
            outcomes = result.outcome
            ready = frozenset(result.decision.ready)
        admitted = [o for o in outcomes if o.status == "admitted"]
        failed = [o for o in outcomes if o.status == "failed"]
        if self._notes is not None:
            decision = result.decision if result is not None else None
            self._notes.send(step, outcomes, decision, result.poison if result else ())
        if admitted and self._on_admitted is not None:
            self._on_admitted(admitted)
        all_idle = None
        if result is not None and result.vote is not None:
            all_idle = not result.vote[1]
        if busy is not None and self._posted_share() is None:
            all_idle = self.all_done(step, not busy)  # no posted exchange: vote now
        return StepOutcome(
            admitted, failed, [o for o in failed if o.seq in ready], all_idle=all_idle
        )

    def carry_poison(self, records: list[PoisonRecord]) -> None:
        """Poison keys an earlier attempt of this run found invalid (before step 0).

        Every stage leader of the world calls it with the same records (a
        restarted or resumed run reads them from its journal), so the caches
        stay identical; a bad schema is not compiled again after a restart.
        """
        self._manager.apply_poison(records)

    # -- across replicas ----------------------------------------------------------

    def share_failures(self, to: Callable[[list[PoisonRecord]], None]) -> None:
        """Hand the keys this rank poisons, deciding alone, to ``to`` after each step."""
        self._share = to

    def exchange_poison(self, sync: int) -> int:
        """Share newly failed grammar keys with the other replicas now.

        With ``distributed.poison_exchange: host`` the exchange leaves
        ``step``, so replicas with partitioned streams step at their own
        rates; the host calls this on every replica's stage-0 leader at one
        of its own sync points (``sync`` numbers them). With ``step`` (the
        default) it is not needed. A no-op outside the poison group.

        Returns
        -------
        int
            Keys shared (identical on every replica).

        Raises
        ------
        PeerLostError
            A replica died or hung.
        """
        if self._coordinator is None:
            return 0
        return len(self._coordinator.exchange_poison(sync, self._manager))

    @property
    def poison_lag_steps(self) -> int:
        """Steps between posting a failure to the other replicas and its arrival there.

        ``distributed.poison_lag_steps`` where ``step`` posts a poison
        exchange (stage leaders of partitioned replicas), else 0.
        """
        share = self._posted_share()
        return share.lag_steps if share is not None else 0

    def _posted_share(self) -> PoisonShare | None:
        coordinator = self._coordinator
        if coordinator is None or not coordinator.poison_in_step:
            return None
        return coordinator.poison

    def all_done(self, step: int, done: bool) -> bool:
        """Whether every replica's stage-0 leader is done (one tiny all_gather, now).

        For hosts that end a phase together (``integrations.hf``); a step
        loop votes through ``step(n, busy=...)`` instead, off the critical
        path. Call it on every stage-0 leader at the same point; without
        peers it returns ``done``.
        """
        comm = self._comm
        if comm is None or not comm.members("replicas"):
            return done
        row = np.array([0 if done else 1], dtype=np.int64)
        got = comm.all_gather("replicas", row, operation="done vote", step=step)
        return not got.any()

    # -- teardown -----------------------------------------------------------------

    def settle(self) -> None:
        """Settle the posted poison exchange (every replica, at session close)."""
        if self._coordinator is not None:
            self._coordinator.settle()

    def close(self) -> None:
        """Stop the compile pool."""
        self._manager.close()
