"""Write the hostile-input corpus, ``hostile.jsonl.gz``, and its ``README.md``.

Usage: ``.venv/bin/python tests/data/hostile/make_hostile.py [--out DIR]``.

Every entry is one workload record in the format ``launch/workload.py``
reads (``{"id", "prompt", "max_tokens", "structured_outputs"}``, plus
``"instances"`` when the synthetic model needs a reference to follow) and an
``"expect"`` object that the tests check: ``{"code": ...}`` for a request
that must fail with that code, ``{"finish": ...}`` (``grammar_end`` or
``length``) for one that is legitimately accepted, with ``"warning"`` when
its output record must carry that warning code.

Two extra fields describe records a client cannot send as plain JSON:

- ``"encoding": "surrogateescape"``: ``structured_outputs`` is the text of
  the spec, and its ``surrogateescape`` encoding is the raw bytes a client
  sent (``\\udcff`` stands for the invalid byte 0xff). The session test
  submits those bytes; a run hands the text on as a Python host would.
- deep entries are spliced as JSON text: ``json.dumps`` cannot write a value
  nested 1,000 levels, but a client can send one.

The output is a pure function of this file: no clock, no random numbers,
and the gzip header carries no name and no time. Entries are written in
table order, so a new entry changes only its own lines.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent
CORPUS = "hostile.jsonl.gz"

_UNSET: Any = msgspec.UNSET


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    # hostile/<group>/<name>: unique, and the README's row.
    id: str
    # What the entry exercises (one line of the README).
    what: str
    # The structured_outputs value, or ``spec_text`` when it must be spliced in.
    spec: Any = _UNSET
    spec_text: str | None = None
    # "surrogateescape": the spec text stands for raw bytes (see the docstring).
    encoding: str | None = None
    max_tokens: int = 32
    # A valid instance the synthetic model follows to the end of the grammar.
    instance: Any = _UNSET
    # {"code": ...} or {"finish": ..., "warning"?: ...}.
    expect: dict[str, str]


def _code(code: str) -> dict[str, str]:
    return {"code": code}


def _finish(reason: str, warning: str | None = None) -> dict[str, str]:
    return {"finish": reason} | ({"warning": warning} if warning else {})


def _arrays(levels: int) -> dict:
    """A schema of ``levels`` nesting levels: arrays around a string."""
    node: dict = {"type": "string"}
    for _ in range(levels - 1):
        node = {"type": "array", "items": node}
    return node


def _arrays_text(levels: int) -> str:
    """``_arrays(levels)`` as JSON text, written without recursion."""
    return '{"type": "array", "items": ' * (levels - 1) + '{"type": "string"}' + "}" * (levels - 1)


def _nested_list(levels: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def _deep_dict(levels: int) -> dict:
    node: dict = {"type": "const_string", "value": "x"}
    for _ in range(levels):
        node = {"x": node}
    return node


def _big_object_schema(min_bytes: int) -> dict:
    # One long description repeated: the schema is big, the gzip stays small.
    text = "A field of a five-megabyte schema. " * 6
    props: dict[str, Any] = {}
    size, i = 0, 0
    while size < min_bytes:
        name = f"p{i:05d}"
        props[name] = {"type": "string", "description": text}
        size += len(name) + len(text) + 40
        i += 1
    return {"type": "object", "properties": props}


def _values(n: int) -> list[str]:
    return [f"value-{i:06d}" for i in range(n)]


def _nesting() -> list[Entry]:
    return [
        Entry(
            id="hostile/nesting/json-64",
            what="schema nested exactly 64 levels (arrays), the limit: accepted",
            spec={"json": _arrays(64)},
            instance=_nested_list(63, "x"),
            max_tokens=256,
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/nesting/json-65",
            what="schema nested 65 levels, one past the limit",
            spec={"json": _arrays(65)},
            expect=_code("spec_too_deep"),
        ),
        Entry(
            id="hostile/nesting/json-text-1000",
            what="schema nested 1,000 levels, sent as JSON text",
            spec={"json": _arrays_text(1000)},
            expect=_code("spec_too_deep"),
        ),
        Entry(
            id="hostile/nesting/json-object-900",
            what="schema nested 900 levels as an object: the line parses (close to "
            "Python's recursion limit), the depth check refuses it",
            spec_text='{"json": ' + _arrays_text(900) + "}",
            expect=_code("spec_too_deep"),
        ),
        Entry(
            id="hostile/nesting/json-object-1000",
            what="schema nested 1,000 levels as an object: the record line itself "
            "is deeper than the workload reader parses",
            spec_text='{"json": ' + _arrays_text(1000) + "}",
            expect=_code("record_invalid"),
        ),
        Entry(
            id="hostile/nesting/regex-64",
            what="regex with 64 nested groups, the limit: accepted",
            spec={"regex": "(" * 64 + "a" + ")" * 64},
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/nesting/regex-65",
            what="regex with 65 nested groups",
            spec={"regex": "(" * 65 + "a" + ")" * 65},
            expect=_code("spec_too_deep"),
        ),
        Entry(
            id="hostile/nesting/ebnf-1000",
            what="EBNF with 1,000 nested parentheses",
            spec={"grammar": "root ::= " + "(" * 1000 + '"a"' + ")" * 1000},
            expect=_code("spec_too_deep"),
        ),
        Entry(
            id="hostile/nesting/structural-tag-100",
            what="structural tag nested 100 levels (its limit is 80)",
            spec={"structural_tag": {"type": "structural_tag", "format": _deep_dict(100)}},
            expect=_code("spec_too_deep"),
        ),
    ]


def _size() -> list[Entry]:
    big = _big_object_schema(5 << 20)
    return [
        Entry(
            id="hostile/size/enum-10k",
            what="enum of 10,000 strings, the limit: accepted (compiles in about a second)",
            spec={"json": {"type": "string", "enum": _values(10_000)}},
            instance="value-004242",
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/size/enum-100k",
            what="enum of 100,000 short strings (under the byte limit, over the count limit)",
            spec={"json": {"type": "string", "enum": [f"{i:x}" for i in range(100_000)]}},
            expect=_code("spec_too_many_values"),
        ),
        Entry(
            id="hostile/size/choice-100k",
            what="choice of 100,000 strings",
            spec={"choice": _values(100_000)},
            expect=_code("spec_too_many_values"),
        ),
        Entry(
            id="hostile/size/schema-5mb",
            what="5 MB schema object (sized before any walk)",
            spec={"json": big},
            expect=_code("spec_too_large"),
        ),
        Entry(
            id="hostile/size/schema-5mb-text",
            what="5 MB schema as JSON text (sized before parsing)",
            spec={"json": json.dumps(big)},
            expect=_code("spec_too_large"),
        ),
        Entry(
            id="hostile/size/regex-2mb",
            what="2 MB regex",
            spec={"regex": "a" * (2 << 20)},
            expect=_code("spec_too_large"),
        ),
    ]


def _regex() -> list[Entry]:
    return [
        Entry(
            id="hostile/regex/repeat-1e9",
            what="bounded repeat of 10^9 letters: xgrammar keeps the count symbolic and "
            "would compile it, but no output of 16 tokens can end it: refused at admission",
            spec={"regex": "[a-z]{1000000000}"},
            max_tokens=16,
            expect=_code("grammar_unreachable_end"),
        ),
        Entry(
            id="hostile/regex/repeat-nested",
            what="nested bounded repeats, 10^9 expansions in all",
            spec={"regex": "((a{1,1000}){1,1000}){1,1000}"},
            max_tokens=16,
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/regex/repeat-overflow",
            what="repeat count of 10^20 (above xgrammar's 10^15)",
            spec={"regex": "a{100000000000000000000}"},
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/regex/backtrack-nested-plus",
            what="catastrophic-backtracking pattern `(a+)+$` (an automaton does not backtrack)",
            spec={"regex": "(a+)+$"},
            max_tokens=16,
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/regex/backtrack-alternation",
            what="catastrophic-backtracking pattern `^(a|a)*b$`",
            spec={"regex": "^(a|a)*b$"},
            max_tokens=16,
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/regex/backtrack-evil",
            what="catastrophic-backtracking pattern `^(([a-z])+.)+[A-Z]([a-z])+$`",
            spec={"regex": "^(([a-z])+.)+[A-Z]([a-z])+$"},
            max_tokens=16,
            expect=_finish("grammar_end"),
        ),
    ]


def _text() -> list[Entry]:
    return [
        Entry(
            id="hostile/text/regex-nul",
            what="regex with a NUL character",
            spec={"regex": "a\x00b"},
            expect=_code("spec_regex_nul"),
        ),
        Entry(
            id="hostile/text/ebnf-raw-nul",
            what="EBNF string literal with a raw NUL character",
            spec={"grammar": 'root ::= "a\x00b"'},
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/text/json-const-nul",
            what="JSON const holding NUL: legitimate, written as `\\u0000` in the output",
            spec={"json": {"const": "a\x00b"}},
            instance="a\x00b",
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/text/choice-nul",
            what="choice option holding NUL: legitimate",
            spec={"choice": ["a\x00b", "c"]},
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/text/regex-lone-surrogate",
            what="regex holding a lone surrogate (`\\ud800`)",
            spec={"regex": "a\ud800"},
            expect=_code("spec_bad_json"),
        ),
        Entry(
            id="hostile/text/json-lone-surrogate",
            what="schema object with a lone surrogate in a description",
            spec={"json": {"type": "string", "description": "\udc80"}},
            expect=_code("spec_bad_json"),
        ),
        Entry(
            id="hostile/text/json-text-surrogate-escape",
            what='schema JSON text with an unpaired escape: `{"const": "\\ud800"}`',
            spec={"json": '{"const": "\\ud800"}'},
            expect=_code("spec_bad_json"),
        ),
        Entry(
            id="hostile/text/spec-invalid-utf8",
            what="spec bytes with an invalid UTF-8 byte (0xff) inside the regex",
            spec='{"regex": "a\udcffb"}',
            encoding="surrogateescape",
            expect=_code("spec_bad_json"),
        ),
        Entry(
            id="hostile/text/spec-truncated-utf8",
            what="spec bytes with a truncated UTF-8 sequence (0xc3) inside a grammar",
            spec='{"grammar": "root ::= \\"\udcc3\\""}',
            encoding="surrogateescape",
            expect=_code("spec_bad_json"),
        ),
    ]


def _unsatisfiable() -> list[Entry]:
    def j(schema: Any) -> dict:
        return {"json": schema}

    return [
        Entry(
            id="hostile/unsat/integer-empty-range",
            what="integer with minimum 5 > maximum 1",
            spec=j({"type": "integer", "minimum": 5, "maximum": 1}),
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/unsat/number-empty-exclusive-range",
            what="number in the empty open interval (1, 1)",
            spec=j({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1}),
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/unsat/string-length-range",
            what="string with minLength 5 > maxLength 1",
            spec=j({"type": "string", "minLength": 5, "maxLength": 1}),
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/unsat/array-items-range",
            what="array with minItems 3 > maxItems 1",
            spec=j({"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}),
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/unsat/object-properties-range",
            what="object with minProperties 3 > maxProperties 1",
            spec=j({"type": "object", "minProperties": 3, "maxProperties": 1}),
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/unsat/required-over-max-properties",
            what="two required properties under maxProperties 1",
            spec=j(
                {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "maxProperties": 1,
                }
            ),
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/unsat/allof-contradictory",
            what="allOf of type string and type integer",
            spec=j({"allOf": [{"type": "string"}, {"type": "integer"}]}),
            expect=_code("schema_unsupported_feature"),
        ),
        Entry(
            id="hostile/unsat/enum-empty",
            what="empty enum",
            spec=j({"enum": []}),
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/unsat/schema-false",
            what="the schema false",
            spec=j(False),
            expect=_code("spec_bad_json"),
        ),
    ]


def _refs() -> list[Entry]:
    def j(schema: Any) -> dict:
        return {"json": schema}

    return [
        Entry(
            id="hostile/ref/local-missing",
            what="local $ref to a definition that does not exist",
            spec=j({"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}),
            expect=_code("spec_bad_json"),
        ),
        Entry(
            id="hostile/ref/remote",
            what="remote $ref: compiles as any value, the output carries a warning",
            spec=j({"$ref": "https://example.com/schemas/never-fetched.json"}),
            instance="anything",
            expect=_finish("grammar_end", "unconstrained_ref"),
        ),
        Entry(
            id="hostile/ref/self-cycle",
            what='`$ref` `"#"` at the root: a cycle with no content',
            spec=j({"$ref": "#"}),
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/ref/two-cycle",
            what="two definitions that refer to each other and nothing else",
            spec=j(
                {
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a",
                }
            ),
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/ref/recursive-tree",
            what="recursion through properties (a tree): legitimate",
            spec=j(
                {
                    "type": "object",
                    "properties": {"children": {"type": "array", "items": {"$ref": "#"}}},
                    "required": ["children"],
                }
            ),
            instance={"children": [{"children": []}]},
            expect=_finish("grammar_end"),
        ),
    ]


def _grammars() -> list[Entry]:
    lark = {"grammar_syntax": "lark"}
    return [
        Entry(
            id="hostile/grammar/ebnf-left-recursion",
            what="left-recursive EBNF rule (xgrammar's Earley parser takes it)",
            spec={"grammar": 'root ::= root "a" | "a"'},
            max_tokens=16,
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/grammar/ebnf-undefined-rule",
            what="EBNF referring to an undefined rule",
            spec={"grammar": "root ::= foo"},
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/grammar/ebnf-no-root",
            what="EBNF without a root rule",
            spec={"grammar": 'foo ::= "a"'},
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/grammar/lark-left-recursion",
            what="left-recursive Lark rule",
            spec={"grammar": 'start: start "a" | "a"'} | lark,
            max_tokens=16,
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/grammar/lark-undefined-rule",
            what="Lark referring to an undefined rule",
            spec={"grammar": "start: foo"} | lark,
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/grammar/lark-special-tokens",
            what="Lark grammar emitting the special tokens `<tool_call>` and `</tool_call>`",
            spec={"grammar": 'start: "<tool_call>" NAME "</tool_call>"\nNAME: /[a-z]{1,8}/'} | lark,
            max_tokens=16,
            expect=_finish("grammar_end"),
        ),
        Entry(
            id="hostile/grammar/lark-stop-token-text",
            what="Lark grammar whose text spells the stop token `<|im_end|>`",
            spec={"grammar": 'start: "ok" "<|im_end|>"'} | lark,
            max_tokens=16,
            expect=_finish("grammar_end"),
        ),
    ]


# (kind, label, value, code): every spec kind empty, blank or of the wrong type.
_KIND_CASES: list[tuple[str, str, Any, str]] = [
    ("json", "empty", "", "spec_blank"),
    ("json", "blank", " \n\t", "spec_blank"),
    ("json", "number", 42, "spec_bad_json"),
    ("json", "list", [], "spec_bad_json"),
    ("json", "text-null", "null", "spec_bad_json"),
    ("regex", "empty", "", "spec_blank"),
    ("regex", "blank", "   ", "spec_blank"),
    ("regex", "number", 7, "spec_bad_type"),
    ("regex", "list", ["a"], "spec_bad_type"),
    ("regex", "object", {"a": 1}, "spec_bad_type"),
    ("choice", "empty", [], "spec_empty_choice"),
    ("choice", "string", "abc", "spec_bad_type"),
    ("choice", "numbers", [1, 2], "spec_bad_type"),
    ("choice", "object", {}, "spec_bad_type"),
    ("grammar", "empty", "", "spec_blank"),
    ("grammar", "blank", "\n\t ", "spec_blank"),
    ("grammar", "number", 5, "spec_bad_type"),
    ("grammar", "list", [], "spec_bad_type"),
    ("json_object", "false", False, "spec_json_object_false"),
    ("json_object", "string", "true", "spec_bad_type"),
    ("json_object", "number", 1, "spec_bad_type"),
    ("structural_tag", "empty", "", "spec_blank"),
    ("structural_tag", "empty-object-text", "{}", "spec_blank"),
    ("structural_tag", "empty-object", {}, "spec_blank"),
    ("structural_tag", "number", 5, "spec_blank"),
    ("structural_tag", "not-json", "not json", "spec_bad_json"),
]
# (label, structured_outputs, code): the whole spec empty, blank or mistyped.
_SPEC_CASES: list[tuple[str, Any, str]] = [
    ("empty-object", {}, "spec_no_kind"),
    ("list", [], "spec_bad_type"),
    ("empty-text", "", "spec_bad_json"),
    ("blank-text", "  \n", "spec_bad_json"),
    ("number", 5, "spec_bad_type"),
    ("null", None, "spec_bad_type"),
    ("true", True, "spec_bad_type"),
    ("two-kinds", {"regex": "a", "choice": ["a"]}, "spec_multiple_kinds"),
    ("unknown-field", {"regexp": "a"}, "spec_bad_type"),
    ("bad-syntax-name", {"grammar": 'root ::= "a"', "grammar_syntax": "yaml"}, "spec_bad_type"),
]


def _kinds() -> list[Entry]:
    out = [
        Entry(
            id=f"hostile/kind/{kind}-{label}",
            what=f"`{kind}` {label.replace('-', ' ')}: `{json.dumps(value)}`",
            spec={kind: value},
            expect=_code(code),
        )
        for kind, label, value, code in _KIND_CASES
    ]
    out += [
        Entry(
            id=f"hostile/kind/spec-{label}",
            what=f"`structured_outputs` {label.replace('-', ' ')}: `{json.dumps(value)}`",
            spec=value,
            expect=_code(code),
        )
        for label, value, code in _SPEC_CASES
    ]
    out.append(
        Entry(
            id="hostile/kind/choice-empty-string",
            what='choice `[""]`: legitimate, the output is empty',
            spec={"choice": [""]},
            expect=_finish("grammar_end"),
        )
    )
    return out


def _length() -> list[Entry]:
    def j(schema: Any) -> dict:
        return {"json": schema}

    return [
        Entry(
            id="hostile/length/min-length-1e6",
            what="string minLength 10^6, far beyond max_tokens: refused at admission",
            spec=j({"type": "string", "minLength": 1_000_000}),
            max_tokens=16,
            expect=_code("grammar_unreachable_end"),
        ),
        Entry(
            id="hostile/length/pattern-repeat-1e6",
            what="pattern `^[a-z]{1000000}$`, far beyond max_tokens: refused at admission",
            spec=j({"type": "string", "pattern": "^[a-z]{1000000}$"}),
            max_tokens=16,
            expect=_code("grammar_unreachable_end"),
        ),
        Entry(
            id="hostile/length/min-items-1e5",
            what="array minItems 10^5 of objects, far beyond max_tokens: refused at admission",
            spec=j(
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"a": {"type": "integer"}},
                        "required": ["a"],
                    },
                    "minItems": 100_000,
                }
            ),
            max_tokens=16,
            expect=_code("grammar_unreachable_end"),
        ),
        Entry(
            id="hostile/length/min-items-no-items",
            what="array minItems 2 with no items schema (strict mode: no items allowed)",
            spec=j({"type": "array", "minItems": 2}),
            expect=_code("grammar_invalid"),
        ),
        Entry(
            id="hostile/length/min-properties-1e6",
            what="object minProperties 10^6 with additionalProperties: refused at admission",
            spec=j({"type": "object", "minProperties": 1_000_000, "additionalProperties": True}),
            max_tokens=16,
            expect=_code("grammar_unreachable_end"),
        ),
        Entry(
            id="hostile/length/beyond-but-within-the-bound",
            what="string minLength 40 with max_tokens 16: the bound (16 tokens of up to "
            "the longest token's bytes) cannot rule it out, so it runs to max_tokens",
            spec=j({"type": "string", "minLength": 40}),
            max_tokens=16,
            expect=_finish("length"),
        ),
    ]


def _required() -> list[Entry]:
    def j(schema: Any) -> dict:
        return {"json": schema}

    # xgrammar enforces only the required names its object lists in
    # properties, and keywords beside anyOf or $ref not at all; each shape
    # below is rewritten into an equivalent it enforces whole
    # (rank_worker/grammars/schema_rewrite.py), so it is served and the
    # synthetic model, following a valid instance, ends the grammar.
    enforced = _finish("grammar_end")
    two = {"foo": {"type": "integer"}, "bar": {"type": "integer"}}
    return [
        Entry(
            id="hostile/required/issue-shape",
            what="objects that require foo with no properties and additionalProperties "
            "unset (xgrammar alone can only emit {}: the issue's [[{}], [{}]]): foo is "
            "listed in properties",
            spec=j(
                {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "object", "required": ["foo"]}},
                }
            ),
            instance=[[{"foo": 1}]],
            expect=enforced,
        ),
        Entry(
            id="hostile/required/not-in-properties",
            what="required foo next to properties that list only bar: foo is listed",
            spec=j(
                {"type": "object", "properties": {"bar": {"type": "string"}}, "required": ["foo"]}
            ),
            instance={"foo": 1},
            expect=enforced,
        ),
        Entry(
            id="hostile/required/untyped",
            what="required foo on an untyped node with no properties (xgrammar alone: any "
            "value): its object branch lists foo",
            spec=j({"required": ["foo"]}),
            instance={"foo": 1},
            expect=enforced,
        ),
        Entry(
            id="hostile/required/anyof-branches",
            what="anyOf branches that list required only, relying on the parent's "
            "properties (xgrammar does not merge them): the parent's keywords move "
            "into each branch",
            spec=j(
                {
                    "type": "object",
                    "properties": two,
                    "anyOf": [{"required": ["foo"]}, {"required": ["bar"]}],
                }
            ),
            instance={"foo": 1},
            expect=enforced,
        ),
        Entry(
            id="hostile/required/beside-ref",
            what="required next to a $ref whose target does not require the name: the "
            "target is conjoined with it",
            spec=j(
                {
                    "$defs": {"pair": {"type": "object", "properties": two}},
                    "$ref": "#/$defs/pair",
                    "required": ["foo"],
                }
            ),
            instance={"foo": 1},
            expect=enforced,
        ),
        Entry(
            id="hostile/required/enforced",
            what="control: required foo listed in properties is enforced and accepted",
            spec=j(
                {"type": "object", "properties": {"foo": {"type": "string"}}, "required": ["foo"]}
            ),
            instance={"foo": "bar"},
            expect=_finish("grammar_end"),
        ),
    ]


def entries() -> list[Entry]:
    """Every corpus entry, in file order."""
    out = [
        *_nesting(),
        *_size(),
        *_regex(),
        *_text(),
        *_unsatisfiable(),
        *_refs(),
        *_grammars(),
        *_kinds(),
        *_length(),
        *_required(),
    ]
    ids = [e.id for e in out]
    assert len(ids) == len(set(ids)), "duplicate ids"
    return out


def record_line(entry: Entry) -> str:
    """One JSONL line, ASCII only (lone surrogates and NUL become \\u escapes)."""
    head: dict[str, Any] = {
        "id": entry.id,
        "prompt": f"Hostile input: {entry.what}",
        "max_tokens": entry.max_tokens,
    }
    tail: dict[str, Any] = {}
    if entry.instance is not _UNSET:
        tail["instances"] = [{"valid": True, "data": entry.instance}]
    if entry.encoding:
        tail["encoding"] = entry.encoding
    tail["expect"] = entry.expect
    spec = entry.spec_text if entry.spec_text is not None else json.dumps(entry.spec)
    return json.dumps(head)[:-1] + ', "structured_outputs": ' + spec + ", " + json.dumps(tail)[1:]


def corpus_bytes() -> bytes:
    """The gzip file: level 9, no file name, time 0, so every run writes the same bytes."""
    text = "".join(record_line(e) + "\n" for e in entries()).encode("ascii")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as gz:
        gz.write(text)
    return buf.getvalue()


class CorpusLine(msgspec.Struct, frozen=True, kw_only=True):
    """One corpus line as the tests read it, without parsing its spec."""

    # 0-based line number: the index ``launch.workload.parse_record`` takes.
    index: int
    id: str
    # The line as written, for ``parse_record``.
    line: str
    expect: dict[str, str]
    encoding: str | None = None


# Read from the ends of a line: json.loads cannot parse the deepest ones.
_HEAD = re.compile(r'^\{"id": ("(?:[^"\\]|\\.)*")')
_TAIL = re.compile(r'(?:"encoding": ("\w+"), )?"expect": (\{[^{}]*\})\}$')


def read_corpus(path: Path = HERE / CORPUS) -> list[CorpusLine]:
    """Every line of a corpus file with its id and expectation."""
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for index, line in enumerate(f):
            line = line.rstrip("\n")
            head, tail = _HEAD.match(line), _TAIL.search(line)
            assert head and tail, f"line {index} is not a corpus record"
            out.append(
                CorpusLine(
                    index=index,
                    id=json.loads(head.group(1)),
                    line=line,
                    expect=json.loads(tail.group(2)),
                    encoding=json.loads(tail.group(1)) if tail.group(1) else None,
                )
            )
    return out


_README_HEAD = """\
# Hostile-input corpus

