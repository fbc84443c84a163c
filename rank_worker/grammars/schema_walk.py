"""The one walk over a canonical schema: lint every object, and follow what the converter reaches.

``spec_text`` calls ``walk`` once per schema, after ``canonical_tree``. It
returns ``SchemaFindings``; the verdict on them is the caller's.

The walk follows xgrammar 0.2.9's JSON-schema converter: it first *parses*
the schema tree, then *generates* the grammar, resolving each ``$ref`` only
when generating it (a ``$ref`` inside an ``allOf`` of two or more branches,
generated as "anything", or inside an object with ``maxProperties: 0``,
generated as ``{}``, is never resolved). Which subschemas of an object are
generated depends on ``strict_mode``. Subschemas the converter never parses
(unused ``$defs``, ``not``/``if``/``then``/``else``, ``contains``,
``dependentSchemas``, ``additionalItems``) are still visited, for the lint
only. On the way:

- every schema object is linted and rewritten in place (``lint_node``, below)
  the first time the walk meets it, before the walk reads it;
- ``oneOf`` nodes the converter parses are collected: it relaxes them to
  ``anyOf`` (with a warning) unless ``one_of_is_exact`` (below); a
  ``oneOf`` is its node's keyword only without ``$ref``, ``const``,
  ``enum`` or ``anyOf`` beside it;
- ``required`` lists of the objects it generates are collected, and
  ``dropped_required`` names the names xgrammar drops.

Both checks run once the walk is done, on the rewritten tree. Iterative;
each object is visited at most once per mode, so ``$ref`` cycles end.

Which ``required`` names xgrammar drops: it reads ``required`` only on a
node it builds as an object (no ``$ref``, ``const``, ``enum``, ``anyOf``,
``oneOf`` or ``allOf`` beside it), and there it enforces only the names
that node lists in its own ``properties``; every other name is dropped
without a word, whatever ``strict_mode`` and ``additionalProperties`` say.
Keywords beside a ``$ref`` or a combinator are not merged into it either,
so a branch that lists ``required`` and relies on its parent's
``properties`` enforces nothing. Measured with a GrammarMatcher
(tests/rank_worker/grammars/test_schema_lint.py re-checks every shape):
``{"type": "object", "required": ["foo"]}`` in strict mode accepts only
``{}``; with ``"properties": {"bar": {}}`` beside it, ``{"bar": 1}``.

The lint of one object
----------------------
``lint_node`` runs once for every schema object of the canonical tree, the
first time the walk meets it, before the walk reads the object's keywords
for its own reach. It records findings and rewrites the object in place
into what xgrammar enforces exactly.

- **Ignored features.** xgrammar 0.2.9 compiles some keywords without
  enforcing them (it logs a C++ warning at most). Measured on this version:
  ``multipleOf`` on non-integers (and on integers when fractional, above
  1024, or next to a one-sided or more-than-10000-wide range),
  ``uniqueItems``, ``contains``, ``allOf`` with two or more branches,
  length bounds next to ``pattern``/``format``, any ``format`` outside
  ``SUPPORTED_FORMATS``, the calendar of ``date`` / ``date-time``,
  ``dependencies``, ``dependentRequired``, ``dependentSchemas``, ``not``,
  ``if``/``then``/``else``, ``$dynamicRef``, ``unevaluatedProperties: false``
  without ``strict_mode``, and every constraint beside the keyword xgrammar
  builds a node from (``$ref``, else ``const``/``enum``, else the first of
  ``anyOf``/``oneOf``/``allOf``). These are reported; the session then
  refuses the schema or checks the finished output
  (``grammar.reject_ignored_features``). The audit of every draft 2020-12
  keyword in every placement is tests/rank_worker/grammars/test_keyword_audit.py.
- **Rewrites.** A count keyword written as an integral float
  (``minLength: 2.0``) is written as the integer: xgrammar refuses the float
  but enforces the same bound as an integer. ``enum`` / ``const`` values are
  filtered by the constraints beside them (``_rewrite_enum``).
- **Type names.** A ``type`` that names no JSON Schema type (``"objekt"``)
  is reported, so it fails with a clear message before xgrammar's own.
- **References.** A ``$ref`` that is not a local JSON pointer is compiled by
  xgrammar as "anything"; it is reported as ``unconstrained_ref``. A local
  pointer that does not resolve is an error.

Findings that follow the converter's own reach (``oneOf`` relaxed to
``anyOf``, dropped ``required`` names) are the walk's.

Values as xgrammar compares them
--------------------------------
- ``is_num`` / ``is_int64``: a JSON number, and one the C++ JSON reader keeps
  as an integer.
- ``one_of_is_exact``: xgrammar enforces ``oneOf`` exactly only when it can
  prove the branches pairwise disjoint; otherwise it logs a C++ warning
  ("oneOf with overlapping or non-provably-disjoint branches ...") and
  compiles the node as ``anyOf``. Decided here in Python, so the walk can
  put the warning on the request (``oneof_as_anyof``) identically on every
  rank. Measured on 0.2.9 (tests/rank_worker/grammars/test_native_output.py
  re-checks it against the library):

  - A branch set is proven disjoint when (a) every branch is a plain type
    test (``type`` plus annotation keywords, no ``object`` type) or a
    finite value set (``const``/``enum``), and no two branches can share a
    value; or (b) every branch is ``"type": "object"`` and requires one
    property, chosen among the first branch's required properties, whose
    value is a ``const``/``enum``, with no value shared between branches.
  - Numbers: two integer literals overlap only when equal; any other pair
    of numbers is assumed to overlap (``1`` and ``1.0``, ``1.5`` and ``2.5``).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

import jsonschema

from gramcoord.rank_worker.grammars.schema_tree import MISSING, SchemaTree


def is_num(v: Any) -> bool:
    """A JSON number (``bool`` is not one)."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def is_int64(v: Any) -> bool:
    """An integer the C++ JSON reader keeps as one (within int64); every other number is a double."""
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


