"""Checks that the host-engine internals an integration touches are still as expected."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

__all__ = ["Internal", "check"]

# (module, dotted attribute, expected parameter names or None, why it is touched)
Internal = tuple[str, str, "tuple[str, ...] | None", str]


def check(internals: Iterable[Internal]) -> list[str]:
    """What is missing or changed among ``internals`` (empty when all match).

    Each attribute must import; where parameter names are given, the
    (unwrapped) callable's signature must have exactly those, in order.
    """
    problems = []
    for module, attr, params, _why in internals:
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{attr}: missing ({exc})")
            continue
        if params is None:
            continue
        got = tuple(inspect.signature(inspect.unwrap(obj)).parameters)
        if got != params:
            problems.append(f"{module}.{attr}: parameters {got}, expected {params}")
    return problems
