"""The rank grid: one frozen value that maps ranks to coordinates and names the groups.

Ranks are laid out with tensor parallelism fastest, then pipeline stages,
then data-parallel replicas::

    rank = (dp * num_stages + pp) * tp_size + tp

so the TP workers of a stage are adjacent (one node) and a replica's stages
are contiguous. Nothing else in gramcoord does rank arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import msgspec

from gramcoord.coordinator.config import ParallelConfig
from gramcoord.coordinator.errors import LayoutError

Requests = Literal["partitioned", "replicated"]
PpSync = Literal["chain", "collective"]


class Coords(NamedTuple):
    dp: int
    pp: int
    tp: int


class StepRoute(NamedTuple):
    """Where one rank's per-step messages come from and go (``step_route``)."""

    # Stage leaders before and after this rank's stage in its replica
    # (arrivals travel between them); None at the ends.
    prev_leader: int | None
    next_leader: int | None
    # The rank this rank takes its batch frame from (None: it plans it),
    # and the ranks it passes the frame on to, in send order.
    frame_src: int | None
    frame_dsts: tuple[int, ...]
    # The stage-0 leader and the last stage's leader of this replica: the
    # step's results go from the second to the first.
    first_leader: int
    last_leader: int


class HostLevels(NamedTuple):
    """One agreement group split by host (``distributed.agreement_levels: host``)."""

    # The agreement group, in group order.
    group: tuple[int, ...]
    # Its members on each host, in group order; hosts ordered by their first member.
    blocks: tuple[tuple[int, ...], ...]
    # The first member of each block: the host's leader.
    leaders: tuple[int, ...]

    def block_of(self, rank: int) -> tuple[int, ...]:
        """The members on ``rank``'s host."""
        return next(b for b in self.blocks if rank in b)