_ANNOTATIONS = frozenset(
    {
        "title",
        "default",
        "description",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
        "$schema",
    }
)
_JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
_COMPOSITE = ("$ref", "anyOf", "allOf", "oneOf")
# Above this many value comparisons a oneOf is reported without a proof
# (xgrammar would finish it; a hostile spec must not stall the lint).
_MAX_PAIR_CHECKS = 200_000


def _has_inexact_number(v: Any) -> bool:
    stack = [v]
    while stack:
        x = stack.pop()
        if is_num(x) and not is_int64(x):
            return True
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


def _may_overlap(a: Any, b: Any) -> bool:
    """Could values ``a`` and ``b`` be the same JSON value? (xgrammar's test)"""
    if is_num(a) or is_num(b):
        if not (is_num(a) and is_num(b)):
            return False
        return a == b if is_int64(a) and is_int64(b) else True
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, list) or isinstance(b, list):
        return (
            isinstance(a, list)
            and isinstance(b, list)
            and len(a) == len(b)
            and all(_may_overlap(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return len(a) == len(b) and all(k in b and _may_overlap(v, b[k]) for k, v in a.items())
    return False


def _value_sets_disjoint(groups: list[list[Any]]) -> bool:
    """No value of one group may equal a value of another group."""
    if not any(_has_inexact_number(v) for g in groups for v in g):
        # Without doubles "may overlap" is plain equality (true != 1).
        owner: dict[str, int] = {}
        for i, group in enumerate(groups):
            for v in group:
                key = json.dumps(v, sort_keys=True, ensure_ascii=False)
                if owner.setdefault(key, i) != i:
                    return False
        return True
    checks = 0
    for i, gi in enumerate(groups):
        for gj in groups[i + 1 :]:
            checks += len(gi) * len(gj)
            if checks > _MAX_PAIR_CHECKS:
                return False
            if any(_may_overlap(a, b) for a in gi for b in gj):
                return False
    return True


def _finite_values(node: dict) -> list[Any] | None:
    if "const" in node:
        return [node["const"]]
    if "enum" in node:
        enum = node["enum"]
        return list(enum) if isinstance(enum, list) and enum else None
    return None


def _type_set(value: Any) -> frozenset[str] | None:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names:
        return None
    if not all(isinstance(t, str) and t in _JSON_TYPES for t in names):
        return None
    return frozenset(names)


def _matches_types(value: Any, types: frozenset[str]) -> bool:
    if is_num(value):
        return bool(types & {"integer", "number"})
    if value is None:
        return "null" in types
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, str):
        return "string" in types
    if isinstance(value, list):
        return "array" in types
    return isinstance(value, dict) and "object" in types


def _proven_by_types_or_values(arms: list[Any]) -> bool:
    value_groups: list[list[Any]] = []
    type_sets: list[frozenset[str]] = []
    for arm in arms:
        if not isinstance(arm, dict) or any(k in arm for k in _COMPOSITE):
            return False
        values = _finite_values(arm)
        if values is not None:
            value_groups.append(values)
            continue
        if "type" not in arm or any(k != "type" and k not in _ANNOTATIONS for k in arm):
            return False
        types = _type_set(arm["type"])
        if types is None or "object" in types:
            return False
        type_sets.append(types)
    # integer and number overlap each other: compare numeric as one class.
    seen: set[str] = set()
    for types in type_sets:
        classes = {"number" if t == "integer" else t for t in types}
        if seen & classes:
            return False
        seen |= classes
    if value_groups:
        all_types = frozenset().union(*type_sets) if type_sets else frozenset()
        if any(_matches_types(v, all_types) for g in value_groups for v in g):
            return False
    return _value_sets_disjoint(value_groups)


def _discriminator_values(arm: Any, key: str) -> list[Any] | None:
    if not isinstance(arm, dict) or any(k in arm for k in _COMPOSITE):
        return None
    if arm.get("type") != "object":
        return None
    required = arm.get("required")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return None
    props = arm.get("properties")
    if key not in required or not isinstance(props, dict) or not isinstance(props.get(key), dict):
        return None
    return _finite_values(props[key])


def _proven_by_discriminator(arms: list[Any]) -> bool:
    first = arms[0]
    if not isinstance(first, dict):
        return False
    required, props = first.get("required"), first.get("properties")
    if not isinstance(required, list) or not isinstance(props, dict):
        return False
    for key in required:
        if not isinstance(key, str) or not isinstance(props.get(key), dict):
            continue
        if _finite_values(props[key]) is None:
            continue
        groups = []
        for arm in arms:
            values = _discriminator_values(arm, key)
            if values is None:
                break
            groups.append(values)
        else:
            if _value_sets_disjoint(groups):
                return True
    return False


def one_of_is_exact(arms: Any) -> bool:
    """Whether xgrammar 0.2.9 enforces ``{"oneOf": arms}`` exactly.

    ``False`` means it compiles the node as ``anyOf`` (and logs a warning).
    A non-list ``arms`` is a compile error, not a relaxation: ``True``.
    """
    if not isinstance(arms, list):
        return True
    if not arms:
        return False
    return _proven_by_discriminator(arms) or _proven_by_types_or_values(arms)


# Formats xgrammar 0.2.9 enforces (each rejects "% %" where a plain string
# accepts it; tests/rank_worker/grammars/test_schema_lint.py re-checks this list).
SUPPORTED_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)

# Keywords xgrammar 0.2.9 compiles and does not enforce at all (each is
# probed in tests/rank_worker/grammars/test_schema_lint.py: the grammar
# accepts an instance the keyword forbids).
_UNENFORCED_KEYWORDS = ("dependencies", "dependentRequired", "dependentSchemas", "not")
# Formats whose shape xgrammar enforces but not the calendar.
_CALENDAR_FORMATS = frozenset({"date", "date-time"})
# Keywords that take a whole number: an integral float (``2.0``) is written
# as the integer, which xgrammar enforces (it refuses ``2.0`` outright).
_COUNT_KEYWORDS = (
    "maxContains",
    "maxItems",
    "maxLength",
    "maxProperties",
    "minContains",
    "minItems",
    "minLength",
    "minProperties",
)

# Keywords that constrain a value of one type. On a node without ``type``
# xgrammar 0.2.9 enforces none of them unless another keyword makes it infer
# the type (``properties`` / ``additionalProperties``: object; ``items`` /
# ``prefixItems``: array), and beside ``enum`` / ``const`` / ``$ref`` /
# ``anyOf`` / ``oneOf`` / ``allOf`` it enforces none of them at all.
VALUE_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "object": ("patternProperties", "minProperties", "maxProperties", "propertyNames"),
    "array": ("minItems", "maxItems"),
}
_INFERS = {
    "object": ("properties", "additionalProperties", "unevaluatedProperties"),
    "array": ("items", "prefixItems", "unevaluatedItems"),
}
_SIBLINGS = frozenset({"type", *(k for keys in VALUE_KEYWORDS.values() for k in keys)})
# The keywords xgrammar builds a node from, in the order it looks for them;
# every other constraint beside the one it finds is dropped.
_WINNERS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# Keywords that constrain an instance: draft 2020-12's applicator and
# validation vocabularies, ``format`` (enforced here) and the older
# ``dependencies``. Annotations (title, default, examples, ``content*``,
# ``$comment``, ...) and containers (``$defs``) constrain nothing.
CONSTRAINTS = frozenset(
    {
        *_SIBLINGS,
        *_WINNERS,
        "$dynamicRef",
        "additionalProperties",
        "contains",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "else",
        "if",
        "items",
        "maxContains",
        "minContains",
        "not",
        "prefixItems",
        "properties",
        "required",
        "then",
        "uniqueItems",
        "unevaluatedItems",
        "unevaluatedProperties",
    }
)
# Reported wherever they appear, by a finding of their own (``required`` by
# the walk's own check).
_REPORTED_ANYWHERE = frozenset(
    {
        "$dynamicRef",
        "contains",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "else",
        "if",
        "maxContains",
        "minContains",
        "not",
        "required",
        "then",
    }
)

