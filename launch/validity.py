"""Check ``ok`` JSON outputs: they must parse, and should satisfy their schema.

``json_valid.checked`` counts ok outputs of ``json`` and ``json_object``
requests; ``parsed`` those whose text is JSON; ``valid`` those that also
validate against their schema with ``jsonschema`` (a ``json_object`` output
is valid when it is an object). A schema that ``jsonschema`` itself cannot
use (an unresolvable remote ``$ref``, say) is counted in ``unverifiable``
rather than guessed at.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema


class JsonChecker:
    def __init__(self) -> None:
        self.checked = 0
        self.parsed = 0
        self.valid = 0
        self.unverifiable = 0

    def check(self, spec: Any, text: str) -> bool | None:
        """Check one ok output of ``spec``; ``None`` when it is not a JSON request."""
        if not isinstance(spec, dict):
            return None
        if "json" in spec:
            schema = spec["json"]
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    return None
        elif spec.get("json_object") is True:
            schema = {"type": "object"}
        else:
            return None
        self.checked += 1
        try:
            data = json.loads(text)
        except ValueError:
            return False
        self.parsed += 1
        try:
            cls = jsonschema.validators.validator_for(schema)
            cls.check_schema(schema)
            ok = cls(schema).is_valid(data)
        except Exception:
            # A schema jsonschema cannot use (xgrammar may have compiled it
            # while ignoring the broken part): counted, never guessed at.
            self.unverifiable += 1
            return None
        self.valid += ok
        return ok

    def counts(self) -> dict[str, int]:
        return {
            "checked": self.checked,
            "parsed": self.parsed,
            "valid": self.valid,
            "unverifiable": self.unverifiable,
        }
