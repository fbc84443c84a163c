"""Jump-forward: emit grammar-forced text without a model step.

When the grammar allows exactly one continuation for the next bytes
(``find_jump_forward_string``: ``": "`` after a key, ``{"name": "`` at the
start of a fixed object), those bytes need no model step. They are appended
as tokens of the *model's* tokenizer, retokenized at the boundary:

1. take the last few output tokens (the window, only tokens that fed the
   grammar, shrunk until their bytes are whole UTF-8 characters);
2. encode ``window text + forced text``;
3. keep the longest common prefix of the old window ids and the new ids,
   roll the grammar back over the rest of the window, and accept the new
   suffix. With old ``[a, b, c]`` and new ``[a, d]``: roll back 2, accept
   ``d``.

The grammar ends in the same state as if the new tokens had been sampled
one by one, because xgrammar matches bytes, not token boundaries.

Model steps saved are estimated per jump as the growth of the output
(``len(suffix) - rolled_back``, at least 0). It is an estimate in both
directions: a merge that shortens the output (``[a, b, c] -> [a, d]``) saved
the steps the forced text would have taken but counts zero, and a jump that
ends on a token boundary the model would not have chosen costs it an extra
step later. ``benchmarks/fill.py`` measures the real saving by decoding with
and without jump-forward. On the 120 dev instances of ``bench fill``
(greedy replay model, K = 0; steps without jump-forward: 14223 with
``any_whitespace`` false, 11429 with true):

==============  =========  ====================  ========  ================
any_whitespace  hold_back  steps saved (real)    estimate  outputs differ
==============  =========  ====================  ========  ================
false           off        39.3% (5585)          5850      0
false           on         26.6% (3777)          3801      0
true            off        14.1% (1616)          2616      0
true            on         13.6% (1555)          1576      0
==============  =========  ====================  ========  ================

``hold_back`` leaves the jump's last token to the model when a longer
vocabulary token extends it, like xgrammar's ``find_jump_forward_tokens``:
the model may then merge forced and free text (``" "`` + ``"`` as ``' "'``)
as it would have without the jump. It keeps token boundaries closer to the
model's own, but in a 150k vocabulary almost every token is extended by
some longer one, so it gives up a third of the saving with
``any_whitespace`` false; it is off by default.

When outputs with and without jump-forward differ
--------------------------------------------------
With greedy sampling the forced text itself is always identical: the mask
allows nothing else. What can differ is what comes after, through token
boundaries:

- The jump ends on a token boundary the model might not have chosen. After
  a key, ``": `` is forced; a model that would have emitted ``' "'`` (the
  forced space and the free opening quote of a string value) as one token
  now continues after ``[":", " "]`` and emits the quote alone. A model
  conditioned on token ids (a real LM) sees a different context from there
  on and may choose differently; a model conditioned on text (the synthetic
  model) does not. ``hold_back`` avoids most of these boundaries.
- Retokenizing the window replaces model-chosen splits with the
  tokenizer's canonical ones (same text, different ids), which again only
  matters to a model conditioned on ids.
- Forced bytes that stop inside a multi-byte UTF-8 character are not
  jumped (xgrammar's string stops before that character); they are sampled.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import GrammarError
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.grammar_state import GrammarState

logger = logging.getLogger(__name__)


class JumpResult(NamedTuple):
    """One jump: drop ``num_rollback`` output tokens, then append ``tokens``."""

    num_rollback: int
    tokens: list[int]
    forced: str


class JumpStats(msgspec.Struct, kw_only=True):
    # Jumps performed.
    num_jumps: int = 0
    # Bytes of forced text emitted without a model step.
    num_forced_bytes: int = 0
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


class JumpForward:
    """Per-rank jump-forward over grammar states (stateless between calls).

    Parameters
    ----------
    tokenizer:
        The model's tokenizer; forced text is encoded with it.
    window:
        Most trailing output tokens retokenized together with the forced
        text.
    """

    def __init__(self, tokenizer: Tokenizer, *, window: int = 4, hold_back: bool = False) -> None:
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.tokenizer = tokenizer
        self.window = window
        self.hold_back = hold_back
        self._prefixes = _token_prefixes(tokenizer) if hold_back else None
        self.stats = JumpStats()

    @classmethod
    def from_config(cls, config: GrammarConfig, tokenizer: Tokenizer) -> JumpForward | None:
        """A ``JumpForward`` when ``grammar.jump_forward`` is on, else ``None``."""
        return cls(tokenizer) if config.jump_forward else None

    def plan(self, state: GrammarState, output: Sequence[int]) -> JumpResult | None:
        """The jump available now, without changing anything.

        ``output`` is the request's output token ids so far; its tail must be
        the tokens most recently accepted by ``state``.
        """
        if not state.is_constrained or state.is_terminated:
            return None
        forced = state.matcher.find_jump_forward_string()
        if not forced:
            return None
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

    def jump(self, state: GrammarState, output: list[int]) -> JumpResult | None:
        """Perform the available jump on ``state`` and ``output`` (in place).

        Returns
        -------
        JumpResult or None
            What was done, or ``None`` when nothing is forced.
        """
        result = self.plan(state, output)
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
