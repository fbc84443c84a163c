"""The per-rank session: one attach, and the role objects a rank's role holds.

Engines embed it, and gramcoord's own step loop (``engine``)
uses nothing else. One ``RankSession`` per process; it joins the world
(``local``, ``start`` or ``attach``), checks the vocabulary, connects the
bitmask transport and builds the roles of this rank in the
``ParallelLayout``. Their collaborators are private.

=================  ==========================================================
role               calls
=================  ==========================================================
``leader``         ``StageLeader``, every stage leader: ``submit``, ``step``,
                   ``finish``, ``abort``, ``request_state``
``masks``          ``StageMasks``, the last stage's leader: ``bitmask``,
                   ``publish``, ``apply``, ``commit``, ``advance``,
                   ``validate_drafts``, ``rollback``, ``jump_forward``
``reader``         ``MaskReader``, the last stage's TP workers: ``receive``,
                   ``apply``, ``commit``, ``release``
``follower``       ``TpFollower``, a TP worker with a scheduler of its own
                   (``parallel.tp_followers``): the leader's calls; on the
                   last stage it has ``masks`` too
=================  ==========================================================

The step's order, per role, is in ``engine.loop`` (our loop)
and docs/embedding.md (a host's). A role a rank does not hold raises
``RoleError`` with the rank's role; ``has(name)`` asks first.
"""

from __future__ import annotations

import contextlib
import logging
import secrets

import msgspec
import numpy as np

from gramcoord.coordinator.byte_link import ByteLink
from gramcoord.coordinator.config import ParallelConfig
from gramcoord.coordinator.external import FORCED_COMPILE_MODE, attach_external
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.runtime import Runtime
from gramcoord.rank_worker.faults import RankFaults
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.session.followers import TpFollower
from gramcoord.rank_worker.session.leader import StageLeader, StepOutcome
from gramcoord.rank_worker.session.reader import FollowerRows, MaskReader
from gramcoord.rank_worker.session.roles import ROLE_NAMES, RoleSet, build_roles
from gramcoord.rank_worker.session.stage_masks import StageMasks
from gramcoord.rank_worker.session.types import (
    MaskBatch,
    RoleError,
    SessionConfig,
    SessionStats,
    StaleGrammarState,
    VocabularyMismatch,
)

# The value types are re-exported: callers may import them from here or from
# the package.
__all__ = [
    "MaskBatch",
    "RankSession",
    "RoleError",
    "SessionConfig",
    "SessionStats",
    "StaleGrammarState",
    "StepOutcome",
    "VocabularyMismatch",
]

logger = logging.getLogger(__name__)


class RankSession:
    """One rank's structured-output session; build with a classmethod.

    Public context every role shares: ``layout``, ``rank``, ``tokenizer``,
    ``config``, ``runtime`` (the control groups, ``None`` alone), ``link``
    (point-to-point bytes to other ranks, for the host's own frames) and
    ``faults``. The grammar work goes through the roles.

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
        self.is_leader = layout.is_stage_leader(rank)
        self.is_last_stage = layout.is_last_stage(rank)
        self.link = ByteLink(runtime) if runtime is not None else None
        self.faults = RankFaults.of(config.faults, rank)
        self._stats = SessionStats()
        self._roles = RoleSet()
        # Start-up exchanges wait up to init_timeout_s: a peer still building
        # its ring under load is slow, not lost.
        startup = runtime.startup() if runtime is not None else contextlib.nullcontext()
        try:
            with startup:
                if runtime is not None:
                    self._check_vocabulary()
                build_roles(
                    layout,
                    rank,
                    runtime,
                    self.link,
                    tokenizer,
                    config,
                    faults=self.faults,
                    stats=self._stats,
                    run_id=run_id or secrets.token_hex(4),
                    into=self._roles,
                )
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
            Compile inline at admission (the external launcher's default,
            ``coordinator.external``), so readiness needs no collective. ``False``
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

    # -- the roles ------------------------------------------------------------------

    def has(self, role: str) -> bool:
        """Whether this rank holds ``role`` (``leader``, ``follower``, ``masks``, ``reader``)."""
        return role in ROLE_NAMES and getattr(self._roles, role) is not None

    def _role(self, name: str):
        obj = getattr(self._roles, name)
        if obj is None:
            c = self.layout.coords(self.rank)
            held = ", ".join(self._roles.held()) or "none (it only computes)"
            raise RoleError(
                f"[rank {self.rank}] (dp {c.dp}, pp {c.pp}, tp {c.tp}) has no {name!r} role; "
                f"its roles: {held}"
            )
        return obj

    @property
    def leader(self) -> StageLeader:
        """The stage leader's calls (every pipeline stage's leader)."""
        return self._role("leader")

    @property
    def follower(self) -> TpFollower:
        """A scheduling TP worker's calls (``parallel.tp_followers``)."""
        return self._role("follower")

    @property
    def masks(self) -> StageMasks | FollowerRows:
        """The last stage's mask calls (its leader; TP followers there)."""
        return self._role("masks")

    @property
    def reader(self) -> MaskReader:
        """A last-stage TP worker's calls: receive, apply, commit, release."""
        return self._role("reader")

    # -- lifecycle -------------------------------------------------------------------

    @property
    def stats(self) -> SessionStats:
        """Typed counters: the manager's, jump-forward's, masks and transport."""
        return self._roles.count(self._stats)

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
        runtime = self.runtime
        parts = self._roles.closers(drain=drain, reason=reason)
        parts.append(("runtime", (lambda: runtime.close(drain=drain)) if runtime else None))
        for what, fn in parts:
            if fn is None:
                continue
            try:
                fn()
            except Exception as exc:  # one failing part still lets the others go
                logger.warning("[rank %d] closing the %s failed: %s", self.rank, what, exc)
        self._roles.rows_reader = self._roles.channel = self._roles.manager = None
        self.runtime = None
