"""What the ``hf`` model needs, checked before any rank starts.

:func:`check_hf_model` is the launcher's pre-start check of ``model.kind:
hf``: the device exists, the model directory has a config, its vocabulary
covers every id the tokenizer can produce (special tokens included;
otherwise a prompt or a sampled special token would crash the embedding
lookup with an ``IndexError`` mid-run), and, with ``model.chat_template``,
the Hugging Face tokenizer has a chat template. It reads the model's
``config.json`` only, never its weights.

:func:`chat_template` builds the prompt wrapper ``make_model`` gives the
model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gramcoord.engine.hf_model import transformers_module
from gramcoord.rank_worker.config import ModelConfig, TokenizerConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, TokenizerError, load_tokenizer


def tokenizer_ids(tokenizer: Tokenizer) -> int:
    """How many ids ``tokenizer`` can produce: its highest real token id + 1.

    The padding past the real vocabulary (empty tokens up to the lm_head
    size) is not counted; special tokens are.
    """
    real = [i for i, b in enumerate(tokenizer.token_bytes) if b]
    return 1 + max([*real, *tokenizer.special_ids.values(), *tokenizer.stop_ids])


def hf_tokenizer_path(tokenizer: Tokenizer) -> str | None:
    """The local directory of a tokenizer loaded with ``tokenizer.name: hf``."""
    return tokenizer.name[3:] if tokenizer.name.startswith("hf:") else None


@functools.lru_cache(maxsize=4)
def _load_hf_tokenizer(path: str) -> Any:
    transformers = transformers_module()
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def chat_template(
    tokenizer: Tokenizer, hf_tokenizer: Any = None
) -> Callable[[Sequence[int]], list[int]]:
    """``prompt ids -> templated ids``: the prompt as one user turn of the chat
    template, with the generation prompt (the assistant turn's opening).

    The prompt's text is ``tokenizer.decode(prompt_ids)`` (prompts are
    encoded text, so this is the text itself); the templated text is
    encoded with ``hf_tokenizer`` (default: the Hugging Face tokenizer at
    ``tokenizer``'s ``hf:<path>``), its special tokens parsed.

    Raises
    ------
    ValueError
        No Hugging Face tokenizer, or one without a chat template.
    """
    if hf_tokenizer is None:
        path = hf_tokenizer_path(tokenizer)
        if path is None:
            raise ValueError(
                f"model.chat_template needs a Hugging Face tokenizer (tokenizer.name 'hf' with "
                f"tokenizer.path); the tokenizer is {tokenizer.name!r}"
            )
        hf_tokenizer = _load_hf_tokenizer(path)
    if not getattr(hf_tokenizer, "chat_template", None):
        where = getattr(hf_tokenizer, "name_or_path", "") or type(hf_tokenizer).__name__
        raise ValueError(
            f"model.chat_template is set but the tokenizer at {where} has no chat template "
            "(tokenizer_config.json / chat_template.jinja)"
        )

    def wrap(prompt_ids: Sequence[int]) -> list[int]:
        text = tokenizer.decode(list(prompt_ids))
        rendered = hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(hf_tokenizer.encode(rendered, add_special_tokens=False))

    return wrap


def device_problem(device: str) -> str | None:
    """Why ``model.device`` cannot be used on this machine, if it cannot."""
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        return f"model.device {device!r} needs CUDA, but this machine has none (torch {torch.__version__})"
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        return f"model.device {device!r}: this machine has {count} CUDA device(s)"
    return None


def check_hf_model(model: ModelConfig, tokenizer: TokenizerConfig) -> str | None:
    """What stops the ``hf`` model from running, as one line, before any rank starts."""
    if model.kind != "hf":
        return None
    problem = device_problem(model.device)
    if problem:
        return problem
    try:
        transformers = transformers_module()
    except ImportError as exc:
        return str(exc)
    try:
        config = transformers.AutoConfig.from_pretrained(model.path, local_files_only=True)
    except Exception as exc:  # any unreadable config is reported, not raised
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"model.path {model.path}: cannot read the model's config: {first}"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_vocab = int(getattr(text, "vocab_size", 0) or 0)
    try:
        tok = load_tokenizer(tokenizer)
    except TokenizerError as exc:
        return str(exc)
    need = tokenizer_ids(tok)
    if model_vocab < need:
        return (
            f"model.path {model.path}: the model's vocabulary has {model_vocab} rows (embedding "
            f"/ lm_head) but the tokenizer {tok.name} produces {need} ids (special tokens "
            "included); use the model's own tokenizer"
        )
    if model.chat_template:
        try:
            chat_template(tok)
        except (ValueError, OSError) as exc:
            return str(exc)
    return None
