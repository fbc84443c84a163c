"""Per-step admission of one stage leader: the coordinator meets the manager.

``Admission`` adapts a ``GrammarManager`` to the coordinator's ``Member``
calls and runs one step:

- deciders report ``manager.local_status()``, share new failures, and apply
  the agreed decision;
- later pipeline stages (``pp_sync: chain``) apply stage 0's decision as it
  is. An admitted request whose local compile has not finished is waited
  for, all of them against one deadline (``grammar.compile_timeout_s`` by
  default); whatever is still not compiled then fails with
  ``grammar_stage_timeout``. A stage never hangs on a compile.

With no coordinator (one rank) it falls back to ``manager.step()``.

NOTE: a gloo send completes only once its receiver has posted the receive,
and stage 0 drains its previous send before the next one. A later stage
that waits for compiles therefore holds stage 0 back by as long, so the
wait is capped at ``STAGE_WAIT_SHARE`` of the step timeout: stage 0 must
never mistake a waiting stage for a lost one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.coordinator import Coordinator
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.runtime import Comm
from gramcoord.coordinator.status import Decision, LocalStatus, PoisonRecord
from gramcoord.rank_worker.grammars.manager import GrammarManager, Outcome

logger = logging.getLogger(__name__)

STAGE_WAIT_SHARE = 0.5


def stage_wait_s(compile_timeout_s: float, step_timeout_s: float) -> float:
    """How long a rank that follows a decision waits for its own compiles, per step.

    A later pipeline stage and a ``fill`` TP follower both wait up to the
    compile timeout, capped at ``STAGE_WAIT_SHARE`` of the step timeout:
    the rank that decided must never take a waiting follower for a lost one.
    """
    return min(compile_timeout_s, step_timeout_s * STAGE_WAIT_SHARE)


class Admission:
    """One stage leader's admission step.

    Parameters
    ----------
    manager:
        This rank's grammar manager.
    coordinator:
        The rank's coordinator, or ``None`` on a single rank.
    stage_wait_s:
        How long a later stage waits, per step, for local compiles of
        requests stage 0 admitted; defaults to ``compile_timeout_s``
        (``build`` caps it at half the step timeout).
    """

    def __init__(
        self,
        manager: GrammarManager,
        coordinator: Coordinator | None,
        *,
        stage_wait_s: float | None = None,
    ) -> None:
        self.manager = manager
        self.coordinator = coordinator
        self.stage_wait_s = (
            manager.config.compile_timeout_s if stage_wait_s is None else stage_wait_s
        )
        self.follower = coordinator is not None and not coordinator.decider
        # Sequence numbers the last decision admitted: a failed outcome among
        # them failed on this stage alone (e.g. grammar_stage_timeout).
        self.last_ready: frozenset[int] = frozenset()
        # The last coordinator step (decision and poison), for TP followers.
        self.last_result = None

    @classmethod
    def build(
        cls,
        manager: GrammarManager,
        layout: ParallelLayout,
        comm: Comm,
        distributed: DistributedConfig,
    ) -> Admission:
        """Admission for ``comm.rank`` (a stage leader), sized from the manager's config."""
        coordinator = None
        wait = manager.config.compile_timeout_s
        if layout.pp > 1:  # only later stages follow stage 0's decisions
            wait = stage_wait_s(wait, distributed.step_timeout_s)
        if wait < manager.config.compile_timeout_s:
            logger.warning(
                "[rank %d] later stages wait at most %.1fs for compiles (half the step timeout), "
                "not compile_timeout_s=%.1fs",
                comm.rank,
                wait,
                manager.config.compile_timeout_s,
            )
        if layout.world_size > 1:
            coordinator = Coordinator.from_config(
                layout,
                comm,
                distributed,
                max_pending=manager.config.max_pending,
                compile_mode=manager.config.compile_mode,
            )
        return cls(manager, coordinator, stage_wait_s=wait)

    def step(self, step: int, *, busy: bool | None = None) -> list[Outcome]:
        """Run step ``step``; returns the outcomes of requests admitted or failed.

        ``busy``: this replica's end-of-run vote (see ``Coordinator.step``).

        Raises
        ------
        DivergenceError, PeerLostError
            From the coordinator; both end the step loop.
        """
        if self.coordinator is None:
            return self.manager.step()
        result = self.coordinator.step(step, self, busy=busy)
        self.last_ready = frozenset(result.decision.ready)
        self.last_result = result
        return result.outcome

    # -- coordinator.Member ---------------------------------------------------

    def local_status(self) -> LocalStatus:
        return self.manager.local_status()

    def new_failures(self) -> list[PoisonRecord]:
        return self.manager.new_failures()

    def apply_poison(self, records: Sequence[PoisonRecord]) -> None:
        self.manager.apply_poison(records)

    def apply_decision(self, decision: Decision) -> list[Outcome]:
        if not self.follower:
            return self.manager.apply_decision(decision)
        # One deadline for the whole decision; the manager owns the wait.
        outcomes = self.manager.apply_decision(decision, wait_s=self.stage_wait_s)
        # Stage 0 already shares these keys; a follower's copy is redundant.
        self.manager.new_failures()
        late = [o for o in outcomes if o.code == "grammar_stage_timeout"]
        if late:
            logger.warning(
                "[rank %d] step %d: %d admitted requests not compiled here within %.1fs: %s",
                self.coordinator.rank if self.coordinator else 0,
                decision.step,
                len(late),
                self.stage_wait_s,
                [o.request_id for o in late],
            )
        return outcomes
