"""Workload records: the dev-data formats and vLLM-style requests.

Accepted as they are, one JSON object per line, every line decoded with one
typed schema (``RecordShape``):

- a vLLM-style record carries ``structured_outputs`` (and optionally
  ``prompt``, ``max_tokens``, ``instances``);
- a schema record (``"schema": {...}``, the dev data) becomes a ``json``
  request; its first valid instance is kept as the reference text;
- a regex record (``"regex": "..."``) becomes a ``regex`` request;
- a record with a ``prompt`` and no spec at all is an unconstrained
  request: ``spec`` is None and ``constrained`` is False. Its rows are
  never masked.

The dev data's descriptive keys (``kind``, ``source``, ``tags``, ...) and
the test corpora's annotations (``expect_error``, ``expect``, ...) are
known fields that the reader ignores.

Which mistakes fail the run, and which fail one record:

- **The record's shape fails the run** (``gramcoord run|verify|check`` exit
  2 before any rank starts): a line that is not JSON, not an object, an
  unknown key (``structured_output``), a wrong type (``"max_tokens":
  "lots"``), ``max_tokens`` below 1, a record with no spec and no prompt or
  with two specs, an empty file. ``WorkloadError`` lists the first few as
  ``FILE:LINE: what`` (lines are 1-based, counting blank ones).
- **A spec's content fails that record alone**: whatever
  ``structured_outputs``, ``schema`` or ``regex`` hold is checked later by
  ``rank_worker/grammars/spec.py`` (and the compiler), which gives the
  request its code. So does a line nested deeper than the reader parses
  (a hostile spec, not a typo): ``error`` is set and the run records it as
  ``record_invalid``.
- **A repeated id fails the later record alone** (``record_invalid``); it
  is renamed ``ID@lineN`` so each line keeps its own output.
"""

from __future__ import annotations

import difflib
import gzip
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

# NOTE: like ``benchmarks/_contract.py``, this assumes the checkout layout (an
# editable install): the repo root holds ``tests/data``, and the full dev
# data may sit beside the checkout in ``../shared/data``.
REPO_ROOT = Path(__file__).resolve().parents[1]
# Names a dev-data folder that wins over both defaults.
DATA_DIR_ENV = "GRAMCOORD_DATA_DIR"
# Shape errors listed in a ``WorkloadError`` before "+N more".
MAX_LISTED = 5


class WorkloadError(ValueError):
    """Workload records of the wrong shape (the run fails with exit 2).

    Attributes
    ----------
    problems:
        ``FILE:LINE: what`` for each bad line found, in file order.
    """

    def __init__(self, problems: list[str], *, total: int | None = None) -> None:
        self.problems = problems
        total = len(problems) if total is None else total
        shown = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  (+{total - MAX_LISTED} more)" if total > MAX_LISTED else ""
        head = "" if total == 1 else f"{total} records of the wrong shape:\n  "
        super().__init__(f"{head}{shown}{more}")


class Instance(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An example output of a dev-data schema record."""

    data: Any
    valid: bool


class RecordShape(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every key a workload line may carry, typed; any other key is an error."""

    # Request id; default ``line-N`` (N the 1-based line).
    id: str | UnsetType = UNSET
    prompt: str = ""
    # Tokens at most; default the config's workload.max_tokens.
    max_tokens: Annotated[int, Meta(ge=1)] | UnsetType = UNSET
    # The spec (vLLM's names); its content is checked by the grammar layer.
    structured_outputs: Any = UNSET
    # Dev-data schema and regex records.
    schema: Any = UNSET
    regex: Any = UNSET
    # Example outputs; the first valid one is the synthetic model's reference.
    instances: list[Instance] = []
    # Dev-data descriptions, ignored.
    kind: str = ""
    description: str = ""
    source: str = ""
    subset: str = ""
    tags: list[str] = []
    keywords: list[str] = []
    size_bytes: int = 0
    example_schema: str = ""
    occurrences: int = 0
    schema_count: int = 0
    # Test-corpus annotations (configs/workload.jsonl, tests/data/hostile), ignored.
    expect_error: str = ""
    source_id: str = ""
    expect: dict[str, str] = {}
    encoding: str = ""


_FIELDS = RecordShape.__struct_fields__
_SPEC_KEYS = ("structured_outputs", "schema", "regex")


class WorkloadRecord(msgspec.Struct, kw_only=True):
    # 0-based position in the stream (unique even if ids repeat).
    index: int
    id: str
    # 1-based line of the file it came from (blank lines count).
    line: int = 0
    # The raw structured_outputs mapping handed to validation; None for an
    # unconstrained request (and for a record that could not be read).
    spec: Any = None
    # False for a plain-prompt request with no structured output at all.
    constrained: bool = True
    prompt: str = ""
    # 0 = the config's workload.max_tokens.
    max_tokens: int = 0
    # Reference output text (a valid instance), if the record has one.
    reference: str | None = None
    # Why this record alone fails (``record_invalid``), if it does.
    error: str | None = None


def _explain(exc: msgspec.ValidationError) -> str:
    """msgspec's message, field path first, with a near miss for unknown keys."""
    text = str(exc)
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`(?: - at `\$`)?", text)
    if unknown:
        name = unknown.group(1)
        near = difflib.get_close_matches(name, _FIELDS, n=1)
        hint = f" (did you mean `{near[0]}`?)" if near else ""
        return f"$.{name}: unknown field{hint}"
    what, sep, where = text.partition(" - at `")
    what = what[:1].lower() + what[1:]
    return f"{where.rstrip('`') if sep else '$'}: {what}"


def _reference(shape: RecordShape) -> str | None:
    for inst in shape.instances:
        if inst.valid:
            return json.dumps(inst.data, ensure_ascii=False)
    return None


def parse_record(
    index: int, line: str, *, line_no: int | None = None, source: str = "<workload>"
) -> WorkloadRecord:
    """Turn one JSONL line into a record.

    Parameters
    ----------
    index:
        The record's position in the stream.
    line:
        The line's text.
    line_no:
        Its 1-based line in ``source`` (default ``index + 1``), for messages
        and the default id.

    Raises
    ------
    WorkloadError
        The line's shape is wrong (see the module docstring); the message
        names ``source``, the line and the field.
    """
    line_no = index + 1 if line_no is None else line_no
    where = f"{source}:{line_no}"
    try:
        # json, not msgspec, parses: a spec may hold lone surrogates, which
        # the grammar layer refuses with its own code.
        raw = json.loads(line)
    except RecursionError:
        return WorkloadRecord(
            index=index,
            id=f"line-{line_no}",
            line=line_no,
            error=f"{where}: nested deeper than the workload reader parses",
        )
    except ValueError as exc:
        raise WorkloadError([f"{where}: not JSON: {exc}"]) from exc
    try:
        shape = msgspec.convert(raw, RecordShape)
    except msgspec.ValidationError as exc:
        raise WorkloadError([f"{where}: {_explain(exc)}"]) from exc
    specs = [k for k in _SPEC_KEYS if getattr(shape, k) is not UNSET]
    if len(specs) > 1:
        raise WorkloadError([f"{where}: set one of {', '.join(specs)}, not {len(specs)}"])
    if not specs and not shape.prompt:
        raise WorkloadError(
            [f"{where}: the record has no structured_outputs, schema or regex, and no prompt"]
        )
    common = dict(
        index=index,
        id=f"line-{line_no}" if shape.id is UNSET else shape.id,
        line=line_no,
        prompt=shape.prompt,
        max_tokens=0 if shape.max_tokens is UNSET else shape.max_tokens,
        reference=_reference(shape),
    )
    if shape.structured_outputs is not UNSET:
        return WorkloadRecord(spec=shape.structured_outputs, **common)
    if shape.schema is not UNSET:
        return WorkloadRecord(spec={"json": shape.schema}, **common)
    if shape.regex is not UNSET:
        return WorkloadRecord(spec={"regex": shape.regex}, **common)
    return WorkloadRecord(constrained=False, **common)


def _lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line, text) of each non-blank line; gzip when it ends in ``.gz``."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                yield line_no, line


