"""A local Hugging Face causal LM as a logits source, with a per-request KV cache.

:class:`HFModel` runs the model on ``prompt + output`` token ids, as a real
engine would, and returns the last position's logits of each row.

KV cache
--------
With ``kv_cache=True`` each request keeps the tokens it was last run on and
their ``DynamicCache``. A row is run on what its context adds to the
longest common prefix with those tokens: the next token(s) after a normal
step, nothing recomputed after jump-forward (the forced tokens are just
more new tokens), and after a retokenization or a rejected draft the cache
is cropped back to the common prefix first (recomputed from scratch when
the cache cannot be cropped, or nothing is shared). A request's draft rows
(``out``, ``out + d0``, ``out + d0 d1``, ...) are one forward pass that
keeps the logits of each row's last position. So the cache never changes
what a row conditions on, only the float rounding of how it was computed;
that rounding depends only on the request's own history of steps, which is
the same on every rank and in the one-process reference.

A cache not used by the last ``idle_calls`` ``logits`` calls is dropped (a
finished request is never seen again; a running one is in every step's
batch), so memory follows the running requests.

:func:`build_tiny_qwen2` builds a random-weight Qwen2-shaped model in
process, so tests need no download.
"""

from __future__ import annotations

import inspect
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gramcoord.engine.models import ModelRequest

# A prompt -> templated prompt function (``model.chat_template``).
PromptTemplate = Callable[[Sequence[int]], Sequence[int]]

DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}


def transformers_module():
    """``transformers``, or an ImportError that names the extra."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "model.kind 'hf' needs transformers: install the 'hf' extra "
            "(pip install 'gramcoord[hf]')"
        ) from exc
    return transformers


def model_vocab_size(model: Any) -> int:
    """Rows of the model's input embedding and lm_head (the smaller one)."""
    sizes = [int(model.get_input_embeddings().weight.shape[0])]
    head = model.get_output_embeddings()
    if head is not None:
        sizes.append(int(head.weight.shape[0]))
    return min(sizes)


@dataclass(eq=False)
class _Entry:
    """One request's cache: the tokens it holds and when it was last used."""

    tokens: list[int]
    cache: Any
    used: int


