"""One JSON Schema from its parsed value to the text that is compiled, and the verdict on it.

``spec.admit`` calls ``schema_text`` for a ``json`` spec (and
``tag_schemas`` for the schemas a structural tag embeds), after parsing
and sizing the request's value. The passes run forward, each once:

1. **canonical** (``schema_tree.canonical_tree``): the sorted copy, the
   facts of its tree, its depth and longest list;
2. **rewrites** (``schema_rewrite.rewrite``): shapes xgrammar would not
   enforce whole, written as an equivalent it does (siblings of ``anyOf``
   into its branches, ``$ref`` with siblings, untyped keywords, annotation
   formats, ``dependentRequired``); the canonical copy is taken again of
   the result;
3. **one walk** (``schema_walk.walk``): the lint of features xgrammar would
   not enforce, the rewrites into what it enforces exactly (integral-float
   counts, ``enum`` / ``const`` values filtered by the keywords beside
   them), and what its converter reaches with this request's
   ``strict_mode`` (``required`` names it drops, ``oneOf`` it relaxes);
4. **verdict**: refuse with a code, or admit with warnings; a warning that
   the grammar does not enforce all of the schema makes the finished output
   end-checked (``GrammarSpec.end_check``);
5. the canonical text, which the caller sizes, keys and bounds.

A new rule belongs to exactly one of these passes.
"""

from __future__ import annotations

import json
from typing import Any

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError, WarningCode
from gramcoord.rank_worker.grammars.schema_rewrite import rewrite
from gramcoord.rank_worker.grammars.schema_tree import SchemaTree, canonical_tree
from gramcoord.rank_worker.grammars.schema_walk import JSON_TYPES, walk

MAX_DEPTH = 64
MAX_DEPTH_STRUCTURAL_TAG = 80
# Enum / choice / required lists longer than this are hostile, not real.
MAX_VALUES = 10_000

# Warnings whose schema the grammar does not fully enforce: checked at the end.
END_CHECKED = (WarningCode.ignored_feature, WarningCode.oneof_as_anyof)


