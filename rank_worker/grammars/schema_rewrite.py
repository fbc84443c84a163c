"""Rewrites of a JSON Schema into an equivalent one that xgrammar enforces exactly.

xgrammar 0.2.9 builds each schema object from one keyword (``$ref``, else
``const`` / ``enum``, else the first of ``anyOf`` / ``oneOf`` / ``allOf``)
and drops every constraint beside it; on an object without ``type`` it
drops the keywords of a type it does not infer. Real schemas write such
shapes all the time, and several have an exact equivalent that xgrammar
enforces whole (``schema.schema_text`` runs this pass after the canonical
copy, then takes the canonical copy of the result):

- **siblings into branches**: ``{S, "anyOf": [B1, B2]}`` is
  ``{"anyOf": [S and B1, S and B2]}``; the same for ``oneOf`` (exactly one
  ``S and Bi`` holds iff ``S`` holds and exactly one ``Bi`` does), and
  ``allOf`` is the conjunction of its branches and ``S``. vLLM's own
  ``tool_choice="required"`` schema is this shape
  (``{"type": "object", "anyOf": [one branch per tool]}``);
- **$ref with siblings**: from draft 2019-09 on, ``{"$ref": R, S}`` is
  ``R and S``: the local target is inlined and conjoined with ``S``. Under
  draft 4 to 7 (``$schema``) a ``$ref``'s siblings mean nothing, and are
  dropped;
- **untyped keywords**: ``minLength`` on an object without ``type``
  constrains strings only; the object becomes ``anyOf`` over the JSON
  types, each branch with its own type's keywords;
- **annotation formats**: a ``format`` xgrammar does not know
  (``utc-millisec``) is an annotation in JSON Schema unless a
  format-assertion vocabulary is asked for: it is dropped, and the end
  check does not assert it either (``end_check``);
- **required names outside properties**: xgrammar enforces only the
  ``required`` names its object lists in ``properties``; a name it does not
  list is described by ``additionalProperties`` (absent: any value), so it
  is listed with that schema;
- **dependentRequired** (and ``dependencies`` with name lists) on an object
  whose property set is finite (``strict_mode``, or
  ``additionalProperties: false``): ``anyOf`` over which trigger names are
  present, at most ``_MAX_TRIGGERS`` of them.

"S and B" is written as one object only where that is exact
(``conjoin``): keywords on one side only, or on both with a meet that is
one keyword (``type`` intersected, ``required`` united, bounds tightened,
``properties`` conjoined name by name, ``enum`` intersected); never where a
keyword reads its siblings (``additionalProperties`` beside another
side's ``properties``, ``items`` beside ``prefixItems``, ``contains``
beside ``minContains``, ``if`` beside ``then``). A branch whose meet is
empty (``type`` string and integer) is dropped: it matched nothing. Where
no exact rewrite exists the object is left as written, and the lint
(``schema_walk.lint_node``) reports what xgrammar would not enforce.

An object a local ``$ref`` points *into* (``#/properties/a/anyOf/0``) is
not restructured, so every pointer keeps its target; ``$defs`` are kept in
place. A rewrite that would grow the schema past ``_GROWTH`` times its
size is not made at all.
"""

from __future__ import annotations

import itertools
from typing import Any
from urllib.parse import unquote

from gramcoord.rank_worker.grammars.schema_tree import MISSING, ONE_SCHEMA, SchemaTree
from gramcoord.rank_worker.grammars.schema_walk import (
    CONSTRAINTS,
    SUPPORTED_FORMATS,
    VALUE_KEYWORDS,
)

