"""The schema lint: ``required`` names xgrammar drops, checked against xgrammar itself.

Every shape in the table is compiled with xgrammar 0.2.9 (tiny vocabulary,
strict or lax as stated) and probed with a GrammarMatcher: an object that
lacks a required name. Where the lint reports a drop, xgrammar accepts that
object (the requirement really is not enforced); where it reports nothing,
xgrammar refuses it. The SUPPORTED_FORMATS list is re-checked here too.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError
from gramcoord.rank_worker.grammars.schema_tree import canonical_tree
from gramcoord.rank_worker.grammars.schema_walk import SUPPORTED_FORMATS, walk
from gramcoord.rank_worker.grammars.spec import validate_spec


def unenforced_required(schema, *, strict_mode=True) -> list[tuple[str, str]]:
    """The walk's ``required`` names xgrammar drops: (path, message)."""
    return walk(canonical_tree(schema, max_depth=1 << 20), strict_mode=strict_mode).dropped_required


TWO = {"foo": {"type": "integer"}, "bar": {"type": "integer"}}
PAIR = {"type": "object", "properties": TWO}

# (schema, strict_mode, paths the lint reports, a text lacking a required name)
DROPPED = [
    pytest.param(
        {"type": "array", "items": {"type": "array", "items": {"type": "object", "required": ["foo"]}}},
        True, ["$.items.items"], "[[{}]]", id="issue-shape",
    ),
    pytest.param(
        {"type": "object", "properties": {"bar": {"type": "integer"}}, "required": ["foo"]},
        True, ["$"], '{"bar": 1}', id="not-in-properties",
    ),
    pytest.param(
        {"type": "object", "properties": {"bar": {"type": "integer"}}, "required": ["foo"],
         "additionalProperties": True},
        True, ["$"], '{"bar": 1}', id="not-in-properties-extra-allowed",
    ),
    pytest.param({"required": ["foo"]}, True, ["$"], "{}", id="untyped-no-properties"),
    pytest.param(
        {"type": "object", "required": ["foo"]}, False, ["$"], "{}", id="typed-no-properties-lax"
    ),
    pytest.param(
        {"type": "object", "patternProperties": {"^f": {"type": "integer"}}, "required": ["foo"]},
        True, ["$"], "{}", id="pattern-properties",
    ),
    pytest.param(
        {**PAIR, "anyOf": [{"required": ["foo"]}, {"required": ["bar"]}]},
        True, ["$.anyOf[0]", "$.anyOf[1]"], "{}", id="anyOf-branches-parent-properties",
    ),
    pytest.param(
        {**PAIR, "oneOf": [{"required": ["foo"]}, {"required": ["bar"]}]},
        True, ["$.oneOf[0]", "$.oneOf[1]"], "{}", id="oneOf-branches-parent-properties",
    ),
    pytest.param(
        {**PAIR, "allOf": [{"required": ["foo"]}]},
        True, ["$.allOf[0]"], "{}", id="allOf-1-branch",
    ),
    pytest.param(
        {**PAIR, "required": ["foo"], "anyOf": [PAIR, {"type": "object"}]},
        True, ["$"], "{}", id="beside-anyOf",
    ),
    pytest.param(
        {"$defs": {"p": PAIR}, "$ref": "#/$defs/p", "required": ["foo"]},
        True, ["$"], "{}", id="beside-ref",
    ),
    pytest.param(
        {"$defs": {"p": {**PAIR, "required": ["bar"]}}, "$ref": "#/$defs/p",
         "required": ["foo", "bar"]},
        True, ["$"], '{"bar": 1}', id="beside-ref-partly-enforced",
    ),
    pytest.param(
        {"type": "object", "properties": {"x": {"$ref": "#"}, "z": {"type": "integer"}},
         "required": ["y"]},
        True, ["$"], '{"z": 1}', id="recursive",
    ),
]  # fmt: skip

ENFORCED = [
    pytest.param({**PAIR, "required": ["foo"]}, True, "{}", id="listed-in-properties"),
    pytest.param(
        {**PAIR, "required": ["foo"], "additionalProperties": True},
        False,
        '{"bar": 1}',
        id="listed-extra-allowed",
    ),
    pytest.param(
        {"$defs": {"p": {**PAIR, "required": ["foo"]}}, "$ref": "#/$defs/p", "required": ["foo"]},
        True,
        "{}",
        id="beside-ref-target-requires",
    ),
    pytest.param(
        {
            "required": ["foo"],
            "anyOf": [{**PAIR, "required": ["foo"]}, {**PAIR, "required": ["foo", "bar"]}],
        },
        True,
        '{"bar": 1}',
        id="every-branch-requires",
    ),
    pytest.param(
        {"type": ["object", "null"], "properties": TWO, "required": ["foo"]},
        True,
        '{"bar": 1}',
        id="type-list",
    ),
]