# The values ``type`` may name (JSON Schema's instance types).
JSON_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")


class SchemaFindings:
    """What the walk found. The lint's lists carry each object's tree rank
    first (the walk meets objects out of tree order and sorts them back)."""

    def __init__(self) -> None:
        # (rank, json path, message) for features xgrammar would not enforce.
        self.ignored: list[tuple[int, str, str]] = []
        # (rank, json path, ref) of refs xgrammar compiles as unconstrained.
        self.remote_refs: list[tuple[int, str, str]] = []
        # (rank, json path, ref) of local pointers that do not resolve.
        self.broken_refs: list[tuple[int, str, str]] = []
        # (rank, json path, value) of ``type`` values that name no JSON Schema type.
        self.bad_types: list[tuple[int, str, Any]] = []
        # The walk's own, in the converter's order: ``required`` names it
        # drops ((path, message)), and ``oneOf`` paths it relaxes to anyOf.
        self.dropped_required: list[tuple[str, str]] = []
        self.inexact_one_ofs: list[str] = []


def lint_node(
    node: dict, path: str, rank: int, tree: SchemaTree, found: SchemaFindings, *, strict_mode: bool
) -> None:
    """Lint one schema object as written, then rewrite it in place into what xgrammar enforces.

    ``tree`` resolves its ``$ref`` and says whether it describes a key
    (``propertyNames``); ``strict_mode`` is the request's.
    """

    def ignored(msg: str) -> None:
        found.ignored.append((rank, path, msg))

    types = node.get("type")
    # A type naming no JSON Schema type is reported; the checks below look
    # at the string names only.
    type_list = types if isinstance(types, list) else [types]
    type_set = {t for t in type_list if isinstance(t, str)}
    bad = [t for t in type_list if t not in JSON_TYPES] or ([] if type_list else [types])
    if "type" in node and bad:
        found.bad_types.append((rank, f"{path}.type", bad[0]))
    if "multipleOf" in node and type_set != {"integer"}:
        ignored("multipleOf is only enforced for type 'integer'")
    elif "multipleOf" in node:
        reason = _integer_multiple_of_ignored(node)
        if reason:
            ignored(reason)
    if node.get("uniqueItems") is True:
        ignored("uniqueItems is not enforced")
    if "contains" in node:
        ignored("contains is not enforced correctly")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) >= 2:
        ignored(f"allOf with {len(all_of)} branches is not enforced")
    for msg in _dropped(node, tree):
        ignored(msg)
    for key in _UNENFORCED_KEYWORDS:
        if key in node:
            ignored(f"{key} is not enforced")
    if "if" in node and ("then" in node or "else" in node):
        ignored("if/then/else is not enforced")
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
        ignored(f"format {fmt!r} is not enforced")
    elif isinstance(fmt, str) and fmt in _CALENDAR_FORMATS:
        ignored(f"format {fmt!r} accepts impossible dates (2022-02-30)")
    has_len = "minLength" in node or "maxLength" in node
    # An unknown format is ignored and the bounds kept; a known one wins.
    if has_len and ("pattern" in node or (isinstance(fmt, str) and fmt in SUPPORTED_FORMATS)):
        ignored("minLength/maxLength next to pattern/format is ignored")
    if (
        node.get("unevaluatedProperties") is False
        and not strict_mode
        and "additionalProperties" not in node
        and not any(k in node for k in _WINNERS)  # else reported as dropped beside it
        and _may_be("object", node)
    ):
        # Other keys are allowed, of any value, as without the keyword.
        ignored("unevaluatedProperties: false is not enforced without strict_mode")
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref == "#" or ref.startswith("#/"):
            if tree.refs.get(ref, MISSING) is MISSING:
                found.broken_refs.append((rank, path, ref))
        else:
            found.remote_refs.append((rank, path, ref))
    if "$dynamicRef" in node:
        ignored("$dynamicRef is not enforced")
    for why in _rewrite_enum(node):
        ignored(why)
    for key in _COUNT_KEYWORDS:
        value = node.get(key)
        if isinstance(value, float) and value.is_integer():
            node[key] = int(value)  # the same constraint, written as xgrammar takes it


