"""JSON strings bounded by minLength/maxLength: xgrammar lets raw control characters in,
``SafeStrings`` keeps them out and changes nothing else.

Probed with the tiny vocabulary (one token per byte, so a token sequence
is a byte sequence): xgrammar 0.2.9 compiles each bounded string of the
table into a grammar that accepts a raw TAB and a raw ``\\x01`` inside the
quotes (not a raw newline); the same string without bounds refuses all
three. Through the compile path every host uses (``XGrammarBackend``, a
scripted token sequence through the real ``GrammarMatcher``), all three
are refused, and every mask is xgrammar's own but for control characters.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import xgrammar as xgr

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.json_strings import SafeStrings, safe_grammar_text
from gramcoord.rank_worker.grammars.spec import validate_spec

CONTROL = ["\t", "\x01", "\n"]

# (schema or structural tag, text before the string's content, text after it)
BOUNDED = [
    pytest.param({"type": "string", "maxLength": 24}, '"a', '"', id="maxLength"),
    pytest.param({"type": "string", "minLength": 2}, '"a', '"', id="minLength"),
    pytest.param({"type": "string", "minLength": 1, "maxLength": 8}, '"a', '"', id="both"),
    pytest.param({"type": ["string", "null"], "maxLength": 8}, '"a', '"', id="type-list"),
    pytest.param(
        {"type": "object", "properties": {"s": {"type": "string", "maxLength": 12}}},
        '{"s": "a',
        '"}',
        id="property",
    ),
    pytest.param(
        {"type": "array", "items": {"$ref": "#/$defs/s"}, "$defs": {"s": {"type": "string", "maxLength": 6}}},
        '["a',
        '"]',
        id="items-ref",
    ),
    pytest.param(
        {"type": "object", "propertyNames": {"maxLength": 6}, "additionalProperties": {"type": "integer"}},
        '{"a',
        '": 1}',
        id="propertyNames",
    ),
    pytest.param(
        {
            "type": "structural_tag",
            "format": {"type": "json_schema", "json_schema": {"type": "string", "maxLength": 9}},
        },
        '"a',
        '"',
        id="structural-tag",
    ),
]  # fmt: skip


def _kind(schema: dict) -> str:
    return "structural_tag" if schema.get("type") == "structural_tag" else "json"


@pytest.fixture(scope="module")
def raw(tiny_tokenizer):
    """xgrammar's own compilers, per kind over the vocabulary view our backend uses."""
    return {
        "json": xgr.GrammarCompiler(tiny_tokenizer.info, max_threads=1, cache_enabled=False),
        "structural_tag": xgr.GrammarCompiler(
            tiny_tokenizer.full_info, max_threads=1, cache_enabled=False
        ),
    }


@pytest.fixture(scope="module")
def backend(tiny_tokenizer):
    return XGrammarBackend(tiny_tokenizer)


def _xgrammar(raw, schema):
    text = json.dumps(schema)
    if _kind(schema) == "structural_tag":
        return raw["structural_tag"].compile_structural_tag(text)
    return raw["json"].compile_json_schema(text, any_whitespace=False, strict_mode=False)


def _ours(backend, schema):
    spec = validate_spec(
        {_kind(schema): schema, "any_whitespace": False, "strict_mode": False}, GrammarConfig()
    )
    return backend(spec)


