"""The per-rank session: the one object that drives a rank's structured output.

Engines embed it, and gramcoord's own step loop (``rank_worker.engine``)
uses nothing else. One ``RankSession`` per process; what it holds depends
on the rank's role in the ``ParallelLayout``:

================  =======================================================
role              holds
================  =======================================================
stage leader      a ``GrammarManager`` and its per-step ``Admission``
last-stage leader also the grammar states, the ``BitmaskBuilder``,
                  jump-forward and (tp > 1) the bitmask channel writer
last-stage worker a ``MaskReader``: receives, applies and releases rows
other TP workers  nothing grammar-related
================  =======================================================

Calls, in step order (see DESIGN section 14):

- ``submit(request_id, spec)``: stage leaders, on arrival, in the same order
  on every leader of a chain; never raises.
- ``step(n, busy=...)``: every stage leader, once per step, at a point
  every rank reaches, whether or not constrained requests are scheduled:
  the agreement, the posted poison exchange (with the end-of-run vote) and
  the decision down the chain.
- ``bitmask(ids, drafts)`` then ``publish(n, batch)``: the last-stage leader,
  while the logits are computed.
- ``apply(logits, batch, ...)``: every last-stage rank (leader and workers).
- ``advance`` / ``validate_drafts`` / ``rollback`` / ``jump_forward``: the
  last-stage leader, after sampling.
- ``finish`` / ``abort``: every stage leader; ``close`` everyone.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import Any

import msgspec
import numpy as np

from gramcoord.coordinator.config import ParallelConfig
from gramcoord.coordinator.errors import CoordinatorError
from gramcoord.coordinator.external import FORCED_COMPILE_MODE, attach_external
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.links import ByteLink
from gramcoord.coordinator.runtime import Runtime
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.faults import RankFaults
from gramcoord.rank_worker.grammars.admission import Admission, stage_wait_s
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.manager import GrammarManager, Outcome
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.bitmask import BitmaskBuilder
from gramcoord.rank_worker.masks.gate import Gate
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.masks.jump_forward import JumpForward
from gramcoord.rank_worker.session.applier import MaskApplier
from gramcoord.rank_worker.session.followers import (
    FollowerBook,
    FollowerNote,
    decided,
    decode_note,
    encode_note,
)
from gramcoord.rank_worker.session.masks import SessionMasks
from gramcoord.rank_worker.session.reader import MaskReader
from gramcoord.rank_worker.session.types import (
    MaskBatch,
    SessionConfig,
    SessionStats,
    StaleGrammarState,
    StepOutcome,
    VocabularyMismatch,
)
from gramcoord.sync.channel import BitmaskChannel, ChannelHandle

# The value types are re-exported: callers may import them from here or from
# the package.
__all__ = [
    "MaskBatch",
    "RankSession",
    "SessionConfig",
    "SessionStats",
    "StaleGrammarState",
    "StepOutcome",
    "VocabularyMismatch",
]

logger = logging.getLogger(__name__)


class RankSession(SessionMasks):
    """One rank's structured-output session; build with a classmethod.

    Parameters
    ----------
    layout:
        The world's layout.
    rank:
        This rank.
    runtime:
        The control runtime, or ``None`` for a single process.
    tokenizer:
        The vocabulary; its name is part of every grammar key.
    config:
        The session's config sections.
    run_id:
        Names this run's shared-memory segments and sockets.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        rank: int,
        runtime: Runtime | None,
        tokenizer: Tokenizer,
        config: SessionConfig,
        *,
        run_id: str | None = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.config = config
        self.k = config.speculative.num_tokens
        self.is_leader = layout.is_stage_leader(rank)
        self.is_last_stage = layout.is_last_stage(rank)
        # TP workers with schedulers of their own follow the leader's steps.
        self.followers = config.parallel.tp_followers if layout.tp > 1 else "none"
        self.is_follower = not self.is_leader and self.followers != "none"
        self.book: FollowerBook | None = None
        self._submit_failed: list[Outcome] = []
        self.link = ByteLink(runtime) if runtime is not None else None
        self.manager: GrammarManager | None = None
        self.admission: Admission | None = None
        self.builder: BitmaskBuilder | None = None
        self.jump: JumpForward | None = None
        self.channel: BitmaskChannel | None = None
        self.reader: MaskReader | None = None
        self.applier: MaskApplier | None = None
        self._states: dict[str, GrammarState] = {}
        self._awaiting: set[str] = set()
        self._gate = Gate.from_config(config.grammar)
        self._stats = SessionStats()
        self.faults = RankFaults.of(config.faults, rank)
        width = (tokenizer.vocab_size + 31) // 32
        max_seqs = config.scheduler.max_num_seqs
        # Start-up exchanges wait up to init_timeout_s: a peer still building
        # its ring under load is slow, not lost.
        startup = runtime.startup() if runtime is not None else contextlib.nullcontext()
        try:
            with startup:
                if runtime is not None:
                    self._check_vocabulary()
                if self.is_follower and self.followers == "read":
                    self.book = FollowerBook()
                if self.is_leader or (self.is_follower and self.followers == "fill"):
                    compile_fn = None
                    if self.faults.compile_delay is not None:
                        limit = int(config.grammar.cache_limit_mb * 2**20)
                        compile_fn = self.faults.wrap_compile(
                            XGrammarBackend(tokenizer, cache_limit_bytes=limit)
                        )
                    self.manager = GrammarManager(config.grammar, tokenizer, compile_fn=compile_fn)
                if self.is_leader:
                    self.admission = (
                        Admission.build(self.manager, layout, runtime, config.distributed)
                        if runtime is not None
                        else Admission(self.manager, None)
                    )
                if self.is_last_stage:
                    self.applier = MaskApplier(
                        width, max_num_seqs=max_seqs, num_speculative_tokens=self.k
                    )
                if self.is_last_stage and self.manager is not None:
                    self.builder = BitmaskBuilder(
                        tokenizer.vocab_size, max_num_seqs=max_seqs, num_speculative_tokens=self.k
                    )
                    if tokenizer.can_encode:
                        self.jump = JumpForward.from_config(config.grammar, tokenizer)
                    elif config.grammar.jump_forward:
                        logger.warning(
                            "[rank %d] jump-forward is off: vocabulary %r came without an encoder",
                            rank,
                            tokenizer.name,
                        )
                if self.is_last_stage and layout.tp > 1 and self.followers != "fill":
                    self._connect_transport(run_id or secrets.token_hex(4))
        except BaseException:
            self.close()
            raise

    # -- construction ---------------------------------------------------------

    @classmethod
    def local(cls, tokenizer: Tokenizer, config: SessionConfig | None = None) -> RankSession:
        """A one-process session (no torch.distributed): the reference topology.

        Parameters
        ----------
        tokenizer:
            The vocabulary.
        config:
            The session's sections; the defaults when ``None``.

        Returns
        -------
        RankSession
            Rank 0 of a world of one: stage leader, last stage, no TP workers.
        """
        config = config or SessionConfig()
        layout = ParallelLayout.build(ParallelConfig(), 1)
        return cls(layout, 0, None, tokenizer, config)

    @classmethod
    def start(
        cls, tokenizer: Tokenizer, config: SessionConfig, *, rank: int, run_id: str | None = None
    ) -> RankSession:
        """Create the world (``MASTER_ADDR``/``MASTER_PORT`` rendezvous) and join it.

        Parameters
        ----------
        tokenizer:
            The vocabulary; every rank must pass the same one.
        config:
            The session's sections; ``parallel`` gives the world size.
        rank:
            This process's rank in the ``ParallelLayout``.
        run_id:
            Names the run's shared-memory segments and sockets.

        Raises
        ------
        CoordinatorError, PeerLostError
            The rendezvous or the control groups failed.
        VocabularyMismatch
            Ranks passed different vocabularies.
        """
        layout = ParallelLayout.build(config.parallel, config.parallel.world_size)
        if layout.world_size == 1:
            return cls(layout, 0, None, tokenizer, config, run_id=run_id)
        runtime = Runtime.start(layout, rank=rank, distributed=config.distributed)
        try:
            return cls(layout, rank, runtime, tokenizer, config, run_id=run_id)
        except BaseException:
            runtime.close(drain=False)
            raise

    @classmethod
    def attach(
        cls,
        tokenizer: Tokenizer,
        config: SessionConfig,
        *,
        run_id: str | None = None,
        force_sync: bool = True,
    ) -> RankSession:
        """Join a world the host made (external launcher).

        Parameters
        ----------
        tokenizer:
            The host's vocabulary (``Tokenizer.from_info`` / ``from_hf``).
        config:
            The session's sections; ``parallel.dp`` may be left at 1 (it is
            derived from the world size).
        run_id:
            Names the run's shared-memory segments and sockets.
        force_sync:
            Compile inline at admission (the external-launcher default of
            DESIGN section 2), so readiness needs no collective. ``False``
            keeps ``grammar.compile_mode`` as configured: with ``async`` the
            host must call ``step`` on every rank every step, and the
            agreement then keeps the ranks' batches identical however their
            compile times differ.
        """
        world = attach_external(config.parallel, config.distributed)
        if force_sync:
            grammar = msgspec.structs.replace(config.grammar, compile_mode=FORCED_COMPILE_MODE)
            config = msgspec.structs.replace(config, grammar=grammar)
        else:
            logger.info(
                "[rank %d] external launcher with compile_mode %r kept (force_sync=False)",
                world.runtime.rank,
                config.grammar.compile_mode,
            )
        try:
            return cls(
                world.layout, world.runtime.rank, world.runtime, tokenizer, config, run_id=run_id
            )
        except BaseException:
            world.runtime.close(drain=False)
            raise

    def _check_vocabulary(self) -> None:
        """Every rank must hold the same vocabulary (one all_gather, at attach)."""
        mine = np.array([self.tokenizer.fingerprint(), self.tokenizer.vocab_size], np.int64)
        got = self.runtime.all_gather("world", mine, operation="vocabulary check", step=-1)
        ranks = self.runtime.members("world")
        odd = tuple(r for r, row in zip(ranks, got) if not (row == got[0]).all())
        if odd:
            raise VocabularyMismatch(
                f"[rank {self.rank}] ranks {list(odd)} attached a different vocabulary than "
                f"rank {ranks[0]} (this rank: {self.tokenizer.name!r}, "
                f"{self.tokenizer.vocab_size} tokens); every rank must pass the same "
                "tokenizer and vocabulary name",
                ranks=odd,
            )

    def _connect_transport(self, run_id: str) -> None:
        assert self.link is not None
        c = self.layout.coords(self.rank)
        group = self.layout.tp_group(c.dp, c.pp)
        vocab = self.tokenizer.vocab_size
        if self.is_leader:
            names = [f"rank{r}" for r in group[1:]]
            self.channel = BitmaskChannel(
                readers=names,
                vocab_size=vocab,
                max_rows=self.config.scheduler.max_num_seqs * (1 + self.k),
                config=self.config.transport,
                run_id=run_id,
                label=f"dp{c.dp}",
                corrupt_every=self.faults.corrupt_every,
            )
            data = msgspec.msgpack.encode(self.channel.handle)
            for r in group[1:]:
                self.link.send(r, data, operation="transport handle", step=-1)
            self.channel.accept()
            logger.info("[rank %d] bitmask channel: %s", self.rank, self.channel.modes)
        else:
            data = self.link.recv(group[0], operation="transport handle", step=-1)
            handle = msgspec.msgpack.decode(data, type=ChannelHandle)
            self.reader = MaskReader.connect(handle, f"rank{self.rank}", vocab_size=vocab)

    # -- admission (stage leaders) ---------------------------------------------

    def submit(self, request_id: str, spec: Any, *, seq: int | None = None) -> Outcome:
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

        Returns
        -------
        Outcome
            ``failed`` at once (bad spec, poisoned key, bad id or seq, with
            a code), else ``pending`` or ``waiting`` until a ``step``
            decides.
        """
        if self.book is not None:
            return self.book.add(request_id, seq)
        manager = self._need("submit", self.manager)
        try:
            outcome = manager.add(request_id, spec, seq=seq)
            if outcome.status == "failed" and self.followers != "none" and self.is_leader:
                self._submit_failed.append(outcome)
            return outcome
        except ValueError as exc:  # a sequence number that does not increase
            return Outcome(
                request_id=request_id if isinstance(request_id, str) else str(request_id)[:64],
                seq=-1 if seq is None else seq,
                status="failed",
                code=ErrorCode.bad_request_id.name,
                message=f"bad sequence number: {exc}",
            )

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
        if self.is_follower:
            return self._follow(step)
        admission = self._need("step", self.admission)
        outcomes = admission.step(step, busy=busy)
        admitted = [o for o in outcomes if o.status == "admitted"]
        failed = [o for o in outcomes if o.status == "failed"]
        if self.followers != "none" and self.is_leader and self.link is not None:
            self._lead(step, outcomes, admission)
        self._start_states(admitted)
        ready = admission.last_ready
        vote = admission.last_result.vote if admission.last_result is not None else None
        all_idle = None if vote is None else not vote[1]
        if busy is not None and self._share_in_step() is None:
            all_idle = self.all_done(step, not busy)  # no posted exchange: vote now
        return StepOutcome(
            admitted, failed, [o for o in failed if o.seq in ready], all_idle=all_idle
        )

    def _lead(self, step: int, outcomes: list[Outcome], admission: Admission) -> None:
        result = admission.last_result
        note = FollowerNote(
            step=step,
            decided=decided(self._submit_failed + outcomes),
            decision=result.decision if result is not None else None,
            poison=result.poison if result is not None else (),
        )
        self._submit_failed = []
        data = encode_note(note)
        c = self.layout.coords(self.rank)
        for r in self.layout.tp_group(c.dp, c.pp)[1:]:
            self.link.send(r, data, operation="follower note", step=step)

    def _follow(self, step: int) -> StepOutcome:
        c = self.layout.coords(self.rank)
        data = self.link.recv(self.layout.leader(c.dp, c.pp), operation="follower note", step=step)
        note = decode_note(data)
        if note.step != step:
            raise CoordinatorError(
                f"[rank {self.rank}] follower at step {step} got the leader's step {note.step}"
            )
        if self.book is not None:
            admitted, failed = self.book.resolve(note)
            return StepOutcome(admitted, failed, [])
        manager = self.manager
        if note.poison:
            manager.apply_poison(note.poison)
        outcomes: list[Outcome] = []
        if note.decision is not None:
            wait = stage_wait_s(
                self.config.grammar.compile_timeout_s, self.config.distributed.step_timeout_s
            )
            outcomes = manager.apply_decision(note.decision, wait_s=wait)
        manager.new_failures()  # the leader shares failures; a follower's copy is redundant
        leader = {d.seq: d for d in note.decided}
        admitted = [o for o in outcomes if o.status == "admitted"]
        failed = [o for o in outcomes if o.status == "failed"]
        stage_failed = [o for o in failed if o.seq in leader and leader[o.seq].status == "admitted"]
        self._start_states(admitted)
        return StepOutcome(admitted, failed, stage_failed)

    def _start_states(self, admitted: list[Outcome]) -> None:
        if self.builder is not None:
            for o in admitted:
                self._states[o.request_id] = GrammarState.from_matcher(
                    self.manager.matcher(o.request_id),
                    vocab_size=self.tokenizer.vocab_size,
                    gate=self._gate,
                )

    def exchange_poison(self, sync: int) -> int:
        """Share newly failed grammar keys with the other replicas now.

        With ``distributed.poison_exchange: host`` the exchange leaves
        ``step``, so replicas with partitioned streams step at their own
        rates (no collective across replicas inside ``step``); the host calls
        this on every replica's stage-0 leader at one of its own sync points
        (``sync`` numbers them). With ``step`` (the default) it is not
        needed. The keys apply from the next ``step`` on, on every stage at
        once. A no-op on ranks outside the poison group.

        Parameters
        ----------
        sync:
            The host's sync point, increasing; labels errors.

        Returns
        -------
        int
            Keys shared (identical on every replica).

        Raises
        ------
        PeerLostError
            A replica died or hung.
        """
        admission = self.admission
        if admission is None or admission.coordinator is None:
            return 0
        return len(admission.coordinator.exchange_poison(sync, admission))

    @property
    def poison_lag_steps(self) -> int:
        """Steps between posting a failure to the other replicas and its arrival there.

        ``distributed.poison_lag_steps`` where ``step`` posts a poison
        exchange (stage leaders of partitioned replicas), else 0.
        """
        share = self._share_in_step()
        return share.lag_steps if share is not None else 0

    def _share_in_step(self):
        """The poison exchange ``step`` posts, or None (no replicas, or ``host`` mode)."""
        coordinator = self.admission.coordinator if self.admission is not None else None
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
        if self.runtime is None or not self.runtime.members("replicas"):
            return done
        row = np.array([0 if done else 1], dtype=np.int64)
        got = self.runtime.all_gather("replicas", row, operation="done vote", step=step)
        return not got.any()

    def request_state(self, request_id: str) -> str:
        """``waiting`` | ``pending`` (compiling or undecided) | ``running`` | ``unknown``.

        Stage leaders only. A request leaves ``pending`` only through a
        ``step`` decision, identically on every rank of its group;
        ``unknown`` covers finished, aborted and failed requests.
        """
        if self.book is not None:
            return self.book.state_of(request_id)
        return self._need("request_state", self.manager).state_of(request_id)

    # -- lifecycle -------------------------------------------------------------

    def finish(self, request_id: str) -> None:
        """Forget a finished request (every stage leader, the same step).

        Parameters
        ----------
        request_id:
            The request; unknown ids are ignored.
        """
        self._states.pop(request_id, None)
        self._awaiting.discard(request_id)
        if self.book is not None:
            self.book.forget(request_id)
        if self.manager is not None:
            self.manager.finish(request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (queued, pending or running).

        Parameters
        ----------
        request_id:
            The request.

        Returns
        -------
        bool
            Whether it was live.
        """
        self._states.pop(request_id, None)
        self._awaiting.discard(request_id)
        if self.book is not None:
            return self.book.forget(request_id)
        return self.manager.abort(request_id) if self.manager is not None else False

    @property
    def stats(self) -> SessionStats:
        """Typed counters: the manager's, jump-forward's, masks and transport."""
        s = self._stats
        s.manager = self.manager.stats if self.manager is not None else None
        s.jump_forward = self.jump.stats if self.jump is not None else None
        if self.channel is not None:
            s.transport_dropped = self.channel.dropped
            s.transport_corrupted = self.channel.corrupted
        elif self.reader is not None:
            s.transport_dropped = self.reader.dropped
        return s

    def close(self, *, drain: bool = True, reason: str | None = None) -> None:
        """Release the transport, the compile pool and the control groups.

        Parameters
        ----------
        drain:
            Complete sends still in flight first (``False`` after a failure).
        reason:
            Why the session ends early (the error); a TP leader passes it to
            its workers with the channel's shutdown, so a worker that stops
            because of it names the cause, not just "channel closed".
        """
        coordinator = self.admission.coordinator if self.admission is not None else None
        channel = self.channel
        close_channel = None
        if channel is not None:
            close_channel = (lambda: channel.close(reason)) if reason else channel.close
        for what, fn in (
            ("reader", self.reader.close if self.reader else None),
            ("channel", close_channel),
            ("poison exchange", coordinator.settle if coordinator and drain else None),
            ("manager", self.manager.close if self.manager else None),
            ("runtime", (lambda: self.runtime.close(drain=drain)) if self.runtime else None),
        ):
            if fn is None:
                continue
            try:
                fn()
            except Exception as exc:  # one failing part still lets the others go
                logger.warning("[rank %d] closing the %s failed: %s", self.rank, what, exc)
        self.reader = self.channel = None
        self.manager = None
        self.runtime = None
