"""The end checks: a finished JSON output parsed, and validated against a schema the grammar weakened.

Every finished output of a ``json`` or ``json_object`` request must parse
(``json_check``): a host's grammar that let a raw control character into a
string (``json_strings``) or any other slip makes it fail with
``output_not_json``, never ``ok``, and the run summary counts it
(``json_checks``).

A JSON schema whose grammar does not enforce all of it (a feature xgrammar
ignores, admitted with ``grammar.reject_ignored_features: false``; a
``oneOf`` enforced as ``anyOf``) is marked ``GrammarSpec.end_check``. When
such a request finishes, its text is validated with ``jsonschema`` (formats
checked too: the calendar of a ``date`` is one of the weakened features)
before it is returned. An output that breaks the schema is never ``ok``: it
fails with ``schema_breach`` and the first violation, and the run
summary counts it.

The verdict depends only on the output text and the canonical schema, so
every rank, and the one-process reference run, gives the same one. Nothing
is ever fetched: a ``$ref`` or ``$schema`` naming a document outside the
schema resolves only against the JSON Schema meta-schemas ``jsonschema``
ships (jsonschema's default would fetch any ``http(s)`` URI a user wrote,
from the engine's host). A reference that resolves nowhere cannot be
checked: the output is let through and the admission warning stands.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
from referencing import Registry
from referencing.exceptions import Unresolvable

from gramcoord.rank_worker.errors import ErrorCode

# Compiled validators kept, by canonical schema text.
_VALIDATORS = 256

MISMATCH = ErrorCode.schema_breach.name
NOT_JSON = ErrorCode.output_not_json.name


def wants_json(spec: Any) -> bool:
    """Whether a request's ``structured_outputs`` (a mapping, or its JSON text) asks for one
    JSON value: a ``json`` schema or ``json_object``."""
    if isinstance(spec, str | bytes):
        try:
            spec = json.loads(spec)
        except ValueError:
            return False
    if not isinstance(spec, dict):
        return False
    return spec.get("json") is not None or spec.get("json_object") is True


def json_check(output: str) -> str | None:
    """Why ``output`` is not JSON (``json.loads``'s own words), or ``None`` when it is."""
    try:
        json.loads(output)
    except ValueError as exc:
        return f"the output is not JSON: {exc}"
    return None


@functools.lru_cache(maxsize=_VALIDATORS)
def _validator(schema_text: str):
    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError:
        return None
    # A registry of our own (jsonschema adds its meta-schemas to it) whose
    # lookup of anything else fails instead of retrieving it.
    return cls(schema, format_checker=cls.FORMAT_CHECKER, registry=Registry())


def end_check(schema_text: str, output: str) -> str | None:
    """Why ``output`` breaks the schema ``schema_text``, or ``None`` when it holds.

    A schema ``jsonschema`` cannot use (its own meta-schema refuses it, or
    a reference in it resolves nowhere) cannot be checked: the output is let
    through and the admission warning stands.
    """
    validator = _validator(schema_text)
    if validator is None:
        return None
    try:
        data = json.loads(output)
    except ValueError as exc:
        return f"the output is not JSON: {exc}"
    try:
        error = next(iter(validator.iter_errors(data)), None)
    except Unresolvable:
        return None
    if error is None:
        return None
    path = "$" + "".join(
        f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in error.absolute_path
    )
    return f"the output breaks the schema at {path}: {error.message[:300]}"