# Keyword groups whose members read each other: a group may come from one
# side of a conjunction only (or be equal on both).
_GROUPS = (
    frozenset({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"}),
    frozenset({"prefixItems", "items", "additionalItems", "unevaluatedItems"}),
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"if", "then", "else"}),
)
_OPEN_GROUP_MEMBERS = frozenset({"properties", "required"})
_LOWER = frozenset(
    {"minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum", "minContains"}
)
_UPPER = frozenset(
    {"maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum", "maxContains"}
)
# The keywords of each type, for untyped objects (``VALUE_KEYWORDS`` plus
# those that make xgrammar infer the type). ``contains`` and its bounds are
# not among them: xgrammar does not enforce them on any node, and reads
# ``minContains`` without ``contains`` as a bound on the items.
_TYPE_KEYWORDS = {
    "string": frozenset(VALUE_KEYWORDS["string"]),
    "number": frozenset(VALUE_KEYWORDS["number"]),
    "array": frozenset(
        {
            *VALUE_KEYWORDS["array"],
            "items",
            "prefixItems",
            "additionalItems",
            "unevaluatedItems",
        }
    ),
    "object": frozenset(
        {
            *VALUE_KEYWORDS["object"],
            "properties",
            "additionalProperties",
            "unevaluatedProperties",
            "required",
            "dependentRequired",
            "dependentSchemas",
            "dependencies",
        }
    ),
}
_ALL_TYPES = ("array", "boolean", "null", "number", "object", "string")
# Drafts whose $ref ignores its siblings.
_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")
_MAX_TRIGGERS = 4
_GROWTH = 8
_MAX_INLINES = 8

_EMPTY = object()  # a conjunction that nothing satisfies


class Rewritten:
    """A rewritten schema and what was rewritten, as (json path, what)."""

    def __init__(self, root: Any, notes: list[tuple[str, str]]) -> None:
        self.root = root
        self.notes = notes


def rewrite(tree: SchemaTree, *, strict_mode: bool, max_depth: int) -> Rewritten | None:
    """The rewritten copy of ``tree``'s canonical schema, or None when nothing changes."""
    root = tree.root
    if not isinstance(root, dict):
        return None
    if _reads_annotations(root):
        return None
    schema_uri = root.get("$schema")
    old_draft = isinstance(schema_uri, str) and any(d in schema_uri for d in _OLD_DRAFTS)
    r = _Rewriter(tree, strict_mode, old_draft, max_depth)
    out = r.node(root, "$", 1, key_schema=False)
    if not r.notes or r.over_budget:
        return None
    return Rewritten(out, r.notes)


