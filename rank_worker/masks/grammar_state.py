"""One request's grammar state: an xgrammar matcher behind a gate.

``GrammarState`` is what the bitmask builder, the step loop and
jump-forward talk to. It adds three things to ``xgrammar.GrammarMatcher``:

- the gate (``gramcoord.rank_worker.masks.gate``): reasoning and trigger tokens are
  accepted without feeding the grammar, and their rows are unconstrained;
- a token history, so ``rollback(n)`` undoes exactly ``n`` tokens whatever
  phase they were accepted in, and restores the phase they crossed;
- clear failures: ``accept_tokens`` is all-or-nothing and raises a
  ``GrammarError`` whose code says whether the grammar had already
  terminated (``grammar_terminated``), had no allowed token at all
  (``grammar_dead_state``) or rejected the token (``token_rejected``).

Stop tokens follow xgrammar: they are allowed only where the grammar may
end, and accepting one terminates the grammar. Extra per-request stop ids
(``stop_token_ids``) are handled the same way, so an ordinary token used as
a stop is blocked inside a string. Non-stop special tokens are never
allowed: ``Tokenizer.info`` gives them empty bytes.

Bitmask rows are numpy ``int32`` arrays of ``ceil(vocab_size / 32)`` words;
bit ``t & 31`` of word ``t >> 5`` set means token ``t`` is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xgrammar as xgr

from gramcoord.rank_worker.errors import ErrorCode, GrammarError
from gramcoord.rank_worker.masks.gate import OPEN_GATE, ConstraintBounds, Gate, Phase

# Leading words of a row probed before a full dead-row scan.
_PROBE_WORDS = 16

# History entry of a token fed to the grammar in the constrained phase. The
# other entries are (phase before, trigger progress before, fed).
_FED = (Phase.CONSTRAINED, (), True)


def strip_padding(drafts: Sequence[int]) -> list[int]:
    """Cut draft tokens at the first negative id (``-1`` is padding)."""
    for i, t in enumerate(drafts):
        if t < 0:
            return list(drafts[:i])
    return list(drafts)


def clear_bits(row: np.ndarray, token_ids: Sequence[int]) -> None:
    """Disallow ``token_ids`` in one int32 bitmask row, in place."""
    words = row.view(np.uint32)
    for t in token_ids:
        words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


class GrammarState:
    """Per-request grammar state over an xgrammar matcher.

    Parameters
    ----------
    compiled:
        The request's compiled grammar (shared; the matcher is per request).
    gate:
        Reasoning / trigger gate; default: constrained from the first token.
    stop_token_ids:
        Override of the grammar's stop tokens (the tokenizer's stop ids plus
        any per-request stop ids). ``None`` keeps the tokenizer's.

    Attributes
    ----------
    vocab_size:
        Vocabulary of the compiled grammar; bitmask rows hold
        ``ceil(vocab_size / 32)`` words.
    """

    __slots__ = ("_gate", "_history", "_masked", "_matcher", "_phase", "_progress", "vocab_size")

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        *,
        gate: Gate | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        override = [int(t) for t in stop_token_ids] if stop_token_ids is not None else None
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=override)
        self._setup(matcher, compiled.tokenizer_info.vocab_size, gate)

    @classmethod
    def from_matcher(
        cls, matcher: xgr.GrammarMatcher, *, vocab_size: int, gate: Gate | None = None
    ) -> GrammarState:
        """Wrap an existing matcher, for example ``GrammarManager.matcher(id)``.

        Its current state is the starting point for ``rollback``; ``reset``
        returns to the grammar's initial state.
        """
        self = cls.__new__(cls)
        self._setup(matcher, vocab_size, gate)
        return self

    def _setup(self, matcher: xgr.GrammarMatcher, vocab_size: int, gate: Gate | None) -> None:
        self._matcher = matcher
        self.vocab_size = int(vocab_size)
        self._gate = gate or OPEN_GATE
        self._phase, self._progress = self._gate.initial
        self._history: list[tuple] = []
        self._masked: tuple[int, ...] | None = None

    # -- queries --------------------------------------------------------

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        return self._matcher

    @property
    def gate(self) -> Gate:
        return self._gate

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def is_constrained(self) -> bool:
        """Whether the next token is judged by the grammar."""
        return self._phase == Phase.CONSTRAINED

    @property
    def is_terminated(self) -> bool:
        """Whether a stop token ended the grammar; nothing more is accepted."""
        return self._phase == Phase.CONSTRAINED and self._matcher.is_terminated()

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (all phases); the most ``rollback`` undoes."""
        return len(self._history)

    def num_trailing_grammar_tokens(self, limit: int) -> int:
        """How many of the last tokens (at most ``limit``) fed the grammar."""
        n = 0
        for entry in reversed(self._history):
            if n >= limit or not entry[2] or entry[0] != Phase.CONSTRAINED:
                break
            n += 1
        return n

    @property
    def masked_ids(self) -> tuple[int, ...]:
        """Implicit end tokens masked while reasoning: those the grammar
        rejects as first content. Empty outside reasoning. Computed once per
        request, since the grammar does not move before reasoning ends."""
        if self._phase != Phase.REASONING:
            return ()
        if self._masked is None:
            masked = []
            if self._gate.masks_implicit_ends:
                m = self._matcher
                for t in sorted(self._gate.implicit_end_ids):
                    if m.accept_token(t):
                        m.rollback(1)
                    else:
                        masked.append(t)
            self._masked = tuple(masked)
        return self._masked

    def constraint_bounds(self, drafts: Sequence[int]) -> ConstraintBounds:
        """``(grammar_start, constraint_start)`` of ``drafts`` (padding stripped)."""
        return self._gate.bounds(self._phase, self._progress, strip_padding(drafts))

    # -- advancing ------------------------------------------------------

    def advance(self, token: int) -> bool:
        """Accept one token if valid; ``False`` (state unchanged) otherwise.

        The primitive behind ``accept_tokens``, ``validate_tokens`` and the
        bitmask builder's speculative rows.
        """
        if token < 0:
            return False
        if self._phase == Phase.CONSTRAINED:
            m = self._matcher
            # Checked first: xgrammar logs a warning for every token offered
            # to a terminated matcher.
            if m.is_terminated() or not m.accept_token(token):
                return False
            self._history.append(_FED)
            return True
        phase, progress, feed = self._gate.step(self._phase, self._progress, token)
        if feed and not self._matcher.accept_token(token):
            return False
        self._history.append((self._phase, self._progress, feed))
        self._phase, self._progress = phase, progress
        return True

    def accept_tokens(self, tokens: Sequence[int]) -> None:
        """Accept sampled tokens, all or none.

        Reasoning and trigger tokens are accepted without feeding the
        grammar; the grammar sees tokens from where the constraint starts.

        Raises
        ------
        GrammarError
            ``grammar_terminated``: a token follows a stop token.
            ``grammar_dead_state``: the grammar allowed no token at all.
            ``token_rejected``: the grammar rejected a token.
            The state is unchanged in every case.
        """
        for i, token in enumerate(tokens):
            if not self.advance(token):
                error = self._rejection(i, int(token))
                self.rollback(i)
                raise error

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of ``tokens`` that would be accepted.

        Stops at the first invalid token and after a stop token. The state
        is unchanged.
        """
        n = 0
        for token in tokens:
            if not self.advance(token):
                break
            n += 1
        self.rollback(n)
        return list(tokens[:n])

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens, across phases.

        Raises
        ------
        ValueError
            More tokens than were accepted.
        """
        if num_tokens == 0:
            return
        if not 0 < num_tokens <= len(self._history):
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {len(self._history)} were accepted"
            )
        undone = self._history[-num_tokens:]
        del self._history[-num_tokens:]
        fed = sum(1 for entry in undone if entry[2])
        if fed:
            self._matcher.rollback(fed)
        self._phase, self._progress = undone[0][0], undone[0][1]

    def reset(self) -> None:
        """Back to the initial state (the masked-id snapshot is kept)."""
        self._matcher.reset()
        self._history.clear()
        self._phase, self._progress = self._gate.initial

    # -- masks ----------------------------------------------------------

    def fill_row(self, bitmask: np.ndarray, row: int) -> bool:
        """Write the next-token mask into ``bitmask[row]``.

        Returns
        -------
        bool
            Whether the row constrains anything: ``False`` for a gated row
            with nothing masked (all bits set).

        Raises
        ------
        GrammarError
            ``grammar_terminated`` when a stop token already ended the grammar.
        """
        if self._phase == Phase.CONSTRAINED:
            if self._matcher.is_terminated():
                raise GrammarError(
                    ErrorCode.grammar_terminated,
                    "the grammar accepted a stop token; no next-token mask exists",
                )
            self._matcher.fill_next_token_bitmask(bitmask, row)
            return True
        bitmask[row] = -1
        masked = self.masked_ids
        if masked:
            clear_bits(bitmask[row], masked)
        return bool(masked)

    def _rejection(self, index: int, token: int) -> GrammarError:
        where = f"token {token} at position {index}"
        if self.is_terminated:
            return GrammarError(
                ErrorCode.grammar_terminated, f"{where} follows a stop token; the grammar has ended"
            )
        if self._phase == Phase.CONSTRAINED:
            row = np.empty((1, (self.vocab_size + 31) // 32), dtype=np.int32)
            self._matcher.fill_next_token_bitmask(row, 0)
            if not live_rows(row, self.vocab_size)[0]:
                return GrammarError(
                    ErrorCode.grammar_dead_state,
                    f"{where}: the grammar allows no token here (no vocabulary token "
                    "continues the text)",
                )
            return GrammarError(ErrorCode.token_rejected, f"{where} is rejected by the grammar")
        return GrammarError(
            ErrorCode.token_rejected,
            f"{where} is an implicit reasoning end the grammar rejects as first content",
        )

    def __repr__(self) -> str:
        return (
            f"GrammarState(phase={self._phase.name}, tokens={len(self._history)}, "
            f"terminated={self.is_terminated})"
        )


def live_rows(rows: np.ndarray, vocab_size: int) -> np.ndarray:
    """Boolean per row: does it allow at least one token below ``vocab_size``?

    The padding bits of the last word (beyond ``vocab_size``) do not count.
    Nearly every live row has a set bit among its first words, so those are
    probed first and only the rest are scanned in full (a full scan of a
    ``[256, 4748]`` mask costs ~0.1 ms; the probe ~10 us).
    """
    full, rem = divmod(vocab_size, 32)
    probe = min(full, _PROBE_WORDS)
    live = rows[:, :probe].any(axis=1) if probe else np.zeros(len(rows), dtype=bool)
    if live.all():
        return live
    rest = np.flatnonzero(~live)
    if rest.size:
        sub = rows[rest]
        found = _any_nonzero(sub[:, :full])
        if rem:
            found |= (sub[:, full].view(np.uint32) & np.uint32((1 << rem) - 1)) != 0
        live[rest] = found
    return live


def _any_nonzero(words: np.ndarray) -> np.ndarray:
    # Viewing pairs of words as int64 halves the work of the scan.
    if words.shape[1] % 2 == 0 and words.flags.c_contiguous:
        words = words.view(np.int64)
    return words.any(axis=1)
