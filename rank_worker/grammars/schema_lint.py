"""The lint of one schema object: what xgrammar would not enforce, and the rewrites it would.

The walk (``schema_walk``) calls ``lint_node`` once for every schema object
of the canonical tree, the first time it meets it, before it reads the
object's keywords for its own reach. ``lint_node`` records findings and
rewrites the object in place into what xgrammar enforces exactly.

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
"""

from __future__ import annotations

from typing import Any

import jsonschema

from gramcoord.rank_worker.grammars.schema_tree import MISSING, SchemaTree
from gramcoord.rank_worker.grammars.schema_values import is_num

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