def _dropped(node: dict, tree: SchemaTree) -> list[str]:
    """Constraints xgrammar drops: beside the keyword it builds the node from, or value
    keywords on a node without type (unless the type is inferred, or it describes a key)."""
    winner = next((k for k in _WINNERS if k in node), None)
    if winner in ("const", "enum"):
        return []  # the values are the constraint; _rewrite_enum keeps those that satisfy the rest
    if winner is not None:
        return [
            f"{key} beside {winner} is not enforced"
            for key in node
            if key in CONSTRAINTS
            and key != winner
            and key not in _REPORTED_ANYWHERE
            and not (key == "uniqueItems" and node[key] is not True)
            and not (key == "allOf" and isinstance(node[key], list) and len(node[key]) >= 2)
            and not (key == "type" and _type_implied(node, winner, tree.refs))
        ]
    if "type" in node or id(node) in tree.key_schemas:
        return []  # keywords of another type than the node's (a key's: string) constrain nothing
    found = []
    for kind, keys in VALUE_KEYWORDS.items():
        if any(k in node for k in _INFERS.get(kind, ())):
            continue  # the type is inferred and its keywords enforced
        found.extend(f"{key} on a node without type is not enforced" for key in keys if key in node)
    return found


def _type_names(value: Any) -> set[str] | None:
    names = value if isinstance(value, list) else [value]
    if not names or not all(isinstance(n, str) for n in names):
        return None
    return {"number" if n == "integer" else n for n in names} | set(names)


