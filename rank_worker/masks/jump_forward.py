"""Jump-forward: emit grammar-forced text without a model step.

When the grammar allows exactly one continuation for the next bytes
(``find_jump_forward_string``: ``": "`` after a key, ``{"name": "`` at the
start of a fixed object), those bytes need no model step. Two modes
(``grammar.jump_forward_mode``):

- ``exact`` (default) jumps only up to the largest *safe* boundary of the
  forced text ``F``: one that no token allowed at an earlier offset of ``F``
  spans. Every run without the jump passes through that text, so with a
  model whose pick depends only on the text so far the output is the same
  text as without jump-forward. Nothing before the output's end is
  retokenized; the scan runs on a fork of the matcher, one next-token mask
  per offset, and stops at the first token that runs past ``F`` or after
  ``max_scan_bytes``.
- ``greedy`` jumps all of the forced text and retokenizes the boundary with
  the output's tail (the longest common prefix of the old and new ids is
  kept; the grammar rolls back over the rest). It saves more steps, but can
  change outputs. ``hold_back`` leaves the jump's last token to the model
  when a longer vocabulary token extends it.

Forced bytes that stop inside a multi-byte UTF-8 character are not jumped.
The proof that exact mode keeps the text, why greedy may not, and the
measured savings per mode are in ``docs/jump-forward.md``; the identity is
tested in ``tests/rank_worker/masks/test_jump_identity.py``.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Sequence
from typing import Literal, NamedTuple

import msgspec
import numpy as np

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import GrammarError
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.grammar_state import GrammarState

logger = logging.getLogger(__name__)

JumpMode = Literal["exact", "greedy"]

# Forced strings whose vocabulary layout is kept, per tokenizer.
_LAYOUT_CACHE = 4096


class JumpResult(NamedTuple):
    """One jump: drop ``num_rollback`` output tokens, then append ``tokens``."""

    num_rollback: int
    tokens: list[int]
    # The text jumped (exact mode: the safe prefix of the forced string).
    forced: str


class JumpStats(msgspec.Struct, kw_only=True):
    # Jumps performed.
    num_jumps: int = 0
    # Bytes of forced text emitted without a model step.
    num_forced_bytes: int = 0
    # Forced bytes left to the model (exact mode: an allowed token spans or
    # runs past them).
    num_forced_bytes_left: int = 0
    # Tokens appended by jumps (retokenized window tails included).
    num_tokens_appended: int = 0
    # Output tokens replaced by retokenization.
    num_tokens_replaced: int = 0
    # Model steps saved, estimated as net output growth per jump (at least 0).
    num_steps_saved: int = 0


def retokenize_plan(old: Sequence[int], new: Sequence[int]) -> tuple[int, list[int]]:
    """Longest common prefix of ``old`` and ``new`` token ids.

    Returns
    -------
    (num_rollback, suffix):
        Roll back ``num_rollback`` tokens of ``old``, then accept ``suffix``.
    """
    k = 0
    for a, b in zip(old, new):
        if a != b:
            break
        k += 1
    return len(old) - k, list(new[k:])


class _TokenPrefixes:
    """Is a byte string a strict prefix of some ordinary token? (bisect)"""

    def __init__(self, tokenizer: Tokenizer) -> None:
        special = set(tokenizer.special_ids.values())
        self._sorted = sorted(
            {b for i, b in enumerate(tokenizer.token_bytes) if b and i not in special}
        )

    def __call__(self, piece: bytes) -> bool:
        i = bisect.bisect_right(self._sorted, piece)
        return i < len(self._sorted) and self._sorted[i].startswith(piece)


@functools.lru_cache(maxsize=4)
def _token_prefixes(tokenizer: Tokenizer) -> _TokenPrefixes:
    return _TokenPrefixes(tokenizer)


class _Offset(NamedTuple):
    """Tokens that agree with ``F[i:]``, for one offset ``i`` of a forced ``F``."""

    # (length, ids) of the tokens spelled ``F[i : i + length]``, longest first.
    inside: tuple[tuple[int, np.ndarray], ...]
    # Tokens that start with ``F[i:]`` and are longer: they run past ``F``.
    past: np.ndarray


class _Vocab:
    """Token ids by spelling, for the exact-mode scan (one per tokenizer).

    Every token with non-empty bytes is listed, special ones included: the
    grammar's mask decides which of them are allowed.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        # Every rank builds this at start, so it is one sort and two linear
        # passes (0.4 s of CPU for Qwen2.5's 151,643 tokens, against 1.1 s
        # for a dict of lists). The sort is stable: a spelling's ids stay in
        # id order.
        tb = tokenizer.token_bytes
        order = sorted((i for i, b in enumerate(tb) if b), key=tb.__getitem__)
        spelled = [tb[i] for i in order]
        starts = [j for j in range(len(spelled)) if j == 0 or spelled[j] != spelled[j - 1]]
        self._keys = [spelled[j] for j in starts]
        # Ids in key order; a key's ids are flat[offsets[k] : offsets[k + 1]].
        self._flat = np.asarray(order, dtype=np.int64)
        self._offsets = [*starts, len(order)]
        self._rank = dict(zip(self._keys, range(len(self._keys))))
        self._max_len = max(map(len, self._keys), default=1)
        self.layout = functools.lru_cache(maxsize=_LAYOUT_CACHE)(self._layout)

    def _layout(self, forced: bytes, n: int) -> tuple[_Offset, ...]:
        """The first ``n`` offsets of ``forced``."""
        out = []
        for i in range(n):
            rest = forced[i:]
            inside = []
            for length in range(min(self._max_len, len(rest)), 0, -1):
                k = self._rank.get(rest[:length])
                if k is not None:
                    inside.append((length, self._flat[self._offsets[k] : self._offsets[k + 1]]))
            # Keys starting with ``rest`` sort in [rest, rest + 0xff...).
            lo = bisect.bisect_right(self._keys, rest)
            hi = bisect.bisect_left(self._keys, rest + b"\xff" * (self._max_len + 1), lo)
            past = self._flat[self._offsets[lo] : self._offsets[hi]]
            out.append(_Offset(tuple(inside), past))
        return tuple(out)