class _Rewriter:
    def __init__(self, tree: SchemaTree, strict_mode: bool, old_draft: bool, max_depth: int):
        self.refs = tree.refs
        self.strict_mode = strict_mode
        self.old_draft = old_draft
        self.max_depth = max_depth
        self.notes: list[tuple[str, str]] = []
        self.pinned = _pinned(tree.root, tree.refs)
        self.budget = _GROWTH * max(_weight(tree.root, 1 << 30), 16)
        self.over_budget = False

    def spend(self, n: int) -> bool:
        self.budget -= n
        if self.budget < 0:
            self.over_budget = True
        return not self.over_budget

    def spend_copies(self, value: Any, copies: int) -> bool:
        """Spend what ``copies`` more copies of ``value`` add to the schema."""
        return self.spend(copies * _weight(value, self.budget // max(copies, 1) + 1))

    # -- the walk ---------------------------------------------------------

    def node(self, value: Any, path: str, depth: int, *, key_schema: bool) -> Any:
        if not isinstance(value, dict) or depth > self.max_depth or self.over_budget:
            return value
        node = value
        if id(value) not in self.pinned:  # its own $id stays on the outer object
            node = self.restructure(value, path, key_schema)
        return self.children(node, path, depth)

    def restructure(self, node: dict, path: str, key_schema: bool) -> dict:
        """Apply the rewrites at one object until none applies."""
        for _ in range(_MAX_INLINES):
            new = (
                self.annotation_format(node, path)
                or self.ref_siblings(node, path)
                or self.combinator_siblings(node, path)
                or (None if key_schema else self.untyped(node, path))
                or self.dependent_required(node, path)
                or self.open_required(node, path)
            )
            if new is None:
                return node
            node = new
        return node

    def children(self, node: dict, path: str, depth: int) -> dict:
        out = dict(node)
        for key, child in node.items():
            p = f"{path}.{key}"
            if key in _MAPS and isinstance(child, dict):
                out[key] = {
                    n: self.node(s, f"{p}.{n}", depth + 2, key_schema=False)
                    for n, s in child.items()
                }
            elif key in ("anyOf", "oneOf", "allOf", "prefixItems") or (
                key == "items" and isinstance(child, list)
            ):
                if isinstance(child, list):
                    out[key] = [
                        self.node(s, f"{p}[{i}]", depth + 2, key_schema=False)
                        for i, s in enumerate(child)
                    ]
            elif key in ONE_SCHEMA and isinstance(child, dict):
                out[key] = self.node(child, p, depth + 1, key_schema=key == "propertyNames")
        return out

    def bare_target(self, arm: dict) -> dict:
        """``arm``'s constraints, with a bare local ``$ref`` (nothing beside it
        but annotations) replaced by its target's: the same schema, written
        where a conjunction can merge it."""
        arm = {k: v for k, v in arm.items() if k in CONSTRAINTS}
        for _ in range(_MAX_INLINES):
            ref = arm.get("$ref")
            if len(arm) != 1 or not isinstance(ref, str) or not ref.startswith("#/"):
                return arm
            target = self.refs.get(ref, MISSING)
            if target is True:
                return {}
            if not isinstance(target, dict) or _has_own_base(target):
                return arm
            if not self.spend_copies(target, 1):
                return arm
            arm = {k: v for k, v in target.items() if k in CONSTRAINTS}
        return arm

    # -- the rewrites -------------------------------------------------------

    def annotation_format(self, node: dict, path: str) -> dict | None:
        fmt = node.get("format")
        if not isinstance(fmt, str) or fmt in SUPPORTED_FORMATS:
            return None
        self.notes.append((path, f"format {fmt!r} is an annotation: not asserted"))
        return {k: v for k, v in node.items() if k != "format"}

    def ref_siblings(self, node: dict, path: str) -> dict | None:
        ref = node.get("$ref")
        siblings = _constraints(node, "$ref")
        if not isinstance(ref, str) or not siblings:
            return None
        if self.old_draft:
            self.notes.append((path, "keywords beside $ref mean nothing before draft 2019-09"))
            return {k: v for k, v in node.items() if k not in siblings}
        if not (ref == "#" or ref.startswith("#/")):
            return None
        target = self.refs.get(ref, MISSING)
        if target is True:
            target = {}
        if not isinstance(target, dict) or _has_own_base(target):
            return None
        target = {k: v for k, v in target.items() if k in CONSTRAINTS}
        merged = conjoin(target, siblings, old_draft=self.old_draft)
        if merged is None or merged is _EMPTY or not self.spend_copies(target, 1):
            return None
        self.notes.append((path, f"$ref {ref} conjoined with the keywords beside it"))
        return {**_annotations(node), **merged}

    def combinator_siblings(self, node: dict, path: str) -> dict | None:
        if any(k in node for k in ("$ref", "const", "enum")):
            return None
        present = [k for k in ("anyOf", "oneOf", "allOf") if k in node]
        if len(present) != 1 or not isinstance(node[present[0]], list) or not node[present[0]]:
            return None
        key = present[0]
        siblings = _constraints(node, key)
        arms = node[key]
        if key == "allOf":
            if len(arms) < 2 and not siblings:
                return None
            merged: Any = siblings
            for arm in arms:
                if arm is True:
                    continue
                if not isinstance(arm, dict) or _has_own_base(arm):
                    return None
                merged = conjoin(merged, self.bare_target(arm), old_draft=self.old_draft)
                if merged is None or merged is _EMPTY:
                    return None  # an empty meet: the lint and compiler speak
            if not self.spend(len(merged)):
                return None
            self.notes.append((path, f"allOf of {len(arms)} conjoined into one object"))
            return {**_annotations(node), **merged}
        if not siblings:
            return None
        out = []
        for arm in arms:
            if arm is False:
                continue
            if arm is True:
                arm = {}
            if not isinstance(arm, dict) or _has_own_base(arm):
                return None
            if "$ref" in arm:
                arm = {**_annotations(arm), **self.bare_target(arm)}
            merged = conjoin(siblings, arm, old_draft=self.old_draft)
            if merged is None:
                return None
            if merged is not _EMPTY:
                out.append(merged)
        if not out or not self.spend_copies(siblings, len(arms) - 1):
            return None
        what = ", ".join(sorted(siblings))
        self.notes.append((path, f"{what} beside {key} moved into each of its branches"))
        return {**_annotations(node), key: out}

    def untyped(self, node: dict, path: str) -> dict | None:
        if "type" in node or any(k in node for k in ("$ref", "const", "enum", "anyOf", "oneOf")):
            return None
        if "allOf" in node:
            return None
        constraints = _constraints(node, None)
        by_type = {
            t: {k: constraints[k] for k in keys if k in constraints}
            for t, keys in _TYPE_KEYWORDS.items()
        }
        typed = set().union(*(set(v) for v in by_type.values()))
        if set(constraints) - typed or _false_inside(constraints):
            return None  # not, if/then/else, ...: left to the lint
        if any(_past_int64(v) for v in by_type["number"].values()):
            return None  # xgrammar's numeric bounds stop at int64: leave it to the lint
        inferred = [t for t in ("object", "array") if _infers(t, constraints)]
        dropped = [
            t for t in ("string", "number", "array", "object") if by_type[t] and t not in inferred
        ]
        if not dropped:
            return None  # xgrammar infers the only type with keywords
        arms = []
        for t in _ALL_TYPES:
            kws = by_type.get(t) or {}
            if not kws:
                arms.append({"type": t})
                continue
            arm = {"type": t, **kws}
            if t == "array" and not any(k in kws for k in ("items", "prefixItems")):
                arm["items"] = {}  # open, as JSON Schema reads it (strict closes typed arrays)
            if t == "object" and not any(
                k in kws for k in ("properties", "additionalProperties", "unevaluatedProperties")
            ):
                arm["additionalProperties"] = {}
            arms.append(arm)
        if not self.spend(len(arms) + len(constraints)):
            return None
        self.notes.append(
            (path, f"keywords of {', '.join(dropped)} on an object without type kept to that type")
        )
        return {**_annotations(node), "anyOf": arms}

    def dependent_required(self, node: dict, path: str) -> dict | None:
        deps = node.get("dependentRequired")
        key = "dependentRequired"
        old = node.get("dependencies")
        if (
            deps is None
            and isinstance(old, dict)
            and all(isinstance(v, list) for v in old.values())
        ):
            deps, key = old, "dependencies"
        if not isinstance(deps, dict) or ("dependentRequired" in node and "dependencies" in node):
            return None
        if any(k in node for k in ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")):
            return None
        if node.get("type") not in ("object", None) or "patternProperties" in node:
            return None
        props = node.get("properties")
        extra = node.get("additionalProperties", MISSING)
        closed = extra is False or (extra is MISSING and self.strict_mode)
        if "unevaluatedProperties" in node or not isinstance(props, dict) or not closed:
            return None
        if _false_inside(node):
            return None
        required = node.get("required", [])
        if not isinstance(required, list) or not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in deps.values()
        ):
            return None
        base = {k: v for k, v in node.items() if k != key}
        base["type"] = "object"
        # Triggers that are required pull their names in; triggers that can
        # never be present constrain nothing.
        need = _closure(set(required), deps)
        triggers = [t for t in deps if t in props and t not in need and deps[t]]
        if len(triggers) > _MAX_TRIGGERS:
            return None
        arms = []
        for present in itertools.product((False, True), repeat=len(triggers)):
            on = {t for t, p in zip(triggers, present, strict=True) if p}
            off = set(triggers) - on
            names = _closure(need | on, deps)
            if names & off or not names <= set(props):
                continue  # a name required that cannot be present: nothing matches
            arm = dict(base)
            arm["properties"] = {n: s for n, s in props.items() if n not in off}
            order = list(required) + sorted(names - set(required))
            if order:
                arm["required"] = order
            arms.append(arm)
        if not arms or not self.spend(len(arms) * (len(base) + 1)):
            return None
        self.notes.append((path, f"{key} written as anyOf over which names are present"))
        if len(arms) == 1:
            return arms[0]
        return {**_annotations(node), "anyOf": [_constraints(a, None) for a in arms]}

    def open_required(self, node: dict, path: str) -> dict | None:
        required = node.get("required")
        if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
            return None
        if any(k in node for k in ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")):
            return None
        if "patternProperties" in node or "unevaluatedProperties" in node:
            return None
        props = node.get("properties", {})
        kind = node.get("type")
        if not isinstance(props, dict) or not (
            kind == "object" or (kind is None and _infers("object", node))
        ):
            return None
        missing = [n for n in required if n not in props]
        extra = node.get("additionalProperties", {})
        if extra is True:
            extra = {}
        if not missing or not isinstance(extra, dict):
            return None
        self.notes.append((path, f"required {missing} listed in properties"))
        return {**node, "properties": {**props, **dict.fromkeys(missing, extra)}}


# Keywords whose value maps names to schemas (definitions are rewritten in
# place: a pointer to one reaches the rewritten, equivalent object).
_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas", "$defs", "definitions"})


def _false_inside(node: dict) -> bool:
    """Whether ``node`` names a ``false`` subschema in a map or list of
    schemas (xgrammar: "Schema 'false' cannot accept any value")."""
    for key in ("properties", "patternProperties", "dependentSchemas"):
        value = node.get(key)
        if isinstance(value, dict) and any(v is False for v in value.values()):
            return True
    return any(
        isinstance(node.get(k), list) and any(v is False for v in node[k])
        for k in ("anyOf", "oneOf", "allOf", "prefixItems")
    )


def _closure(names: set[str], deps: dict[str, list[str]]) -> set[str]:
    """``names`` with every name a present trigger requires, until none adds one."""
    names = set(names)
    grown = True
    while grown:
        grown = False
        for trigger, more in deps.items():
            if trigger in names and not set(more) <= names:
                names |= set(more)
                grown = True
    return names


def conjoin(a: dict, b: dict, *, old_draft: bool = False) -> Any:
    """One object that means ``a and b``, ``_EMPTY`` if nothing can satisfy
    both, or None when no single object says it exactly (or only with a
    ``false`` subschema, which xgrammar refuses to compile).

    Under ``old_draft`` (draft 4 to 7) a ``$ref`` hides its siblings, so a
    side with a ``$ref`` conjoins with nothing but annotations."""
    if old_draft and (("$ref" in a and b) or ("$ref" in b and a)):
        return None
    for group in _GROUPS:
        in_a = {k: a[k] for k in group if k in a}
        in_b = {k: b[k] for k in group if k in b}
        if in_a and in_b and in_a != in_b and not _open_merge(in_a, in_b, group):
            return None
    if _false_inside(a) or _false_inside(b):
        return None
    out = dict(b)
    for key, value in a.items():
        if key not in out:
            out[key] = value
            continue
        other = out[key]
        if value == other:
            continue
        met = _meet(key, value, other, old_draft)
        if met is None or met is _EMPTY:
            return met
        out[key] = met
    return out


def _open_merge(in_a: dict, in_b: dict, group: frozenset) -> bool:
    """Whether two sides' keywords of one group may be merged key by key: only
    ``properties`` (no side closes the object with additionalProperties,
    patternProperties or unevaluatedProperties)."""
    return "properties" in group and set(in_a) | set(in_b) <= _OPEN_GROUP_MEMBERS


def _meet(key: str, a: Any, b: Any, old_draft: bool) -> Any:
    if key == "type":
        return _type_meet(a, b)
    if key == "required" and isinstance(a, list) and isinstance(b, list):
        return b + [n for n in a if n not in b]
    if key in _LOWER | _UPPER and _is_num(a) and _is_num(b):
        return max(a, b) if key in _LOWER else min(a, b)
    if key == "enum" and isinstance(a, list) and isinstance(b, list):
        kept = [v for v in a if any(_same(v, w) for w in b)]
        return kept if kept else _EMPTY
    if key == "const":
        return _EMPTY if not _same(a, b) else a
    if key == "properties" and isinstance(a, dict) and isinstance(b, dict):
        # xgrammar emits properties in map order: the first side's come first.
        out = dict(a)
        for name, sub in b.items():
            if name not in out or out[name] == sub:
                out[name] = sub
                continue
            x, y = out[name], sub
            if x is True or y is True:
                out[name] = y if x is True else x
                continue
            if not (isinstance(x, dict) and isinstance(y, dict)):
                return None
            met = conjoin(x, y, old_draft=old_draft)
            if met is None or met is _EMPTY:
                return None  # an absent-only property has no exact object form
            out[name] = met
        return out
    return None


_TYPE_ORDER = ("array", "boolean", "integer", "null", "number", "object", "string")


def _type_meet(a: Any, b: Any) -> Any:
    sa = set(a) if isinstance(a, list) else {a}
    sb = set(b) if isinstance(b, list) else {b}
    if not all(isinstance(t, str) for t in sa | sb):
        return None
    both = sa & sb
    if ("integer" in sa and "number" in sb) or ("integer" in sb and "number" in sa):
        both.add("integer")
    names = [t for t in _TYPE_ORDER if t in both]
    if not names:
        return _EMPTY
    return names[0] if len(names) == 1 else names


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``1 == 1.0``, but ``True != 1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return (type(a) is type(b) and a == b) or (_is_num(a) and _is_num(b) and a == b)


def _reads_annotations(root: Any) -> bool:
    """Whether the schema uses ``unevaluatedProperties`` / ``unevaluatedItems``
    anywhere: they read what the subschemas beside them evaluated, which a
    rewrite of those subschemas changes."""
    stack = [root]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if "unevaluatedProperties" in v or "unevaluatedItems" in v:
                return True
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _weight(value: Any, limit: int) -> int:
    """How many JSON values ``value`` holds (counting stops past ``limit``)."""
    n, stack = 0, [value]
    while stack and n <= limit:
        v = stack.pop()
        n += 1
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return n


def _past_int64(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _infers(kind: str, constraints: dict) -> bool:
    keys = {
        "object": ("properties", "additionalProperties", "unevaluatedProperties"),
        "array": ("items", "prefixItems", "unevaluatedItems"),
    }[kind]
    return any(k in constraints for k in keys)


def _constraints(node: dict, but: str | None) -> dict:
    return {k: v for k, v in node.items() if k in CONSTRAINTS and k != but}


def _annotations(node: dict) -> dict:
    return {k: v for k, v in node.items() if k not in CONSTRAINTS}


def _has_own_base(node: dict) -> bool:
    """Whether ``node`` sets a base URI or an anchor: moving it would move them."""
    return any(k in node for k in ("$id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "id"))


def _pinned(root: Any, refs: dict[str, Any]) -> set[int]:
    """ids of the objects a local pointer passes through on a keyword other
    than ``$defs`` / ``definitions`` (restructuring one would move a target)."""
    pinned: set[int] = set()
    for ref in refs:
        if ref == "#":
            continue
        node = root
        for raw in ref[2:].split("/"):
            part = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                if part not in ("$defs", "definitions"):
                    pinned.add(id(node))
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                break
    return pinned
