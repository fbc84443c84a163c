"""One step's readiness agreement inside one agreement group: the one agreement.

Every host runs it: gramcoord's own engine (through ``Coordinator``), and the
vLLM and SGLang adapters (through the same ``Coordinator`` over their
engine's process group). Every member reports its pending window as one
fixed-shape int64 row (its *report*, below). One collective combines the
rows: a request is admitted when it is ready on every member, and failed
when it failed on any member (failed wins). Every member computes the same ``Decision`` from the
same combined data, so decisions are identical without a second round.

The collective is skipped when the window is empty (the pending set is
agreed state, so every member skips together), except every
``clock_sync_steps`` steps, when an empty report still travels so that the
agreed clock -- and with it poison TTL expiry -- moves on.

With ``compile_mode: sync`` every request is ready or failed when it
enters the window, so the decision is local and the collective only runs
on clock steps (where it still checks the pending fingerprints).

The report
----------

A fixed-shape int64 row: what one rank tells its agreement group each step.

Two codecs share the pending *window* (the first ``window`` pending
requests in sequence order; later ones wait, nothing is dropped).

``GatherCodec`` (one ``all_gather``; every rank combines every row)::

    word 0      MAGIC_GATHER
    word 1      step
    word 2      n_window        entries in this step's window
    word 3      n_total         pending requests, window and overflow
    word 4      fingerprint     63-bit blake2b of the window's seqs (and keys)
    word 5      clock_ms        local wall clock
    word 6..7   reserved (0)
    ready       ceil(window/64) words, bit i = window[i] compiled here
    failed      ceil(window/64) words, bit i = window[i] failed here
    reasons     ceil(window/4) words holding one int16 code per slot

``ReduceCodec`` (one ``all_reduce(BAND)``; the same size for any number of
ranks, the path to hundreds of replicas)::

    word 0      MAGIC_REDUCE
    word 1, 2   step, ~step
    word 3, 4   n_window, ~n_window
    word 5, 6   n_total, ~n_total
    word 7, 8   fingerprint, ~fingerprint
    word 9      clock_ms on the group's first member, all ones elsewhere
    ready       ceil(window/64) words (AND = ready everywhere)
    not failed  ceil(window/64) words, ~failed (AND = ~(failed anywhere))
    reasons     window words, ~(1 << code) on failed slots, all ones elsewhere

A value ``x`` sent with its complement is equal on every rank exactly when
``AND(x) | AND(~x)`` is all ones. The first member's clock survives the AND
because every other rank sends all ones. Reason codes are 1..32767 for the
gather codec and 1..63 for the reduce codec. When members fail a request for
different reasons, the lowest code wins with either codec, so both give the
same decision.

Bitsets use numpy's native byte order; all ranks of a group are assumed to
share it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Literal, NamedTuple

import numpy as np

from gramcoord.coordinator.errors import CoordinatorError, DivergenceError
from gramcoord.coordinator.status import Decision, LocalStatus, PendingState, decide_alone

logger = logging.getLogger(__name__)

MAGIC_GATHER = 0x67636F6F72640001
MAGIC_REDUCE = 0x67636F6F72640101
GATHER_HEADER = 8
REDUCE_HEADER = 10
MAX_GATHER_REASON = (1 << 15) - 1
MAX_REDUCE_REASON = 63
_MASK63 = (1 << 63) - 1
# Plain ints: enum attribute lookups cost more than the arithmetic here.
_PENDING, _READY, _FAILED = (
    int(PendingState.PENDING),
    int(PendingState.READY),
    int(PendingState.FAILED),
)


class Window(NamedTuple):
    """The part of a rank's pending set decided this step."""

    seqs: np.ndarray  # int64, ascending
    states: np.ndarray  # int64 PendingState values
    reasons: np.ndarray  # int64, nonzero exactly where FAILED
    n_total: int  # pending requests including those waiting beyond the window
    keys: tuple[bytes, ...] = ()  # grammar keys, parallel to seqs (or empty)


