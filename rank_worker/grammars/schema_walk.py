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

- every schema object is linted and rewritten in place (``schema_lint``)
  the first time the walk meets it, before the walk reads it;
- ``oneOf`` nodes the converter parses are collected: it relaxes them to
  ``anyOf`` (with a warning) unless ``schema_values.one_of_is_exact``; a
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
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from gramcoord.rank_worker.grammars.schema_lint import SchemaFindings, lint_node
from gramcoord.rank_worker.grammars.schema_tree import MISSING, SchemaTree
from gramcoord.rank_worker.grammars.schema_values import is_int64, one_of_is_exact

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