def _factorizations(world_size: int) -> list[tuple[int, int, int]]:
    return [
        (dp, pp, world_size // (dp * pp))
        for dp in range(1, world_size + 1)
        if world_size % dp == 0
        for pp in range(1, world_size // dp + 1)
        if (world_size // dp) % pp == 0
    ]


class ParallelLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The ``(dp, pp, tp)`` grid of a world, with its roles and groups.

    Build it with :meth:`build` (or :meth:`from_world` for an existing
    world); both validate and name the valid values on error.

    Attributes
    ----------
    dp, pp, tp:
        Data-parallel replicas, pipeline stages, tensor-parallel ranks per
        stage.
    requests:
        ``"partitioned"``: each replica has its own request stream.
        ``"replicated"``: every replica sees the same stream.
    pp_sync:
        ``"chain"``: stage 0 decides and later stages receive the decision
        point to point. ``"collective"``: every stage leader joins the
        agreement.
    """

    dp: int
    pp: int
    tp: int
    requests: Requests = "partitioned"
    pp_sync: PpSync = "chain"

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name} must be an integer >= 1, got {value!r}")
        if self.requests not in ("partitioned", "replicated"):
            raise LayoutError(
                f"parallel.requests must be 'partitioned' or 'replicated', got {self.requests!r}"
            )
        if self.pp_sync not in ("chain", "collective"):
            raise LayoutError(
                f"parallel.pp_sync must be 'chain' or 'collective', got {self.pp_sync!r}"
            )

    @classmethod
    def build(cls, parallel: ParallelConfig, world_size: int) -> ParallelLayout:
        """Validate ``parallel`` against ``world_size`` and build the layout.

        Raises
        ------
        LayoutError
            If ``dp * pp * tp != world_size``; the message lists every valid
            ``(dp, pp, tp)`` for that world size.
        """
        if world_size < 1:
            raise LayoutError(f"world size must be >= 1, got {world_size}")
        product = parallel.dp * parallel.pp * parallel.tp
        if product != world_size:
            valid = ", ".join(str(f) for f in _factorizations(world_size))
            raise LayoutError(
                f"parallel dp*pp*tp = {parallel.dp}*{parallel.pp}*{parallel.tp} = {product} "
                f"does not match the world size {world_size}; valid (dp, pp, tp): {valid}"
            )
        return cls(
            dp=parallel.dp,
            pp=parallel.pp,
            tp=parallel.tp,
            requests=parallel.requests,
            pp_sync=parallel.pp_sync,
        )

    @classmethod
    def from_world(cls, parallel: ParallelConfig, world_size: int) -> ParallelLayout:
        """Fit ``parallel`` to an existing world (external launcher).

        ``pp`` and ``tp`` are taken as given. ``dp`` is derived as
        ``world_size // (pp * tp)`` when the config leaves it at 1; an
        explicit ``dp`` must match exactly.

        Raises
        ------
        LayoutError
            If ``pp * tp`` does not divide the world size, or an explicit
            ``dp`` does not fit.
        """
        stage = parallel.pp * parallel.tp
        if parallel.dp == 1 and world_size % stage == 0:
            parallel = msgspec.structs.replace(parallel, dp=world_size // stage)
        return cls.build(parallel, world_size)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    # -- coordinates ---------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} out of range; valid ranks are 0..{self.world_size - 1}")

    def coords(self, rank: int) -> Coords:
        """The ``(dp, pp, tp)`` coordinates of ``rank``."""
        self._check_rank(rank)
        replica, rest = divmod(rank, self.pp * self.tp)
        stage, tp = divmod(rest, self.tp)
        return Coords(replica, stage, tp)

    def rank_of(self, dp: int, pp: int, tp: int = 0) -> int:
        """The global rank at coordinates ``(dp, pp, tp)``."""
        for name, value, size in (("dp", dp, self.dp), ("pp", pp, self.pp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise LayoutError(f"{name} index {value} out of range; valid are 0..{size - 1}")
        return (dp * self.pp + pp) * self.tp + tp

    def leader(self, dp: int, pp: int) -> int:
        """The stage leader (``tp == 0``) of stage ``pp`` in replica ``dp``."""
        return self.rank_of(dp, pp, 0)

    def step_route(self, rank: int) -> StepRoute:
        """The neighbours of ``rank`` in the step loop.

        Arrivals go down the stage leaders of a replica. A batch frame goes
        from the stage-0 leader to its TP workers and to the next stage's
        leader; every later rank takes it from the same TP index on the
        stage before and passes it to the same TP index on the stage after.
        """
        c = self.coords(rank)
        first, last = c.pp == 0, c.pp == self.pp - 1
        if not first:
            src: int | None = self.rank_of(c.dp, c.pp - 1, c.tp)
        else:
            src = None if c.tp == 0 else self.leader(c.dp, 0)
        dsts: list[int] = []
        if first and c.tp == 0:
            dsts += [self.rank_of(c.dp, 0, t) for t in range(1, self.tp)]
        if not last:
            dsts.append(self.rank_of(c.dp, c.pp + 1, c.tp))
        return StepRoute(
            prev_leader=None if first else self.leader(c.dp, c.pp - 1),
            next_leader=None if last else self.leader(c.dp, c.pp + 1),
            frame_src=src,
            frame_dsts=tuple(dsts),
            first_leader=self.leader(c.dp, 0),
            last_leader=self.leader(c.dp, self.pp - 1),
        )

    # -- roles ---------------------------------------------------------------

    def is_stage_leader(self, rank: int) -> bool:
        return self.coords(rank).tp == 0

    def is_tp_worker(self, rank: int) -> bool:
        return self.coords(rank).tp > 0

    def is_first_stage(self, rank: int) -> bool:
        return self.coords(rank).pp == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coords(rank).pp == self.pp - 1

    def is_decider(self, rank: int) -> bool:
        """Whether ``rank`` computes decisions (rather than receiving them).

        Stage-0 leaders always decide; with ``pp_sync: collective`` every
        stage leader does.
        """
        c = self.coords(rank)
        return c.tp == 0 and (c.pp == 0 or self.pp_sync == "collective")

    def describe(self, rank: int) -> str:
        """A short label such as ``"rank 3 (dp1 pp0 tp1: TP worker)"``."""
        c = self.coords(rank)
        roles = ["stage leader" if c.tp == 0 else "TP worker"]
        if c.pp == 0:
            roles.append("first stage")
        if c.pp == self.pp - 1:
            roles.append("last stage")
        return f"rank {rank} (dp{c.dp} pp{c.pp} tp{c.tp}: {', '.join(roles)})"

    # -- groups --------------------------------------------------------------

    def stage_leaders(self) -> tuple[int, ...]:
        return tuple(self.leader(d, k) for d in range(self.dp) for k in range(self.pp))

    def dp_leaders(self) -> tuple[int, ...]:
        """The stage-0 leader of every replica (the DP-leader group)."""
        return tuple(self.leader(d, 0) for d in range(self.dp))

    def pp_chain(self, dp: int) -> tuple[int, ...]:
        """Stage leaders of replica ``dp`` in stage order."""
        return tuple(self.leader(dp, k) for k in range(self.pp))

    def pp_chains(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.pp_chain(d) for d in range(self.dp))

    def tp_group(self, dp: int, pp: int) -> tuple[int, ...]:
        """The leader and TP workers of stage ``pp`` in replica ``dp``."""
        return tuple(self.rank_of(dp, pp, t) for t in range(self.tp))

    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.tp_group(d, k) for d in range(self.dp) for k in range(self.pp))

    def agreement_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups that run the readiness agreement, one per request stream.

        Chain: the stage-0 leaders that share a stream. Collective: every
        stage leader of those replicas. A group of one decides alone.
        """
        if self.requests == "replicated":
            return (self.dp_leaders() if self.pp_sync == "chain" else self.stage_leaders(),)
        if self.pp_sync == "chain":
            return tuple((self.leader(d, 0),) for d in range(self.dp))
        return self.pp_chains()

    def agreement_group(self, rank: int) -> tuple[int, ...]:
        """The agreement group of ``rank``; empty if it only follows decisions."""
        self._check_rank(rank)
        for group in self.agreement_groups():
            if rank in group:
                return group
        return ()

    def poison_group(self) -> tuple[int, ...]:
        """The ranks that union their newly failed keys each step.

        Only partitioned streams with ``dp > 1`` need it: with replicated
        streams the agreement already unions failures. With the chain, the
        DP leaders share and forward to their later stages; with the
        collective every stage leader takes part.
        """
        if self.requests == "replicated" or self.dp == 1:
            return ()
        return self.dp_leaders() if self.pp_sync == "chain" else self.stage_leaders()

    def chain_prev(self, rank: int) -> int | None:
        """The stage leader that sends decisions to ``rank`` (chain only)."""
        c = self.coords(rank)
        if self.pp_sync != "chain" or c.tp != 0 or c.pp == 0:
            return None
        return self.leader(c.dp, c.pp - 1)

    def chain_next(self, rank: int) -> int | None:
        """The stage leader that ``rank`` forwards decisions to (chain only)."""
        c = self.coords(rank)
        if self.pp_sync != "chain" or c.tp != 0 or c.pp == self.pp - 1:
            return None
        return self.leader(c.dp, c.pp + 1)

    def host_levels(self, hosts: Sequence[str]) -> tuple[HostLevels, ...]:
        """Every agreement group that two levels can help, split by host.

        ``hosts[r]`` names rank ``r``'s host. A group on one host, or with
        one member per host, is left out: two levels would only add rounds.

        Raises
        ------
        LayoutError
            If ``hosts`` does not name one host per rank.
        """
        if len(hosts) != self.world_size:
            raise LayoutError(
                f"{len(hosts)} host names for a world of {self.world_size} ranks; "
                f"every rank needs one"
            )
        out = []
        for group in self.agreement_groups():
            by_host: dict[str, list[int]] = {}
            for r in group:
                by_host.setdefault(hosts[r], []).append(r)
            blocks = tuple(tuple(b) for b in by_host.values())
            if 1 < len(blocks) < len(group):
                out.append(HostLevels(group, blocks, tuple(b[0] for b in blocks)))
        return tuple(out)

    def level_groups(self, hosts: Sequence[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The extra control groups of ``host_levels``, named, in a fixed order.

        ``agreement_host``: the members of one agreement group on one host
        (left out when only one); ``agreement_leaders``: one leader per host.
        """
        named: list[tuple[str, tuple[int, ...]]] = []
        for levels in self.host_levels(hosts):
            named += [("agreement_host", b) for b in levels.blocks if len(b) > 1]
            named.append(("agreement_leaders", levels.leaders))
        return tuple(named)

    def control_groups(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Every control group of the world, named, in a fixed order.

        Every rank must create process groups in the same order, so this
        lists all groups (not only the caller's). Groups of one rank are
        left out: they never communicate.
        """
        named: list[tuple[str, tuple[int, ...]]] = []
        named += [("agreement", g) for g in self.agreement_groups()]
        named.append(("poison", self.poison_group()))
        if self.pp_sync == "chain":
            named += [("pp_chain", c) for c in self.pp_chains()]
        named += [("tp", g) for g in self.tp_groups()]
        # The stage-0 leaders of every replica: the step loop's end-of-run vote.
        named.append(("replicas", self.dp_leaders()))
        named.append(("world", tuple(range(self.world_size))))
        return tuple((name, g) for name, g in named if len(g) > 1)
