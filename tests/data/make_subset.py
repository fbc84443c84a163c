"""Cut the repo's test subset (``tests/data/``) out of the full dev data.

Usage: ``.venv/bin/python tests/data/make_subset.py [--src DIR]``.
``--src`` defaults to ``../shared/data`` beside the checkout. The output is
a pure function of the source files: records are picked by stable criteria
(labels, tags, sizes and a blake2b hash of each id), never by a clock or a
random generator, and keep the source's order.

Schemas (``schemas-dev.jsonl`` and the matching label lines):

- every schema xgrammar refused in conversion (``status != "ok"``): the
  poisoning and ``grammar_invalid`` cases;
- every test-suite case tagged ``external_ref`` or ``annotation_semantics``;
- every schema of the adversarial subsets (``WHOLE_SUBSETS``: Handwritten
  and Synthesized), for the hostile-input tests;
- slow compiles for timeout and saturation tests: the slowest labelled ones
  whose record stays under 70 KB, and the slowest small schemas (at most
  8 KB of schema);
- per subset, the first ``FAST_PER_SUBSET`` in hash order among the schemas
  unit tests sample (compiled fine, labelled under 15 ms, at most 1.5 KB,
  every valid instance accepted), and ``ANY_PER_SUBSET`` more of any kind
  (schema at most 30 KB).

Regexes (``regexes-dev.jsonl``): every one with a lookaround (xgrammar
0.2.9 refuses those), the ones with the largest bounded repeats (slow to
compile with a real vocabulary), and per origin and length quartile the
first few in hash order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SRC = HERE.parents[2] / "shared" / "data"

FAST_PER_SUBSET = 2
ANY_PER_SUBSET = 1
NUM_SLOW_BIG = 5
NUM_SLOW_SMALL = 3
MAX_SLOW_RECORD_BYTES = 70_000
MAX_SMALL_SCHEMA_BYTES = 8_000
MAX_ANY_SCHEMA_BYTES = 30_000
SLOW_LABEL_MS = 1000.0
REGEX_PER_BIN = 4
# Records tests name by id (a clean clone has only this subset).
NAMED = frozenset(
    {"jsonschemabench/Kubernetes/kb_480_Normalized", "jsonschemabench/Github_hard/o14514"}
)
# Adversarial subsets kept whole (often unsatisfiable or nearly so).
WHOLE_SUBSETS = frozenset({"Handwritten", "Synthesized"})
NUM_REGEX_BIG_REPEAT = 3

_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def _order(rid: str) -> str:
    """A stable pseudo-random rank for an id."""
    return hashlib.blake2b(rid.encode(), digest_size=8).hexdigest()


def _read(path: Path) -> list[tuple[str, dict]]:
    """(line as written, parsed record) for each non-blank line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(line, json.loads(line)) for line in lines if line.strip()]


def _unit_test_usable(rec: dict, label: dict) -> bool:
    # The filter tests/rank_worker samples from (dev_pool, test_dev_schemas).
    return (
        label.get("status") == "ok"
        and label.get("compile_ms", 1e9) <= 15.0
        and rec["size_bytes"] <= 1500
        and any(inst["valid"] for inst in rec["instances"])
        and label.get("valid_accepted") == label.get("valid_total")
    )


