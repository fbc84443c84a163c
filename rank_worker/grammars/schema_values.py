"""JSON values as xgrammar 0.2.9 compares them, and which ``oneOf`` nodes it enforces exactly.

Helpers below the walk: ``schema_walk`` asks ``one_of_is_exact`` of every
``oneOf`` the converter parses, and ``schema_lint`` uses ``is_num``. Nothing
here calls another module of the project.

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
