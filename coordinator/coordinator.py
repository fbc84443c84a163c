"""One stage leader's per-step coordination: poison exchange, agreement, chain.

A ``Coordinator`` drives a ``Member`` -- in production the rank's
``GrammarManager`` itself, driven by ``rank_worker.session.leader`` -- through one step:

decider (stage 0, or every stage leader with ``pp_sync: collective``)
    1. post new failures (and the end-of-run vote) to the DP leaders, and
       apply the union posted ``lag`` steps ago (``poison_share``);
    2. take the member's local status and agree on a decision;
    3. send the decision and the poison down the chain;
    4. apply the decision to the member.

follower (a later stage with ``pp_sync: chain``)
    1. receive stage 0's decision and poison (forwarding them on);
    2. apply the poison, then exactly that decision.

TP workers have no coordinator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from gramcoord.coordinator.agreement import Agreement
from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.errors import CoordinatorError, LayoutError
from gramcoord.coordinator.layout import HostLevels, ParallelLayout
from gramcoord.coordinator.status import Decision, LocalStatus, PoisonRecord, wall_clock_ms

if TYPE_CHECKING:
    # A rank's runtime; the chain of a pipeline, the two-level agreement of a
    # multi-host group and the poison sharing of DP replicas are imported
    # where they are built, so a rank of one replica with no pipeline stages
    # and one agreement level never loads them.
    from gramcoord.coordinator.comm import Comm
    from gramcoord.coordinator.pipeline import Chain
    from gramcoord.coordinator.poison_share import PoisonShare
    from gramcoord.coordinator.two_level import TwoLevel

logger = logging.getLogger(__name__)


class Member(Protocol):
    """What a coordinator needs from one rank's grammar state (plain values)."""

    def local_status(self) -> LocalStatus: ...

    def apply_decision(self, decision: Decision) -> Any: ...

    def new_failures(self) -> Sequence[PoisonRecord]: ...

    def apply_poison(self, records: Sequence[PoisonRecord]) -> Any: ...


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one step decided on this rank."""

    decision: Decision
    # Poison records applied this step (shared or received), in order.
    poison: tuple[PoisonRecord, ...] = ()
    # Whatever the member's apply_decision returned.
    outcome: Any = None
    # True on followers: the decision came down the chain.
    followed: bool = False
    # The end-of-run vote settled this step: (the step that voted, whether
    # any replica was busy then); None when no vote settled.
    vote: tuple[int, bool] | None = None


class Coordinator:
    """Per-step coordination for one stage leader.

    Parameters
    ----------
    layout:
        The world's layout.
    comm:
        The runtime (or a fake with the same calls).
    window:
        The pending window, ``grammar.max_pending``.
    compile_mode:
        ``"async"``, or ``"sync"`` (external launcher): decisions are local
        and no readiness collective runs.
    agreement_op:
        ``"all_gather"`` or ``"all_reduce"`` (``distributed.agreement_op``).
    clock_sync_steps:
        Idle steps between clock agreements.
    clock:
        Wall clock in milliseconds (injected by tests).
    poison_in_step:
        Share new failures inside every ``step`` (``distributed.
        poison_exchange: step``); otherwise only in ``exchange_poison``.
    poison_lag_steps:
        Steps between posting a poison exchange and settling it
        (``distributed.poison_lag_steps``).
    levels:
        This rank's agreement group split by host, to agree in two levels
        (``distributed.agreement_levels: host``; see ``levels.TwoLevel``);
        None agrees flat.

    Raises
    ------
    LayoutError
        If this rank is a TP worker.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        comm: Comm,
        *,
        window: int,
        compile_mode: Literal["async", "sync"] = "async",
        agreement_op: Literal["all_gather", "all_reduce"] = "all_gather",
        clock_sync_steps: int = 64,
        clock: Callable[[], int] = wall_clock_ms,
        poison_in_step: bool = True,
        poison_lag_steps: int = 2,
        levels: HostLevels | None = None,
    ) -> None:
        rank = comm.rank
        if not layout.is_stage_leader(rank):
            raise LayoutError(
                f"{layout.describe(rank)} is a TP worker; only stage leaders run a coordinator"
            )
        self.rank = rank
        self._comm = comm
        self._clock = clock
        self._last_step: int | None = None
        self.poison_in_step = poison_in_step
        # Poison received by exchange_poison, sent down the chain next step.
        self._unsent: tuple[PoisonRecord, ...] = ()
        # New failures kept for the next exchange_poison (host mode).
        self._held_failures: list[PoisonRecord] = []
        self.decider = layout.is_decider(rank)
        self.agreement: Agreement | None = None
        self.poison: PoisonShare | None = None
        prev, nxt = layout.chain_prev(rank), layout.chain_next(rank)
        self.chain: Chain | None = None
        if prev is not None or nxt is not None:
            from gramcoord.coordinator.pipeline import Chain

            self.chain = Chain(comm, rank=rank, prev=prev, next=nxt, window=window)
        # Set when this rank agrees in two levels (inside its host, then across).
        self.levels: HostLevels | None = None
        if self.decider:
            members = layout.agreement_group(rank)
            gather = self._gather("agreement") if len(members) > 1 else None
            reduce = self._reduce("agreement", "band") if len(members) > 1 else None
            if levels is not None and levels.group == members:
                from gramcoord.coordinator.two_level import TwoLevel

                self.levels = levels
                gather, reduce = self._two_level(TwoLevel(comm, levels))
            self.agreement = Agreement(
                members=members,
                rank=rank,
                window=window,
                gather=gather,
                reduce=reduce,
                op=agreement_op,
                compile_mode=compile_mode,
                clock_sync_steps=clock_sync_steps,
            )
            poison_members = layout.poison_group()
            if rank in poison_members:
                from gramcoord.coordinator.poison_share import PoisonShare

                self.poison = PoisonShare(
                    members=poison_members,
                    post=self._post("poison"),
                    # A host's sync points are its own: settle each at once.
                    lag_steps=poison_lag_steps if poison_in_step else 0,
                )
        logger.info(
            "[rank %d] coordinator: %s, %s, agreement group %s%s, poison group %s, window %d, %s",
            rank,
            layout.describe(rank),
            "decider" if self.decider else "follower",
            list(layout.agreement_group(rank)),
            f" in two levels over hosts {[list(b) for b in self.levels.blocks]}"
            if self.levels
            else "",
            list(layout.poison_group()) if self.poison else [],
            window,
            compile_mode,
        )

    @classmethod
    def from_config(
        cls,
        layout: ParallelLayout,
        comm: Comm,
        distributed: DistributedConfig,
        *,
        max_pending: int,
        compile_mode: Literal["async", "sync"] = "async",
    ) -> Coordinator:
        """Build from the ``distributed`` section and ``grammar.max_pending``.

        Raises
        ------
        CoordinatorError
            If ``agreement_levels`` is ``host`` but ``comm`` holds no host
            names (a runtime built from a different config).
        """
        levels = None
        if distributed.agreement_levels == "host" and layout.world_size > 1:
            if not comm.hosts:
                raise CoordinatorError(
                    "distributed.agreement_levels is 'host' but the runtime knows no host "
                    "names; build the runtime from the same distributed config"
                )
            mine = [lv for lv in layout.host_levels(comm.hosts) if comm.rank in lv.group]
            levels = mine[0] if mine else None
        return cls(
            layout,
            comm,
            window=max_pending,
            compile_mode=compile_mode,
            # Large groups switch to the fixed-size report; every member sees
            # the same group size, so all of them pick the same op.
            agreement_op="all_reduce"
            if len(layout.agreement_group(comm.rank)) >= distributed.agreement_reduce_from
            else distributed.agreement_op,
            clock_sync_steps=distributed.clock_sync_steps,
            poison_in_step=distributed.poison_exchange == "step",
            poison_lag_steps=distributed.poison_lag_steps,
            levels=levels,
        )

    def _gather(self, group: str) -> Callable:
        comm, op = self._comm, group

        def gather(row):
            return comm.all_gather(group, row, operation=op, step=self._current)

        return gather

    def _post(self, group: str) -> Callable:
        comm, op = self._comm, group

        def post(row):
            return comm.all_gather_start(group, row, operation=op, step=self._current)

        return post

    def _two_level(self, two: TwoLevel) -> tuple[Callable, Callable]:
        def gather(row):
            return two.all_gather(row, operation="agreement", step=self._current)

        def reduce(row):
            return two.all_reduce(row, "band", operation="agreement", step=self._current)

        return gather, reduce

    def _reduce(self, group: str, kind: Literal["band", "max"]) -> Callable:
        comm, op = self._comm, group

        def reduce(row):
            return comm.all_reduce(group, row, kind, operation=op, step=self._current)

        return reduce

    @property
    def _current(self) -> int:
        return -1 if self._last_step is None else self._last_step

    def exchange_poison(self, sync: int, member: Member) -> tuple[PoisonRecord, ...]:
        """Share new failures across the DP leaders now (``poison_exchange: host``).

        Every member of the poison group calls it at the same host sync
        point (``sync`` numbers those points and labels errors). The records
        are applied at the start of the next ``step``, on this rank and,
        down the pipeline chain with that step's decision, on later stages.

        Returns
        -------
        tuple of PoisonRecord
            The union shared (identical on every member); empty on a rank
            outside the poison group.

        Raises
        ------
        PeerLostError
            A member died or hung.
        """
        if self.poison is None:
            return ()
        new = self._held_failures + list(member.new_failures())
        self._held_failures = []
        settled = self.poison.exchange(sync, new, self._clock())
        assert settled is not None  # lag 0 outside the step
        shared = settled.records
        # Applied at the start of the next step, here and (down the chain)
        # on every later stage at the same point, so a request submitted in
        # between gets the same verdict on every rank.
        self._unsent += shared
        return shared

    def settle(self) -> None:
        """Wait for the poison exchanges still in flight (every member, after its last step).

        What they carry is dropped: the run is over.
        """
        if self.poison is not None:
            self.poison.drain()

    def step(self, step: int, member: Member, *, busy: bool | None = None) -> StepResult:
        """Run step ``step`` for ``member``; see the module docstring.

        ``busy`` is this replica's end-of-run vote (stage-0 deciders of a
        poison group; None: no vote); it settles ``lag`` steps later, in
        ``StepResult.vote``.

        Raises
        ------
        ValueError
            If ``step`` does not increase.
        DivergenceError
            If the group's pending sets or steps differ.
        PeerLostError
            If a peer died or hung (the runtime has released its groups).
        """
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} does not follow step {self._last_step}")
        self._last_step = step
        if not self.decider:
            assert self.chain is not None
            decision, poison = self.chain.receive(step)
            if poison:
                member.apply_poison(poison)
            outcome = member.apply_decision(decision)
            return StepResult(decision=decision, poison=poison, outcome=outcome, followed=True)
        assert self.agreement is not None
        clock, agreed, vote = self._clock(), False, None
        new = member.new_failures()
        poison, self._unsent = self._unsent, ()
        if poison:
            member.apply_poison(poison)
        if self.poison is not None and self.poison_in_step:
            settled = self.poison.exchange(step, new, clock, busy=busy)
            # While nothing settles, hold the last agreed clock: TTLs expire
            # on an agreed clock only.
            clock, agreed = self.agreement.clock_ms, True
            if settled is not None:
                clock = settled.clock_ms
                if settled.busy is not None:
                    vote = (settled.step, settled.busy)
                if settled.records:
                    member.apply_poison(settled.records)
                poison += settled.records
        elif self.poison is not None:
            self._held_failures += list(new)
        decision = self.agreement.decide(
            step, member.local_status(), clock_ms=clock, clock_agreed=agreed
        )
        if self.chain is not None:
            self.chain.send(decision, poison)
        outcome = member.apply_decision(decision)
        return StepResult(decision=decision, poison=poison, outcome=outcome, vote=vote)
