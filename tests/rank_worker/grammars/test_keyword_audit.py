"""The lint against every draft 2020-12 keyword, in every placement, probed with xgrammar 0.2.9.

Each keyword is placed on a typed node, on an untyped one, beside each
combinator (``allOf``, ``anyOf``, ``oneOf`` with one typed branch, and a
``$ref`` to a typed definition; with and without ``type`` on the node),
and beside ``enum`` / ``const`` values. The schema goes through
``validate_spec`` (lax: ``strict_mode`` false, since strict mode forbids
more than a keyword does) and its canonical text is compiled with a tiny
vocabulary. Then, for an instance the keyword forbids:

- ``E``, enforced: xgrammar refuses it, and the lint says nothing of the keyword;
- ``F``, flagged: the lint names the keyword (the output is then
  end-checked), and xgrammar really lets the instance through;
- ``EF``: the lint names it although this placement is enforced (the
  ``enum`` filter enforces it for the values; the finding is kept);
- ``A``, an annotation: a ``format`` xgrammar does not know asserts nothing
  in JSON Schema, so the instance is valid, and allowed.

The schema is rewritten first where an enforced equivalent exists
(``schema_rewrite``): keywords beside a combinator or a ``$ref`` move into
it, untyped keywords keep to their type, so most placements are ``E``.

Annotations (``title``, ``description``, ``default``, ``examples``,
``deprecated``, ``readOnly``, ``writeOnly``, ``$comment``, ``contentEncoding``,
``contentMediaType``, ``contentSchema``) and identifiers (``$schema``,
``$id``, ``$anchor``, ``$dynamicAnchor``, ``$vocabulary``) constrain nothing
in draft 2020-12, and ``$defs`` only holds schemas; they are not in the table.
``minContains`` / ``maxContains`` are named by the ``contains`` finding.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.schema import enforced_tree
from gramcoord.rank_worker.grammars.schema_walk import walk
from gramcoord.rank_worker.grammars.spec import validate_spec

AB = {"properties": {"a": {}, "b": {}}}
INT3 = {"type": "integer", "maximum": 3}

# keyword: (its type, the keyword and what it needs, a forbidden instance, an allowed one)
CASES = {
    "minLength": ("string", {"minLength": 3}, "ab", "abc"),
    "maxLength": ("string", {"maxLength": 2}, "abc", "ab"),
    "pattern": ("string", {"pattern": "^a+$"}, "b", "aa"),
    "format": ("string", {"format": "email"}, "% %", "a@b.co"),
    "format-unknown": ("string", {"format": "idn-email"}, "x", "a@b"),
    "minimum": ("integer", {"minimum": 5}, 4, 5),
    "maximum": ("integer", {"maximum": 5}, 6, 5),
    "exclusiveMinimum": ("integer", {"exclusiveMinimum": 5}, 5, 6),
    "exclusiveMaximum": ("integer", {"exclusiveMaximum": 5}, 5, 4),
    "multipleOf": ("integer", {"multipleOf": 3}, 4, 6),
    "items": ("array", {"items": {"type": "integer"}}, ["a"], [1]),
    "prefixItems": ("array", {"prefixItems": [{"type": "integer"}]}, ["a"], [1]),
    "minItems": ("array", {"minItems": 2}, [1], [1, 2]),
    "maxItems": ("array", {"maxItems": 1}, [1, 2], [1]),
    "uniqueItems": ("array", {"uniqueItems": True}, [1, 1], [1, 2]),
    "contains": ("array", {"contains": {"const": 1}}, [2], [1]),
    "minContains": ("array", {"contains": {"const": 1}, "minContains": 2}, [1], [1, 1]),
    "maxContains": ("array", {"contains": {"const": 1}, "maxContains": 1}, [1, 1], [1]),
    "unevaluatedItems": ("array", {"unevaluatedItems": False}, [1], []),
    "unevaluatedItems-prefix": (
        "array", {"prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, [1, 2], [1],
    ),
    "properties": ("object", {"properties": {"a": {"type": "integer"}}}, {"a": "x"}, {"a": 1}),
    "additionalProperties": (
        "object", {"properties": {"a": {}}, "additionalProperties": False}, {"b": 1}, {"a": 1},
    ),
    "patternProperties": (
        "object", {"patternProperties": {"^n": {"type": "integer"}}}, {"n": "x"}, {"n": 1},
    ),
    "propertyNames": ("object", {"propertyNames": {"pattern": "^[a-z]+$"}}, {"A": 1}, {"a": 1}),
    "required": ("object", {"properties": {"a": {}}, "required": ["a"]}, {}, {"a": 1}),
    "minProperties": ("object", {"minProperties": 1}, {}, {"a": 1}),
    "maxProperties": ("object", {"maxProperties": 1}, {"a": 1, "b": 2}, {"a": 1}),
    "dependentRequired": ("object", {**AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}, {"a": 1, "b": 2}),
    "dependentSchemas": (
        "object", {**AB, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}, {"a": 1, "b": 2},
    ),
    "unevaluatedProperties": (
        "object", {"properties": {"a": {}}, "unevaluatedProperties": False}, {"b": 1}, {"a": 1},
    ),
    "unevaluatedProperties-alone": ("object", {"unevaluatedProperties": False}, {"b": 1}, {}),
    "enum": ("string", {"enum": ["a", "b"]}, "c", "a"),
    "const": ("string", {"const": "a"}, "b", "a"),
    "not": ("string", {"not": {"const": "a"}}, "a", "b"),
    "if/then/else": (
        "string", {"if": {"minLength": 2}, "then": {"pattern": "^a"}, "else": {"const": "z"}}, "bb", "ab",
    ),
    "allOf": ("integer", {"allOf": [INT3]}, 4, 1),
    "anyOf": ("integer", {"anyOf": [INT3]}, 4, 1),
    "oneOf": ("integer", {"oneOf": [INT3]}, 4, 1),
    "$ref": ("integer", {"$defs": {"m": INT3}, "$ref": "#/$defs/m"}, 4, 1),
    "$dynamicRef": (
        "integer", {"$defs": {"d": {"$dynamicAnchor": "d", **INT3}}, "$dynamicRef": "#d"}, 4, 1,
    ),
    "type": ("integer", {"type": "integer"}, "x", 1),
}  # fmt: skip

PLACEMENTS = ["typed", "untyped", "allOf", "allOf+type", "anyOf", "anyOf+type", "oneOf",
              "oneOf+type", "$ref", "$ref+type", "enum", "const"]  # fmt: skip

# keyword x placement -> E (enforced), F (flagged), EF (flagged, enforced here),
# A (an annotation: the instance is valid, and allowed), - (no such placement)
AUDIT = """
minLength                   E    E    E    E    E    E    E    E    E    E    E    F
maxLength                   E    E    E    E    E    E    E    E    E    E    E    F
pattern                     E    E    E    E    E    E    E    E    E    E    E    F
format                      E    E    E    E    E    E    E    E    E    E    E    F
format-unknown              A    A    A    A    A    A    A    A    A    A    A    A
minimum                     E    E    E    E    E    E    E    E    E    E    E    F
maximum                     E    E    E    E    E    E    E    E    E    E    E    F
exclusiveMinimum            E    E    E    E    E    E    E    E    E    E    E    F
exclusiveMaximum            E    E    E    E    E    E    E    E    E    E    E    F
multipleOf                  E    F    E    E    E    E    E    E    E    E   EF    F
items                       E    E    E    E    E    E    E    E    E    E    E    F
prefixItems                 E    E    E    E    E    E    E    E    E    E    E    F
minItems                    E    E    E    E    E    E    E    E    E    E    E    F
maxItems                    E    E    E    E    E    E    E    E    E    E    E    F
uniqueItems                 F    F    F    F    F    F    F    F    F    F   EF    F
contains                    F    F    F    F    F    F    F    F    F    F   EF    F
minContains                 EF    F   EF   EF   EF   EF   EF   EF   EF   EF   EF    F
maxContains                 F    F    F    F    F    F    F    F    F    F   EF    F
unevaluatedItems            E    E    F    F    F    F    F    F    F    F    E    F
unevaluatedItems-prefix     E    E    F    F    F    F    F    F    F    F    E    F
properties                  E    E    E    E    E    E    E    E    E    E    E    F
additionalProperties        E    E    E    E    E    E    E    E    E    E    E    F
patternProperties           E    E    E    E    E    E    E    E    E    E    E    F
propertyNames               E    E    E    E    E    E    E    E    E    E    E    F
required                    E    E    E    E    E    E    E    E    E    E    E    F
minProperties               E    E    E    E    E    E    E    E    E    E    E    F
maxProperties               E    E    E    E    E    E    E    E    E    E    E    F
dependentRequired           F    F    F    F    F    F    F    F    F    F   EF    F
dependentSchemas            F    F    F    F    F    F    F    F    F    F   EF    F
unevaluatedProperties       F    F    F    F    F    F    F    F    F    F    E    F
unevaluatedProperties-alone F    F    F    F    F    F    F    F    F    F    E    F
enum                        E    E    E    E    E    E    E    E    E    E    E    F
const                       E    E    E    E    E    E    E    E    E    E    E    E
not                         F    F    F    F    F    F    F    F    F    F   EF    F
if/then/else                F    F    F    F    F    F    F    F    F    F   EF    F
allOf                       E    E    -    -    F    F    F    F    E    E    E    F
anyOf                       E    E    E    E    -    -    E    E    E    E    E    F
oneOf                       E    E    E    E    F    F    -    -    E    E    E    F
$ref                        E    E    E    E    E    E    E    E    -    -    E    F
$dynamicRef                 F    F    F    F    F    F    F    F    F    F   EF    F
type                        E    E    E    E    E    E    E    E    E    E    E    F
"""


def _table() -> list:
    params = []
    for line in AUDIT.strip().splitlines():
        keyword, *verdicts = line.split()
        assert len(verdicts) == len(PLACEMENTS), keyword
        for placement, verdict in zip(PLACEMENTS, verdicts):
            if verdict != "-":
                params.append(
                    pytest.param(keyword, placement, verdict, id=f"{keyword}@{placement}")
                )
    return params


def _place(keyword: str, placement: str) -> dict:
    kind, fragment, forbidden, allowed = CASES[keyword]
    if placement == "typed":
        return {"type": kind, **fragment}
    if placement == "untyped":
        return dict(fragment)
    if placement == "enum":
        return {"enum": [forbidden, allowed], **fragment}
    if placement == "const":
        return {"const": forbidden, **fragment}
    combinator, _, typed = placement.partition("+")
    # The combinator's branch has the keyword's type; for `type` itself, no type.
    branch = {} if keyword == "type" else {"type": kind}
    node = {"type": kind} if typed and keyword != "type" else {}
    if combinator == "$ref":
        defs = {**fragment.get("$defs", {}), "t": branch}
        return {**node, **fragment, "$defs": defs, "$ref": "#/$defs/t"}
    return {**node, **fragment, combinator: [branch]}


def _names(keyword: str, message: str) -> bool:
    name = {"minContains": "contains", "maxContains": "contains"}.get(keyword, keyword)
    name = name.split("-")[0]
    if message.startswith("["):  # an enum / const filter: ['minLength', 'type'] beside const
        # A $ref beside the values is inlined: its target's keywords are listed.
        return name == "$ref" or repr(name) in message.split("]")[0]
    return message.startswith((f"{name} ", f"{name}:", f"{name} '"))


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    return xgr.GrammarCompiler(tiny_tokenizer.info, max_threads=1, cache_enabled=False)


@pytest.mark.parametrize(("keyword", "placement", "verdict"), _table())
def test_each_keyword_is_enforced_or_flagged(compiler, keyword, placement, verdict):
    schema = _place(keyword, placement)
    spec = validate_spec({"json": schema, "strict_mode": False}, GrammarConfig())
    found = walk(enforced_tree(schema, strict_mode=False), strict_mode=False)
    messages = [m for _, m in found.ignored + found.dropped_required]
    flagged = any(_names(keyword, m) for m in messages)
    if flagged:
        assert spec.end_check and any(w.startswith("ignored_feature") for w in spec.warnings)
    _, _, forbidden, allowed = CASES[keyword]
    compiled = compiler.compile_json_schema(spec.text, strict_mode=False)

    def accepts(value) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        text = json.dumps(value, separators=(",", ":"))
        return matcher.accept_string(text) and matcher.is_completed()

    assert flagged is (verdict in ("F", "EF")), messages
    assert accepts(forbidden) is (verdict in ("F", "A")), "xgrammar's verdict changed"
    if verdict == "E" and placement != "const":
        assert accepts(allowed)
