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
  ``multipleOf`` on non-integers, ``uniqueItems``, ``contains``, ``allOf``
  with two or more branches, length bounds next to ``pattern``/``format``,
  and any ``format`` outside ``SUPPORTED_FORMATS``. These are reported.
- **References.** A ``$ref`` that is not a local JSON pointer is compiled by
  xgrammar as "anything"; it is reported as ``unconstrained_ref``. A local
  pointer that does not resolve is an error.

The walk is iterative, so a hostile 100k-deep schema cannot blow the stack.
"""

from __future__ import annotations

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


def _resolve_pointer(root: Any, ref: str) -> bool:
    if ref == "#":
        return True
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def _lint_node(node: dict, path: str, findings: SchemaFindings, root: Any) -> None:
    types = node.get("type")
    # Only string type names count; anything else is malformed and left to
    # the compiler to reject.
    type_set = {t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)}
    if "multipleOf" in node and type_set != {"integer"}:
        findings.ignored.append((path, "multipleOf is only enforced for type 'integer'"))
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