Specs that try to break a rank: deep nesting, huge enums and schemas, regex
bombs, NUL, lone surrogates and invalid UTF-8, unsatisfiable schemas, bad
`$ref`s, odd grammars, every spec kind empty, blank or of the wrong type,
lengths far beyond `max_tokens`, and `required` names xgrammar silently
drops. Each must fail its own request with a specific code, or finish the
way recorded here; it must never crash a rank, hang, or change any other
request's output.

`hostile.jsonl.gz` holds one workload record per line (the format
`launch/workload.py` reads: `id`, `prompt`, `max_tokens`,
`structured_outputs`, and `instances` where the synthetic model needs a
reference) plus `expect`: `{"code": C}` (the request fails with code C) or
`{"finish": R}` (it is legitimately accepted and ends with finish reason R;
`"warning": W` when its output record carries warning W). It is gzipped
because the big entries make it about 16 MB as text.

Made by `make_hostile.py` (deterministic: same bytes every run); never edit
the corpus by hand. `tests/rank_worker/grammars/test_hostile.py` checks that the
committed file equals the script's output, and runs every entry through a
rank's session; `tests/launch/test_hostile_run.py` runs them inside a
one-process run next to normal records.

Two kinds of record a client cannot send as plain JSON:

- `"encoding": "surrogateescape"`: `structured_outputs` is the spec's text,
  and its `surrogateescape` encoding is the raw bytes a client sent
  (`\\udcff` is the invalid byte 0xff). The session test submits the bytes
  (msgspec refuses them as invalid UTF-8); a run passes the text on as a
  Python host would (the spec does not encode as UTF-8). Both fail with
  `spec_bad_json`.
