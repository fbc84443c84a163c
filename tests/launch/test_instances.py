"""``gramcoord check --instances``: every verdict, from schemas whose grammars are known.

The schemas are written here (not taken from the dev data) so that each
verdict has a case whose cause is known: xgrammar 0.2.9 enforces the first
exactly, ignores ``dependentRequired`` in the second (caught by the end
check), refuses nothing valid in strict mode for the third but its
instance has a property the schema does not list (strict mode, by design),
cannot compile the fourth, and the fifth has no instances.
"""

from __future__ import annotations

import io
import json

import pytest

from gramcoord.launch.cli import main
from gramcoord.launch.config import load_config
from gramcoord.launch.instance_forms import serializations
from gramcoord.launch.instances import run_instances

AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
RECORDS = [
    {
        "id": "exact",
        "subset": "t",
        "schema": {"type": "object", "properties": AB, "required": ["a"]},
        "instances": [
            {"valid": True, "data": {"b": 2, "a": 1}},  # written in the schema's order
            {"valid": False, "data": {"b": 2}},
            {"valid": False, "data": {"a": "x"}},
        ],
    },
    {
        "id": "end-checked",
        "subset": "t",
        # Open: no rewrite splits dependentRequired, so it is checked at the end.
        "schema": {
            "type": "object",
            "properties": AB,
            "required": ["a"],
            "additionalProperties": True,
            "dependentRequired": {"a": ["b"]},
        },
        "instances": [
            {"valid": True, "data": {"a": 1, "b": 2}},
            {"valid": False, "data": {"a": 1}},
        ],
    },
    {
        "id": "strict",
        "subset": "t",
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "instances": [{"valid": True, "data": {"a": 1, "extra": True}}],
    },
    {
        "id": "refused",
        "subset": "t",
        "schema": {"type": "string", "pattern": "(a"},
        "instances": [],
    },
    {"id": "untested", "subset": "t", "schema": {"type": "integer"}, "instances": []},
]


@pytest.fixture
def schemas(tmp_path):
    path = tmp_path / "schemas.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_every_verdict_and_the_coverage(schemas, tiny_tokenizer):
    out = io.BytesIO()
    report = run_instances(load_config(), schemas, out, tokenizer=tiny_tokenizer)
    lines = {ln["id"]: ln for ln in map(json.loads, out.getvalue().splitlines())}
    assert [lines[r["id"]]["verdict"] for r in RECORDS] == [
        "exact",
        "end_checked",
        "over_constrained",
        "refused",
        "untested",
    ]
    exact = lines["exact"]
    assert (exact["valid_accepted"], exact["invalid_rejected"]) == (1, 2)
    checked = lines["end-checked"]
    assert checked["end_check"] and checked["invalid_caught"] == 1 and not checked["silent"]
    assert lines["strict"]["over_reasons"] == ["strict_mode"]
    assert lines["refused"]["code"] == "grammar_invalid"
    assert report.by_verdict == {
        "exact": 1,
        "end_checked": 1,
        "over_constrained": 1,
        "refused": 1,
        "untested": 1,
    }
    assert (report.covered, report.coverage, report.silent_under) == (4, 0.8, 0)
    assert report.over_reasons == {"strict_mode": 1}


def test_a_silently_under_constrained_schema_is_counted(tmp_path, tiny_tokenizer):
    # minLength beside enum: xgrammar emits the values and ignores the
    # bound; the enum is rewritten to the values that satisfy it, so the
    # grammar is exact. With reject_ignored_features the untyped minLength
    # is refused instead of checked.
    records = [
        {
            "id": "enum",
            "schema": {"enum": ["a", "bb"], "minLength": 2},
            "instances": [{"valid": False, "data": "a"}, {"valid": True, "data": "bb"}],
        }
    ]
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(records[0]) + "\n")
    out = io.BytesIO()
    report = run_instances(load_config(), path, out, tokenizer=tiny_tokenizer)
    (line,) = map(json.loads, out.getvalue().splitlines())
    assert line["verdict"] == "exact", line
    assert report.silent_under == 0


def test_a_bounded_string_that_needs_an_escape_is_over_constrained_by_xgrammar(
    tmp_path, tiny_tokenizer
):
    # xgrammar 0.2.9 takes no escape sequence in a string with minLength /
    # maxLength: a valid "a\nb" is rejected, and the report says why.
    rec = {
        "id": "escapes",
        "schema": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10}}},
        "instances": [{"valid": True, "data": {"s": "a\nb"}}, {"valid": True, "data": {"s": "ab"}}],
    }
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    out = io.BytesIO()
    run_instances(load_config(), path, out, tokenizer=tiny_tokenizer)
    (line,) = map(json.loads, out.getvalue().splitlines())
    assert line["verdict"] == "over_constrained"
    assert line["over_reasons"] == ["xgrammar_bounded_string_escapes"]
    assert line["valid_accepted"] == 1


def test_a_key_a_pattern_finds_but_does_not_match_whole_is_over_constrained_by_xgrammar(
    tmp_path, tiny_tokenizer
):
    # JSON Schema's patterns search; xgrammar's match the whole string, so
    # the valid key "ab1" (it contains "ab") is refused. gramcoord keeps the
    # host's semantics and the report names the cause.
    rec = {
        "id": "anchored",
        "schema": {
            "type": "object",
            "patternProperties": {"[a-z]+": {"type": "integer"}},
            "additionalProperties": False,
        },
        "instances": [{"valid": True, "data": {"ab1": 1}}, {"valid": True, "data": {"ab": 1}}],
    }
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    out = io.BytesIO()
    run_instances(load_config(), path, out, tokenizer=tiny_tokenizer)
    (line,) = map(json.loads, out.getvalue().splitlines())
    assert line["over_reasons"] == ["xgrammar_anchors_patterns"]


def test_serializations_put_properties_in_the_schema_order():
    schema = {
        "type": "object",
        "properties": {"z": {"type": "object", "properties": {"y": {}, "x": {}}}, "a": {}},
    }
    data = {"a": 1, "z": {"x": 1, "y": 2}, "extra": 3}
    first, original = serializations(schema, data)
    assert first == '{"z": {"y": 2, "x": 1}, "a": 1, "extra": 3}'
    assert original == json.dumps(data)


def test_the_command_writes_a_line_per_schema_and_exits_0(schemas, tmp_path, capsys):
    out = tmp_path / "report.jsonl"
    assert main(["check", "--instances", str(schemas), "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == len(RECORDS)
    assert "covered" in capsys.readouterr().err
    assert main(["check", "--instances", str(tmp_path / "missing.jsonl")]) == 2
