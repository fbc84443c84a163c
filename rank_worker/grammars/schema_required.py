"""Which ``required`` names xgrammar 0.2.9 drops, and the finding that names them.

A helper below the walk: ``schema_walk`` collects the ``required`` lists of
the objects the converter generates, then calls ``dropped_required`` once
with them, after every rewrite of the tree is done.

xgrammar 0.2.9 reads ``required`` only on a node it builds as an object (no
``$ref``, ``const``, ``enum``, ``anyOf``, ``oneOf`` or ``allOf`` beside
it), and there it enforces only the names that node lists in its own
``properties``; every other name is dropped without a word, whatever
``strict_mode`` and ``additionalProperties`` say. Keywords beside a
``$ref`` or a combinator are not merged into it either, so a branch that
lists ``required`` and relies on its parent's ``properties`` enforces
nothing. Measured with a GrammarMatcher (tests/rank_worker/grammars/
test_schema_lint.py re-checks every shape): ``{"type": "object",
"required": ["foo"]}`` in strict mode accepts only ``{}``; with
``"properties": {"bar": {}}`` beside it, ``{"bar": 1}``.
"""

from __future__ import annotations

from typing import Any

from gramcoord.rank_worker.grammars.schema_tree import MISSING


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
