"""Rewrites into what xgrammar enforces exactly (``schema_rewrite``): keyword by
keyword, each checked three ways where it applies: the rewritten schema, the
verdict of ``jsonschema`` on the same instances before and after, and what a
real grammar accepts."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from referencing import Registry

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.schema_rewrite import conjoin, rewrite
from gramcoord.rank_worker.grammars.schema_tree import canonical_tree
from gramcoord.rank_worker.grammars.spec import validate_spec

STRICT = GrammarConfig(reject_ignored_features=True)
LAX = GrammarConfig(reject_ignored_features=True, strict_mode=False)


def rewritten(schema: dict, strict_mode: bool = False):
    tree = canonical_tree(schema, max_depth=64)
    return rewrite(tree, strict_mode=strict_mode, max_depth=64)


def _validator(schema):
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, registry=Registry())


def same_verdicts(schema: dict, instances: list) -> None:
    """jsonschema gives every instance the same verdict before and after."""
    r = rewritten(schema)
    assert r is not None, "nothing was rewritten"
    before, after = _validator(schema), _validator(r.root)
    for inst in instances:
        assert before.is_valid(inst) == after.is_valid(inst), (inst, r.root)


@pytest.fixture(scope="module")
def compile_lax(qwen_tokenizer):
    backend = XGrammarBackend(qwen_tokenizer)

    def accepts(schema: dict, texts: list[str]) -> list[bool]:
        spec = validate_spec({"json": schema}, LAX)
        assert not spec.warnings, spec.warnings  # enforced whole, no end check
        compiled = backend(spec)
        out = []
        for text in texts:
            m = xgr.GrammarMatcher(compiled)
            out.append(m.accept_string(text) and m.is_completed())
        return out

    return accepts


# -- siblings into branches ---------------------------------------------------

TOOLS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "anyOf": [
            {
                "properties": {"name": {"enum": ["weather"]}, "parameters": {"type": "object"}},
                "required": ["name", "parameters"],
            },
            {
                "properties": {"name": {"enum": ["add"]}, "parameters": {"type": "object"}},
                "required": ["name", "parameters"],
            },
        ],
    },
}


def test_vllms_tool_choice_required_schema_is_enforced_whole(compile_lax):
    spec = validate_spec({"json": TOOLS}, STRICT)
    assert not spec.warnings and not spec.end_check
    items = json.loads(spec.text)["items"]
    assert list(items) == ["anyOf"]
    assert all(arm["type"] == "object" for arm in items["anyOf"])
    same_verdicts(TOOLS, [[{"name": "add", "parameters": {}}], ["x"], [1], [], [{"name": "x"}]])
    assert compile_lax(
        TOOLS, ['[{"name": "add", "parameters": {}}]', '["x"]', '[{"name": "x", "parameters": {}}]']
    ) == [True, False, False]


@pytest.mark.parametrize("key", ["anyOf", "oneOf"])
def test_siblings_move_into_each_branch(key):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        key: [{"properties": {"b": {"type": "string"}}, "required": ["b"]}, {"maxProperties": 1}],
    }
    r = rewritten(schema)
    assert set(r.root) == {key}
    assert r.root[key][0] == {
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["b", "a"],
        "type": "object",
    }
    same_verdicts(schema, [{"a": 1, "b": "x"}, {"a": 1}, {"b": "x"}, {"a": "1", "b": "x"}, 3])


def test_a_branch_that_meets_nothing_is_dropped():
    r = rewritten({"type": "string", "anyOf": [{"type": "integer"}, {"maxLength": 3}]})
    assert r.root == {"anyOf": [{"maxLength": 3, "type": "string"}]}


def test_allof_is_conjoined_with_its_siblings():
    schema = {
        "type": "object",
        "allOf": [
            {"properties": {"a": {"type": "integer", "minimum": 0}}},
            {"properties": {"a": {"maximum": 9}}, "required": ["a"]},
        ],
    }
    r = rewritten(schema)
    assert r.root == {
        "properties": {"a": {"maximum": 9, "minimum": 0, "type": "integer"}},
        "required": ["a"],
        "type": "object",
    }
    same_verdicts(schema, [{"a": 5}, {"a": 10}, {"a": -1}, {}, {"a": "x"}])


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # additionalProperties reads its own side's properties.
        ({"additionalProperties": False}, {"properties": {"x": {}}}),
        # items after prefixItems.
        ({"items": {"type": "integer"}}, {"prefixItems": [{"type": "string"}]}),
        # two patterns have no one-regex meet here.
        ({"pattern": "a"}, {"pattern": "b"}),
        # then reads its if.
        ({"if": {"minLength": 2}}, {"then": {"maxLength": 3}}),
    ],
)
def test_keywords_that_read_their_siblings_are_not_conjoined(a, b):
    assert conjoin(a, b) is None
    schema = {**a, "anyOf": [b]}
    r = rewritten(schema)
    assert r is None or set(a) <= set(r.root)  # not moved into the branch


# -- $ref with siblings ----------------------------------------------------------


def test_ref_with_siblings_is_the_target_conjoined():
    schema = {
        "$defs": {"list": {"type": "array", "items": {"type": "integer"}}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/list", "maxItems": 2}},
    }
    r = rewritten(schema)
    assert r.root["properties"]["x"] == {
        "items": {"type": "integer"},
        "maxItems": 2,
        "type": "array",
    }
    same_verdicts(schema, [{"x": [1, 2]}, {"x": [1, 2, 3]}, {"x": ["a"]}, {}])


def test_before_2019_a_refs_siblings_mean_nothing():
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"n": {"type": "integer"}},
        "properties": {"x": {"$ref": "#/definitions/n", "maximum": 2}},
    }
    r = rewritten(schema)
    assert r.root["properties"]["x"] == {"$ref": "#/definitions/n"}
    same_verdicts(schema, [{"x": 1}, {"x": 5}, {"x": "a"}])


def test_a_pointer_into_a_rewritten_object_keeps_its_target():
    # "#/properties/a/anyOf/0" points into the object whose siblings would
    # move into its branches: it is left as written.
    schema = {
        "properties": {
            "a": {"type": "string", "anyOf": [{"maxLength": 2}]},
            "b": {"$ref": "#/properties/a/anyOf/0"},
        }
    }
    r = rewritten(schema)
    assert r is None or r.root["properties"]["a"]["type"] == "string"


# -- untyped keywords, formats, required, dependentRequired ------------------------


def test_untyped_keywords_constrain_their_own_type_only(compile_lax):
    schema = {"minLength": 3}
    r = rewritten(schema)
    assert {"minLength": 3, "type": "string"} in r.root["anyOf"]
    same_verdicts(schema, ["ab", "abc", 1, None, [], {}])
    assert compile_lax(schema, ['"ab"', '"abc"', "1", "[1]", '{"a": 1}']) == [
        False, True, True, True, True,
    ]  # fmt: skip


def test_a_format_xgrammar_does_not_know_is_an_annotation():
    spec = validate_spec({"json": {"type": "integer", "format": "utc-millisec"}}, STRICT)
    assert json.loads(spec.text) == {"type": "integer"} and not spec.warnings


def test_required_names_outside_properties_are_listed():
    spec = validate_spec(
        {"json": {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}}, STRICT
    )
    assert json.loads(spec.text)["properties"] == {"a": {}, "b": {}} and not spec.warnings


def test_dependent_required_over_a_closed_object(compile_lax):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "additionalProperties": False,
        "dependentRequired": {"a": ["b"]},
    }
    same_verdicts(schema, [{}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {"c": 1}])
    assert compile_lax(schema, ["{}", '{"a": 1}', '{"b": 1}', '{"a": 1, "b": 2}']) == [
        True, False, True, True,
    ]  # fmt: skip
    # An open object cannot be split by which names are present.
    assert rewritten({**schema, "additionalProperties": True}) is None


def test_unevaluated_keywords_leave_the_schema_as_written():
    assert rewritten({"type": "object", "allOf": [{}], "unevaluatedProperties": False}) is None


def test_a_rewrite_that_would_grow_past_its_budget_is_not_made():
    # 200 properties beside 50 branches: 50 copies of them.
    props = {f"p{i}": {"type": "integer"} for i in range(200)}
    arms = [{"required": [f"p{i}"]} for i in range(50)]
    assert rewritten({"type": "object", "properties": props, "anyOf": arms}) is None
    assert rewritten({"type": "object", "properties": props, "anyOf": arms[:2]}) is not None


# -- the dev data -------------------------------------------------------------------


def test_every_rewrite_keeps_jsonschemas_verdict_on_the_dev_instances(dev_schemas):
    """The promise of the module, on real schemas: rewritten (lax, as JSON
    Schema reads it), every valid and invalid instance gets the same
    verdict from jsonschema."""
    checked = 0
    for rec in dev_schemas:
        schema = rec["schema"]
        if not isinstance(schema, dict):
            continue
        r = rewritten(schema)
        if r is None:
            continue
        try:
            before, after = _validator(schema), _validator(r.root)
            verdicts = [before.is_valid(i["data"]) for i in rec.get("instances") or []]
        except Exception:  # what jsonschema cannot read is not compared
            continue
        for inst, verdict in zip(rec.get("instances") or [], verdicts, strict=True):
            assert after.is_valid(inst["data"]) == verdict, (rec["id"], r.notes, inst)
            checked += 1
    assert checked > 0


def test_a_structural_tags_schemas_are_rewritten_as_json_specs_are():
    # vLLM's tool-calling path: the tools' schemas inside a structural tag.
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<tool_call>",
            "content": {"type": "json_schema", "json_schema": TOOLS["items"]},
            "end": "</tool_call>",
        },
    }
    spec = validate_spec({"structural_tag": tag}, STRICT)
    embedded = json.loads(spec.text)["format"]["content"]["json_schema"]
    assert list(embedded) == ["anyOf"] and not spec.warnings
    assert list(json.loads(spec.text)) == ["type", "format"]  # the tag's own order kept
    unique = {"type": "array", "uniqueItems": True}
    tag["format"]["content"]["json_schema"] = unique
    (warning,) = validate_spec({"structural_tag": tag}, STRICT).warnings
    assert warning == "ignored_feature: $.format.content.json_schema: uniqueItems is not enforced"