def pick_schemas(recs: list[dict], labels: list[dict]) -> set[str]:
    label_of = {lab["id"]: lab for lab in labels}
    picked: set[str] = {rec["id"] for rec in recs if rec["id"] in NAMED}
    for rec in recs:
        lab = label_of[rec["id"]]
        tags = set(rec["tags"])
        if lab["status"] != "ok" or tags & {"external_ref", "annotation_semantics"}:
            picked.add(rec["id"])
        if rec["subset"] in WHOLE_SUBSETS:
            picked.add(rec["id"])
    slow = [
        rec
        for rec in recs
        if label_of[rec["id"]].get("compile_ms", 0.0) >= SLOW_LABEL_MS and rec["id"] not in picked
    ]
    slow.sort(key=lambda r: -label_of[r["id"]]["compile_ms"])
    big = [r for r in slow if len(json.dumps(r)) <= MAX_SLOW_RECORD_BYTES]
    small = [r for r in slow if r["size_bytes"] <= MAX_SMALL_SCHEMA_BYTES]
    picked.update(r["id"] for r in big[:NUM_SLOW_BIG])
    picked.update(r["id"] for r in small[:NUM_SLOW_SMALL])
    by_subset: dict[str, list[dict]] = defaultdict(list)
    for rec in recs:
        by_subset[rec["subset"]].append(rec)
    for members in by_subset.values():
        members = sorted(members, key=lambda r: _order(r["id"]))
        fast = [r for r in members if _unit_test_usable(r, label_of[r["id"]])]
        picked.update(r["id"] for r in fast[:FAST_PER_SUBSET])
        rest = [
            r for r in members if r["id"] not in picked and r["size_bytes"] <= MAX_ANY_SCHEMA_BYTES
        ]
        picked.update(r["id"] for r in rest[:ANY_PER_SUBSET])
    return picked


def _max_repeat(regex: str) -> int:
    bounds = [int(hi or lo) for lo, hi in _REPEAT.findall(regex)]
    return max(bounds, default=0)


def pick_regexes(recs: list[dict]) -> set[str]:
    picked = {r["id"] for r in recs if _LOOKAROUND.search(r["regex"])}
    big = sorted(
        (r for r in recs if r["id"] not in picked),
        key=lambda r: (-_max_repeat(r["regex"]), _order(r["id"])),
    )
    picked.update(r["id"] for r in big[:NUM_REGEX_BIG_REPEAT])
    # Length quartiles per origin (pattern / patternProperties).
    by_origin: dict[str, list[dict]] = defaultdict(list)
    for rec in recs:
        by_origin[rec["subset"]].append(rec)
    for members in by_origin.values():
        members = sorted(members, key=lambda r: (len(r["regex"]), r["id"]))
        num_bins = 4
        for b in range(num_bins):
            chunk = members[b * len(members) // num_bins : (b + 1) * len(members) // num_bins]
            chunk = [
                r for r in sorted(chunk, key=lambda r: _order(r["id"])) if r["id"] not in picked
            ]
            picked.update(r["id"] for r in chunk[:REGEX_PER_BIN])
    return picked


def _write(path: Path, rows: list[tuple[str, dict]], keep: set[str]) -> None:
    # Lines are copied byte for byte, in source order.
    text = "".join(line + "\n" for line, rec in rows if rec["id"] in keep)
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", type=Path, default=DEFAULT_SRC, help="full dev-data folder")
    p.add_argument("--out", type=Path, default=HERE, help="where the subset is written")
    args = p.parse_args(argv)
    schemas = _read(args.src / "schemas-dev.jsonl")
    labels = _read(args.src / "schemas-dev.xgrammar-labels.jsonl")
    recs, label_recs = [r for _, r in schemas], [x for _, x in labels]
    assert [r["id"] for r in recs] == [x["id"] for x in label_recs], "labels out of order"
    keep = pick_schemas(recs, label_recs)
    _write(args.out / "schemas-dev.jsonl", schemas, keep)
    _write(args.out / "schemas-dev.xgrammar-labels.jsonl", labels, keep)
    regexes = _read(args.src / "regexes-dev.jsonl")
    keep_re = pick_regexes([r for _, r in regexes])
    _write(args.out / "regexes-dev.jsonl", regexes, keep_re)
    licenses = args.out / "LICENSES"
    licenses.mkdir(exist_ok=True)
    for lic in sorted((args.src / "LICENSES").iterdir()):
        shutil.copyfile(lic, licenses / lic.name)
    print(f"{len(keep)} schemas, {len(keep_re)} regexes -> {args.out}")


if __name__ == "__main__":
    main()
