"""A schema-aware walk over a JSON Schema: canonical form and lint.

One walk does three jobs:

- **Canonical form.** Keyword order inside a schema object carries no
  meaning, so keywords are sorted. The order of a ``properties`` map *does*
  carry meaning (xgrammar emits properties in that order), so it is kept.
  Data values (``const``, ``enum``, ``default``, ``examples``) are kept as
  written. The result is what gets hashed *and* what gets compiled, so one
  key always means one grammar.
- **Ignored features.** xgrammar 0.2.9 compiles some keywords without
  enforcing them (it logs a C++ warning at most). Measured on this version:
  ``multipleOf`` on non-integers (and on integers when fractional, above
  1024, or next to a one-sided or more-than-10000-wide range),
  ``uniqueItems``, ``contains``, ``allOf`` with two or more branches,
  length bounds next to ``pattern``/``format``, any ``format`` outside
  ``SUPPORTED_FORMATS``, the calendar of ``date`` / ``date-time``,
  ``dependencies``, ``dependentRequired``, ``dependentSchemas``, ``not`` and
  ``if``/``then``/``else``. These are reported; the session then refuses
  the schema or checks the finished output (``grammar.reject_ignored_features``).
- **Rewrites.** A count keyword written as an integral float
  (``minLength: 2.0``) is written as the integer: xgrammar refuses the float
  but enforces the same bound as an integer.
- **Type names.** A ``type`` that names no JSON Schema type (``"objekt"``)
  is reported, so it fails with a clear message before xgrammar's own.
- **References.** A ``$ref`` that is not a local JSON pointer is compiled by
  xgrammar as "anything"; it is reported as ``unconstrained_ref``. A local
  pointer that does not resolve is an error.

Checks that follow the converter's own reach (``oneOf`` relaxed to
``anyOf``, dropped ``required`` names) live in ``schema_reach``.

The walk is iterative, so a hostile 100k-deep schema cannot blow the stack.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import jsonschema

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
_COUNT_KEYWORDS = frozenset(
    {
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "minContains",
        "maxContains",
    }
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
_INFERS = {"object": ("properties", "additionalProperties"), "array": ("items", "prefixItems")}
_SHAPE_KEYWORDS = ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")

# The values ``type`` may name (JSON Schema's instance types).
JSON_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")

# Keywords whose value is one schema, a list of schemas, or a map of them.
_ONE = frozenset(
    {
        "additionalProperties",
        "additionalItems",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
        "unevaluatedProperties",
        "unevaluatedItems",
        "items",
    }
)
_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class SchemaFindings:
    """What the walk found: ignored features, bad and remote refs, depth."""

    def __init__(self) -> None:
        # (json path, message) for features xgrammar would not enforce.
        self.ignored: list[tuple[str, str]] = []
        # (json path, ref) of refs xgrammar compiles as unconstrained.
        self.remote_refs: list[tuple[str, str]] = []
        # (json path, ref) of local pointers that do not resolve.
        self.broken_refs: list[tuple[str, str]] = []
        # (json path, value) of ``type`` values that name no JSON Schema type.
        self.bad_types: list[tuple[str, Any]] = []
        self.max_depth = 0
        self.max_values = 0


# What ``pointer_target`` returns for a pointer that names nothing.
MISSING = object()


def pointer_target(root: Any, ref: str) -> Any:
    """The node a local ``#``/``#/...`` pointer names, or ``MISSING``."""
    if ref == "#":
        return root
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node


def _resolve_pointer(root: Any, ref: str) -> bool:
    return pointer_target(root, ref) is not MISSING


def _lint_node(node: dict, path: str, findings: SchemaFindings, root: Any) -> None:
    types = node.get("type")
    # A type naming no JSON Schema type is reported; the checks below look
    # at the string names only.
    type_list = types if isinstance(types, list) else [types]
    type_set = {t for t in type_list if isinstance(t, str)}
    bad = [t for t in type_list if t not in JSON_TYPES] or ([] if type_list else [types])
    if "type" in node and bad:
        findings.bad_types.append((f"{path}.type", bad[0]))
    if "multipleOf" in node and type_set != {"integer"}:
        findings.ignored.append((path, "multipleOf is only enforced for type 'integer'"))
    elif "multipleOf" in node:
        reason = _integer_multiple_of_ignored(node)
        if reason:
            findings.ignored.append((path, reason))
    if node.get("uniqueItems") is True:
        findings.ignored.append((path, "uniqueItems is not enforced"))
    if "contains" in node:
        findings.ignored.append((path, "contains is not enforced correctly"))
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) >= 2:
        findings.ignored.append((path, f"allOf with {len(all_of)} branches is not enforced"))
    _lint_untyped(node, path, findings)
    for key in _UNENFORCED_KEYWORDS:
        if key in node:
            findings.ignored.append((path, f"{key} is not enforced"))
    if "if" in node and ("then" in node or "else" in node):
        findings.ignored.append((path, "if/then/else is not enforced"))
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
        findings.ignored.append((path, f"format {fmt!r} is not enforced"))
    elif isinstance(fmt, str) and fmt in _CALENDAR_FORMATS:
        findings.ignored.append((path, f"format {fmt!r} accepts impossible dates (2022-02-30)"))
    has_len = "minLength" in node or "maxLength" in node
    if has_len and ("pattern" in node or isinstance(fmt, str)):
        findings.ignored.append((path, "minLength/maxLength next to pattern/format is ignored"))
    for key in ("enum", "required"):
        if isinstance(node.get(key), list):
            findings.max_values = max(findings.max_values, len(node[key]))
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref == "#" or ref.startswith("#/"):
            if not _resolve_pointer(root, ref):
                findings.broken_refs.append((path, ref))
        else:
            findings.remote_refs.append((path, ref))
    if isinstance(node.get("$dynamicRef"), str):
        findings.remote_refs.append((path, node["$dynamicRef"]))


