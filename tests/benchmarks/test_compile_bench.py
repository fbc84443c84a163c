"""The baselines of ``gramcoord bench compile`` do what they claim.

- ``xgrammar_unsupported`` and ``likely_lark`` give vLLM's verdicts
  (``has_xgrammar_unsupported_json_features``, ``grammar_is_likely_lark``);
- ``VllmRefail`` rejects a bad spec where vLLM does and passes a good one.
"""

from __future__ import annotations

import json

import pytest

from gramcoord.benchmarks import compile as bench
from gramcoord.benchmarks.compile import VllmRefail, likely_lark, xgrammar_unsupported
from gramcoord.launch.workload import dev_data_dir

STR = {"type": "string"}


@pytest.mark.parametrize(
    ("schema", "unsupported"),
    [
        pytest.param({"type": "object", "properties": {"a": STR}}, False, id="plain"),
        pytest.param({"type": "integer", "multipleOf": 3}, True, id="multipleOf"),
        pytest.param({"type": ["number", "null"], "multipleOf": 2}, True, id="type-list"),
        pytest.param({"type": "array", "uniqueItems": True}, True, id="uniqueItems"),
        pytest.param({"type": "array", "maxContains": 2}, True, id="maxContains"),
        pytest.param({"type": "string", "format": "email"}, False, id="known-format"),
        pytest.param({"type": "string", "format": "color"}, True, id="unknown-format"),
        pytest.param({"type": "string", "pattern": "a+", "maxLength": 3}, True, id="pattern-len"),
        pytest.param({"type": "string", "pattern": "a+"}, False, id="pattern-only"),
        pytest.param(
            {"type": "object", "propertyNames": {"pattern": "^a", "minLength": 1}},
            True,
            id="propertyNames-pattern-len",
        ),
        pytest.param(
            {"type": "object", "propertyNames": STR, "properties": {"a": STR}},
            True,
            id="propertyNames-with-properties",
        ),
        pytest.param(
            {"type": "object", "patternProperties": {"^a": STR, "^b": STR}},
            True,
            id="two-patternProperties",
        ),
        pytest.param(
            {"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}},
            True,
            id="nested",
        ),
        pytest.param({"anyOf": [STR, {"type": "array", "contains": STR}]}, True, id="in-list"),
        # vLLM descends a list one level only: a list inside a list is not read.
        pytest.param({"x": [[{"type": "integer", "multipleOf": 2}]]}, False, id="list-of-list"),
    ],
)
def test_unsupported_features_match_vllm(schema, unsupported):
    assert xgrammar_unsupported(schema) is unsupported


@pytest.mark.parametrize(
    ("text", "lark"),
    [
        pytest.param("root ::= x", False, id="ebnf"),
        pytest.param("start: 'a'", True, id="lark"),
        pytest.param("# root ::= x\nstart: 'a'", True, id="ebnf-in-comment"),
        pytest.param("start: 'a'\n// x ::= y", True, id="ebnf-in-slash-comment"),
        pytest.param("\n\nroot ::= 'a'  # rule", False, id="ebnf-later-line"),
    ],
)
def test_lark_detection_matches_vllm(text, lark):
    assert likely_lark(text) is lark


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        pytest.param(bench.BAD_EBNF, "validation", id="undefined-rule"),
        pytest.param({"grammar": 'root ::= "a"'}, "", id="good-ebnf"),
        pytest.param({"json": {"type": "integer", "multipleOf": 3}}, "validation", id="walk"),
        pytest.param(
            {"json": {"type": "object", "properties": {"a": False}, "required": ["a"]}},
            "validation",
            id="unsatisfiable",
        ),
        pytest.param({"json": {"type": "object", "properties": {"a": STR}}}, "", id="good"),
        pytest.param({"json": json.dumps({"type": "boolean"})}, "", id="good-text"),
    ],
)
def test_vllm_refail_rejects_where_vllm_does(tiny_tokenizer, spec, where):
    assert VllmRefail(tiny_tokenizer)(spec) == where


def test_bad_dev_specs_are_refused_by_vllm(qwen_tokenizer):
    specs = bench._bad_dev_specs(dev_data_dir())
    assert specs, "the dev data holds schemas xgrammar refuses"
    vllm = VllmRefail(qwen_tokenizer)
    assert all(vllm(s) for s in specs)