def _accepts(compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(("schema", "before", "after"), BOUNDED)
def test_xgrammar_lets_tab_and_x01_into_a_bounded_string(raw, schema, before, after):
    compiled = _xgrammar(raw, schema)
    assert _accepts(compiled, f"{before}b{after}")
    assert _accepts(compiled, f"{before}\tb{after}")
    assert _accepts(compiled, f"{before}\x01b{after}")
    assert not _accepts(compiled, f"{before}\nb{after}")
    with pytest.raises(ValueError):
        json.loads(f"{before}\tb{after}")
    # Without the bounds the same string refuses all three.
    plain = {"type": "string"}
    for char in CONTROL:
        assert not _accepts(raw["json"].compile_json_schema(json.dumps(plain)), f'"a{char}b"')


@pytest.mark.parametrize(("schema", "before", "after"), BOUNDED)
@pytest.mark.parametrize("char", CONTROL, ids=["tab", "x01", "newline"])
def test_every_host_compile_refuses_a_raw_control_character(
    backend, piece, tiny_tokenizer, schema, before, after, char
):
    # A scripted model: the tokens of the prefix, then the control character.
    matcher = xgr.GrammarMatcher(_ours(backend, schema))
    for token in tiny_tokenizer.encode(before):
        assert matcher.accept_token(token)
    assert not matcher.accept_token(piece(tiny_tokenizer, char))
    # The same output without it is still accepted, and is JSON.
    assert matcher.accept_string(f"b{after}") and matcher.is_completed()
    if _kind(schema) == "json":
        json.loads(f"{before}b{after}")


@pytest.mark.parametrize(("schema", "before", "after"), BOUNDED)
def test_masks_are_xgrammars_but_for_control_characters(
    raw, backend, tiny_tokenizer, schema, before, after
):
    theirs = xgr.GrammarMatcher(_xgrammar(raw, schema))
    ours = xgr.GrammarMatcher(_ours(backend, schema))
    control = [i for i, b in enumerate(tiny_tokenizer.token_bytes) if any(c < 0x20 for c in b)]
    size = tiny_tokenizer.info.vocab_size
    for token in [*tiny_tokenizer.encode(f"{before}bcd{after}"), tiny_tokenizer.stop_ids[0]]:
        masks = []
        for matcher in (theirs, ours):
            bitmask = xgr.allocate_token_bitmask(1, size)
            matcher.fill_next_token_bitmask(bitmask)
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:size]
            masks.append(bits.astype(bool))
        outside = np.ones(size, dtype=bool)
        outside[control] = False
        assert np.array_equal(masks[0][outside], masks[1][outside])
        assert not (masks[1] & ~masks[0]).any()  # ours only ever takes away
        assert theirs.accept_token(token) and ours.accept_token(token)


@pytest.mark.parametrize(
    ("schema", "longest"),
    [
        pytest.param({"type": "string", "maxLength": 3}, 3, id="max"),
        pytest.param({"type": "string", "minLength": 2, "maxLength": 4}, 4, id="min-max"),
    ],
)
def test_bounds_count_the_same(raw, backend, schema, longest):
    for n in range(longest + 2):
        text = '"' + "é" * n + '"'  # a two-byte character counts once, either way
        assert _accepts(_ours(backend, schema), text) is _accepts(_xgrammar(raw, schema), text)


class _Recorder:
    """A compiler that records the calls it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return name

        return call


@pytest.mark.parametrize(
    ("schema", "method"),
    [
        pytest.param('{"type": "string"}', "compile_json_schema", id="plain"),
        pytest.param('{"type": "string", "pattern": "^a$"}', "compile_json_schema", id="pattern"),
        pytest.param('{"type": "string", "enum": ["a"], "maxLength": 3}', "compile_json_schema", id="enum"),
        pytest.param('{"type": "string", "maxLength": 3}', "compile_grammar", id="bounded"),
        pytest.param('{"type": "strin", "maxLength": 3}', "compile_json_schema", id="compile-error"),
    ],
)  # fmt: skip
def test_other_grammars_reach_the_hosts_own_call(schema, method):
    inner = _Recorder()
    SafeStrings(inner).compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    ((name, args, kwargs),) = inner.calls
    assert name == method
    if method == "compile_json_schema":  # exactly as the host asked
        assert (args, kwargs) == ((schema,), {"any_whitespace": False, "separators": (",", ":")})
    else:  # with the host's options applied
        assert '": "' not in args[0] and "[^\\0-\\x1f" in args[0]


def test_the_rewrite_touches_only_the_length_rule():
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}})
    before = str(xgr.Grammar.from_json_schema(schema))
    after = safe_grammar_text(xgr.Grammar.from_json_schema(schema))
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines())
    assert changed == [
        (
            'root_prop_0_characters ::= (([^\\"\\\\\\r\\n]))',
            'root_prop_0_characters ::= (([^\\0-\\x1f\\"\\\\]))',
        )
    ]