@functools.lru_cache(maxsize=4)
def _vocab(tokenizer: Tokenizer) -> _Vocab:
    return _Vocab(tokenizer)


def _any_allowed(words: np.ndarray, ids: np.ndarray) -> bool:
    """Whether a uint32 bitmask row allows any of ``ids``."""
    if ids.size == 0:
        return False
    return bool(((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).any())


class JumpForward:
    """Per-rank jump-forward over grammar states (stateless between calls,
    apart from the statistics and one scratch mask row: use it from one
    thread at a time).

    Parameters
    ----------
    tokenizer:
        The model's tokenizer; forced text is encoded with it.
    mode:
        ``"exact"``: jump only the safe prefix of the forced text (see the
        module docstring). ``"greedy"``: jump all of it.
    window:
        Greedy mode: most trailing output tokens retokenized together with
        the forced text.
    hold_back:
        Greedy mode: leave the last token to the model when a longer token
        extends it.
    max_scan_bytes:
        Exact mode: most offsets of the forced text examined per jump (one
        next-token mask each). A longer forced string is jumped at most this
        far; the rest comes with a later jump.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        mode: JumpMode = "exact",
        window: int = 4,
        hold_back: bool = False,
        max_scan_bytes: int = 128,
    ) -> None:
        if mode not in ("exact", "greedy"):
            raise ValueError(f"mode must be 'exact' or 'greedy', got {mode!r}")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        if hold_back and mode == "exact":
            raise ValueError("hold_back is a greedy-mode option")
        if max_scan_bytes < 1:
            raise ValueError(f"max_scan_bytes must be >= 1, got {max_scan_bytes}")
        self.tokenizer = tokenizer
        self.mode = mode
        self.window = window
        self.hold_back = hold_back
        self.max_scan_bytes = max_scan_bytes
        self._prefixes = _token_prefixes(tokenizer) if hold_back else None
        self._vocab = _vocab(tokenizer) if mode == "exact" else None
        self._row: np.ndarray | None = None
        self.stats = JumpStats()

    @classmethod
    def from_config(cls, config: GrammarConfig, tokenizer: Tokenizer) -> JumpForward | None:
        """A ``JumpForward`` in ``grammar.jump_forward_mode`` when
        ``grammar.jump_forward`` is on, else ``None``."""
        return cls(tokenizer, mode=config.jump_forward_mode) if config.jump_forward else None

    def plan(self, state: GrammarState, output: Sequence[int]) -> JumpResult | None:
        """The jump available now, without changing anything.

        ``output`` is the request's output token ids so far; its tail must be
        the tokens most recently accepted by ``state``.
        """
        return self._plan(state, output)[0]

    def _plan(self, state: GrammarState, output: Sequence[int]) -> tuple[JumpResult | None, str]:
        """The jump and the whole forced string (``""`` when none)."""
        if not state.is_constrained or state.is_terminated:
            return None, ""
        forced = state.matcher.find_jump_forward_string()
        if not forced:
            return None, ""
        if self.mode == "exact":
            return self._plan_exact(state, forced), forced
        return self._plan_greedy(state, output, forced), forced

    # -- exact mode -----------------------------------------------------

    def safe_length(self, state: GrammarState, forced: str) -> int:
        """Bytes of ``forced`` (the state's forced string) that no allowed
        token spans or runs past: the largest safe boundary on a character
        boundary, 0 when there is none."""
        data = forced.encode("utf-8")
        n = min(len(data), self.max_scan_bytes)
        layout = self._vocab.layout(data, n)
        ends = set(np.cumsum([len(c.encode("utf-8")) for c in forced]).tolist())
        words = self._row_words(state.vocab_size)
        row = words.view(np.int32).reshape(1, -1)
        stops = np.asarray(state.matcher.stop_token_ids, dtype=np.int64)
        fork = state.matcher.fork()
        reach = best = 0
        for i, offset in enumerate(layout):
            if i and not fork.accept_string(data[i - 1 : i]):
                # Cannot happen for a forced string; stop where it is known.
                logger.warning("forced byte %d of %r rejected; jump shortened", i - 1, forced)
                break
            fork.fill_next_token_bitmask(row, 0)
            if _any_allowed(words, offset.past) or _any_allowed(words, stops):
                # Spans every boundary after i: none of them is safe.
                break
            for length, ids in offset.inside:
                if _any_allowed(words, ids):
                    reach = max(reach, i + length)
                    break
            if reach <= i + 1 and i + 1 in ends:
                best = i + 1
        return best

    def _plan_exact(self, state: GrammarState, forced: str) -> JumpResult | None:
        size = self.safe_length(state, forced)
        if not size:
            return None
        text = forced.encode("utf-8")[:size].decode("utf-8")
        tokens = self.tokenizer.encode(text)
        if not tokens or self.tokenizer.decode_bytes(tokens) != text.encode("utf-8"):
            logger.debug("jump-forward skipped: %r does not round-trip", text)
            return None
        return JumpResult(0, tokens, text)

    def _row_words(self, vocab_size: int) -> np.ndarray:
        width = (vocab_size + 31) // 32
        if self._row is None or self._row.size != width:
            self._row = np.zeros(width, dtype=np.uint32)
        return self._row

    # -- greedy mode ----------------------------------------------------

    def _plan_greedy(
        self, state: GrammarState, output: Sequence[int], forced: str
    ) -> JumpResult | None:
        tb = self.tokenizer.token_bytes
        w = state.num_trailing_grammar_tokens(min(self.window, len(output)))
        while w:
            try:
                text = b"".join(tb[t] for t in output[len(output) - w :]).decode("utf-8")
                break
            except UnicodeDecodeError:
                w -= 1
        else:
            text = ""
        old = list(output[len(output) - w :]) if w else []
        new = self.tokenizer.encode(text + forced)
        whole = (text + forced).encode("utf-8")
        if self.tokenizer.decode_bytes(new) != whole:
            # A tokenizer that does not round-trip cannot be spliced safely.
            logger.debug("jump-forward skipped: %r does not round-trip", text + forced)
            return None
        if self._prefixes is not None and new:
            last = tb[new[-1]]
            # Leave the last token to the model when a longer token extends
            # it (it may merge forced and free text, as '": "' + '"' does),
            # but never give back text the output already had.
            if len(whole) - len(last) >= len(text.encode("utf-8")) and self._prefixes(last):
                new = new[:-1]
        num_rollback, suffix = retokenize_plan(old, new)
        if not suffix:
            return None
        return JumpResult(num_rollback, suffix, forced)

    # -- applying -------------------------------------------------------

    def jump(self, state: GrammarState, output: list[int]) -> JumpResult | None:
        """Perform the available jump on ``state`` and ``output`` (in place).

        Returns
        -------
        JumpResult or None
            What was done, or ``None`` when nothing is forced.
        """
        result, forced = self._plan(state, output)
        jumped = len(result.forced.encode("utf-8")) if result is not None else 0
        self.stats.num_forced_bytes_left += len(forced.encode("utf-8")) - jumped
        if result is None:
            return None
        removed = output[len(output) - result.num_rollback :] if result.num_rollback else []
        state.rollback(result.num_rollback)
        try:
            state.accept_tokens(result.tokens)
        except GrammarError:
            # The bytes are grammar-forced, so this means the tokenizer and
            # the grammar's vocabulary disagree. Put the state back.
            logger.warning("jump-forward tokens %s rejected; jump skipped", result.tokens)
            state.accept_tokens(removed)
            return None
        if result.num_rollback:
            del output[-result.num_rollback :]
        output.extend(result.tokens)
        s = self.stats
        s.num_jumps += 1
        s.num_forced_bytes += len(result.forced.encode("utf-8"))
        s.num_tokens_appended += len(result.tokens)
        s.num_tokens_replaced += result.num_rollback
        s.num_steps_saved += max(0, len(result.tokens) - result.num_rollback)
        return result
