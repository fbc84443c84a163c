"""vLLM's per-request path for a structured-output spec, rebuilt for the
``poisoned_repeat`` rows of ``gramcoord bench compile``.

Read from ``vllm/v1/structured_output/backend_xgrammar.py`` and
``utils.py`` (vLLM main) and re-implemented here: the frontend validates
every request (``validate_xgrammar_grammar``) and rejects a bad spec there;
a spec that passes is compiled on the engine's ``GrammarCompiler``, which
vLLM builds with ``max_threads=8``, its cache on and
``VLLM_XGRAMMAR_CACHE_MB`` (512) as the cache limit. vLLM keeps no record
of a failed spec: the next request with it is validated from scratch.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

# vLLM's XgrammarBackend compiler.
VLLM_COMPILER = dict(max_threads=8, cache_enabled=True, cache_limit_bytes=512 << 20)

# String formats xgrammar's JSON-schema converter implements; vLLM rejects
# any other ``format`` on a string up front.
_XGR_FORMATS = frozenset(
    [
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
    ]
)
_ARRAY_UNSUPPORTED = frozenset({"uniqueItems", "contains", "minContains", "maxContains"})


def _types(node: dict) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _length_and_pattern(node: Any) -> bool:
    return (
        isinstance(node, dict)
        and ("pattern" in node or "format" in node)
        and ("minLength" in node or "maxLength" in node)
    )


def xgrammar_unsupported(schema: Any) -> bool:
    """vLLM's pre-check for schema features xgrammar cannot honour
    (``has_xgrammar_unsupported_json_features``), re-implemented: every
    object of the tree is visited, lists descended one level as vLLM does."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        types = _types(node)
        if types & {"integer", "number"} and "multipleOf" in node:
            return True
        if "array" in types and node.keys() & _ARRAY_UNSUPPORTED:
            return True
        if "string" in types and "format" in node and node["format"] not in _XGR_FORMATS:
            return True
        if "string" in types and _length_and_pattern(node):
            return True
        if "object" in types:
            names = node.get("propertyNames")
            if _length_and_pattern(names):
                return True
            if "propertyNames" in node and (
                "properties" in node
                or "patternProperties" in node
                or isinstance(node.get("additionalProperties"), dict)
                or node.get("unevaluatedProperties", True) is not True
            ):
                return True
            pattern_props = node.get("patternProperties")
            if isinstance(pattern_props, dict) and ("properties" in node or len(pattern_props) > 1):
                return True
        for value in node.values():
            if isinstance(value, dict):
                stack.append(value)
            elif isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, dict))
    return False


def likely_lark(text: str) -> bool:
    # vLLM's grammar_is_likely_lark: EBNF once any line, comments cut, has "::=".
    for line in text.split("\n"):
        line = line.split("#", 1)[0].split("//", 1)[0]
        if "::=" in line:
            return False
    return True


class VllmRefail:
    """vLLM's per-request path for a structured-output spec, rebuilt from
    ``vllm/v1/structured_output/backend_xgrammar.py`` (vLLM main): the
    frontend validates every request and rejects it there (a JSON schema:
    the unsupported-feature walk, then ``Grammar.from_json_schema``; a
    grammar: ``Grammar.from_ebnf`` or ``from_lark``). Only a spec that
    passes reaches the engine's compiler (cache on, ``VLLM_COMPILER``).
    Nothing remembers a failure, so a repeat fails the same way again."""

    def __init__(self, tokenizer) -> None:
        self.compiler = xgr.GrammarCompiler(tokenizer.info, **VLLM_COMPILER)

    def __call__(self, spec: dict) -> str:
        """Where ``spec`` fails: ``"validation"`` or ``"compile"``; ``""``
        when vLLM would accept it."""
        try:
            if "json" in spec:
                schema = spec["json"]
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if xgrammar_unsupported(schema):
                    return "validation"
                xgr.Grammar.from_json_schema(schema)
            elif likely_lark(spec["grammar"]):
                xgr.Grammar.from_lark(spec["grammar"])
            else:
                xgr.Grammar.from_ebnf(spec["grammar"])
        except Exception:
            return "validation"
        try:
            if "json" in spec:
                text = spec["json"] if isinstance(spec["json"], str) else json.dumps(spec["json"])
                self.compiler.compile_json_schema(text)
            else:
                self.compiler.compile_grammar(spec["grammar"])
        except Exception:
            return "compile"
        return ""
