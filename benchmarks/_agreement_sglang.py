"""The SGLang-style agreement step, and the pending windows every contender decides.

``gramcoord bench agreement`` and ``gramcoord bench scale`` time our
coordinator against :func:`sglang_step`: SGLang's way of agreeing, pickled
``all_gather_object`` of the ready/failed index sets, then set
intersection/union, with pickled objects down a pipeline chain. Both decide
the same windows:
:func:`shared_status` (half ready, a quarter pending, a quarter failed) and
:func:`local_status` (the same, with a few requests that other DP members
see ready still pending or failed on this one), held by a
:class:`StaticMember` so that every step is a steady-state step.
"""

from __future__ import annotations

__all__ = ["StaticMember", "local_status", "sglang_step", "shared_status"]


class StaticMember:
    """A member whose pending window never changes: steady-state steps."""

    def __init__(self, status) -> None:
        self.status = status

    def local_status(self):
        return self.status

    def apply_decision(self, decision):
        return decision

    def new_failures(self):
        return []

    def apply_poison(self, records):
        return None


def shared_status(pending: int):
    from gramcoord.coordinator.status import LocalStatus, PendingState

    states = [
        (PendingState.READY, PendingState.READY, PendingState.PENDING, PendingState.FAILED)[i % 4]
        for i in range(pending)
    ]
    reasons = [21 if s == PendingState.FAILED else 0 for s in states]
    return LocalStatus(
        seqs=tuple(range(1000, 1000 + pending)), states=tuple(states), reasons=tuple(reasons)
    )


def local_status(pending: int, member: int, members: int):
    """``shared_status`` with a few requests of this DP member still pending or failed."""
    from gramcoord.coordinator.status import LocalStatus, PendingState

    base = shared_status(pending)
    states, reasons = list(base.states), list(base.reasons)
    for i in range(pending):
        if i % (4 * members) == 4 * member:  # ready elsewhere, still pending here
            states[i] = PendingState.PENDING
        elif i % (4 * members) == 4 * member + 1:  # ready elsewhere, failed here
            states[i], reasons[i] = PendingState.FAILED, 30 + member % 30
    return LocalStatus(seqs=base.seqs, states=tuple(states), reasons=tuple(reasons))


def sglang_step(status, group, chain_group, chain_peer, is_sender, world):
    """SGLang-style: pickled index sets gathered, then pickled objects down the chain.

    Returns the decided ``(ready, failed)`` index sets; a later stage returns
    the ones it received.
    """
    import torch.distributed as dist

    from gramcoord.coordinator.status import PendingState

    if chain_group is not None and not is_sender:
        got = [None]
        dist.recv_object_list(got, src=chain_peer, group=chain_group)
        ready, failed = got[0]
        return set(ready), set(failed)
    ready = {i for i, s in enumerate(status.states) if s == PendingState.READY}
    failed = {i for i, s in enumerate(status.states) if s == PendingState.FAILED}
    if group is not None:
        out = [None] * world
        dist.all_gather_object(out, (ready, failed), group=group)
        ready = set.intersection(*(r for r, _ in out))
        failed = set.union(*(f for _, f in out))
        ready -= failed
    if chain_group is not None:
        dist.send_object_list([(sorted(ready), sorted(failed))], dst=chain_peer, group=chain_group)
    return ready, failed
