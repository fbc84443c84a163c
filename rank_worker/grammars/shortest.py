"""The unreachable-end bound: the fewest tokens any output of a grammar needs.

The last pass of ``spec.admit``, run when the request brings a token
budget. A ``regex`` of ``a{100000}``, a ``minLength`` of 10^8 or a
``minItems`` of 10^6 can never reach the grammar's end within
``max_tokens: 256``: every token the model samples carries at most
``Tokenizer.max_token_bytes`` bytes, so an output of at least ``n`` bytes
needs at least ``ceil(n / max_token_bytes)`` tokens. A request whose bound
exceeds its ``max_tokens`` fails at admission with
``grammar_unreachable_end`` instead of burning every token to ``length``.

The bound is conservative: wherever it cannot tell (a ``$ref`` cycle, a
regex Python cannot parse, Lark, structural tags), it counts 0. It depends
only on the spec, so every rank gives the same verdict. A JSON schema is
bounded over its canonical tree (``schema_tree``), whose ``$ref``s are
already resolved.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gramcoord.rank_worker.grammars.schema_tree import MISSING, SchemaTree

try:  # the stdlib's own regex parser (private, stable since 3.11)
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover
    import sre_parse as _sre_parse  # type: ignore[no-redef]

# Walk at most this deep; past it a node counts 0.
_MAX_DEPTH = 256
_INF = 1 << 62


def regex_min_chars(pattern: str) -> int:
    """The fewest characters a match of ``pattern`` has (0 when Python cannot parse it)."""
    try:
        low = _sre_parse.parse(pattern).getwidth()[0]
    except (re.error, RecursionError, OverflowError, ValueError):
        return 0
    return int(min(low, _INF))


def unreachable_end(min_bytes: int, max_tokens: int, max_token_bytes: int) -> str | None:
    """Why no output of at least ``min_bytes`` bytes fits in ``max_tokens`` tokens, or ``None``.

    ``min_bytes`` is the grammar's ``min_output_bytes``; ``max_token_bytes``
    is the vocabulary's longest token.
    """
    need = min_tokens(min_bytes, max_token_bytes)
    if need <= max_tokens:
        return None
    return (
        f"the grammar's shortest output needs at least {need} tokens (of at most "
        f"{max_token_bytes} bytes each); max_tokens is {max_tokens}: raise "
        "max_tokens or loosen the length bounds"
    )


def min_output_bytes(kind: str, text: str, tree: SchemaTree | None = None) -> int:
    """A lower bound, in bytes, on every output of the grammar ``kind`` / ``text``."""
    if kind == "regex":
        return regex_min_chars(text)
    if kind == "choice":
        options = json.loads(text)
        return min((len(o.encode("utf-8")) for o in options), default=0)
    if kind == "json" and tree is not None:
        return _Walk(tree.refs).min_len(tree.root, 0)
    if kind == "json_object":
        return 2
    return 0


def min_tokens(min_bytes: int, max_token_bytes: int) -> int:
    """Tokens an output of ``min_bytes`` bytes needs at the least (the end's stop token excluded)."""
    if min_bytes <= 0:
        return 0
    return -(-min_bytes // max(1, max_token_bytes))


def _count(v: Any) -> int:
    """A count keyword's value as a whole number; 0 unless it is a positive JSON number."""
    if isinstance(v, int | float) and not isinstance(v, bool) and v > 0:
        return int(min(v, _INF))
    return 0


class _Walk:
    """Shortest JSON text of a schema, memoized per ``$ref`` target."""

    def __init__(self, refs: dict[str, Any]) -> None:
        self.refs = refs
        self._refs: dict[str, int] = {}

    def min_len(self, s: Any, depth: int) -> int:
        if depth > _MAX_DEPTH or not isinstance(s, dict):
            return 0
        ref = s.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            if ref not in self._refs:
                self._refs[ref] = 0  # a cycle counts 0 (conservative)
                target = self.refs.get(ref, MISSING)
                self._refs[ref] = 0 if target is MISSING else self.min_len(target, depth + 1)
            return self._refs[ref]
        if "const" in s:
            return len(json.dumps(s["const"], ensure_ascii=False).encode("utf-8"))
        if isinstance(s.get("enum"), list) and s["enum"]:
            return min(len(json.dumps(v, ensure_ascii=False).encode("utf-8")) for v in s["enum"])
        options = []
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and s[key]:
                options.append(min(self.min_len(b, depth + 1) for b in s[key]))
        if isinstance(s.get("allOf"), list) and s["allOf"]:
            options.append(max(self.min_len(b, depth + 1) for b in s["allOf"]))
        own = self._typed(s, depth)
        return max([own, *options])

    def _typed(self, s: dict, depth: int) -> int:
        types = s.get("type")
        names = types if isinstance(types, list) else [types] if isinstance(types, str) else []
        if not names:
            return 1  # a digit is the shortest JSON value
        return min(self._of_type(t, s, depth) for t in names)

    def _of_type(self, t: str, s: dict, depth: int) -> int:
        if t == "string":
            chars = _count(s.get("minLength"))
            if isinstance(s.get("pattern"), str):
                chars = max(chars, regex_min_chars(s["pattern"]))
            return 2 + min(chars, _INF)
        if t in ("integer", "number"):
            return 1
        if t in ("boolean", "null"):
            return 4
        if t == "array":
            count = _count(s.get("minItems"))
            if count == 0:
                return 2
            prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
            each = [self.min_len(p, depth + 1) for p in prefix[:count]]
            rest = count - len(each)
            item = self.min_len(s.get("items", {}), depth + 1) if rest > 0 else 0
            return min(2 + sum(each) + rest * item + (count - 1), _INF)
        if t == "object":
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            required = [r for r in s.get("required", ()) if isinstance(r, str)]
            count = _count(s.get("minProperties"))
            # Each property is at least `"":0` (4 bytes), commas between.
            least = 2 + 5 * count - 1 if count else 2
            if not required:
                return least
            total = 2 + (len(required) - 1)
            for name in required:
                key = len(json.dumps(name, ensure_ascii=False).encode("utf-8")) + 1
                total += key + self.min_len(props.get(name, {}), depth + 1)
            return min(max(total, least), _INF)
        return 0