def _type_implied(node: dict, winner: str, refs: dict[str, Any]) -> bool:
    """Whether every branch xgrammar builds ``node`` from has a type within ``node``'s own."""
    outer = _type_names(node["type"])
    ref = node["$ref"] if winner == "$ref" else None
    arms = [refs.get(ref, MISSING) if isinstance(ref, str) else MISSING] if ref else node[winner]
    if outer is None or not isinstance(arms, list) or not arms:
        return False
    for arm in arms:
        inner = _type_names(arm.get("type")) if isinstance(arm, dict) and "type" in arm else None
        if (
            inner is None
            or not {n for n in inner if n != "number" or "integer" not in inner} <= outer
        ):
            return False
    return True


def _may_be(kind: str, node: dict) -> bool:
    names = _type_names(node.get("type", kind))
    return names is None or kind in names


def _rewrite_enum(node: dict) -> list[str]:
    """Keep only the ``enum`` / ``const`` values that satisfy the constraints beside them.

    xgrammar emits exactly the listed values and ignores ``type``,
    ``minLength``, ``properties`` and every other constraint beside them;
    JSON Schema requires both. Filtering the values with those constraints
    (``jsonschema``, formats checked) gives a schema xgrammar enforces
    exactly. Returns findings when no value satisfies them, or when
    ``jsonschema`` cannot check the constraints beyond type and value
    keywords (a ``$ref`` to the rest of the document, say).
    """
    # xgrammar emits the const when there is one (an enum beside it is a
    # constraint on it), else the enum values.
    values = None if "const" in node or not isinstance(node.get("enum"), list) else node["enum"]
    if "$ref" in node or (values is None and "const" not in node):
        return []
    winner = "enum" if values is not None else "const"
    siblings = {k: node[k] for k in node if k in CONSTRAINTS and k != winner}
    if not siblings:
        return []
    what = "const" if values is None else "enum values"
    local = {k: node[k] for k in ("$defs", "definitions") if k in node}
    try:
        cls = jsonschema.validators.validator_for({})
        check = cls({**local, **siblings}, format_checker=cls.FORMAT_CHECKER)
        if values is None:
            keep = [node["const"]] if check.is_valid(node["const"]) else []
        else:
            keep = [v for v in values if check.is_valid(v)]
    except (jsonschema.SchemaError, TypeError, ValueError, RecursionError):
        return []  # keywords jsonschema cannot use: xgrammar's own verdict stands
    except Exception:  # an unresolvable $ref inside, among others
        return [f"{k} beside {what} is not enforced" for k in siblings if k not in _SIBLINGS]
    if not keep:
        # Nothing here can match, yet the schema may still be satisfiable
        # (an optional property): xgrammar's grammar stays, and the end
        # check catches an output that uses the node.
        return [f"{sorted(siblings)} beside {what} is not enforced"]
    if values is not None and len(keep) < len(values):
        node["enum"] = keep
    return []


