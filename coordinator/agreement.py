"""One step's readiness agreement inside one agreement group: the one agreement.

Every host runs it: gramcoord's own engine (through ``Coordinator``), and the
vLLM and SGLang adapters (through the same ``Coordinator`` over their
engine's process group). Every member reports its pending window as one
fixed-shape int64 row (``gramcoord.coordinator.pending_report``). One collective combines the rows: a request is
admitted when it is ready on every member, and failed when it failed on any
member (failed wins). Every member computes the same ``Decision`` from the
same combined data, so decisions are identical without a second round.

The collective is skipped when the window is empty (the pending set is
agreed state, so every member skips together), except every
``clock_sync_steps`` steps, when an empty report still travels so that the
agreed clock -- and with it poison TTL expiry -- moves on.

With ``compile_mode: sync`` every request is ready or failed when it
enters the window, so the decision is local and the collective only runs
on clock steps (where it still checks the pending fingerprints).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import numpy as np

from gramcoord.coordinator.errors import CoordinatorError, DivergenceError
from gramcoord.coordinator.pending_report import (
    CODECS,
    Verdict,
    Window,
    fingerprint,
    key_digests,
    window_of,
)
from gramcoord.coordinator.status import Decision, LocalStatus, PendingState, decide_alone

_PENDING, _READY, _FAILED = (int(s) for s in PendingState)

logger = logging.getLogger(__name__)

Gather = Callable[[np.ndarray], np.ndarray]
"""row int64[n] -> int64[members, n], the rows of every member in group order."""
Reduce = Callable[[np.ndarray], np.ndarray]
"""row int64[n] -> int64[n], the bitwise AND over members."""


class Agreement:
    """Decides each step for one member of one agreement group.

    Parameters
    ----------
    members:
        Global ranks of the group, in group order (the same on every member).
    rank:
        This member's global rank.
    window:
        The pending window (``grammar.max_pending``): at most this many
        requests are decided per step, the first ones in sequence order;
        later ones wait.
    gather:
        The group's all-gather (see ``Gather``). Used by ``op="all_gather"``
        and, on the rare divergence path, by both ops.
    reduce:
        The group's ``all_reduce(BAND)``; required for ``op="all_reduce"``.
    op:
        ``"all_gather"`` (rows grow with the group) or ``"all_reduce"``
        (fixed size; reason codes limited to 1..63).
    compile_mode:
        ``"async"`` or ``"sync"``; see the module docstring.
    clock_sync_steps:
        Idle steps between clock agreements.
    """

    def __init__(
        self,
        *,
        members: tuple[int, ...],
        rank: int,
        window: int,
        gather: Gather | None,
        reduce: Reduce | None = None,
        op: Literal["all_gather", "all_reduce"] = "all_gather",
        compile_mode: Literal["async", "sync"] = "async",
        clock_sync_steps: int = 64,
    ) -> None:
        assert rank in members, f"rank {rank} is not in its agreement group {members}"
        if len(members) > 1 and gather is None:
            raise ValueError("an agreement group of more than one member needs a gather")
        if op == "all_reduce" and len(members) > 1 and reduce is None:
            raise ValueError("op 'all_reduce' needs a reduce function")
        self.members = members
        self.rank = rank
        self.index = members.index(rank)
        self.window = window
        self.op = op
        self.compile_mode = compile_mode
        self.clock_sync_steps = clock_sync_steps
        self._gather = gather
        self._reduce = reduce
        self._codec = CODECS[op](window)
        self._row = np.zeros(self._codec.size, dtype=np.int64)
        self._clock_ms = 0
        self.collectives = 0

    @property
    def clock_ms(self) -> int:
        """The last agreed clock (identical on every member)."""
        return self._clock_ms

    def decide(
        self, step: int, status: LocalStatus, *, clock_ms: int, clock_agreed: bool = False
    ) -> Decision:
        """Agree on this step's decision.

        Parameters
        ----------
        step:
            The step number; every member must be at the same step.
        status:
            This member's pending requests, ascending by seq.
        clock_ms:
            This member's wall clock, or an already agreed clock when
            ``clock_agreed`` (e.g. from the poison exchange).

        Returns
        -------
        Decision
            Identical on every member of the group.

        Raises
        ------
        DivergenceError
            If members are at different steps or hold different pending
            windows; it names the ranks and the first differing request.
        PeerLostError
            From the collective, when a member died or hung.
        """
        win = window_of(status, self.window, self._codec.max_reason)
        if self.compile_mode == "sync":
            pending = win.states == _PENDING
            if bool(pending.any()):
                raise CoordinatorError(
                    f"[rank {self.rank}] compile_mode is sync but seq "
                    f"{int(win.seqs[np.argmax(pending)])} is still pending at step {step}"
                )
        tick = step % self.clock_sync_steps == 0
        if len(self.members) == 1:
            self._advance(clock_ms)
            return decide_alone(step, status, self._clock_ms)
        if self.compile_mode == "sync" and not tick:
            self._advance(clock_ms if clock_agreed else self._clock_ms)
            return decide_alone(step, status, self._clock_ms)
        if len(win.seqs) == 0 and not tick:
            self._advance(clock_ms if clock_agreed else self._clock_ms)
            return Decision(step=step, clock_ms=self._clock_ms)
        verdict = self._collective(step, win, clock_ms)
        self._advance(clock_ms if clock_agreed else verdict.clock_ms)
        return self._decision(step, win, verdict)

    def _advance(self, clock_ms: int) -> None:
        self._clock_ms = max(self._clock_ms, int(clock_ms))

    def _decision(self, step: int, win: Window, verdict: Verdict) -> Decision:
        n = len(win.seqs)
        ready_idx = np.flatnonzero(verdict.ready[:n])
        failed_idx = np.flatnonzero(verdict.failed[:n])
        failed_on: tuple[tuple[int, ...], ...] = ()
        if verdict.failed_by is not None:
            by = verdict.failed_by
            failed_on = tuple(
                tuple(self.members[m] for m in np.flatnonzero(by[:, i]).tolist())
                for i in failed_idx.tolist()
            )
        return Decision(
            step=step,
            ready=tuple(win.seqs[ready_idx].tolist()),
            failed=tuple(zip(win.seqs[failed_idx].tolist(), verdict.reasons[failed_idx].tolist())),
            clock_ms=self._clock_ms,
            failed_on=failed_on,
            members=self.members if failed_on else (),
        )

    def _collective(self, step: int, win: Window, clock_ms: int) -> Verdict:
        self._codec.encode(step, win, clock_ms, self.index, self._row)
        self.collectives += 1
        if self.op == "all_gather":
            assert self._gather is not None
            verdict = self._codec.combine(self._gather(self._row), step)
        else:
            assert self._reduce is not None
            verdict = self._codec.combine(self._reduce(self._row), step)
        if not verdict.consistent:
            self._diagnose(step, win)
        return verdict

    def _diagnose(self, step: int, win: Window) -> None:
        """Gather every member's window and raise a DivergenceError that explains it."""
        assert self._gather is not None
        n, w = len(win.seqs), self.window
        payload = np.full(4 + 2 * w, -1, dtype=np.int64)
        payload[:4] = (step, n, win.n_total, fingerprint(win.seqs, win.keys))
        payload[4 : 4 + n] = win.seqs
        payload[4 + w : 4 + w + n] = key_digests(win.keys, n)
        rows = np.array(self._gather(payload))
        raise divergence(rows, self.members, step)