- the 900- and 1,000-level schema objects are written as JSON text, because
  `json.dumps` cannot write them. At 1,000 levels the workload reader's own
  JSON parser gives up (Python's recursion limit): `record_invalid`. At 900
  the line parses and the depth check refuses the spec: `spec_too_deep`.

Codes: `spec_*` and `schema_unsupported_feature` are refused at admission,
before any compile (`schema_unsupported_feature` with
`grammar.reject_ignored_features: true`, as the soak and these tests run;
the default admits such a schema with a warning and checks the output);
`grammar_unreachable_end` is a grammar whose shortest output needs more
tokens than the record's `max_tokens`, refused at admission too;
`grammar_invalid` is xgrammar refusing the spec at compile; `record_invalid`
is a workload line the reader could not use.

| id | what it exercises | expected |
|---|---|---|
"""


def readme_text() -> str:
    rows = []
    for e in entries():
        if "code" in e.expect:
            want = f"fails `{e.expect['code']}`"
        else:
            want = f"finishes `{e.expect['finish']}`"
            if "warning" in e.expect:
                want += f", warning `{e.expect['warning']}`"
        what = e.what.replace("|", "\\|")
        rows.append(f"| `{e.id.removeprefix('hostile/')}` | {what} | {want} |\n")
    return _README_HEAD + "".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="folder written")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = corpus_bytes()
    (args.out / CORPUS).write_bytes(data)
    (args.out / "README.md").write_text(readme_text(), encoding="utf-8")
    print(f"{len(entries())} entries, {len(data)} bytes -> {args.out / CORPUS}")


if __name__ == "__main__":
    main()
