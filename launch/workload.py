"""Workload records: the dev-data formats and vLLM-style requests.

Accepted as they are, one JSON object per line:

- a schema record (``"schema": {...}``) becomes a ``json`` request; its first
  valid instance is kept as the reference text;
- a regex record (``"kind": "regex"``, ``"regex": "..."``) becomes a
  ``regex`` request;
- a vLLM-style record carries ``structured_outputs`` (and optionally
  ``prompt``, ``max_tokens``);
- a record with a ``prompt`` and no spec at all (no ``structured_outputs``,
  ``schema`` or ``regex``) is an unconstrained request: ``spec`` is None and
  ``constrained`` is False. Its rows are never masked.

A line that is not JSON, or a record of no known shape, is still returned,
as a ``WorkloadRecord`` with ``error`` set, so a caller can report it
without losing its place.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

# NOTE: like ``launch/bench.py``, this assumes the checkout layout (an
# editable install): the repo root holds ``tests/data``, and the full dev
# data may sit beside the checkout in ``../shared/data``.
REPO_ROOT = Path(__file__).resolve().parents[1]
# Names a dev-data folder that wins over both defaults.
DATA_DIR_ENV = "GRAMCOORD_DATA_DIR"


class WorkloadRecord(msgspec.Struct, kw_only=True):
    # 0-based line number among non-blank lines (unique even if ids repeat).
    index: int
    id: str
    # The raw structured_outputs mapping handed to validation; None for an
    # unconstrained request (and for a record that could not be read).
    spec: Any = None
    # False for a plain-prompt request with no structured output at all.
    constrained: bool = True
    prompt: str = ""
    max_tokens: int = 0
    # Reference output text (a valid instance), if the record has one.
    reference: str | None = None
    # Why the record could not be read, if it could not.
    error: str | None = None


def _reference(rec: dict) -> str | None:
    for inst in rec.get("instances") or ():
        if isinstance(inst, dict) and inst.get("valid") is True and "data" in inst:
            return json.dumps(inst["data"], ensure_ascii=False)
    return None


def parse_record(index: int, line: str) -> WorkloadRecord:
    """Turn one JSONL line into a record; never raises."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as exc:
        return WorkloadRecord(index=index, id=f"line-{index}", error=f"not JSON: {exc}")
    if not isinstance(rec, dict):
        return WorkloadRecord(index=index, id=f"line-{index}", error="record is not an object")
    rid = str(rec.get("id", f"line-{index}"))
    max_tokens = rec.get("max_tokens", 0)
    max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0
    prompt = rec.get("prompt") if isinstance(rec.get("prompt"), str) else ""
    common = dict(index=index, id=rid, prompt=prompt, max_tokens=max_tokens)
    if "structured_outputs" in rec:
        return WorkloadRecord(spec=rec["structured_outputs"], reference=_reference(rec), **common)
    if "schema" in rec:
        return WorkloadRecord(spec={"json": rec["schema"]}, reference=_reference(rec), **common)
    if rec.get("kind") == "regex" or "regex" in rec:
        return WorkloadRecord(spec={"regex": rec.get("regex")}, **common)
    if prompt:
        return WorkloadRecord(constrained=False, reference=_reference(rec), **common)
    return WorkloadRecord(
        error="record has none of structured_outputs, schema, regex, prompt", spec=None, **common
    )


def _lines(path: str | Path) -> Iterator[str]:
    """Non-blank lines of a JSONL file, gzip-compressed when it ends in ``.gz``."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                yield line


def read_workload(path: str | Path, limit: int = 0) -> Iterator[WorkloadRecord]:
    """Yield records from a JSONL file (``.jsonl.gz`` too), skipping blank lines."""
    for index, line in enumerate(_lines(path)):
        if limit and index >= limit:
            return
        yield parse_record(index, line)


def stream_workload(
    path: str | Path,
    *,
    limit: int = 0,
    repeat: int = 1,
    mix_path: str | Path | None = None,
    mix_every: int = 10,
) -> Iterator[WorkloadRecord]:
    """The request stream of a run: ``path`` read ``repeat`` times, with
    ``mix_path``'s records (cycled) mixed in, one after every ``mix_every - 1``.

    Ids stay unique: with ``repeat > 1`` each pass adds ``#pass`` to its ids,
    and a mixed record adds ``#n`` (its n-th use). ``index`` counts the
    stream. ``limit`` (0 = none) bounds the stream.
    """
    mixed = [parse_record(i, line) for i, line in enumerate(_lines(mix_path))] if mix_path else []
    uses = 0
    index = 0
    for rnd in range(repeat):
        for rec in read_workload(path):
            if mixed and index % mix_every == mix_every - 1:
                extra = mixed[uses % len(mixed)]
                yield msgspec.structs.replace(extra, index=index, id=f"{extra.id}#{uses}")
                uses += 1
                index += 1
                if limit and index >= limit:
                    return
            rid = f"{rec.id}#{rnd}" if repeat > 1 else rec.id
            yield msgspec.structs.replace(rec, index=index, id=rid)
            index += 1
            if limit and index >= limit:
                return


def dev_data_dir() -> Path:
    """The folder of dev data (``schemas-dev.jsonl`` and friends).

    Tests and benchmarks read their real schemas from here. In order:
    ``$GRAMCOORD_DATA_DIR`` when set (relative to the working directory);
    the full set in ``../shared/data`` beside the checkout when it exists;
    otherwise the subset the repo carries in ``tests/data``.
    """
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).resolve()
    shared = REPO_ROOT.parent / "shared" / "data"
    if (shared / "schemas-dev.jsonl").is_file():
        return shared
    return REPO_ROOT / "tests" / "data"
