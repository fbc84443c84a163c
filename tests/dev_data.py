"""The dev schemas (``gramcoord.launch.workload.dev_data_dir``), for every suite.

Plain functions, no fixtures: the engine suites' spawned ranks import this.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from gramcoord.launch.workload import dev_data_dir

SCHEMAS = dev_data_dir() / "schemas-dev.jsonl"


@functools.lru_cache(maxsize=1)
def _records() -> tuple[dict[str, Any], ...]:
    # Never a skip: without the data these tests would silently stop testing.
    assert SCHEMAS.is_file(), f"dev data not found at {SCHEMAS} (see tests/data/README.md)"
    return tuple(json.loads(line) for line in SCHEMAS.read_text().splitlines() if line)


def records() -> list[dict[str, Any]]:
    """Every dev record (a fresh copy of each, so callers may add fields)."""
    return [dict(r) for r in _records()]


def schema(want: str) -> dict[str, Any]:
    """The schema of the first dev record whose id contains ``want``."""
    for record in _records():
        if want in record["id"]:
            return record["schema"]
    raise KeyError(want)