# Never shapes the output, or cannot be an object: nothing to report.
NOT_APPLICABLE = [
    pytest.param({**PAIR, "not": {"required": ["foo"]}}, id="under-not"),
    pytest.param({"$defs": {"x": {"type": "object", "required": ["q"]}}, "type": "integer"}, id="unused-defs"),
    pytest.param({"type": "string", "required": ["foo"]}, id="not-an-object"),
    pytest.param({"enum": [{}], "required": ["foo"]}, id="enum"),
    pytest.param({"allOf": [{"required": ["foo"]}, {"required": ["bar"]}]}, id="allOf-2-reported-apart"),
    pytest.param({"required": [1, None]}, id="non-string-names"),
    pytest.param({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, id="ref-cycle-no-required"),
]  # fmt: skip


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    return xgr.GrammarCompiler(tiny_tokenizer.info, max_threads=1, cache_enabled=False)


def _accepts(compiler, schema, strict: bool, text: str) -> bool:
    compiled = compiler.compile_json_schema(json.dumps(schema), strict_mode=strict)
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(("schema", "strict", "paths", "probe"), DROPPED)
def test_dropped_required_is_reported_and_xgrammar_drops_it(compiler, schema, strict, paths, probe):
    found = unenforced_required(schema, strict_mode=strict)
    assert [p for p, _ in found] == paths
    assert all("is not enforced" in m and "required '" in m for _, m in found)
    assert _accepts(compiler, schema, strict, probe), "xgrammar enforces it after all"


@pytest.mark.parametrize(("schema", "strict", "probe"), ENFORCED)
def test_enforced_required_is_not_reported_and_xgrammar_enforces_it(
    compiler, schema, strict, probe
):
    assert unenforced_required(schema, strict_mode=strict) == []
    assert not _accepts(compiler, schema, strict, probe), "xgrammar drops it after all"


@pytest.mark.parametrize("schema", NOT_APPLICABLE)
def test_required_that_shapes_nothing_is_not_reported(schema):
    assert unenforced_required(schema) == []
    assert unenforced_required(schema, strict_mode=False) == []


def test_message_names_the_reason():
    (beside,) = unenforced_required(
        {"$defs": {"p": PAIR}, "$ref": "#/$defs/p", "required": ["foo"]}
    )
    assert beside == (
        "$",
        "required 'foo' is not enforced (keywords beside $ref are not merged into it)",
    )
    many = [f"n{i}" for i in range(8)]
    ((_, msg),) = unenforced_required({"type": "object", "required": many})
    assert "'n0', 'n1', 'n2', 'n3', 'n4' (+3 more)" in msg


def test_hostile_ref_graphs_stay_cheap():
    # 10,000 chained $refs with a required at the head; then a lattice of
    # anyOf branches that would be 2**40 paths without memoization.
    chain = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(10_000)}
    chain["d10000"] = PAIR
    schema = {"$defs": chain, "$ref": "#/$defs/d0", "required": ["foo"]}
    assert [p for p, _ in unenforced_required(schema)] == ["$"]
    lattice = {f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}] * 2} for i in range(40)}
    lattice["l40"] = {**PAIR, "required": ["foo"]}
    schema = {"$defs": lattice, "$ref": "#/$defs/l0", "required": ["foo"]}
    assert unenforced_required(schema) == []


# -- through validate_spec ----------------------------------------------------------

ISSUE_SHAPE = {
    "type": "array",
    "items": {"type": "array", "items": {"type": "object", "required": ["foo"]}},
}


def test_issue_shape_is_enforced_whole(compiler):
    # Compiled as written, xgrammar accepts only empty objects ([[{}], [{}]]):
    # the lint of the schema as written names the dropped name...
    assert unenforced_required(ISSUE_SHAPE) == [
        (
            "$.items.items",
            "required 'foo' is not enforced (it is not listed in this object's properties)",
        )
    ]
    # ...and validation lists foo in properties (schema_rewrite): enforced,
    # no warning, and the grammar requires foo.
    spec = validate_spec({"json": ISSUE_SHAPE}, GrammarConfig(reject_ignored_features=True))
    assert not spec.warnings and not spec.end_check
    compiled = compiler.compile_json_schema(spec.text, strict_mode=spec.strict_mode)
    empty, foo = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)
    assert not (empty.accept_string("[[{}], [{}]]") and empty.is_completed())
    assert foo.accept_string('[[{"foo": 1}]]') and foo.is_completed()