def canonical_json(value: Any) -> str:
    """JSON text as it is keyed and compiled: no spaces, Unicode as written, no NaN."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def schema_text(
    schema: dict, config: GrammarConfig, strict_mode: bool
) -> tuple[str, list[str], SchemaTree]:
    """The canonical text of ``schema``, its warnings, and its tree (for the bound).

    Raises
    ------
    SpecError
        Too deep, a list too long, a ``type`` naming no type, a local
        ``$ref`` that does not resolve, or (with
        ``grammar.reject_ignored_features``) a feature xgrammar would not
        enforce.
    """
    tree = enforced_tree(schema, strict_mode)
    found = walk(tree, strict_mode=strict_mode)
    if found.bad_types:
        path, value = found.bad_types[0]
        raise SpecError(
            ErrorCode.spec_bad_json,
            f"json schema: {path}: {json.dumps(value)} is not a JSON Schema type; "
            f"use one of {', '.join(JSON_TYPES)} (or a list of them)",
        )
    if found.broken_refs:
        path, ref = found.broken_refs[0]
        raise SpecError(ErrorCode.spec_bad_json, f"$ref {ref!r} at {path} does not resolve")
    warnings: list[str] = []
    ignored = found.ignored + found.dropped_required
    if ignored:
        detail = "; ".join(f"{p}: {m}" for p, m in ignored[:5])
        more = f" (+{len(ignored) - 5} more)" if len(ignored) > 5 else ""
        if config.reject_ignored_features:
            raise SpecError(
                ErrorCode.schema_unsupported_feature,
                f"xgrammar would not enforce: {detail}{more}. {config.unenforced_hint}",
            )
        warnings.append(f"{WarningCode.ignored_feature}: {detail}{more}")
    if found.remote_refs:
        refs = ", ".join(f"{r!r} at {p}" for p, r in found.remote_refs[:3])
        warnings.append(f"{WarningCode.unconstrained_ref}: {refs} not resolvable locally")
    if found.inexact_one_ofs:
        warnings.append(_one_of_warning(found.inexact_one_ofs))
    return canonical_json(tree.root), warnings, tree


def enforced_tree(schema: dict, strict_mode: bool) -> SchemaTree:
    """Passes 1 and 2: the canonical tree of ``schema``, rewritten where an
    enforced equivalent exists (``schema_rewrite``).

    Raises
    ------
    SpecError
        Too deep, or a list too long.
    """
    tree = canonical_tree(schema, max_depth=MAX_DEPTH)
    if tree.max_depth > MAX_DEPTH:
        raise SpecError(
            ErrorCode.spec_too_deep,
            f"json schema nests {tree.max_depth} levels; the limit is {MAX_DEPTH}",
        )
    if tree.max_values > MAX_VALUES:
        raise SpecError(
            ErrorCode.spec_too_many_values,
            f"json schema has a list of {tree.max_values} values; the limit is {MAX_VALUES}",
        )
    rewritten = rewrite(tree, strict_mode=strict_mode, max_depth=MAX_DEPTH)
    if rewritten is not None:
        again = canonical_tree(rewritten.root, max_depth=MAX_DEPTH)
        if again.max_depth <= MAX_DEPTH and again.max_values <= MAX_VALUES:
            return again
    return tree


def tag_schemas(tag: dict) -> tuple[dict, list[str]]:
    """A structural tag with each JSON schema it embeds rewritten as a ``json``
    spec's is (strict, as xgrammar compiles them), and the warnings on them.

    The tag's own key order is kept. What no rewrite reaches is named in an
    ``ignored_feature`` warning; a structural tag's output is not checked at
    the end (its text interleaves tags and free text).

    Raises
    ------
    SpecError
        The tag, or a schema in it, nests too deeply.
    """
    depth = canonical_tree(tag, max_depth=MAX_DEPTH_STRUCTURAL_TAG, sort=False).max_depth
    if depth > MAX_DEPTH_STRUCTURAL_TAG:
        raise SpecError(
            ErrorCode.spec_too_deep,
            f"structural_tag nests {depth} levels; the limit is {MAX_DEPTH_STRUCTURAL_TAG}",
        )
    inexact: list[str] = []
    ignored: list[str] = []

    def enforced(schema: Any, where: str) -> Any:
        if not isinstance(schema, dict):
            return schema
        tree = enforced_tree(schema, strict_mode=True)
        found = walk(tree, strict_mode=True)
        inexact.extend(where + p[1:] for p in found.inexact_one_ofs)
        ignored.extend(f"{where}{p[1:]}: {m}" for p, m in found.ignored + found.dropped_required)
        return tree.root

    def visit(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            if node.get("type") in _TAG_SCHEMA_TYPES and "json_schema" in node:
                where = f"{path}.json_schema"
                return {k: enforced(v, where) if k == "json_schema" else v for k, v in node.items()}
            return {k: visit(v, f"{path}.{k}") for k, v in node.items()}
        if isinstance(node, list):
            return [visit(v, f"{path}[{i}]") for i, v in enumerate(node)]
        return node

    out = visit(tag, "$")
    warnings = [_one_of_warning(inexact)] if inexact else []
    if ignored:
        more = f" (+{len(ignored) - 5} more)" if len(ignored) > 5 else ""
        warnings.append(f"{WarningCode.ignored_feature}: {'; '.join(ignored[:5])}{more}")
    return out, warnings


def _one_of_warning(paths: list[str]) -> str:
    shown = ", ".join(paths[:3])
    more = f" (+{len(paths) - 3} more)" if len(paths) > 3 else ""
    return (
        f"{WarningCode.oneof_as_anyof}: {shown}{more} enforced as anyOf (branches not provably "
        "disjoint): output matching several branches is accepted"
    )


_TAG_SCHEMA_TYPES = ("json_schema", "qwen_xml_parameter")