def _by_value(values: list, members: tuple[int, ...]) -> dict:
    groups: dict = {}
    for value, rank in zip(values, members):
        groups.setdefault(value, []).append(rank)
    return groups


def divergence(rows: np.ndarray, members: tuple[int, ...], step: int) -> DivergenceError:
    """Explain gathered diagnostic rows ``[step, n_window, n_total, fp, seqs..., keys...]``.

    ``seqs`` and ``keys`` (one digest per grammar key) are ``window`` words each.
    """
    steps = rows[:, 0].tolist()
    if len(set(steps)) > 1:
        parts = "; ".join(f"step {s} on ranks {r}" for s, r in _by_value(steps, members).items())
        odd = tuple(r for r, s in zip(members, steps) if s != steps[0])
        return DivergenceError(
            f"agreement group {list(members)} is not in step: {parts}", step=step, ranks=odd
        )
    keys = [tuple(row[1:4].tolist()) for row in rows]
    odd = tuple(r for r, k in zip(members, keys) if k != keys[0])
    held = "; ".join(
        f"ranks {r} hold {k[0]} in the window, {k[1]} pending (fingerprint {k[2]:#x})"
        for k, r in _by_value(keys, members).items()
    )
    w = (rows.shape[1] - 4) // 2
    seqs, grammars = rows[:, 4 : 4 + w], rows[:, 4 + w :]
    differs = np.flatnonzero(np.any((seqs != seqs[0]) | (grammars != grammars[0]), axis=0))
    if differs.size == 0:
        return DivergenceError(
            f"pending sets diverged at step {step}: {held}; the windows match, the "
            f"requests waiting beyond them differ",
            step=step,
            ranks=odd,
        )
    pos = int(differs[0])
    column = seqs[:, pos].tolist()
    present = [s for s in column if s >= 0]
    if len(set(column)) == 1:  # the same number, different specs
        groups = _by_value(grammars[:, pos].tolist(), members)
        where = f"seq {column[0]} holds a different grammar on " + "; ".join(
            f"ranks {r}" for r in groups.values()
        )
    else:
        where = "; ".join(
            f"{'seq ' + str(s) if s >= 0 else 'nothing'} on ranks {r}"
            for s, r in _by_value(column, members).items()
        )
    return DivergenceError(
        f"pending sets diverged at step {step}: {held}; first differing request at window "
        f"position {pos}: {where}",
        step=step,
        ranks=odd,
        seq=min(present) if present else -1,
    )
