"""Logits sources for the step loop: a synthetic stand-in and a local HF model.

A :class:`LogitsSource` turns rows ``(request, output ids so far)`` into one
float32 row of next-token logits each, ``vocab_size`` wide (the tokenizer's
padded vocabulary). The step loop masks those rows and samples from them.

- :class:`SyntheticModel` is not a language model. Its rows depend only on
  ``(seed, request id, text generated so far)``: no clock, no global RNG, no
  token positions, so every rank, process and run gets the same rows, and
  retokenization or jump-forward leave its preferences unchanged. With a
  reference instance it follows the reference to the stop token; without
  one, or off it, it prefers closing punctuation and the stop token, so
  generation ends.
- :class:`HFModel` (``hf_model``) runs a local Hugging Face causal LM (the
  ``hf`` extra) on ``prompt + output`` token ids, as a real engine would,
  with a per-request KV cache. :func:`build_tiny_qwen2` builds a
  random-weight Qwen2-shaped model in process, so tests need no download.

:func:`make_model` picks the source a :class:`ModelConfig` names.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
import torch

from gramcoord.engine.hf_checks import chat_template, tokenizer_ids
from gramcoord.engine.hf_model import DTYPES, HFModel, build_tiny_qwen2
from gramcoord.rank_worker.config import ModelConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

__all__ = [
    "HFModel",
    "LogitsSource",
    "ModelRequest",
    "SyntheticModel",
    "build_tiny_qwen2",
    "make_model",
    "vocab_index",
]


class ModelRequest(msgspec.Struct, frozen=True):
    """What a logits source (and a drafter) knows about a request."""

    request_id: str
    # Prompt token ids (the HF model conditions on them; the synthetic model
    # ignores them).
    prompt_ids: tuple[int, ...] = ()
    # A valid instance to follow (synthetic model) or replay (replay drafter).
    reference: str | None = None


class LogitsSource(Protocol):
    # Width of every logits row: the tokenizer's padded vocabulary.
    vocab_size: int

    def logits(self, rows: Sequence[tuple[ModelRequest, Sequence[int]]]) -> torch.Tensor:
        """``float32[len(rows), vocab_size]``: row ``i`` holds the next-token
        logits after ``rows[i][0].prompt_ids + rows[i][1]`` (the output ids so
        far, drafts included when scoring draft rows)."""
        ...


def _digest(*parts: object, size: int = 16) -> bytes:
    """A stable hash of ``parts`` (never Python's per-process ``hash``)."""
    h = hashlib.blake2b(digest_size=size)
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


# ---------------------------------------------------------------------------
# Synthetic model


# Closing punctuation preferred off the reference, best first. Single
# characters only: '"}' would open a string at a value's start, and '}}'
# is string content inside one, where '"' must win.
_CLOSERS = ('"', "}", "]")
# Background rows; each request uses the one its id hashes to.
_NUM_BACKGROUNDS = 16
# Separators preferred off the reference when no closer is allowed.
_SEPARATORS = (":", ",")
# Punctuation that moves a pattern along ("[0-9]+-[0-9]+", "[a-z]+\.[a-z]+")
# when neither a closer nor a separator is allowed yet; without it a pattern
# that repeats a character class could loop on its background favourite.
_PATTERN_MARKS = ("-", ".", "_", "/", "@")
# Scores. The background is standard normal, far below every boost.
_ON_REFERENCE = 100.0  # + the token's length in bytes: longest wins
_STOP_AT_END = 100.0
_FALLBACK_STOP = 40.0
_CLOSER = 30.0  # + 0.1 x (number of closers after it)
_SEPARATOR = 25.0
_HASHED_PICK = 20.0  # + 0, 1, 2
_PATTERN_MARK = 15.0
# Added to whitespace-only tokens' background, so that, where JSON allows
# any whitespace, the structure goes on instead.
_WHITESPACE = -10.0


@functools.lru_cache(maxsize=4)
def vocab_index(tokenizer: Tokenizer) -> tuple[dict[bytes, int], int]:
    """Token bytes -> id (first id wins) and the longest token's length
    (cached per tokenizer).

    Special tokens are included (a reference may spell ``</tool_call>``) but
    stop tokens are not: the stop token is chosen at the reference's end.
    """
    stops = set(tokenizer.stop_ids)
    tb = tokenizer.token_bytes
    # Built backwards, so that of two ids with the same bytes the first one
    # is written last and wins (one comprehension: 0.07 s of CPU for
    # Qwen2.5 against 0.6 s for a setdefault loop; every rank builds it).
    index = {b: i for i, b in zip(range(len(tb) - 1, -1, -1), reversed(tb)) if b and i not in stops}
    return index, max(map(len, index), default=1)


@functools.lru_cache(maxsize=4)
def _backgrounds(tokenizer: Tokenizer, seed: int) -> torch.Tensor:
    """``float32[_NUM_BACKGROUNDS, vocab_size]`` fixed standard-normal rows,
    whitespace-only tokens lowered by 10."""
    vocab_size = tokenizer.vocab_size
    entropy = int.from_bytes(_digest("background", seed, vocab_size), "little")
    rng = np.random.default_rng(entropy)
    rows = rng.standard_normal((_NUM_BACKGROUNDS, vocab_size), dtype=np.float32)
    blank = [i for i, b in enumerate(tokenizer.token_bytes) if b and not b.strip()]
    rows[:, blank] += _WHITESPACE
    return torch.from_numpy(rows)


@functools.lru_cache(maxsize=65536)
def _background_of(seed: int, request_id: str) -> int:
    """Index of the background row a request uses."""
    return _digest("request", seed, request_id)[0] % _NUM_BACKGROUNDS


class SyntheticModel:
    """Deterministic text-keyed logits that follow a request's reference.

    A row is the request's background row (one of 16 fixed standard-normal
    rows, chosen by a hash of ``(seed, request_id)``) with a few sparse
    boosts keyed by the text generated so far:

    - while the text is a prefix of the reference, every token whose bytes
      continue the reference scores ``100 + len(bytes)`` (longest first); at
      the reference's end the stop token does;
    - in every other case, and below those scores whenever the reference
      cannot be continued, the stop token scores 40, closing punctuation
      about 30, ``:`` and ``,`` 25, three tokens picked by a hash of
      ``(seed, request_id, text)`` 20-22 and pattern punctuation (``-`` ``.``
      ``_`` ``/`` ``@``) 15, so generation tends to close the structure and
      end.

    Under a grammar mask the best allowed boost wins; when every boosted
    token is masked, the background row decides, which is where requests
    without a reference differ from one another. Whitespace-only tokens
    score 10 lower in the background, so optional whitespace never runs on.

    Parameters
    ----------
    tokenizer:
        Vocabulary of the rows (``vocab_size`` wide) and the text decoder.
    seed:
        Seed of the backgrounds and the hashed picks.
    """

    def __init__(self, tokenizer: Tokenizer, *, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.seed = seed
        self._index, self._max_len = vocab_index(tokenizer)
        self._backgrounds = _backgrounds(tokenizer, seed)
        self._closers = [
            (self._index[c.encode()], _CLOSER + 0.1 * (len(_CLOSERS) - i))
            for i, c in enumerate(_CLOSERS)
            if c.encode() in self._index
        ]
        stops = tokenizer.stop_ids
        self._stop_at_end = [(t, _STOP_AT_END + (t == tokenizer.eos_id)) for t in stops]
        self._fallback = [
            *(
                (self._index[c.encode()], _PATTERN_MARK)
                for c in _PATTERN_MARKS
                if c.encode() in self._index
            ),
            *(
                (self._index[c.encode()], _SEPARATOR)
                for c in _SEPARATORS
                if c.encode() in self._index
            ),
            *self._closers,
            *((t, _FALLBACK_STOP + (t == tokenizer.eos_id)) for t in stops),
        ]

    def logits(self, rows: Sequence[tuple[ModelRequest, Sequence[int]]]) -> torch.Tensor:
        """``float32[len(rows), vocab_size]``; see :class:`LogitsSource`."""
        which = [_background_of(self.seed, request.request_id) for request, _ in rows]
        out = self._backgrounds.index_select(0, torch.tensor(which, dtype=torch.long))
        r_idx: list[int] = []
        c_idx: list[int] = []
        values: list[float] = []
        for r, (request, ids) in enumerate(rows):
            text = self.tokenizer.decode_bytes(list(ids))
            boosts = self._boosts(request, text)
            r_idx += [r] * len(boosts)
            c_idx += boosts.keys()
            values += boosts.values()
        if values:
            out[torch.tensor(r_idx), torch.tensor(c_idx)] = torch.tensor(values)
        return out

    def _boosts(self, request: ModelRequest, text: bytes) -> dict[int, float]:
        """Token id -> score for the row after ``text`` (no duplicates)."""
        boosts: dict[int, float] = {}

        def add(pairs) -> None:
            for token, score in pairs:
                if score > boosts.get(token, float("-inf")):
                    boosts[token] = score

        ref = request.reference
        ref_bytes = None if ref is None else ref.encode("utf-8")
        if ref_bytes is not None and ref_bytes.startswith(text):
            rest = ref_bytes[len(text) :]
            if not rest:
                add(self._stop_at_end)
                return boosts
            for n in range(1, min(self._max_len, len(rest)) + 1):
                token = self._index.get(rest[:n])
                if token is not None:
                    add([(token, _ON_REFERENCE + n)])
        digest = _digest("text", self.seed, request.request_id, text)
        picks = [int.from_bytes(digest[i : i + 4], "little") % self.vocab_size for i in (0, 4, 8)]
        add((t, _HASHED_PICK + i) for i, t in enumerate(picks))
        add(self._fallback)
        return boosts


# ---------------------------------------------------------------------------
# make_model


def make_model(
    config: ModelConfig,
    tokenizer: Tokenizer,
    *,
    device: str | torch.device | None = None,
    hf_tokenizer: Any = None,
) -> LogitsSource:
    """The logits source ``config`` names, ``tokenizer.vocab_size`` wide.

    For ``hf``: the model at ``config.path`` on ``config.device`` (or
    ``device``) in ``config.dtype``, with a KV cache unless
    ``config.kv_cache`` is false. ``config.chat_template`` wraps each prompt
    in ``hf_tokenizer``'s chat template (default: the Hugging Face tokenizer
    loaded from the path of an ``hf:<path>`` tokenizer).

    Raises
    ------
    ValueError
        The model has fewer embedding rows than the ids ``tokenizer``
        produces, or ``chat_template`` is set and there is no chat template.
    """
    if config.kind == "synthetic":
        return SyntheticModel(tokenizer, seed=config.seed)
    assert config.path is not None  # ModelConfig checks it
    template = None
    if config.chat_template:
        template = chat_template(tokenizer, hf_tokenizer)
    return HFModel(
        config.path,
        device=device or config.device,
        dtype=DTYPES[config.dtype],
        vocab_size=tokenizer.vocab_size,
        kv_cache=config.kv_cache,
        prompt_template=template,
        tokenizer_ids=tokenizer_ids(tokenizer),
    )
