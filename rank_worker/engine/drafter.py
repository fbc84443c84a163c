"""Draft-token proposers for speculative decoding.

A drafter proposes up to ``k`` next tokens from the output so far; the
verifier (the target model under the grammar's speculative rows) keeps the
ones it agrees with. Two drafters, chosen by ``speculative.drafter``:

- ``ngram``: prompt/output lookup. The last ``n`` tokens (longest ``n``
  first) are searched for earlier in prompt + output; the tokens that
  followed the most recent earlier match are proposed.
- ``reference``: replays a reference text (a workload record's valid
  instance). While the output's text is a prefix of the reference, it
  proposes the tokenizer's encoding of the rest, so drafts are often but not
  always what the model picks.

Drafts never see the grammar: trimming them is ``bitmask.trim_drafts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gramcoord.rank_worker.config import SpeculativeConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer


class Drafter(Protocol):
    def propose(self, output: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``output``."""
        ...


class NgramDrafter:
    """Prompt/output lookup drafter.

    Parameters
    ----------
    prompt:
        Prompt token ids, searched together with the output.
    min_n, max_n:
        Suffix lengths tried, longest first.
    """

    def __init__(self, prompt: Sequence[int] = (), *, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.prompt = list(prompt)
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, output: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        ctx = self.prompt + list(output)
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            tail = ctx[-n:]
            # Most recent earlier occurrence that has a continuation.
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start : start + n] == tail:
                    return ctx[start + n : start + n + k]
        return []


class ReferenceDrafter:
    """Replay a reference text as drafts.

    Parameters
    ----------
    tokenizer:
        Encodes the reference.
    reference:
        The text to replay.
    """

    def __init__(self, tokenizer: Tokenizer, reference: str) -> None:
        self.tokenizer = tokenizer
        self.reference = reference.encode("utf-8")
        self._ids = tokenizer.encode(reference)
        # Byte offset -> index of the canonical token that starts there.
        self._at: dict[int, int] = {}
        offset = 0
        for i, t in enumerate(self._ids):
            self._at[offset] = i
            offset += len(tokenizer.token_bytes[t])

    def propose(self, output: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        text = self.tokenizer.decode_bytes(list(output))
        if not self.reference.startswith(text):
            return []
        start = self._at.get(len(text))
        if start is not None:
            return self._ids[start : start + k]
        rest = self.reference[len(text) :].decode("utf-8", "ignore")
        return self.tokenizer.encode(rest)[:k]


def _reference_or_ngram(
    tokenizer: Tokenizer, prompt: Sequence[int], reference: str | None
) -> Drafter:
    if reference is None:
        return NgramDrafter(prompt)
    return ReferenceDrafter(tokenizer, reference)


# speculative.drafter -> factory(tokenizer, prompt, reference).
DRAFTERS = {
    "ngram": lambda tokenizer, prompt, reference: NgramDrafter(prompt),
    "reference": _reference_or_ngram,
}


def make_drafter(
    config: SpeculativeConfig,
    *,
    tokenizer: Tokenizer,
    prompt: Sequence[int] = (),
    reference: str | None = None,
) -> Drafter | None:
    """The drafter ``config`` names, or ``None`` (``none``, or K == 0).

    A ``reference`` drafter without a reference text falls back to
    ``ngram`` for that request.
    """
    if config.num_tokens == 0 or config.drafter == "none":
        return None
    return DRAFTERS[config.drafter](tokenizer, prompt, reference)
