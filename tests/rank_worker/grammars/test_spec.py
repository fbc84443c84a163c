"""Spec validation: every rejection rule, warnings, and canonical keys."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError
from gramcoord.rank_worker.grammars.spec import (
    MAX_DEPTH,
    MAX_VALUES,
    StructuredOutputSpec,
    validate_spec,
)

CFG = GrammarConfig()
# Refusing what xgrammar would not enforce (the default admits it, end-checked).
REFUSE = GrammarConfig(reject_ignored_features=True)


def _nested(depth: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(depth):
        node = {"type": "array", "items": node}
    return node


@pytest.mark.parametrize(
    ("spec", "code"),
    [
        pytest.param({}, ErrorCode.spec_no_kind, id="no-kind"),
        pytest.param(
            {"regex": "a", "choice": ["a"]}, ErrorCode.spec_multiple_kinds, id="two-kinds"
        ),
        pytest.param({"choice": []}, ErrorCode.spec_empty_choice, id="empty-choice"),
        pytest.param({"grammar": "   \n"}, ErrorCode.spec_blank, id="blank-grammar"),
        pytest.param({"json": "  "}, ErrorCode.spec_blank, id="blank-json"),
        pytest.param({"structural_tag": "{}"}, ErrorCode.spec_blank, id="blank-structural-tag"),
        pytest.param({"regex": ""}, ErrorCode.spec_blank, id="blank-regex"),
        pytest.param(
            {"json_object": False}, ErrorCode.spec_json_object_false, id="json-object-false"
        ),
        pytest.param({"regex": "ab\x00c"}, ErrorCode.spec_regex_nul, id="regex-nul"),
        pytest.param({"json": _nested(MAX_DEPTH)}, ErrorCode.spec_too_deep, id="schema-too-deep"),
        pytest.param(
            {"json": "[" * 100_000 + "]" * 100_000}, ErrorCode.spec_too_deep, id="json-text-bomb"
        ),
        pytest.param(
            {"regex": "(" * 65 + "a" + ")" * 65}, ErrorCode.spec_too_deep, id="regex-too-deep"
        ),
        pytest.param(
            {"grammar": "root ::= " + "(" * 70 + '"a"' + ")" * 70},
            ErrorCode.spec_too_deep,
            id="grammar-too-deep",
        ),
        pytest.param({"regex": "a" * (2 << 20)}, ErrorCode.spec_too_large, id="too-large"),
        pytest.param(
            {"json": {"enum": list(range(MAX_VALUES + 1))}},
            ErrorCode.spec_too_many_values,
            id="giant-enum",
        ),
        pytest.param(
            {"choice": ["x"] * (MAX_VALUES + 1)}, ErrorCode.spec_too_many_values, id="giant-choice"
        ),
        pytest.param({"json": "{not json"}, ErrorCode.spec_bad_json, id="bad-json-text"),
        pytest.param({"json": 42}, ErrorCode.spec_bad_json, id="schema-not-object"),
        pytest.param({"json": False}, ErrorCode.spec_bad_json, id="schema-false"),
        pytest.param(
            {"json": {"$ref": "#/definitions/missing"}},
            ErrorCode.spec_bad_json,
            id="broken-local-ref",
        ),
        pytest.param({"regex": 7}, ErrorCode.spec_bad_type, id="regex-not-string"),
        pytest.param({"choice": "abc"}, ErrorCode.spec_bad_type, id="choice-not-list"),
        pytest.param({"jsn": {}}, ErrorCode.spec_bad_type, id="unknown-field"),
        pytest.param("not json", ErrorCode.spec_bad_json, id="spec-text-not-json"),
        pytest.param([1, 2], ErrorCode.spec_bad_type, id="spec-not-object"),
        pytest.param({"json": '{"const": NaN}'}, ErrorCode.spec_bad_json, id="nan-text"),
        pytest.param({"json": {"const": float("inf")}}, ErrorCode.spec_bad_json, id="inf-value"),
        pytest.param({"json": '{"a": 1e999}'}, ErrorCode.spec_bad_json, id="overflow"),
        pytest.param(
            {"json": {"allOf": [{}], "properties": {"a": {"$ref": "#/allOf/\u00b2"}}}},
            ErrorCode.spec_bad_json,
            id="unicode-digit-ref",
        ),
        pytest.param({"regex": "a\ud800"}, ErrorCode.spec_bad_json, id="regex-lone-surrogate"),
        pytest.param(
            {"json": {"type": "string", "description": "\udcff"}},
            ErrorCode.spec_bad_json,
            id="schema-lone-surrogate",
        ),
        pytest.param(
            {"json": '{"const": "\\ud800"}'}, ErrorCode.spec_bad_json, id="escaped-lone-surrogate"
        ),
        pytest.param({"choice": ["\udc80"]}, ErrorCode.spec_bad_json, id="choice-lone-surrogate"),
        pytest.param(b'{"regex": "a\xffb"}', ErrorCode.spec_bad_json, id="invalid-utf8-bytes"),
        pytest.param(
            {"json": _nested(2000)}, ErrorCode.spec_too_deep, id="schema-object-2000-levels"
        ),
        pytest.param(
            {"json": {"type": "string", "enum": ["x" * 100] * 20_000}},
            ErrorCode.spec_too_large,
            id="schema-object-too-large",
        ),
    ],
)
def test_rejections(spec, code):
    with pytest.raises(SpecError) as info:
        validate_spec(spec, CFG)
    assert info.value.code is code
    assert info.value.message  # actionable text, not just a code


IGNORED = [
    pytest.param({"type": "number", "multipleOf": 0.5}, "multipleOf", id="multipleOf-number"),
    pytest.param({"type": "array", "uniqueItems": True}, "uniqueItems", id="uniqueItems"),
    pytest.param({"type": "array", "contains": {"type": "integer"}}, "contains", id="contains"),
    # Two patterns: no single object says both (rewrites conjoin the rest).
    pytest.param({"allOf": [{"pattern": "a"}, {"pattern": "b"}]}, "allOf", id="allOf-2"),
    pytest.param({"type": "string", "format": "date"}, "format", id="calendar-format"),
    pytest.param(
        {"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength", id="pattern+len"
    ),
    pytest.param(
        {"type": "string", "format": "email", "minLength": 3}, "minLength", id="format+len"
    ),
    pytest.param(
        {"type": "object", "properties": {"deep": {"type": "array", "uniqueItems": True}}},
        "$.properties.deep",
        id="nested-path",
    ),
    pytest.param(
        # patternProperties may describe foo: it cannot be listed as any value.
        {"type": "object", "patternProperties": {"^b": {}}, "required": ["foo"]},
        "required 'foo' is not enforced",
        id="required-not-in-properties",
    ),
]


@pytest.mark.parametrize(("schema", "needle"), IGNORED)
def test_ignored_features_rejected(schema, needle):
    with pytest.raises(SpecError) as info:
        validate_spec({"json": schema}, REFUSE)
    assert info.value.code is ErrorCode.schema_unsupported_feature
    assert needle in info.value.message
    assert "reject_ignored_features" in info.value.message


@pytest.mark.parametrize(("schema", "needle"), IGNORED)
def test_ignored_features_downgrade_to_warning(schema, needle):
    spec = validate_spec({"json": schema}, CFG)
    assert any(w.startswith("ignored_feature") and needle in w for w in spec.warnings)
    assert spec.end_check


@pytest.mark.parametrize(
    "schema",
    [
        pytest.param({"type": "integer", "multipleOf": 3}, id="multipleOf-integer"),
        pytest.param({"type": "array", "uniqueItems": False}, id="uniqueItems-false"),
        pytest.param({"allOf": [{"type": "integer"}]}, id="allOf-1"),
        # Rewritten into what xgrammar enforces whole (schema_rewrite).
        pytest.param({"allOf": [{"type": "object"}, {"required": ["a"]}]}, id="allOf-2-merged"),
        pytest.param({"type": "string", "format": "idn-email"}, id="annotation-format"),
        pytest.param(
            {"type": "object", "properties": {"bar": {}}, "required": ["foo"]},
            id="required-listed",
        ),
        pytest.param({"type": "string", "format": "uuid"}, id="supported-format"),
        pytest.param({"type": "string", "maxLength": 3}, id="plain-length"),
        pytest.param({"enum": [{"uniqueItems": True}]}, id="keyword-inside-data"),
    ],
)
def test_enforced_features_pass(schema):
    assert validate_spec({"json": schema}, CFG).warnings == ()


@pytest.mark.parametrize(
    "ref",
    [
        pytest.param("https://example.com/schema.json", id="remote"),
        pytest.param("other.json#/definitions/a", id="relative-file"),
    ],
)
def test_unresolvable_ref_warns(ref):
    spec = validate_spec({"json": {"type": "object", "properties": {"a": {"$ref": ref}}}}, CFG)
    assert any(w.startswith("unconstrained_ref") and ref in w for w in spec.warnings)


def test_local_ref_is_fine():
    schema = {"$defs": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/s"}}}
    assert validate_spec({"json": schema}, CFG).warnings == ()


def test_key_ignores_keyword_order_and_whitespace():
    a = {
        "type": "object",
        "required": ["x"],
        "properties": {"x": {"type": "string", "minLength": 1}},
    }
    b_text = '{ "properties" : {"x": {"minLength":1, "type":"string"}},\n "required":["x"], "type":"object"}'
    ka = validate_spec({"json": a}, CFG)
    kb = validate_spec({"json": b_text}, CFG)
    assert ka.key == kb.key and ka.text == kb.text and len(ka.key) == 16


def test_key_keeps_property_order():
    # Property order is output order in xgrammar, so it is part of the key.
    a = {"type": "object", "properties": {"x": {}, "y": {}}}
    b = {"type": "object", "properties": {"y": {}, "x": {}}}
    assert validate_spec({"json": a}, CFG).key != validate_spec({"json": b}, CFG).key
    assert json.loads(validate_spec({"json": b}, CFG).text)["properties"] == {"y": {}, "x": {}}


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        pytest.param({"regex": "a+"}, {"regex": "a+"}, True, id="same-regex"),
        pytest.param({"regex": "a+"}, {"regex": "a+ "}, False, id="regex-whitespace-matters"),
        pytest.param({"json": {}}, {"json": {}, "any_whitespace": False}, False, id="json-options"),
        pytest.param(
            {"regex": "a"},
            {"regex": "a", "any_whitespace": False},
            True,
            id="regex-ignores-options",
        ),
        pytest.param(
            {"json": {}}, {"json": {}, "disable_any_whitespace": True}, False, id="vllm-spelling"
        ),
        pytest.param({"choice": ["a", "b"]}, {"choice": ["b", "a"]}, False, id="choice-order"),
        pytest.param(
            {"grammar": 'root ::= "a"'},
            {"grammar": 'root ::= "a"', "grammar_syntax": "lark"},
            False,
            id="syntax",
        ),
    ],
)
def test_key_table(a, b, same):
    assert (validate_spec(a, CFG).key == validate_spec(b, CFG).key) is same


def test_key_depends_on_vocab():
    assert (
        validate_spec({"regex": "a"}, CFG, vocab="x").key
        != validate_spec({"regex": "a"}, CFG, vocab="y").key
    )


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        pytest.param({"grammar": 'root ::= "a"'}, "ebnf", id="ebnf"),
        pytest.param({"grammar": 'start: "a"'}, "lark", id="lark"),
        pytest.param({"json_object": True}, "json_object", id="json-object"),
        pytest.param({"choice": ["a"]}, "choice", id="choice"),
        pytest.param(StructuredOutputSpec(regex="a"), "regex", id="struct-input"),
        pytest.param(b'{"regex": "a"}', "regex", id="bytes-input"),
        pytest.param({"json": True}, "json", id="schema-true"),
    ],
)
def test_kinds(spec, kind):
    assert validate_spec(spec, CFG).kind == kind


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["json", "regex", "choice", "grammar", "json_object", "structural_tag", "x"]
        ),
        json_values,
        max_size=3,
    )
)
def test_fuzzed_specs_only_raise_spec_error(spec):
    try:
        out = validate_spec(spec, CFG)
    except SpecError as exc:
        assert isinstance(exc.code, ErrorCode) and exc.message
        return
    assert len(out.key) == 16 and out.kind in (
        "json",
        "regex",
        "choice",
        "ebnf",
        "lark",
        "json_object",
        "structural_tag",
    )


@pytest.mark.parametrize(
    ("schema", "where", "value"),
    [
        pytest.param({"type": "objekt"}, "$.type", '"objekt"', id="typo"),
        pytest.param({"type": ["string", "objekt"]}, "$.type", '"objekt"', id="typo-in-list"),
        pytest.param(
            {"properties": {"a": {"type": "strin"}}}, "$.properties.a.type", '"strin"', id="nested"
        ),
        pytest.param({"type": [{}]}, "$.type", "{}", id="type-list-of-object"),
        pytest.param({"type": {"a": 1}}, "$.type", '{"a": 1}', id="type-object"),
        pytest.param({"type": []}, "$.type", "[]", id="type-empty-list"),
    ],
)
def test_bad_type_name_fails_before_the_compiler(schema, where, value):
    # Refused at validation with a message naming the field and the choices,
    # never xgrammar's raw RuntimeError text at compile.
    with pytest.raises(SpecError) as info:
        validate_spec({"json": schema}, CFG)
    assert info.value.code == ErrorCode.spec_bad_json
    msg = str(info.value)
    assert f"{where}: {value} is not a JSON Schema type" in msg and "integer, null" in msg
    assert "RuntimeError" not in msg


def test_structural_tag_keeps_property_order():
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "json_schema",
            "json_schema": {"type": "object", "properties": {"name": {}, "arguments": {}}},
        },
    }
    text = validate_spec({"structural_tag": tag}, CFG).text
    assert text.index('"name"') < text.index('"arguments"')


def test_size_checked_before_parsing():
    huge = "[" + "1," * (1 << 20) + "1]"
    with pytest.raises(SpecError) as info:
        validate_spec({"json": huge}, CFG)
    assert info.value.code is ErrorCode.spec_too_large