class HFModel:
    """A local Hugging Face causal LM as a logits source.

    A row with no tokens at all is fed the model's BOS (or EOS, or id 0) so
    it still has logits.

    Without the KV cache each row runs in its own forward pass by default,
    so a row's logits depend only on its tokens, never on the other rows of
    the call (a padded batch changes the kernels' shapes and so the last
    bits of the logits, which can flip a near-tie between a multi-rank run
    and the one-process reference). ``batch_rows=True`` instead batches
    rows with left padding, an attention mask and matching position ids:
    faster, equal up to float rounding. With the cache (see the module
    docstring) rows always run one request at a time.

    Parameters
    ----------
    path_or_model:
        A local model directory (loaded with ``local_files_only=True``;
        nothing is downloaded) or an already-built model object (moved to
        ``device`` / ``dtype`` in place, as ``Module.to`` does).
    device, dtype:
        Where and in what precision the model runs (``"auto"``: the
        checkpoint's dtype, or the object's as it is). Logits come back as
        float32 on ``device``.
    vocab_size:
        Width of the returned rows (the tokenizer's padded vocabulary);
        the model's rows are truncated, or padded with ``-inf``. ``None``:
        the model's own vocabulary size.
    batch_rows:
        Batch a call's rows into padded forward passes (no KV cache only).
    max_batch_tokens:
        Padded tokens per forward pass when batching; larger calls run in
        several passes.
    kv_cache:
        Keep each request's KV cache between calls.
    idle_calls:
        Drop a request's cache after this many calls without it.
    prompt_template:
        Maps a request's prompt ids to the ids the model sees (a chat
        template); applied once per distinct prompt.
    tokenizer_ids:
        How many ids the tokenizer can produce; a model with fewer
        embedding rows is refused here, not with an ``IndexError`` mid-run.

    Raises
    ------
    ValueError
        The model's vocabulary is smaller than ``tokenizer_ids``.
    """

    def __init__(
        self,
        path_or_model: str | os.PathLike[str] | Any,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        vocab_size: int | None = None,
        batch_rows: bool = False,
        max_batch_tokens: int = 65536,
        kv_cache: bool = False,
        idle_calls: int = 8,
        prompt_template: PromptTemplate | None = None,
        tokenizer_ids: int | None = None,
    ) -> None:
        if isinstance(path_or_model, (str, os.PathLike)):
            transformers = transformers_module()
            model = transformers.AutoModelForCausalLM.from_pretrained(
                os.fspath(path_or_model), local_files_only=True, dtype=dtype
            )
            where = os.fspath(path_or_model)
        else:
            model = path_or_model
            where = type(model).__name__
        if dtype == "auto":
            model = model.to(device=device)
        else:
            model = model.to(device=device, dtype=dtype)
        self.model = model.eval()
        _align_parameters(self.model)
        self.device = torch.device(device)
        self.model_vocab = model_vocab_size(self.model)
        if tokenizer_ids is not None and self.model_vocab < tokenizer_ids:
            raise ValueError(
                f"the model at {where} has {self.model_vocab} embedding rows but the tokenizer "
                f"produces ids up to {tokenizer_ids - 1} ({tokenizer_ids} ids)"
            )
        config = self.model.config
        self.vocab_size = int(vocab_size or config.vocab_size)
        self.batch_rows = batch_rows
        self.max_batch_tokens = max_batch_tokens
        self.kv_cache = kv_cache
        self.idle_calls = idle_calls
        self.prompt_template = prompt_template
        start = next(
            (t for t in (config.bos_token_id, config.eos_token_id) if isinstance(t, int)), 0
        )
        self._empty = [start]
        self._pad_id = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
        params = inspect.signature(self.model.forward).parameters
        self._keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), "")
        # transformers 5 names the cache argument ``cache``; 4.x ``past_key_values``.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._entries: dict[str, _Entry] = {}
        self._templated: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self._calls = 0
        # Forward passes that reused a cached prefix / started from nothing;
        # caches rolled back to a shorter common prefix (cropped or rebuilt).
        self.cache_hits = 0
        self.cache_misses = 0
        self.cache_rollbacks = 0

    @property
    def cached_requests(self) -> int:
        """Requests whose KV cache is held now."""
        return len(self._entries)

    def logits(self, rows: Sequence[tuple[ModelRequest, Sequence[int]]]) -> torch.Tensor:
        """``float32[len(rows), vocab_size]`` on ``device``; see ``LogitsSource``."""
        contexts = [self._context(req, ids) for req, ids in rows]
        out = torch.full((len(rows), self.vocab_size), float("-inf"), device=self.device)
        self._calls += 1
        if self.kv_cache:
            self._cached_logits(rows, contexts, out)
            self._evict()
            return out
        start = 0
        while start < len(contexts):
            stop = start + 1
            longest = len(contexts[start])
            while self.batch_rows and stop < len(contexts):
                longest2 = max(longest, len(contexts[stop]))
                if longest2 * (stop - start + 1) > self.max_batch_tokens:
                    break
                longest, stop = longest2, stop + 1
            self._put(out, start, self._forward(contexts[start:stop]))
            start = stop
        return out

    def forget(self, request_id: str | None = None) -> None:
        """Drop one request's KV cache, or every one."""
        if request_id is None:
            self._entries.clear()
        else:
            self._entries.pop(request_id, None)

    # -- inputs ------------------------------------------------------------------

    def _context(self, req: ModelRequest, ids: Sequence[int]) -> list[int]:
        prompt: Sequence[int] = req.prompt_ids
        if self.prompt_template is not None:
            key = tuple(prompt)
            templated = self._templated.get(key)
            if templated is None:
                templated = list(self.prompt_template(key))
                self._templated[key] = templated
                if len(self._templated) > 1024:
                    self._templated.popitem(last=False)
            prompt = templated
        return [*prompt, *ids] or list(self._empty)

    def _check_ids(self, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.model_vocab]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the model's {self.model_vocab} embedding rows"
            )

    def _put(self, out: torch.Tensor, start: int, last: torch.Tensor) -> None:
        width = min(self.vocab_size, last.shape[-1])
        out[start : start + last.shape[0], :width] = last[:, :width]

    # -- without a cache ------------------------------------------------------------

    def _forward(self, contexts: list[list[int]]) -> torch.Tensor:
        n, length = len(contexts), max(len(c) for c in contexts)
        ids = torch.full((n, length), self._pad_id, dtype=torch.long)
        mask = torch.zeros((n, length), dtype=torch.long)
        for i, c in enumerate(contexts):
            self._check_ids(c)
            ids[i, length - len(c) :] = torch.tensor(c, dtype=torch.long)
            mask[i, length - len(c) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = {self._keep: 1} if self._keep else {}
        with torch.inference_mode():
            result = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=False,
                **keep,
            )
        return result.logits[:, -1, :].float()

    # -- with a cache ------------------------------------------------------------------

    def _cached_logits(self, rows, contexts: list[list[int]], out: torch.Tensor) -> None:
        i = 0
        while i < len(rows):
            rid = rows[i][0].request_id
            # Rows of one request that extend each other (its draft rows).
            j = i + 1
            while (
                j < len(rows)
                and rows[j][0].request_id == rid
                and len(contexts[j]) > len(contexts[j - 1])
                and contexts[j][: len(contexts[j - 1])] == contexts[j - 1]
            ):
                j += 1
            ends = [len(c) for c in contexts[i:j]]
            self._put(out, i, self._extend(rid, contexts[j - 1], ends))
            i = j

    def _extend(self, rid: str, context: list[int], ends: list[int]) -> torch.Tensor:
        """Logits after ``context[:e]`` for each ``e`` in ``ends`` (``[len(ends), V]``)."""
        entry = self._entries.get(rid)
        shared = 0
        if entry is not None:
            limit = min(len(entry.tokens), ends[0] - 1)
            while shared < limit and entry.tokens[shared] == context[shared]:
                shared += 1
        if entry is not None and 0 < shared < len(entry.tokens):
            self.cache_rollbacks += 1
            if entry.cache.is_croppable:
                entry.cache.crop(shared - len(entry.tokens))
            else:
                shared = 0
        if entry is None or shared == 0:
            entry = self._new_entry(rid)
            shared = 0
            self.cache_misses += 1
        else:
            self.cache_hits += 1
        new = context[shared:]
        self._check_ids(new)
        keep = ends[-1] - ends[0] + 1
        ids = torch.tensor([new], dtype=torch.long, device=self.device)
        positions = torch.arange(shared, len(context), device=self.device).unsqueeze(0)
        kwargs = {self._keep: keep} if self._keep else {}
        with torch.inference_mode():
            result = self.model(
                input_ids=ids,
                position_ids=positions,
                use_cache=True,
                **{self._cache_arg: entry.cache},
                **kwargs,
            )
        entry.tokens = list(context)
        entry.used = self._calls
        logits = result.logits[0, -keep:, :]
        picks = torch.tensor([e - ends[0] for e in ends], device=logits.device)
        return logits.index_select(0, picks).float()

    def _new_entry(self, rid: str) -> _Entry:
        transformers = transformers_module()
        entry = _Entry([], transformers.DynamicCache(config=self.model.config), self._calls)
        self._entries[rid] = entry
        return entry

    def _evict(self) -> None:
        stale = [r for r, e in self._entries.items() if self._calls - e.used >= self.idle_calls]
        for rid in stale:
            del self._entries[rid]


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
    transformers = transformers_module()
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
