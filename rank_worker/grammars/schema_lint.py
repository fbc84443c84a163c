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
  length bounds next to ``pattern``/``format``, and any ``format`` outside
  ``SUPPORTED_FORMATS``. These are reported.
- **References.** A ``$ref`` that is not a local JSON pointer is compiled by
  xgrammar as "anything"; it is reported as ``unconstrained_ref``. A local
  pointer that does not resolve is an error.

The walk is iterative, so a hostile 100k-deep schema cannot blow the stack.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

# Formats xgrammar 0.2.9 enforces (each rejects "% %" where a plain string
# accepts it; tests/rank_worker/test_schema_lint.py re-checks this list).
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
        self.max_depth = 0
        self.max_values = 0


_MISSING = object()


def _pointer_target(root: Any, ref: str) -> Any:
    """The node a local ``#``/``#/...`` pointer names, or ``_MISSING``."""
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
            return _MISSING
    return node


def _resolve_pointer(root: Any, ref: str) -> bool:
    return _pointer_target(root, ref) is not _MISSING


def _lint_node(node: dict, path: str, findings: SchemaFindings, root: Any) -> None:
    types = node.get("type")
    # Only string type names count; anything else is malformed and left to
    # the compiler to reject.
    type_set = {t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)}
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
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
        findings.ignored.append((path, f"format {fmt!r} is not enforced"))
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


# xgrammar 0.2.9 enforces an integer multipleOf only up to this value, and
# next to a range only when both ends are set and it spans at most this many
# integers; otherwise it warns and drops the multipleOf.
_MAX_INTEGER_MULTIPLE_OF = 1024
_MAX_MULTIPLE_OF_RANGE = 10_000


def _integer_multiple_of_ignored(node: dict) -> str | None:
    step = node["multipleOf"]
    if not _is_num(step) or step <= 0:
        return None  # a compile error, not an ignored keyword
    if step == 1:
        return None  # dropping it changes nothing
    if step != int(step) or step > _MAX_INTEGER_MULTIPLE_OF:
        return f"multipleOf is only enforced for whole numbers up to {_MAX_INTEGER_MULTIPLE_OF}"
    lo = hi = None
    bounds = [node.get(k) for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")]
    if any(b is not None and (not _is_num(b) or b != int(b)) for b in bounds):
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
                stack.append((child, False, depth + 1, cpath, _setter(new, key)))
    return out_root[0], findings


def _setter(container: Any, key: Any):
    def put(v: Any) -> None:
        container[key] = v

    return put


# -- oneOf relaxed to anyOf ---------------------------------------------
#
# xgrammar 0.2.9 enforces ``oneOf`` exactly only when it can prove the
# branches pairwise disjoint; otherwise it logs a C++ warning ("oneOf with
# overlapping or non-provably-disjoint branches ...") and compiles the node
# as ``anyOf``. ``inexact_one_ofs`` predicts that warning in Python, so the
# request carries it (``oneof_as_anyof``) identically on every rank.
# Measured on 0.2.9 (tests/rank_worker/test_native_output.py re-checks it
# against the library):
#
# - A branch set is proven disjoint when (a) every branch is a plain type
#   test (``type`` plus annotation keywords, no ``object`` type) or a finite
#   value set (``const``/``enum``), and no two branches can share a value;
#   or (b) every branch is ``"type": "object"`` and requires one property,
#   chosen among the first branch's required properties, whose value is a
#   ``const``/``enum``, with no value shared between branches.
# - Numbers: two integer literals overlap only when equal; any other pair of
#   numbers is assumed to overlap (``1`` and ``1.0``, ``1.5`` and ``2.5``).
# - Only nodes the converter parses count: ``oneOf`` is the node's keyword
#   when it has no ``$ref``, ``const``, ``enum`` or ``anyOf``; unused
#   ``$defs``, ``not``/``if``/``then``/``else``, ``contains``,
#   ``dependentSchemas`` and ``additionalItems`` are never parsed.

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


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_int64(v: Any) -> bool:
    # The C++ JSON reader keeps integer literals within int64 as integers;
    # everything else numeric is a double.
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _has_inexact_number(v: Any) -> bool:
    stack = [v]
    while stack:
        x = stack.pop()
        if _is_num(x) and not _is_int64(x):
            return True
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


def _may_overlap(a: Any, b: Any) -> bool:
    """Could values ``a`` and ``b`` be the same JSON value? (xgrammar's test)"""
    if _is_num(a) or _is_num(b):
        if not (_is_num(a) and _is_num(b)):
            return False
        return a == b if _is_int64(a) and _is_int64(b) else True
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
    if _is_num(value):
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


# (node, path, forced type, generated); see inexact_one_ofs.
_Visit = tuple[Any, str, "str | None", bool]


def inexact_one_ofs(schema: Any, *, strict_mode: bool = True) -> list[str]:
    """JSON paths of the ``oneOf`` nodes xgrammar 0.2.9 relaxes to ``anyOf``.

    Follows the converter's own reach. It first *parses* the schema tree
    (that is where it warns), then *generates* the grammar, resolving each
    ``$ref`` only when generating it: a ``$ref`` inside an ``allOf`` of two
    or more branches (generated as "anything") or inside an object with
    ``maxProperties: 0`` (generated as ``{}``) is never resolved. Paths use
    the notation of the other findings (``$.properties.a.oneOf``), in a
    deterministic order; a node reached twice is reported once. Iterative,
    and each node is visited at most once per mode, so ``$ref`` cycles end.
    """
    found: list[str] = []
    reported: set[int] = set()
    visited: set[tuple[int, str | None, bool]] = set()
    # (node, path, forced type, generated): the forced type comes from a
    # type list or propertyNames' implied "string" ("" forces the untyped
    # reading of an empty type list); generated is False below a node whose
    # children are parsed but never generated.
    stack: list[_Visit] = [(schema, "$", None, True)]
    while stack:
        node, path, forced, gen = stack.pop()
        if not isinstance(node, dict) or (id(node), forced, gen) in visited:
            continue
        visited.add((id(node), forced, gen))
        children: list[_Visit] = []
        if "$ref" in node:
            ref = node["$ref"]
            if gen and isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                target = _pointer_target(schema, ref)
                if target is not _MISSING:
                    children.append((target, _pointer_path(ref), None, True))
        elif "const" in node or "enum" in node:
            pass
        elif "anyOf" in node or "oneOf" in node or "allOf" in node:
            key = next(k for k in ("anyOf", "oneOf", "allOf") if k in node)
            arms = node[key]
            if isinstance(arms, list):
                arm_gen = gen and (key != "allOf" or len(arms) == 1)
                children.extend(
                    (a, f"{path}.{key}[{i}]", None, arm_gen) for i, a in enumerate(arms)
                )
            if key == "oneOf" and not one_of_is_exact(arms) and id(node) not in reported:
                reported.add(id(node))
                found.append(f"{path}.oneOf")
        else:
            children.extend(_typed_children(node, path, forced, gen, strict_mode))
        stack.extend(reversed(children))
    return found


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
    some = not (_is_int64(max_props) and max_props == 0)
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
