"""Runtime failures of the cross-rank coordinator.

Three kinds, as everywhere in gramcoord:

- ``LayoutError`` is bad user input (a parallel layout that cannot be built);
  it names the valid values.
- ``PeerLostError`` and ``DivergenceError`` are runtime failures of the
  group; both are fatal for the step loop.
- Internal invariants are plain ``assert``.
"""

from __future__ import annotations


class LayoutError(ValueError):
    """The parallel layout does not fit the world, or a coordinate is out of range."""


class CoordinatorError(RuntimeError):
    """Base class of the coordinator's runtime failures."""


class PeerLostError(CoordinatorError):
    """A peer died or hung during a collective or point-to-point call.

    Attributes
    ----------
    ranks:
        Global ranks believed lost: those that did not answer the roll call
        after the failure (empty when every member answered, in which case
        ``peer`` names the other end of a point-to-point call if known).
    operation:
        What was running, e.g. ``"agreement"`` or ``"pp_chain recv"``.
    step:
        Step number of the failed call, or -1 outside the step loop.
    rank:
        The rank that raised.
    """

    def __init__(
        self,
        *,
        rank: int,
        ranks: tuple[int, ...],
        operation: str,
        step: int,
        group: tuple[int, ...],
        detail: str,
    ) -> None:
        self.rank = rank
        self.ranks = ranks
        self.operation = operation
        self.step = step
        self.group = group
        who = (
            f"rank {ranks[0]}"
            if len(ranks) == 1
            else f"ranks {list(ranks)}"
            if ranks
            else "an unidentified rank"
        )
        super().__init__(
            f"[rank {rank}] {who} lost during {operation!r} at step {step} "
            f"(group {list(group)}): {detail}"
        )


class DivergenceError(CoordinatorError):
    """Ranks that must agree reported different state.

    Raised on every member of the group at the same step, because every
    member sees the same gathered reports.

    Attributes
    ----------
    step:
        Step at which the divergence was seen.
    ranks:
        Global ranks whose report differs from the group's first member.
    seq:
        First differing request's sequence number (the smaller of the
        values seen at the first differing window position), or -1 when the
        difference is not in the pending set (e.g. the step numbers differ).
    """

    def __init__(self, message: str, *, step: int, ranks: tuple[int, ...], seq: int = -1) -> None:
        self.step = step
        self.ranks = ranks
        self.seq = seq
        super().__init__(message)
