"""Fixtures for the grammar-state, bitmask and jump-forward tests.

The tokenizers, ``compile_json`` and ``dev_pool`` come from ``tests/conftest.py``: ``tiny_tokenizer`` (256
bytes, five pieces, one stop, one special; 263 tokens, so the last bitmask
word has padding bits) and ``qwen_tokenizer`` (the real Qwen2.5 vocabulary,
loaded once per session).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gramcoord.rank_worker.grammars.tokenizer import Tokenizer


class Piece:
    """Look up the single token whose bytes are exactly a piece of text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._ids: dict[bytes, int] = {}
        special = set(tokenizer.special_ids.values())
        for i, b in enumerate(tokenizer.token_bytes):
            if b and i not in special:
                self._ids.setdefault(b, i)

    def __call__(self, text: str) -> int:
        try:
            return self._ids[text.encode()]
        except KeyError:
            raise AssertionError(f"{text!r} is not a single token") from None


@pytest.fixture(scope="session", params=["tiny", "qwen"])
def any_tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tokenizer")


@pytest.fixture(scope="session")
def piece() -> Callable[[Tokenizer, str], int]:
    """``piece(tokenizer, text)``: the id of the token spelled ``text``."""
    cache: dict[int, Piece] = {}

    def lookup(tokenizer: Tokenizer, text: str) -> int:
        if id(tokenizer) not in cache:
            cache[id(tokenizer)] = Piece(tokenizer)
        return cache[id(tokenizer)](text)

    return lookup