class Verdict(NamedTuple):
    """The combined reports, before they are turned into a Decision."""

    ready: np.ndarray  # bool[window]: admit (failed already removed)
    failed: np.ndarray  # bool[window]
    reasons: np.ndarray  # int64[window]: agreed code where failed
    clock_ms: int
    consistent: bool  # False: step or pending set differs somewhere
    # bool[members, window]: which member failed each slot (gather codec
    # only; None from the reduce codec, whose AND forgets who).
    failed_by: np.ndarray | None = None


def window_of(status: LocalStatus, size: int, max_reason: int) -> Window:
    """Cut ``status`` to its first ``size`` entries and check its shape.

    Raises
    ------
    ValueError
        If the seqs are not strictly ascending, a state is unknown, or a
        failed entry has no reason code (or one out of range).
    """
    n = min(len(status.seqs), size)
    seqs = np.asarray(status.seqs[:n], dtype=np.int64)
    states = np.asarray(status.states[:n], dtype=np.int64)
    reasons = np.asarray(status.reasons[:n], dtype=np.int64)
    if n > 1 and not (seqs[1:] > seqs[:-1]).all():
        raise ValueError("LocalStatus.seqs must be strictly ascending")
    if n and (seqs[0] < 0 or seqs[-1] >= 1 << 47):
        raise ValueError("sequence numbers must be in 0 .. 2**47 - 1")
    if n and (states.min() < _PENDING or states.max() > _FAILED):
        raise ValueError(f"unknown PendingState in {status.states[:n]}")
    failed = states == _FAILED
    bad = failed & ((reasons < 1) | (reasons > max_reason))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"failed seq {int(seqs[i])} has reason code {int(reasons[i])}; "
            f"codes must be 1..{max_reason}"
        )
    reasons = np.where(failed, reasons, 0)
    return Window(seqs, states, reasons, len(status.seqs), tuple(status.keys[:n]))


def fingerprint(seqs: np.ndarray, keys: tuple[bytes, ...] = ()) -> int:
    """63-bit digest of the ordered sequence numbers and their grammar keys (non-negative)."""
    digest = hashlib.blake2b(np.ascontiguousarray(seqs, dtype="<i8").tobytes(), digest_size=8)
    for key in keys:
        digest.update(key)
    return int.from_bytes(digest.digest(), "little") & _MASK63


def key_digests(keys: tuple[bytes, ...], n: int) -> np.ndarray:
    """int64[n]: a 63-bit digest of each key (0 where none), for divergence reports."""
    out = np.zeros(n, dtype=np.int64)
    for i, key in enumerate(keys[:n]):
        d = hashlib.blake2b(key, digest_size=8).digest()
        out[i] = int.from_bytes(d, "little") & _MASK63
    return out


def _words(bits: int) -> int:
    return (bits + 63) // 64


def pack_bits(mask: np.ndarray, words: int) -> np.ndarray:
    """bool[n] -> int64[words], bit i of the set is ``mask[i]``."""
    buf = np.zeros(words * 8, dtype=np.uint8)
    packed = np.packbits(mask.astype(np.uint8), bitorder="little")
    buf[: packed.size] = packed
    return buf.view(np.int64)


