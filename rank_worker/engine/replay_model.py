"""A deterministic stand-in model: logits keyed by the text generated so far.

``ReplayModel.logits(contexts)`` returns one float32 row of vocabulary
logits per context (a list of token ids). The row depends only on the
context's *text*, so retokenization and jump-forward do not change what the
model prefers, and on nothing else (no clock, no global RNG), so every rank
and every run gets the same rows.

- While the text is a prefix of the reference, every token whose bytes
  continue the reference gets a large score, longest first; at the end of
  the reference the stop token does.
- Off the reference, a few tokens picked by a hash of the text get a
  medium score, and closing punctuation and the stop token a larger one,
  so generation tends to finish.
- Every other token keeps a fixed pseudo-random score, which decides
  whenever all boosted tokens are masked.

It is the model behind the greedy reference decoder in tests and
benchmarks; it is not a language model.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

_CLOSERS = ("}", "]", '"', '"}', "}}", "]}", '"]')


@functools.lru_cache(maxsize=4)
def _vocab_index(tokenizer: Tokenizer) -> tuple[dict[bytes, int], int]:
    """Token bytes -> id (first id wins) and the longest token's length.

    Special tokens are included (a reference may spell ``</think>``) but
    stop tokens are not: the stop token is chosen at the reference's end.
    """
    index: dict[bytes, int] = {}
    stops = set(tokenizer.stop_ids)
    for i, b in enumerate(tokenizer.token_bytes):
        if b and i not in stops:
            index.setdefault(b, i)
    return index, max(len(b) for b in index)


@functools.lru_cache(maxsize=4)
def _base_scores(vocab_size: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal(vocab_size).astype(np.float32))


class ReplayModel:
    """Deterministic text-keyed logits that follow a reference text.

    Parameters
    ----------
    tokenizer:
        Vocabulary of the logits rows.
    reference:
        Text to follow; ``None`` for none.
    seed:
        Seed of the fixed background scores.
    """

    def __init__(self, tokenizer: Tokenizer, reference: str | None, *, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.reference = None if reference is None else reference.encode("utf-8")
        self.vocab_size = tokenizer.vocab_size
        self._index, self._max_len = _vocab_index(tokenizer)
        self._base = _base_scores(self.vocab_size, seed)
        self._closers = [self._index[c.encode()] for c in _CLOSERS if c.encode() in self._index]
        self._seed = seed

    def logits(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """``float32[len(contexts), vocab_size]`` logits, one row per context."""
        out = self._base.repeat(len(contexts), 1)
        for row, ids in zip(out, contexts):
            for token, score in self._boosts(self.tokenizer.decode_bytes(list(ids))):
                row[token] = score
        return out

    def _boosts(self, text: bytes) -> list[tuple[int, float]]:
        ref = self.reference
        if ref is not None and ref.startswith(text):
            rest = ref[len(text) :]
            if not rest:
                return [(t, 100.0) for t in self.tokenizer.stop_ids]
            boosts = []
            for n in range(1, min(self._max_len, len(rest)) + 1):
                token = self._index.get(rest[:n])
                if token is not None:
                    boosts.append((token, 100.0 + n))
            return boosts
        digest = hashlib.blake2b(text, digest_size=32, key=str(self._seed).encode()).digest()
        picks = [int.from_bytes(digest[i : i + 4], "little") % self.vocab_size for i in (0, 8, 16)]
        boosts = [(t, 20.0 + i) for i, t in enumerate(picks)]
        boosts += [(t, 30.0) for t in self._closers]
        boosts += [(t, 40.0) for t in self.tokenizer.stop_ids]
        return boosts