def _unique_ids(records: Iterable[WorkloadRecord]) -> Iterator[WorkloadRecord]:
    """A repeated id fails its later record alone, renamed ``ID@lineN``."""
    first: dict[str, int] = {}
    for rec in records:
        if rec.id in first:
            error = rec.error or f"request id {rec.id!r} repeats line {first[rec.id]}"
            rec = msgspec.structs.replace(rec, id=f"{rec.id}@line{rec.line}", error=error)
        first.setdefault(rec.id, rec.line)
        yield rec


def _records(path: str | Path) -> Iterator[WorkloadRecord]:
    for index, (line_no, line) in enumerate(_lines(path)):
        yield parse_record(index, line, line_no=line_no, source=str(path))


def read_workload(path: str | Path, limit: int = 0) -> Iterator[WorkloadRecord]:
    """Yield records from a JSONL file (``.jsonl.gz`` too), skipping blank lines.

    Raises
    ------
    WorkloadError
        At the first line of the wrong shape; ``load_workload`` lists them all.
    """
    for rec in _unique_ids(_records(path)):
        if limit and rec.index >= limit:
            return
        yield rec


def load_workload(path: str | Path, limit: int = 0) -> list[WorkloadRecord]:
    """Every record of a file, checked whole before anything runs.

    Raises
    ------
    WorkloadError
        Lines of the wrong shape (the first ``MAX_LISTED`` listed), or a file
        with no records.
    """
    records: list[WorkloadRecord] = []
    problems: list[str] = []
    for index, (line_no, line) in enumerate(_lines(path)):
        try:
            records.append(parse_record(index, line, line_no=line_no, source=str(path)))
        except WorkloadError as exc:
            problems.extend(exc.problems)
    if problems:
        raise WorkloadError(problems)
    if not records:
        raise WorkloadError([f"{path}: no records (every line is blank)"])
    records = list(_unique_ids(records))
    return records[:limit] if limit else records


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
    a mixed record adds ``#n`` (its n-th use), and an id that still repeats
    fails its later record (``ID@lineN``). ``index`` counts the stream.
    ``limit`` (0 = none) bounds the stream.

    Raises
    ------
    WorkloadError
        A line of the wrong shape, or an empty ``mix_path``.
    """
    mixed = list(read_workload(mix_path)) if mix_path else []
    if mix_path and not mixed:
        raise WorkloadError([f"{mix_path}: no records (every line is blank)"])

    def passes() -> Iterator[WorkloadRecord]:
        uses = 0
        index = 0
        for rnd in range(repeat):
            for rec in read_workload(path):
                if mixed and index % mix_every == mix_every - 1:
                    extra = mixed[uses % len(mixed)]
                    yield msgspec.structs.replace(extra, index=index, id=f"{extra.id}#{uses}")
                    uses += 1
                    index += 1
                rid = f"{rec.id}#{rnd}" if repeat > 1 else rec.id
                yield msgspec.structs.replace(rec, index=index, id=rid)
                index += 1

    for rec in _unique_ids(passes()):
        if limit and rec.index >= limit:
            return
        yield rec


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