def test_property_names_are_strings_not_objects():
    # propertyNames is read as a string schema: its required means nothing.
    schema = {"type": "object", "propertyNames": {"required": ["z"]}}
    assert unenforced_required(schema, strict_mode=False) == []
    assert validate_spec({"json": schema, "strict_mode": False}, GrammarConfig()).kind == "json"


# -- formats --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(SUPPORTED_FORMATS))
def test_supported_formats_are_enforced(compiler, fmt):
    # "% %" is a plain string no supported format accepts.
    assert _accepts(compiler, {"type": "string"}, True, '"% %"')
    assert not _accepts(compiler, {"type": "string", "format": fmt}, True, '"% %"')


# -- keywords xgrammar compiles and does not enforce ----------------------------------

# Open (additionalProperties true): the names present cannot be split into
# anyOf branches, so dependentRequired stays unenforced (schema_rewrite
# rewrites it over closed objects).
OBJ_AB = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "additionalProperties": True,
}

# (schema, a text the keyword forbids, the message the lint gives)
UNENFORCED = [
    pytest.param({**OBJ_AB, "dependencies": {"a": ["b"]}}, '{"a": 1}', "dependencies", id="dependencies-names"),
    pytest.param({**OBJ_AB, "dependencies": {"a": {"required": ["b"]}}}, '{"a": 1}', "dependencies", id="dependencies-schema"),
    pytest.param({**OBJ_AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "dependentRequired", id="dependentRequired"),
    pytest.param({**OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}', "dependentSchemas", id="dependentSchemas"),
    pytest.param({"type": "integer", "not": {"const": 1}}, "1", "not is not", id="not"),
    pytest.param(
        {**OBJ_AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
        '{"a": 1}', "if/then/else", id="if-then",
    ),
    pytest.param({"type": "string", "format": "date"}, '"2022-02-30"', "impossible dates", id="date-calendar"),
    pytest.param(
        {"type": "string", "format": "date-time"}, '"2022-02-30T00:00:00Z"', "impossible dates",
        id="date-time-calendar",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "forbidden", "message"), UNENFORCED)
def test_unenforced_keywords_are_found_and_xgrammar_really_ignores_them(
    compiler, schema, forbidden, message
):
    assert _accepts(compiler, schema, True, forbidden), "xgrammar enforces it after all"
    with pytest.raises(SpecError) as info:
        validate_spec({"json": schema}, GrammarConfig(reject_ignored_features=True))
    assert info.value.code is ErrorCode.schema_unsupported_feature
    assert message in info.value.message
    spec = validate_spec({"json": schema}, GrammarConfig(reject_ignored_features=False))
    assert spec.end_check and any(message in w for w in spec.warnings)


@pytest.mark.parametrize(
    ("schema", "short", "enough"),
    [
        pytest.param({"type": "string", "minLength": 2.0}, '"a"', '"ab"', id="minLength"),
        pytest.param(
            {"type": "array", "items": {"type": "integer"}, "minItems": 2.0},
            "[1]",
            "[1, 2]",
            id="minItems",
        ),
        pytest.param(
            {"type": "array", "items": {"type": "integer"}, "maxItems": 1.0},
            "[1, 2]",
            "[1]",
            id="maxItems",
        ),
    ],
)
def test_an_integral_float_count_is_enforced_as_the_integer(compiler, schema, short, enough):
    spec = validate_spec({"json": schema}, GrammarConfig())
    assert not spec.end_check and not spec.warnings
    canonical = json.loads(spec.text)
    assert all(isinstance(v, int) for k, v in canonical.items() if k.startswith(("min", "max")))
    assert not _accepts(compiler, canonical, True, short)
    assert _accepts(compiler, canonical, True, enough)


def test_enum_values_are_filtered_by_the_keywords_beside_them(compiler):
    schema = {"type": "string", "enum": ["a", "bb", 3], "minLength": 2}
    spec = validate_spec({"json": schema}, GrammarConfig())
    assert json.loads(spec.text)["enum"] == ["bb"] and not spec.warnings
    assert not _accepts(compiler, json.loads(spec.text), True, '"a"')
    assert _accepts(compiler, schema, True, '"a"')  # xgrammar alone takes "a"


def test_an_enum_nothing_satisfies_stays_and_is_checked_at_the_end():
    # An optional property no value can satisfy: the schema still holds
    # objects without it, so it is admitted, named, and end-checked.
    schema = {"type": "object", "properties": {"k": {"type": "object", "enum": ["a", "b"]}}}
    spec = validate_spec({"json": schema}, GrammarConfig())
    assert spec.end_check
    assert any("beside enum values is not enforced" in w for w in spec.warnings)
