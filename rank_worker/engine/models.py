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
- :class:`HFModel` runs a local Hugging Face causal LM (the ``hf`` extra) on
  ``prompt + output`` token ids, as a real engine would.
  :func:`build_tiny_qwen2` builds a random-weight Qwen2-shaped model in
  process, so tests need no download.

:func:`make_model` picks the source a :class:`ModelConfig` names.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
import torch

from gramcoord.rank_worker.config import ModelConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer


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
    index: dict[bytes, int] = {}
    stops = set(tokenizer.stop_ids)
    for i, b in enumerate(tokenizer.token_bytes):
        if b and i not in stops:
            index.setdefault(b, i)
    return index, max(len(b) for b in index)


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
# Hugging Face model


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "model.kind 'hf' needs transformers: install the 'hf' extra "
            "(pip install 'gramcoord[hf]')"
        ) from exc
    return transformers


class HFModel:
    """A local Hugging Face causal LM as a logits source.

    Each row's input is ``prompt_ids + output ids``, and only the last
    position's logits are computed. A row with no tokens at all is fed the
    model's BOS (or EOS, or id 0) so it still has logits.

    By default each row runs in its own forward pass, so a row's logits
    depend only on its tokens, never on the other rows of the call (a
    padded batch changes the kernels' shapes and so the last bits of the
    logits, which can flip a near-tie between a multi-rank run and the
    one-process reference). ``batch_rows=True`` instead batches rows with
    left padding, an attention mask and matching position ids: faster,
    equal up to float rounding.

    Parameters
    ----------
    path_or_model:
        A local model directory (loaded with ``local_files_only=True``;
        nothing is downloaded) or an already-built model object (moved to
        ``device`` / ``dtype`` in place, as ``Module.to`` does).
    device, dtype:
        Where and in what precision the model runs. Logits come back as
        float32 on ``device``.
    vocab_size:
        Width of the returned rows (the tokenizer's padded vocabulary);
        the model's rows are truncated, or padded with ``-inf``. ``None``:
        the model's own vocabulary size.
    batch_rows:
        Batch a call's rows into padded forward passes (see above).
    max_batch_tokens:
        Padded tokens per forward pass when batching; larger calls run in
        several passes.
    """

    def __init__(
        self,
        path_or_model: str | os.PathLike[str] | Any,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        vocab_size: int | None = None,
        batch_rows: bool = False,
        max_batch_tokens: int = 65536,
    ) -> None:
        if isinstance(path_or_model, (str, os.PathLike)):
            transformers = _transformers()
            model = transformers.AutoModelForCausalLM.from_pretrained(
                os.fspath(path_or_model), local_files_only=True
            )
        else:
            model = path_or_model
        self.model = model.to(device=device, dtype=dtype).eval()
        _align_parameters(self.model)
        self.device = torch.device(device)
        config = self.model.config
        self.vocab_size = int(vocab_size or config.vocab_size)
        self.batch_rows = batch_rows
        self.max_batch_tokens = max_batch_tokens
        start = next(
            (t for t in (config.bos_token_id, config.eos_token_id) if isinstance(t, int)), 0
        )
        self._empty = [start]
        self._pad_id = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
        params = inspect.signature(self.model.forward).parameters
        self._keep = next(
            ({k: 1} for k in ("logits_to_keep", "num_logits_to_keep") if k in params), {}
        )

    def logits(self, rows: Sequence[tuple[ModelRequest, Sequence[int]]]) -> torch.Tensor:
        """``float32[len(rows), vocab_size]`` on ``device``; see :class:`LogitsSource`."""
        contexts = [[*req.prompt_ids, *ids] or self._empty for req, ids in rows]
        out = torch.full((len(rows), self.vocab_size), float("-inf"), device=self.device)
        start = 0
        while start < len(contexts):
            stop = start + 1
            longest = len(contexts[start])
            while self.batch_rows and stop < len(contexts):
                longest2 = max(longest, len(contexts[stop]))
                if longest2 * (stop - start + 1) > self.max_batch_tokens:
                    break
                longest, stop = longest2, stop + 1
            last = self._forward(contexts[start:stop])
            width = min(self.vocab_size, last.shape[-1])
            out[start:stop, :width] = last[:, :width]
            start = stop
        return out

    def _forward(self, contexts: list[list[int]]) -> torch.Tensor:
        n, length = len(contexts), max(len(c) for c in contexts)
        ids = torch.full((n, length), self._pad_id, dtype=torch.long)
        mask = torch.zeros((n, length), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, length - len(c) :] = torch.tensor(c, dtype=torch.long)
            mask[i, length - len(c) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            result = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=False,
                **self._keep,
            )
        return result.logits[:, -1, :].float()


def _align_parameters(model: torch.nn.Module) -> None:
    """Copy parameters and buffers that are not 64-byte aligned.

    A loaded checkpoint's tensors may sit at any offset of a mapped file,
    and BLAS takes different code paths (different last bits) for aligned
    and unaligned operands: copying makes the logits independent of how
    the weights were loaded. Tied parameters stay tied.
    """
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.data_ptr() % 64:
                tensor.data = tensor.data.clone()


def build_tiny_qwen2(
    path: str | os.PathLike[str] | None = None, *, vocab_size: int = 151_936, seed: int = 0
) -> Any:
    """A tiny random-weight ``Qwen2ForCausalLM`` (hidden 32, 2 layers).

    The weights depend only on ``seed`` (the global RNG is left as it
    was). With ``path``, the model is also saved there
    (``save_pretrained``), so ``model.path`` can point at it.
    """
    transformers = _transformers()
    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=151_643 if vocab_size > 151_643 else 0,
        eos_token_id=151_645 if vocab_size > 151_645 else 0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config).eval()
    if path is not None:
        model.save_pretrained(os.fspath(path))
    return model


def make_model(
    config: ModelConfig, tokenizer: Tokenizer, *, device: str | torch.device = "cpu"
) -> LogitsSource:
    """The logits source ``config`` names, ``tokenizer.vocab_size`` wide."""
    if config.kind == "synthetic":
        return SyntheticModel(tokenizer, seed=config.seed)
    assert config.path is not None  # ModelConfig checks it
    return HFModel(config.path, device=device, vocab_size=tokenizer.vocab_size)
