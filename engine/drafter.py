"""Draft-token proposers for speculative decoding.

A drafter proposes up to ``k`` next tokens from the output so far; the
verifier (the target model under the grammar's speculative rows) keeps the
ones it agrees with. Two drafters, chosen by ``speculative.drafter``:

- ``ngram``: prompt/output lookup. The last ``n`` tokens (longest ``n``
  first) are searched for earlier in prompt + output; the tokens that
  followed the most recent earlier match are proposed.
- ``replay``: replays the request's reference text (a workload record's
  valid instance), with deliberate errors. While the output's text is a
  prefix of the reference, it proposes the reference's tokens (then the
  stop token at its end), but about one proposed position in
  ``error_every`` is perturbed, chosen by a hash of ``(request_id, output
  position)``, so the same positions are wrong on every rank and every run.
  A perturbed token is either a shorter token that still spells the
  reference (grammar-valid, yet not what a model following the reference
  picks: the model rejects it) or an unrelated token (the grammar usually
  trims it).

Drafts never see the grammar: trimming them is ``bitmask.trim_drafts``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

from gramcoord.engine.models import ModelRequest, vocab_index
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


class ReplayDrafter:
    """Replay a reference text as drafts, with deliberate errors.

    Parameters
    ----------
    tokenizer:
        Encodes the reference; its ``eos_id`` is drafted at the end.
    reference:
        The text to replay.
    request_id:
        Keys the error positions, with ``seed``.
    error_every:
        About one proposed position in ``error_every`` is wrong; 0 replays
        the reference exactly.
    seed:
        Second key of the error positions.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        reference: str,
        *,
        request_id: str = "",
        error_every: int = 4,
        seed: int = 0,
    ) -> None:
        if error_every < 0:
            raise ValueError(f"error_every must be >= 0, got {error_every}")
        self.tokenizer = tokenizer
        self.reference = reference.encode("utf-8")
        self.request_id = request_id
        self.error_every = error_every
        self.seed = seed
        # Byte offset -> the token that spells the reference from there: the
        # canonical encoding's boundaries now, other offsets when first asked.
        self._next: dict[int, int] = {}
        self._add(0, tokenizer.encode(reference))
        self._index, self._max_len = vocab_index(tokenizer)

    def propose(self, output: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        tb = self.tokenizer.token_bytes
        text = self.tokenizer.decode_bytes(list(output))
        if not self.reference.startswith(text):
            return []
        pos = len(text)
        drafts: list[int] = []
        while len(drafts) < k:
            position = len(output) + len(drafts)
            if pos == len(self.reference):
                drafts.append(self.tokenizer.eos_id)
                break
            token = self._next_token(pos)
            roll = self._roll(position)
            if roll is None:
                drafts.append(token)
                pos += len(tb[token])
                continue
            wrong = self._shorter(token) if roll & 1 else None
            if wrong is None:
                # An unrelated token: the rest of the proposal would not
                # spell the reference, so it ends here.
                drafts.append((token + 1 + roll % (self.tokenizer.vocab_size - 1)) % len(tb))
                break
            drafts.append(wrong)
            pos += len(tb[wrong])
        return drafts

    def _roll(self, position: int) -> int | None:
        """``None`` if ``position`` is proposed right, else a hash to perturb with."""
        if not self.error_every:
            return None
        data = f"{self.seed}\0{self.request_id}\0{position}".encode()
        roll = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        return roll >> 8 if roll % self.error_every == 0 else None

    def _shorter(self, token: int) -> int | None:
        """The longest token that spells a proper prefix of ``token``."""
        spelled = self.tokenizer.token_bytes[token]
        for n in range(len(spelled) - 1, 0, -1):
            found = self._index.get(spelled[:n])
            if found is not None:
                return found
        return None

    def _add(self, pos: int, tokens: list[int]) -> None:
        for token in tokens:
            self._next.setdefault(pos, token)
            pos += len(self.tokenizer.token_bytes[token])

    def _next_token(self, pos: int) -> int:
        """A token that spells the reference at byte ``pos < len(reference)``."""
        if pos not in self._next:
            rest = self.reference[pos:]
            try:
                self._add(pos, self.tokenizer.encode(rest.decode("utf-8")))
            except UnicodeDecodeError:
                # Inside a character: the longest token spelling the next bytes.
                self._add(pos, [self._longest(rest)])
        return self._next[pos]

    def _longest(self, rest: bytes) -> int:
        for n in range(min(len(rest), self._max_len), 0, -1):
            found = self._index.get(rest[:n])
            if found is not None:
                return found
        raise ValueError(f"no token spells {rest[:8]!r}")


# speculative.drafter -> factory(tokenizer, request); K = 0 never drafts.
DRAFTERS: dict[str, Callable[[Tokenizer, ModelRequest], Drafter]] = {
    "ngram": lambda tokenizer, request: NgramDrafter(request.prompt_ids),
    "replay": lambda tokenizer, request: (
        NgramDrafter(request.prompt_ids)
        if request.reference is None
        else ReplayDrafter(tokenizer, request.reference, request_id=request.request_id)
    ),
}


def make_drafter(
    config: SpeculativeConfig, tokenizer: Tokenizer, request: ModelRequest
) -> Drafter | None:
    """The drafter ``config`` names for ``request``, or ``None`` when K == 0.

    A ``replay`` drafter without a reference text falls back to ``ngram``
    for that request.
    """
    if config.num_tokens == 0:
        return None
    return DRAFTERS[config.drafter](tokenizer, request)