_SIBLINGS = frozenset({"type", *(k for keys in VALUE_KEYWORDS.values() for k in keys)})


def _rewrite_enum(node: dict, path: str, findings: SchemaFindings) -> dict:
    """Keep only the ``enum`` / ``const`` values that satisfy the keywords beside them.

    xgrammar emits exactly the listed values and ignores ``type``,
    ``minLength`` and the other value keywords beside them; JSON Schema
    requires both. Filtering the values with those keywords (``jsonschema``,
    formats checked) gives a schema xgrammar enforces exactly.
    """
    values = node.get("enum") if isinstance(node.get("enum"), list) else None
    if values is None and "const" not in node:
        return node
    siblings = {k: node[k] for k in node if k in _SIBLINGS}
    if not siblings:
        return node
    try:
        cls = jsonschema.validators.validator_for({})
        check = cls(siblings, format_checker=cls.FORMAT_CHECKER)
        if values is None:
            keep = [node["const"]] if check.is_valid(node["const"]) else []
        else:
            keep = [v for v in values if check.is_valid(v)]
    except (jsonschema.SchemaError, TypeError, ValueError, RecursionError):
        return node  # keywords jsonschema cannot use: xgrammar's own verdict stands
    if not keep:
        # Nothing here can match, yet the schema may still be satisfiable
        # (an optional property): xgrammar's grammar stays, and the end
        # check catches an output that uses the node.
        what = "const" if values is None else "enum values"
        findings.ignored.append((path, f"{sorted(siblings)} beside {what} is not enforced"))
        return node
    if values is None or len(keep) == len(values):
        return node
    return {**node, "enum": keep}


def _lint_untyped(node: dict, path: str, findings: SchemaFindings) -> None:
    """Value keywords xgrammar drops: on an untyped node, or beside a shape keyword."""
    if "type" in node and not any(k in node for k in ("$ref", "anyOf", "oneOf", "allOf")):
        return
    shape = next((k for k in _SHAPE_KEYWORDS if k in node), None)
    if shape in ("enum", "const") and "type" not in node:
        return  # the values are the constraint; rewrite_enum keeps those that satisfy the rest
    for kind, keys in VALUE_KEYWORDS.items():
        if shape is None and any(k in node for k in _INFERS.get(kind, ())):
            continue  # the type is inferred and its keywords enforced
        for key in keys:
            if key in node:
                where = f"beside {shape}" if shape else "on a node without type"
                findings.ignored.append((path, f"{key} {where} is not enforced"))


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


def _data_depth(value: Any) -> int:
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            depth = max(depth, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return depth


def walk_schema(schema: Any, *, max_depth: int) -> tuple[Any, SchemaFindings]:
    """Canonicalize and lint ``schema`` in one iterative pass.

    Returns the canonical copy and the findings. Walking stops descending
    past ``max_depth`` (the caller rejects such a schema), so a hostile
    depth costs O(max_depth) work per branch, not a crash.
    """
    findings = SchemaFindings()
    out_root: list[Any] = [None]
    # Stack items: (value, is_schema, depth, path, setter)
    stack: list[tuple[Any, bool, int, str, Any]] = [
        (schema, True, 1, "$", lambda v: out_root.__setitem__(0, v))
    ]
    while stack:
        value, is_schema, depth, path, put = stack.pop()
        findings.max_depth = max(findings.max_depth, depth if isinstance(value, dict | list) else 0)
        if depth > max_depth:
            put(value)
            continue
        if not is_schema:
            put(value)
            d = _data_depth(value)
            findings.max_depth = max(findings.max_depth, depth - 1 + d)
            if isinstance(value, list):
                findings.max_values = max(findings.max_values, len(value))
            continue
        if not isinstance(value, dict):
            put(value)
            continue
        _lint_node(value, path, findings, schema)
        value = _rewrite_enum(value, path, findings)
        # Keys are seeded in order first: children are filled later, in
        # stack (reverse) order.
        new: dict[str, Any] = dict.fromkeys(sorted(value))
        put(new)
        for key in sorted(value):
            child = value[key]
            cpath = f"{path}.{key}"
            if key in _MAP and isinstance(child, dict):
                # Keep the map's own order: it is the property order.
                sub: dict[str, Any] = dict.fromkeys(child)
                new[key] = sub
                for name, s in child.items():
                    stack.append((s, True, depth + 2, f"{cpath}.{name}", _setter(sub, name)))
            elif key in _LIST and isinstance(child, list):
                items: list[Any] = [None] * len(child)
                new[key] = items
                for i, s in enumerate(child):
                    stack.append((s, True, depth + 2, f"{cpath}[{i}]", _setter(items, i)))
            elif key in _ONE and isinstance(child, dict):
                stack.append((child, True, depth + 1, cpath, _setter(new, key)))
            elif key == "dependencies" and isinstance(child, dict):
                sub = dict.fromkeys(child)
                new[key] = sub
                for name, s in child.items():
                    stack.append((s, isinstance(s, dict), depth + 2, cpath, _setter(sub, name)))
            else:
                if key in _COUNT_KEYWORDS and isinstance(child, float) and child.is_integer():
                    child = int(child)  # the same constraint, written as xgrammar takes it
                stack.append((child, False, depth + 1, cpath, _setter(new, key)))
    return out_root[0], findings


def _setter(container: Any, key: Any):
    def put(v: Any) -> None:
        container[key] = v

    return put


def is_num(v: Any) -> bool:
    """A JSON number (``bool`` is not one)."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def is_int64(v: Any) -> bool:
    # The C++ JSON reader keeps integer literals within int64 as integers;
    # everything else numeric is a double.
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
