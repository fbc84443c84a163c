"""Jump-forward: emit grammar-forced text without a model step.

When the grammar allows exactly one continuation for the next bytes
(``find_jump_forward_string``: ``": "`` after a key, ``{"name": "`` at the
start of a fixed object), those bytes need no model step. Two modes
(``grammar.jump_forward_mode``):

- ``exact`` (default) jumps only the part of the forced text the model could
  not have decided differently, and never touches earlier tokens. With a
  model whose choice depends only on the text so far (the synthetic model),
  outputs are the same text as without jump-forward.
- ``greedy`` jumps all of the forced text and retokenizes the boundary with
  the output's tail. It saves more steps, but can change outputs.

Exact mode
----------
Let ``X`` be the output text and ``F`` the forced bytes. Without a jump the
model walks through ``F`` token by token: at byte offset ``i`` of ``F`` it
picks one of the tokens the grammar allows after ``X + F[:i]``. All of them
agree with ``F`` (it is forced), so each either ends inside ``F`` (at
``i + len``) or runs past its end, merging forced and free text (``}],``
when only ``}`` is forced). A stop token allowed at ``i`` ends the output
there; it counts as running past the end.

A boundary ``j`` (``0 < j <= len(F)``) is *safe* when no token allowed at any
``i < j`` spans it (starts before ``j`` and ends after it). Every run without
the jump then passes through ``X + F[:j]``: its offsets inside ``F`` grow
strictly, and from an offset below ``j`` no allowed token skips ``j``. The
jump goes to the largest safe ``j`` on a character boundary (none: no jump).
It is found by scanning ``i = 0, 1, ...`` on a fork of the matcher, filling
one next-token mask per offset and testing only the tokens that agree with
``F[i:]`` (looked up in the vocabulary, cached per forced string); the scan
stops at the first offset where a token runs past ``F`` (no later boundary
can be safe) or after ``max_scan_bytes``. Nothing before ``X`` is
retokenized: ``F[:j]`` is encoded on its own and appended.

*Why the text is identical.* Take a deterministic model whose pick depends
only on the text so far and the allowed set. The allowed set is itself a
function of the text, because xgrammar matches bytes, not token boundaries.
Let ``T0, T1, ..., Tn`` be the texts at which the run without jump-forward
queries the model (``T0`` empty, ``Tn`` where it picks the stop token).
Invariant: whenever the jump run queries the model or jumps, its text is
one of the ``Tk``. It holds at the start. A query at ``Tk`` picks the same
token as the plain run did there (same text, same allowed set), so it
reaches ``Tk+1``, or stops with the same output if ``k = n``. A jump at
``Tk`` (k < n; nothing is forced where a stop token is allowed) moves to
``Tk + F[:j]``, which the plain run, querying at ``Tk``, goes on to visit by
the safety of ``j``: it is some ``Tm`` with ``m > k``. So the jump run's
queries are a strictly increasing subsequence of ``T0..Tn`` that ends at
``Tn`` with the stop token, and both outputs are the text ``Tn``; the jump
run takes at most as many model steps. Token ids may differ (``F[:j]`` gets
the tokenizer's own split, the model may have split it differently), so a
model conditioned on ids (a real LM) gets no such guarantee; nor does a run
that ends on ``max_tokens``, since the two runs use different token counts.

Greedy mode
-----------
The forced text is appended as tokens of the *model's* tokenizer,
retokenized at the boundary:

1. take the last few output tokens (the window, only tokens that fed the
   grammar, shrunk until their bytes are whole UTF-8 characters);
2. encode ``window text + forced text``;
3. keep the longest common prefix of the old window ids and the new ids,
   roll the grammar back over the rest of the window, and accept the new
   suffix. With old ``[a, b, c]`` and new ``[a, d]``: roll back 2, accept
   ``d``.

The grammar ends in the same state as if the new tokens had been sampled
one by one, because xgrammar matches bytes, not token boundaries.

``hold_back`` leaves the jump's last token to the model when a longer
vocabulary token extends it, like xgrammar's ``find_jump_forward_tokens``:
the model may then merge forced and free text (``" "`` + ``"`` as ``' "'``)
as it would have without the jump. In a 150k vocabulary almost every token
is extended by some longer one, so it gives up much of the saving.

Greedy outputs can differ from outputs without jump-forward, even for a
text-keyed model: when the model would have left the forced text through a
token that also covers free text (``}],`` above, with only ``}`` forced),
the jump takes that choice away, and after ``}`` the model may pick ``]``
instead. A model conditioned on token ids also sees the retokenized window
and the jump's token boundaries.

Measured
--------
Model steps saved (real: decoding with and without jump-forward) on the 120
dev instances of ``bench fill`` (synthetic model, K = 0), and how many
outputs have the same text as without jump-forward, among the runs that
did not end on ``max_tokens``; ``measure`` in
``tests/rank_worker/masks/test_jump_identity.py``. The model follows the valid
instance (``max_tokens`` 1024; 14223 / 11429 steps without jump-forward),
an invalid one (112 instances; it improvises where the grammar forbids it)
or none (it improvises throughout); ``max_tokens`` 512 for those two.

=========  ==============  ===================  ===================
reference  any_whitespace  exact: saved, same   greedy: saved, same
=========  ==============  ===================  ===================
valid      false           28.0%, 120/120       39.3%, 120/120
valid      true            14.5%, 120/120       14.1%, 120/120
invalid    false           39.4%, 109/109       51.3%, 71/109
invalid    true            20.7%, 110/110       25.0%, 104/110
none       false           49.0%, 116/116       57.8%, 63/116
none       true            24.4%, 117/117       32.7%, 106/117
=========  ==============  ===================  ===================

Exact mode gives up about 30% of greedy's saving with ``any_whitespace``
false: after a key the model emits ``":`` and ``' "'`` is forced, but 197
Qwen2.5 tokens extend ``' "'`` (``' "$'``, ``' "../'``, ``' ""'``...), so
exact leaves it to the model, which then spends a step on it whenever the
value's start is not one of those. With ``any_whitespace`` true, greedy's
boundaries cost the model extra steps later and exact saves as much. A model conditioned on token ids (a
random-weight tiny Qwen2, 30 instances, ``any_whitespace`` false) kept the
same output in 8 of 12 finished runs with exact mode and 4 of 12 with
greedy (18 of 30 runs ran to ``max_tokens`` 256 either way).

Model steps saved are also estimated per jump as the growth of the output
(``len(suffix) - rolled_back``, at least 0; in exact mode the number of
tokens appended). It is an estimate in both directions: the model may have
covered the jumped text in fewer or more tokens than the tokenizer does.

Forced bytes that stop inside a multi-byte UTF-8 character are not jumped
(xgrammar's string stops before that character); they are sampled.
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
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(tokenizer.token_bytes):
            if b:
                by_bytes.setdefault(b, []).append(i)
        self._keys = sorted(by_bytes)
        # Ids in key order; a key's ids are flat[offsets[k] : offsets[k + 1]].
        self._flat = np.asarray([i for key in self._keys for i in by_bytes[key]], dtype=np.int64)
        self._offsets = np.cumsum([0] + [len(by_bytes[key]) for key in self._keys]).tolist()
        self._rank = {key: k for k, key in enumerate(self._keys)}
        self._max_len = max(len(b) for b in self._keys)
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