def unpack_bits(words: np.ndarray, n: int) -> np.ndarray:
    """int64[words] -> bool[n]."""
    raw = np.ascontiguousarray(words, dtype=np.int64).view(np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


class GatherCodec:
    """Report rows for one ``all_gather``; see the module docstring."""

    max_reason = MAX_GATHER_REASON

    def __init__(self, window: int) -> None:
        self.window = window
        self.bit_words = _words(window)
        self.reason_words = (window + 3) // 4
        self._ready = GATHER_HEADER
        self._failed = self._ready + self.bit_words
        self._reasons = self._failed + self.bit_words
        self.size = self._reasons + self.reason_words

    def encode(self, step: int, win: Window, clock_ms: int, index: int, out: np.ndarray) -> None:
        """Write this rank's row into ``out`` (int64[size]); ``index`` is unused."""
        n = len(win.seqs)
        out[:] = 0
        fp = fingerprint(win.seqs, win.keys)
        out[:6] = (MAGIC_GATHER, step, n, win.n_total, fp, clock_ms)
        out[self._ready : self._failed] = pack_bits(win.states == _READY, self.bit_words)
        out[self._failed : self._reasons] = pack_bits(win.states == _FAILED, self.bit_words)
        out[self._reasons :].view(np.int16)[:n] = win.reasons

    def combine(self, rows: np.ndarray, step: int) -> Verdict:
        """Combine the gathered ``rows`` (int64[members, size]) of one step."""
        w = self.window
        key = rows[:, 1:5]
        consistent = bool((rows[:, 0] == MAGIC_GATHER).all() and (key == key[0]).all())
        consistent = consistent and int(key[0, 0]) == step
        ready_words = np.bitwise_and.reduce(rows[:, self._ready : self._failed], axis=0)
        failed_rows = rows[:, self._failed : self._reasons]
        failed = unpack_bits(np.bitwise_or.reduce(failed_rows, axis=0), w)
        ready = unpack_bits(ready_words, w) & ~failed
        codes = (
            np.ascontiguousarray(rows[:, self._reasons :]).view(np.int16)[:, :w].astype(np.int32)
        )
        # The lowest code reported by any member names the failure, as in
        # the reduce codec, so both ops give identical decisions.
        lowest = np.where(codes > 0, codes, MAX_GATHER_REASON + 1).min(axis=0)
        reasons = np.where(failed, lowest, 0).astype(np.int64)
        failed_by = None
        if failed.any():
            failed_by = np.stack([unpack_bits(r, w) for r in failed_rows])
        return Verdict(ready, failed, reasons, int(rows[:, 5].max()), consistent, failed_by)


class ReduceCodec:
    """Report rows for one ``all_reduce(BAND)``; see the module docstring."""

    max_reason = MAX_REDUCE_REASON

    def __init__(self, window: int) -> None:
        self.window = window
        self.bit_words = _words(window)
        self._ready = REDUCE_HEADER
        self._notfailed = self._ready + self.bit_words
        self._reasons = self._notfailed + self.bit_words
        self.size = self._reasons + window

    def encode(self, step: int, win: Window, clock_ms: int, index: int, out: np.ndarray) -> None:
        """Write this rank's row; ``index`` is its position in the group."""
        n = len(win.seqs)
        fp = fingerprint(win.seqs, win.keys)
        out[0] = MAGIC_REDUCE
        out[1:9] = (step, ~step, n, ~n, win.n_total, ~win.n_total, fp, ~fp)
        out[9] = clock_ms if index == 0 else -1
        failed = win.states == _FAILED
        out[self._ready : self._notfailed] = pack_bits(win.states == _READY, self.bit_words)
        out[self._notfailed : self._reasons] = ~pack_bits(failed, self.bit_words)
        reasons = out[self._reasons :]
        reasons[:] = -1
        reasons[:n] = np.where(failed, ~np.left_shift(np.int64(1), win.reasons), -1)

    def combine(self, reduced: np.ndarray, step: int) -> Verdict:
        """Read the BAND-reduced row (int64[size]) of one step."""
        w = self.window
        pairs = reduced[1:9].reshape(4, 2)
        consistent = bool(reduced[0] == MAGIC_REDUCE and ((pairs[:, 0] | pairs[:, 1]) == -1).all())
        consistent = consistent and int(reduced[1]) == step
        failed = unpack_bits(~reduced[self._notfailed : self._reasons], w)
        ready = unpack_bits(reduced[self._ready : self._notfailed], w) & ~failed
        masks = (~reduced[self._reasons :]).astype(np.uint64)
        # Lowest set bit of each failed slot's OR-ed one-hot mask.
        lowest = masks & (~masks + np.uint64(1))
        codes = np.zeros(w, dtype=np.int64)
        nz = lowest != 0
        codes[nz] = np.log2(lowest[nz].astype(np.float64)).astype(np.int64)
        reasons = np.where(failed, codes, 0)
        return Verdict(ready, failed, reasons, int(reduced[9]), consistent)


CODECS: dict[str, type[GatherCodec] | type[ReduceCodec]] = {
    "all_gather": GatherCodec,
    "all_reduce": ReduceCodec,
}


# -- the agreement ----------------------------------------------------------

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
