"""Token-sequence triggers, matched incrementally with KMP automata.

A trigger is a token-id sequence (for example the tokens of a tool-call
tag) after which a constraint starts. Tokens arrive one at a time and may be
rolled back, so the matcher is *stateless*: the caller holds the progress (a
tuple with one matched length per sequence) and keeps old values for
rollback. Each sequence gets its own KMP failure table, so a step costs
amortised O(1) per sequence and never rescans earlier tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

Progress = tuple[int, ...]


def _failure_table(seq: tuple[int, ...]) -> tuple[int, ...]:
    """``fail[i]``: length of the longest proper border of ``seq[: i + 1]``."""
    fail = [0] * len(seq)
    k = 0
    for i in range(1, len(seq)):
        while k and seq[i] != seq[k]:
            k = fail[k - 1]
        if seq[i] == seq[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class TriggerMatcher:
    """Recognise the first completion of any of several token sequences.

    Parameters
    ----------
    sequences:
        Non-empty token-id sequences. Matching is over token ids, not text:
        a trigger whose text the model spells with other tokens is not seen.

    Raises
    ------
    ValueError
        No sequence, or an empty one.

    Examples
    --------
    >>> m = TriggerMatcher([(7, 8)])
    >>> p, hit = m.advance(m.initial, 7)
    >>> m.advance(p, 8)
    ((0,), True)
    """

    __slots__ = ("_fail", "_seqs", "initial")

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        seqs = tuple(tuple(int(t) for t in s) for s in sequences)
        if not seqs:
            raise ValueError("a trigger needs at least one token sequence")
        if any(not s for s in seqs):
            raise ValueError("trigger sequences must not be empty")
        self._seqs = seqs
        self._fail = tuple(_failure_table(s) for s in seqs)
        # Progress after a completed match restarts from zero: the
        # constraint has started and the matcher is no longer consulted.
        self.initial: Progress = (0,) * len(seqs)

    @property
    def sequences(self) -> tuple[tuple[int, ...], ...]:
        return self._seqs

    def advance(self, progress: Progress, token: int) -> tuple[Progress, bool]:
        """Feed one token.

        Returns
        -------
        (progress, matched):
            The new progress, and whether some sequence just completed (then
            the progress is reset to ``initial``).
        """
        out = []
        for seq, fail, k in zip(self._seqs, self._fail, progress):
            while k and seq[k] != token:
                k = fail[k - 1]
            if seq[k] == token:
                k += 1
            if k == len(seq):
                return self.initial, True
            out.append(k)
        return tuple(out), False

    def __repr__(self) -> str:
        return f"TriggerMatcher({list(self._seqs)!r})"
