"""Fixtures for the grammar-state, bitmask and jump-forward tests.

The tokenizers come from ``tests/conftest.py``: ``tiny_tokenizer`` (256
bytes, five pieces, one stop, one special; 263 tokens, so the last bitmask
word has padding bits) and ``qwen_tokenizer`` (the real Qwen2.5 vocabulary,
loaded once per session).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import xgrammar as xgr

from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

# Dev schemas used by the property tests: small, fast to compile, with a
# valid instance xgrammar accepts as ``json.dumps`` text.
_POOL_SIZE = 24
_MAX_SCHEMA_BYTES = 1500
_MAX_LABEL_COMPILE_MS = 15.0


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


@pytest.fixture(scope="session")
def compile_json() -> Callable[..., xgr.CompiledGrammar]:
    """``compile_json(tokenizer, schema, any_whitespace=True)``, cached."""
    compilers: dict[int, xgr.GrammarCompiler] = {}
    cache: dict[tuple, xgr.CompiledGrammar] = {}

    def compile_(tokenizer: Tokenizer, schema, *, any_whitespace: bool = True):
        key = (id(tokenizer), json.dumps(schema, sort_keys=True), any_whitespace)
        if key not in cache:
            if id(tokenizer) not in compilers:
                compilers[id(tokenizer)] = xgr.GrammarCompiler(tokenizer.info, max_threads=1)
            cache[key] = compilers[id(tokenizer)].compile_json_schema(
                schema, any_whitespace=any_whitespace
            )
        return cache[key]

    return compile_


def instance_text(data, any_whitespace: bool) -> str:
    # xgrammar's separators: compact with any_whitespace, ", " / ": " without.
    return json.dumps(data) if not any_whitespace else json.dumps(data, separators=(",", ":"))


@pytest.fixture(scope="session")
def dev_pool(dev_schemas, qwen_tokenizer, compile_json) -> dict[bool, list[tuple]]:
    """any_whitespace -> [(schema id, compiled grammar, instance text)]."""
    candidates = [
        rec
        for rec in dev_schemas
        if rec["label"].get("status") == "ok"
        and rec["label"].get("compile_ms", 1e9) <= _MAX_LABEL_COMPILE_MS
        and rec["size_bytes"] <= _MAX_SCHEMA_BYTES
        and any(inst["valid"] for inst in rec["instances"])
    ]
    pool: dict[bool, list[tuple]] = {True: [], False: []}
    for any_ws in (True, False):
        for rec in candidates:
            if len(pool[any_ws]) >= _POOL_SIZE:
                break
            data = next(inst["data"] for inst in rec["instances"] if inst["valid"])
            text = instance_text(data, any_ws)
            try:
                compiled = compile_json(qwen_tokenizer, rec["schema"], any_whitespace=any_ws)
            except Exception:
                continue
            matcher = xgr.GrammarMatcher(compiled)
            if matcher.accept_string(text) and matcher.is_completed():
                pool[any_ws].append((rec["id"], compiled, text))
    assert len(pool[True]) >= 10 and len(pool[False]) >= 10, "too few usable dev schemas"
    return pool
