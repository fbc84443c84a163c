"""The canonical copy of a JSON Schema, and the facts of its tree that later passes read.

``spec_text`` calls ``canonical_tree`` once per schema, right after parsing
it; the walk (``schema_walk``) and the bound (``shortest``) read the
``SchemaTree`` it returns and never call back here.

- **Canonical form.** Keyword order inside a schema object carries no
  meaning, so keywords are sorted. The order of a ``properties`` map *does*
  carry meaning (xgrammar emits properties in that order), so it is kept.
  Data values (``const``, ``enum``, ``default``, ``examples``) are kept as
  written, and shared with the input: nothing downstream mutates them. The
  copy is what the walk rewrites in place, and what gets hashed *and*
  compiled, so one key always means one grammar.
- **Tree facts.** For every schema object: its JSON path
  (``$.properties.a``), its rank in tree order (the order in which lint
  findings are reported), and its schema-valued children. Every local
  ``$ref`` (``#`` or ``#/...``) is resolved once, here, so no later pass
  resolves a pointer.
- **Hostile input.** The copy is iterative, so a 100k-deep schema cannot
  blow the stack, and it stops descending past ``max_depth``; the caller
  refuses a schema whose ``max_depth`` or ``max_values`` is over the limit
  before any other pass runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

# Keywords whose value is one schema, a list of schemas, or a map of them.
ONE_SCHEMA = frozenset(
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

# What ``SchemaTree.refs`` holds for a pointer that names nothing.
MISSING = object()


class SchemaTree:
    """A canonical schema copy and the facts of its tree (see the module docstring)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        # id(schema object) -> its JSON path, its rank in tree order, and its
        # schema-valued children as (child, path), in tree order.
        self.path: dict[int, str] = {}
        self.rank: dict[int, int] = {}
        self.children: dict[int, list[tuple[Any, str]]] = {}
        # Every local ``$ref`` of a schema object -> its target (``MISSING``
        # when it names nothing); remote refs are not here.
        self.refs: dict[str, Any] = {}
        # ids of the schema objects that are a ``propertyNames`` value: they
        # describe a key, a string whether or not they say so.
        self.key_schemas: set[int] = set()
        self.max_depth = 0
        # The longest list anywhere (enum, required, data).
        self.max_values = 0


def canonical_tree(schema: Any, *, max_depth: int, sort: bool = True) -> SchemaTree:
    """Copy ``schema`` into canonical form and record its tree facts, in one iterative pass.

    ``sort=False`` keeps keyword order (a structural tag's embedded schemas:
    the tag is compiled as written). Past ``max_depth`` values are kept as
    they are, unvisited.
    """
    out: list[Any] = [None]
    tree = SchemaTree(None)
    # (value, is a schema position, depth, path, setter, parent's children
    # list, the keyword it is the value of)
    stack: list[tuple[Any, bool, int, str, Callable[[Any], None], list | None, str | None]] = [
        (schema, True, 1, "$", lambda v: out.__setitem__(0, v), None, None)
    ]
    while stack:
        value, is_schema, depth, path, put, siblings, keyword = stack.pop()
        tree.max_depth = max(tree.max_depth, depth if isinstance(value, dict | list) else 0)
        if depth > max_depth:
            put(value)
            continue
        if not is_schema or not isinstance(value, dict):
            put(value)
            if not is_schema:
                tree.max_depth = max(tree.max_depth, depth - 1 + _data_depth(value))
                if isinstance(value, list):
                    tree.max_values = max(tree.max_values, len(value))
            continue
        keys = sorted(value) if sort else list(value)
        new: dict[str, Any] = dict.fromkeys(keys)
        put(new)
        if siblings is not None:
            siblings.append((new, path))
        tree.rank[id(new)] = len(tree.rank)
        tree.path[id(new)] = path
        if keyword == "propertyNames":
            tree.key_schemas.add(id(new))
        mine: list[tuple[Any, str]] = []
        tree.children[id(new)] = mine
        for key in ("enum", "required"):
            if isinstance(value.get(key), list):
                tree.max_values = max(tree.max_values, len(value[key]))
        ref = value.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            tree.refs.setdefault(ref, None)
        # Children are pushed in key order, so they are copied in reverse:
        # the tree order lint findings follow.
        for key in keys:
            _push_children(stack, new, key, value[key], depth, f"{path}.{key}", mine)
    tree.root = out[0]
    for ref in tree.refs:
        tree.refs[ref] = _pointer_target(tree.root, ref)
    # Children were appended in visit order (reversed key order); the walk
    # wants them in tree order.
    for kids in tree.children.values():
        kids.reverse()
    return tree


def _push_children(
    stack: list, new: dict, key: str, child: Any, depth: int, cpath: str, mine: list
) -> None:
    if key in _MAP and isinstance(child, dict):
        # Keep the map's own order: it is the property order.
        sub: dict[str, Any] = dict.fromkeys(child)
        new[key] = sub
        for name, s in child.items():
            stack.append((s, True, depth + 2, f"{cpath}.{name}", _setter(sub, name), mine, None))
    elif key in _LIST and isinstance(child, list):
        items: list[Any] = [None] * len(child)
        new[key] = items
        for i, s in enumerate(child):
            stack.append((s, True, depth + 2, f"{cpath}[{i}]", _setter(items, i), mine, None))
    elif key in ONE_SCHEMA and isinstance(child, dict):
        stack.append((child, True, depth + 1, cpath, _setter(new, key), mine, key))
    elif key == "dependencies" and isinstance(child, dict):
        sub = dict.fromkeys(child)
        new[key] = sub
        for name, s in child.items():
            is_schema = isinstance(s, dict)
            stack.append((s, is_schema, depth + 2, cpath, _setter(sub, name), mine, None))
    else:
        stack.append((child, False, depth + 1, cpath, _setter(new, key), None, None))


def _setter(container: Any, key: Any) -> Callable[[Any], None]:
    def put(v: Any) -> None:
        container[key] = v

    return put


def _data_depth(value: Any) -> int:
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            depth = max(depth, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return depth


def _pointer_target(root: Any, ref: str) -> Any:
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
