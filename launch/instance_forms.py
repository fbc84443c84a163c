"""How ``gramcoord check --instances`` writes an instance, and the variants it probes with.

- ``serializations``: the texts our grammar could have written for a value
  (properties in the schema's order first, then the instance's own order);
- ``unescaped``: the value with every character JSON must escape replaced
  (probes xgrammar's bounded strings, which take no escape sequence);
- ``searching``: the schema with every unanchored ``pattern`` /
  ``patternProperties`` regex written as a search (probes xgrammar's
  whole-string matching).
"""

from __future__ import annotations

import json
import re
from typing import Any


def serializations(schema: Any, data: Any) -> list[str]:
    """The texts our grammar could have written for ``data``, most likely first."""
    ordered = json.dumps(_in_schema_order(schema, data, schema, 0), ensure_ascii=False)
    plain = json.dumps(data, ensure_ascii=False)
    return [ordered] if ordered == plain else [ordered, plain]


def _resolve(schema: Any, root: Any, depth: int) -> Any:
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 32:
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return schema
        node: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return schema
        schema, seen = node, seen + 1
    return schema


def _branches(schema: dict) -> list[dict]:
    out = [schema]
    for key in ("allOf", "anyOf", "oneOf"):
        for b in schema.get(key) or ():
            if isinstance(b, dict):
                out.append(b)
    return out


def _in_schema_order(schema: Any, data: Any, root: Any, depth: int) -> Any:
    """``data`` with every object's keys in its schema's ``properties`` order."""
    schema = _resolve(schema, root, depth)
    if depth > 64 or not isinstance(schema, dict):
        return data
    branches = [_resolve(b, root, depth) for b in _branches(schema)]
    branches = [b for b in branches if isinstance(b, dict)]
    if isinstance(data, dict):
        order: list[str] = []
        sub: dict[str, Any] = {}
        for b in branches:
            props = b.get("properties")
            if isinstance(props, dict):
                for k, s in props.items():
                    if k not in sub:
                        order.append(k)
                        sub[k] = s
        extra = next(
            (
                b["additionalProperties"]
                for b in branches
                if isinstance(b.get("additionalProperties"), dict)
            ),
            {},
        )
        keys = [k for k in order if k in data] + [k for k in data if k not in sub]
        return {k: _in_schema_order(sub.get(k, extra), data[k], root, depth + 1) for k in keys}
    if isinstance(data, list):
        items = next((b["items"] for b in branches if isinstance(b.get("items"), dict)), {})
        prefix = next(
            (b["prefixItems"] for b in branches if isinstance(b.get("prefixItems"), list)), []
        )
        return [
            _in_schema_order(prefix[i] if i < len(prefix) else items, v, root, depth + 1)
            for i, v in enumerate(data)
        ]
    return data


_ESCAPED = re.compile(r'["\\\x00-\x1f]')


def searching(schema: Any) -> Any:
    """``schema`` with every ``pattern`` / ``patternProperties`` regex written as a search."""

    def wrap(p: str) -> str:
        anchored = p.startswith("^") and p.endswith("$") and not p.endswith("\\$")
        return p if anchored or p.startswith(".*(?:") else f".*(?:{p}).*"

    if isinstance(schema, list):
        return [searching(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "pattern" and isinstance(v, str):
            out[k] = wrap(v)
        elif k == "patternProperties" and isinstance(v, dict):
            out[k] = {wrap(p): searching(s) for p, s in v.items()}
        else:
            out[k] = searching(v)
    return out


def unescaped(data: Any) -> Any:
    """``data`` with every character JSON must escape replaced by ``_`` (same lengths)."""
    if isinstance(data, str):
        return _ESCAPED.sub("_", data)
    if isinstance(data, list):
        return [unescaped(v) for v in data]
    if isinstance(data, dict):
        return {k: unescaped(v) for k, v in data.items()}
    return data
