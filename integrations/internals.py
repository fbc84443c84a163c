"""Checks that the host-engine internals an integration touches are still as expected."""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["Internal", "check", "check_version"]

logger = logging.getLogger(__name__)

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


def check_version(engine: str, module: str, series: str, verified: str) -> str:
    """The installed ``module``'s version, if it is in ``series`` (such as ``"0.32"``).

    Raises ``RuntimeError`` naming the supported series otherwise, and logs a
    warning for a version of the series other than ``verified``.
    """
    version = str(getattr(importlib.import_module(module), "__version__", "unknown"))
    if not (version == series or version.startswith(series + ".")):
        raise RuntimeError(
            f"gramcoord's {engine} integration supports {engine} {series}.x "
            f"(verified on {verified}); {engine} {version} is installed"
        )
    if version != verified:
        logger.warning("gramcoord: %s %s is untested (verified on %s)", engine, version, verified)
    return version