# xgrammar 0.2.9 enforces an integer multipleOf only up to this value, and
# next to a range only when both ends are set and it spans at most this many
# integers; otherwise it warns and drops the multipleOf.
_MAX_INTEGER_MULTIPLE_OF = 1024
_MAX_MULTIPLE_OF_RANGE = 10_000


def _integer_multiple_of_ignored(node: dict) -> str | None:
    step = node["multipleOf"]
    if not is_num(step) or step <= 0:
        return None  # a compile error, not an ignored keyword
    if step == 1:
        return None  # dropping it changes nothing
    if step != int(step) or step > _MAX_INTEGER_MULTIPLE_OF:
        return f"multipleOf is only enforced for whole numbers up to {_MAX_INTEGER_MULTIPLE_OF}"
    lo = hi = None
    bounds = [node.get(k) for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")]
    if any(b is not None and (not is_num(b) or b != int(b)) for b in bounds):
        return None  # rejected by the compiler
    low, low_x, high, high_x = (None if b is None else int(b) for b in bounds)
    if low is not None or low_x is not None:
        lo = max(v for v in (low, None if low_x is None else low_x + 1) if v is not None)
    if high is not None or high_x is not None:
        hi = min(v for v in (high, None if high_x is None else high_x - 1) if v is not None)
    if lo is None and hi is None:
        return None
    if lo is None or hi is None or hi - lo + 1 > _MAX_MULTIPLE_OF_RANGE:
        return (
            "multipleOf next to minimum/maximum is only enforced when both are set and "
            f"span at most {_MAX_MULTIPLE_OF_RANGE} integers"
        )
    return None


# A stack item: (node, path, forced type, generated). The forced type comes
# from a type list or propertyNames' implied "string" ("" forces the untyped
# reading of an empty type list); generated is False below a node whose
# children are parsed but never generated. ``_UNPARSED`` marks a subschema
# the converter never parses: visited for the lint only.
_Visit = tuple[Any, str, Any, bool]
_UNPARSED = object()


def walk(tree: SchemaTree, *, strict_mode: bool, lint: bool = True) -> SchemaFindings:
    """Lint, rewrite and follow ``tree`` in one pass; see the module docstring.

    ``lint=False`` only follows the converter (a structural tag's embedded
    schemas, compiled as written): no lint, no rewrites.
    """
    found = SchemaFindings()
    met: set[int] = set()
    reached: set[tuple[int, str | None, bool]] = set()
    one_ofs: dict[int, tuple[dict, str]] = {}
    required: dict[int, tuple[dict, str]] = {}
    stack: list[_Visit] = [(tree.root, "$", None, True)]
    while stack:
        node, path, forced, gen = stack.pop()
        if not isinstance(node, dict):
            continue
        if id(node) not in met:
            met.add(id(node))
            kids = tree.children.get(id(node))
            if lint and kids is not None:
                path_, rank = tree.path[id(node)], tree.rank[id(node)]
                lint_node(node, path_, rank, tree, found, strict_mode=strict_mode)
                stack.extend((kid, p, _UNPARSED, False) for kid, p in reversed(kids))
        if forced is _UNPARSED or (id(node), forced, gen) in reached:
            continue
        reached.add((id(node), forced, gen))
        if "oneOf" in node and not any(k in node for k in ("$ref", "const", "enum", "anyOf")):
            one_ofs.setdefault(id(node), (node, path))
        if gen and isinstance(node.get("required"), list) and forced in (None, "", "object"):
            required.setdefault(id(node), (node, path))
        stack.extend(reversed(_children(node, path, forced, gen, strict_mode, tree.refs)))
    found.inexact_one_ofs = [
        f"{p}.oneOf" for n, p in one_ofs.values() if not one_of_is_exact(n["oneOf"])
    ]
    found.dropped_required = dropped_required(list(required.values()), tree.refs)
    for name in ("ignored", "remote_refs", "broken_refs", "bad_types"):
        # The lint met objects in the converter's order; report in tree order.
        ranked = sorted(getattr(found, name), key=lambda item: item[0])
        setattr(found, name, [item[1:] for item in ranked])
    return found


def _children(
    node: dict, path: str, forced: str | None, gen: bool, strict_mode: bool, refs: dict
) -> list[_Visit]:
    """What the converter parses below ``node``, in its order."""
    if "$ref" in node:
        ref = node["$ref"]
        if gen and isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            target = refs.get(ref, MISSING)
            if target is not MISSING:
                return [(target, _pointer_path(ref), None, True)]
        return []
    if "const" in node or "enum" in node:
        return []
    if "anyOf" in node or "oneOf" in node or "allOf" in node:
        key = next(k for k in ("anyOf", "oneOf", "allOf") if k in node)
        arms = node[key]
        if not isinstance(arms, list):
            return []
        arm_gen = gen and (key != "allOf" or len(arms) == 1)
        return [(a, f"{path}.{key}[{i}]", None, arm_gen) for i, a in enumerate(arms)]
    return _typed_children(node, path, forced, gen, strict_mode)


def _typed_children(
    node: dict, path: str, forced: str | None, gen: bool, strict_mode: bool
) -> list[_Visit]:
    if forced is None and "type" in node:
        t = node["type"]
        if isinstance(t, list):
            if not t:
                return [(node, path, "", gen)]
            return [(node, path, x, gen) for x in t if isinstance(x, str)]
        if not isinstance(t, str):
            return []
        kind = t
    elif forced:
        kind = forced
    elif any(k in node for k in ("properties", "additionalProperties", "unevaluatedProperties")):
        kind = "object"
    elif any(k in node for k in ("items", "prefixItems", "unevaluatedItems")):
        kind = "array"
    else:
        return []
    out: list[_Visit] = []
    if kind == "object":
        out.extend(_object_children(node, path, gen, strict_mode))
    elif kind == "array":
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            out.extend((s, f"{path}.prefixItems[{i}]", None, gen) for i, s in enumerate(prefix))
        if "items" in node:
            out.append((node["items"], f"{path}.items", None, gen))
        elif "unevaluatedItems" in node:
            out.append((node["unevaluatedItems"], f"{path}.unevaluatedItems", None, gen))
    return out


def _object_children(node: dict, path: str, gen: bool, strict_mode: bool) -> list[_Visit]:
    """Subschemas of an object node, each marked with whether it is generated.

    Every subschema below is parsed; which are generated depends on the mix
    of ``properties``, ``patternProperties``, ``propertyNames`` and whether
    other keys are allowed (``strict_mode`` forbids them by default).
    """
    props, pattern = node.get("properties"), node.get("patternProperties")
    has_props = isinstance(props, dict) and bool(props)
    has_pattern = isinstance(pattern, dict) and bool(pattern)
    has_names = "propertyNames" in node
    if "additionalProperties" in node:
        extra_key = "additionalProperties"
        extra = node[extra_key]
        allow_extra = extra if isinstance(extra, bool) else True
    else:
        extra_key = "unevaluatedProperties"
        extra = node.get(extra_key)
        allow_extra = not strict_mode or (extra if isinstance(extra, bool) else extra_key in node)
    # maxProperties 0 leaves out the named properties and everything built
    # after them; a propertyNames/patternProperties rule next to named
    # properties is built first.
    max_props = node.get("maxProperties")
    some = not (is_int64(max_props) and max_props == 0)
    gen_props = gen_pattern = gen_names = gen_extra = False
    if has_props and (has_pattern or has_names):
        gen_props = some
        if has_pattern:
            gen_pattern = gen_extra = True
        elif allow_extra:
            gen_names = gen_extra = True
    elif has_pattern:
        gen_pattern = some
    elif has_names:
        gen_names = gen_extra = some
    else:
        gen_props = gen_extra = some
    out: list[_Visit] = []
    for key, key_gen in (("properties", gen_props), ("patternProperties", gen_pattern)):
        sub = node.get(key)
        if isinstance(sub, dict):
            out.extend(
                (s, f"{path}.{key}.{name}", None, gen and key_gen) for name, s in sub.items()
            )
    if has_names:
        names = node["propertyNames"]
        implied = None if isinstance(names, dict) and "type" in names else "string"
        out.append((names, f"{path}.propertyNames", implied, gen and gen_names))
    if extra_key in node:
        out.append((extra, f"{path}.{extra_key}", None, gen and gen_extra))
    return out


def _pointer_path(ref: str) -> str:
    """``#/$defs/a`` as a lint path: ``$.$defs.a``."""
    if ref == "#":
        return "$"
    parts = (unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/"))
    return "$" + "".join(f".{p}" for p in parts)


# -- the required names xgrammar drops -------------------------------------------


def may_be_object(node: dict) -> bool:
    """Whether xgrammar could build ``node`` as an object."""
    if "const" in node or "enum" in node:
        return False
    types = node.get("type", "object")
    if isinstance(types, str):
        return types == "object"
    # A malformed type is the compiler's to reject.
    return isinstance(types, list) and (not types or "object" in types)


def dropped_required(nodes: list[tuple[dict, str]], refs: dict[str, Any]) -> list[tuple[str, str]]:
    """``(path, message)`` for each of ``nodes`` (generated objects with a
    ``required`` list, in the converter's order) whose names xgrammar drops."""
    found: list[tuple[str, str]] = []
    enforced_by = _Enforced(refs)
    for node, path in nodes:
        names = [r for r in dict.fromkeys(node["required"]) if isinstance(r, str)]
        if not names or not may_be_object(node):
            continue
        enforced = enforced_by(node)
        if enforced is None:
            continue
        dropped = [n for n in names if n not in enforced]
        if not dropped:
            continue
        shown = ", ".join(repr(n) for n in dropped[:5])
        more = f" (+{len(dropped) - 5} more)" if len(dropped) > 5 else ""
        beside = next((k for k in ("$ref", "anyOf", "oneOf", "allOf") if k in node), None)
        why = (
            f"keywords beside {beside} are not merged into it"
            if beside
            else "it is not listed in this object's properties"
        )
        found.append((path, f"required {shown}{more} is not enforced ({why})"))
    return found


class _Enforced:
    """Names every object xgrammar generates for a node is sure to hold.

    ``None`` stands for every name: the node's value is fixed (``const``,
    ``enum``), cannot be an object, or is a compile error or an ``allOf``
    reported as not enforced already. Iterative and memoized per node, so a
    hostile chain of 10,000 ``$ref``s or a lattice of ``anyOf`` branches
    costs one visit per node; a ``$ref`` cycle enforces nothing.
    """

    def __init__(self, refs: dict[str, Any]) -> None:
        self.refs = refs
        self.memo: dict[int, set[str] | None] = {}

    def __call__(self, node: Any) -> set[str] | None:
        if not isinstance(node, dict):
            return set()  # ``true``: anything
        active: set[int] = set()
        stack = [node]
        while stack:
            cur = stack[-1]
            key = id(cur)
            if key in self.memo:
                stack.pop()
                continue
            todo = [d for d in self._deps(cur) if id(d) not in self.memo and id(d) not in active]
            if todo and key not in active:
                active.add(key)
                stack.extend(todo)
                continue
            # Dependencies still active are on a cycle: they enforce nothing.
            self.memo[key] = self._names(cur)
            active.discard(key)
            stack.pop()
        return self.memo[id(node)]

    def _target(self, node: dict) -> Any:
        ref = node["$ref"]
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            return self.refs.get(ref, MISSING)
        return True  # a remote ref is compiled as "anything"

    def _arms(self, node: dict) -> list[Any] | None:
        """The branches that decide, or None when the node decides nothing here."""
        for key in ("anyOf", "oneOf", "allOf"):
            if key in node:
                arms = node[key]
                bad = not isinstance(arms, list) or not arms or (key == "allOf" and len(arms) > 1)
                return None if bad else arms
        return []

    def _deps(self, node: dict) -> list[dict]:
        if "$ref" in node:
            found = [self._target(node)]
        elif not may_be_object(node):
            found = []
        else:
            found = self._arms(node) or []
        return [d for d in found if isinstance(d, dict)]

    def _get(self, node: Any) -> set[str] | None:
        if not isinstance(node, dict):
            return set()
        return self.memo.get(id(node), set())

    def _names(self, node: dict) -> set[str] | None:
        if "$ref" in node:
            return self._get(self._target(node))
        if not may_be_object(node):
            return None
        arms = self._arms(node)
        if arms is None:
            return None
        if arms:
            known = [f for f in map(self._get, arms) if f is not None]
            return set.intersection(*known) if known else None
        required, props = node.get("required"), node.get("properties")
        if not isinstance(required, list) or not isinstance(props, dict):
            return set()
        return {r for r in required if isinstance(r, str) and r in props}
