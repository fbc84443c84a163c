"""Build ``configs/workload.jsonl``, the default workload of ``make run``.

Usage: ``.venv/bin/python configs/make_workload.py [--data DIR] [--out FILE]``.
``--data`` defaults to ``gramcoord.launch.workload.dev_data_dir()``: the
full dev set when one is configured or beside the checkout, else the repo's
``tests/data`` subset (which gives a different workload). The
output is a pure function of the data and of xgrammar's verdicts: records
are picked by stable criteria and ordered by a fixed rule, never by a clock.

Every record is vLLM-shaped: ``{"id", "prompt", "max_tokens",
"structured_outputs", "instances"?}``; a valid instance, when present, is
the reference the synthetic model follows. A record meant to fail carries
``"expect_error"``, the code it must fail with.

- **JSON schemas** (``NUM_SCHEMAS``): dev schemas with a short valid
  instance, labelled fast, that pass ``validate_spec`` without warnings,
  compile with the real Qwen2.5 vocabulary, and accept their instance.
  Drawn round-robin over the subsets, in hash order within each.
- **Regexes** (``NUM_REGEXES``): dev regexes that compile, without
  lookarounds or large bounded repeats (both slow or refused).
- Hand-written: two ``choice``, two EBNF ``grammar`` (one with a reference),
  one ``json_object``, and two unconstrained prompts (no
  ``structured_outputs``).
- **Bad specs**, interleaved with the rest: no kind, an empty choice, a dev
  regex xgrammar refuses, the smallest dev schema our validator rejects for
  ``uniqueItems``, and the smallest dev schema that passes validation but
  fails to compile, twice under two ids (the second meets a poisoned key).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import xgrammar as xgr

from gramcoord.launch.workload import dev_data_dir
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.spec import GrammarSpec, validate_spec
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "configs" / "workload.jsonl"

NUM_SCHEMAS = 30
NUM_REGEXES = 8
# Per-subset caps: test-suite cases are one-keyword toys, so one is enough.
SCHEMA_CAP = defaultdict(lambda: 2, {"draft2020-12": 1})
REGEX_CAP = {"pattern": 6, "patternProperties": 2}
MAX_LABEL_MS = 30.0
MIN_REFERENCE_CHARS, MAX_REFERENCE_CHARS = 20, 400
MIN_REGEX_CHARS, MAX_REGEX_CHARS = 12, 80
MAX_REGEX_REPEAT = 32
# Above this a compile is reported (never silently dropped: that would make
# the output depend on the machine's load).
SLOW_COMPILE_MS = 300.0

_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")

CHOICES = [
    (
        "gramcoord/choice/sentiment",
        "Classify the review 'The battery easily lasts two days.' as positive, negative "
        "or neutral.",
        ["positive", "negative", "neutral"],
    ),
    (
        "gramcoord/choice/capital",
        "What is the capital of France?",
        ["Paris", "London", "Berlin", "Madrid", "Rome"],
    ),
]

# xgrammar's GBNF dialect. The first one outputs JSON, so a JSON instance
# can serve as its reference (``json.dumps`` separators: ", " and ": ").
WEATHER_EBNF = r"""root ::= "{" ws "\"city\"" ws ":" ws city ws "," ws "\"temp_c\"" ws ":" ws temp ws "," ws "\"sky\"" ws ":" ws sky ws "}"
city ::= "\"" [A-Z] [a-z]+ (" " [A-Z] [a-z]+)* "\""
temp ::= "-"? [0-9] [0-9]?
sky ::= "\"clear\"" | "\"cloudy\"" | "\"rain\"" | "\"snow\""
ws ::= " "?
"""
DATETIME_EBNF = r"""root ::= date "T" time "Z"
date ::= "20" [0-9] [0-9] "-" month "-" day
month ::= "0" [1-9] | "1" [0-2]
day ::= "0" [1-9] | [12] [0-9] | "3" [01]
time ::= hour ":" [0-5] [0-9] ":" [0-5] [0-9]
hour ::= [01] [0-9] | "2" [0-3]
"""
GRAMMARS = [
    (
        "gramcoord/ebnf/weather",
        "Report today's weather in Oslo as JSON.",
        WEATHER_EBNF,
        {"city": "Oslo", "temp_c": -3, "sky": "snow"},
    ),
    (
        "gramcoord/ebnf/datetime",
        "When does the next full moon rise? Answer with an ISO 8601 UTC timestamp.",
        DATETIME_EBNF,
        None,
    ),
]
PLAIN = [
    ("gramcoord/plain/greeting", "Say hello in three languages."),
    ("gramcoord/plain/haiku", "Write a haiku about compilers."),
]


def _order(rid: str) -> str:
    """A stable pseudo-random rank for an id."""
    return hashlib.blake2b(rid.encode(), digest_size=8).hexdigest()


def _read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def _reference(rec: dict) -> Any:
    return next((i["data"] for i in rec["instances"] if i["valid"]), None)


def _record(rid: str, prompt: str, max_tokens: int, so: Any, ref: Any = None, **extra) -> dict:
    out: dict[str, Any] = {"id": rid, "prompt": prompt, "max_tokens": max_tokens}
    if so is not None:
        out["structured_outputs"] = so
    if ref is not None:
        out["instances"] = [{"valid": True, "data": ref}]
    out.update(extra)
    return out


class Checker:
    """Validate and compile specs the way a rank does, with the real vocabulary."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        # Refuses what xgrammar would not enforce, so the bad-spec picks
        # carry a code (the default admits them, end-checked).
        self.config = GrammarConfig(reject_ignored_features=True)
        self.vocab = tokenizer.name
        self.backend = XGrammarBackend(tokenizer)
        self.compile_ms: dict[str, float] = {}

    def validate(self, so: Any) -> GrammarSpec | SpecError:
        try:
            return validate_spec(so, self.config, vocab=self.vocab)
        except SpecError as exc:
            return exc

    def compile(self, rid: str, spec: GrammarSpec) -> Any:
        """The compiled grammar, or None if xgrammar refuses the spec."""
        t0 = time.perf_counter()
        try:
            compiled = self.backend(spec)
        except Exception:
            compiled = None
        self.compile_ms[rid] = (time.perf_counter() - t0) * 1e3
        return compiled

    def error_code(self, rid: str, so: Any) -> str | None:
        """The code a rank fails this spec with (None if it compiles)."""
        spec = self.validate(so)
        if isinstance(spec, SpecError):
            return spec.code.name
        return None if self.compile(rid, spec) is not None else ErrorCode.grammar_invalid.name

    def good(self, rid: str, so: Any, ref: Any = None) -> bool:
        """Valid, no warnings, compiles, and accepts ``ref`` (if given) whole."""
        spec = self.validate(so)
        if isinstance(spec, SpecError) or spec.warnings:
            return False
        compiled = self.compile(rid, spec)
        if compiled is None:
            return False
        if ref is None:
            return True
        matcher = xgr.GrammarMatcher(compiled)
        text = json.dumps(ref, ensure_ascii=False)
        return matcher.accept_string(text) and matcher.is_completed()


def _prompt(rec: dict) -> str:
    schema = rec["schema"]
    for key in ("title", "description"):
        value = schema.get(key)
        if isinstance(value, str) and 0 < len(value) <= 80 and "\n" not in value:
            return f"Answer with one JSON value for: {value}"
    return f"Answer with one JSON value for this {rec['subset']} schema."


def pick_schemas(check: Checker, recs: list[dict], labels: dict[str, dict]) -> list[dict]:
    by_subset: dict[str, list[dict]] = defaultdict(list)
    for rec in recs:
        lab = labels[rec["id"]]
        ref = _reference(rec)
        if (
            lab["status"] == "ok"
            and lab.get("compile_ms", 1e9) <= MAX_LABEL_MS
            and not set(rec["tags"]) & {"external_ref", "annotation_semantics"}
            and ref is not None
            and MIN_REFERENCE_CHARS
            <= len(json.dumps(ref, ensure_ascii=False))
            <= MAX_REFERENCE_CHARS
        ):
            by_subset[rec["subset"]].append(rec)
    queues = {s: sorted(m, key=lambda r: _order(r["id"])) for s, m in by_subset.items()}
    taken: dict[str, int] = defaultdict(int)
    out: list[dict] = []
    # Round-robin over subsets in the data's order, hash order inside each.
    progress = True
    while len(out) < NUM_SCHEMAS and progress:
        progress = False
        for subset, queue in queues.items():
            while queue and taken[subset] < SCHEMA_CAP[subset] and len(out) < NUM_SCHEMAS:
                rec = queue.pop(0)
                so, ref = {"json": rec["schema"]}, _reference(rec)
                if check.good(rec["id"], so, ref):
                    taken[subset] += 1
                    out.append(_record(rec["id"], _prompt(rec), 256, so, ref))
                    progress = True
                    break
    assert len(out) == NUM_SCHEMAS, f"only {len(out)} usable schemas"
    return out


def _max_repeat(regex: str) -> int:
    return max((int(hi or lo) for lo, hi in _REPEAT.findall(regex)), default=0)


def pick_regexes(check: Checker, recs: list[dict]) -> list[dict]:
    out: list[dict] = []
    for origin, cap in REGEX_CAP.items():
        members = [
            r
            for r in recs
            if r["subset"] == origin
            and MIN_REGEX_CHARS <= len(r["regex"]) <= MAX_REGEX_CHARS
            and not _LOOKAROUND.search(r["regex"])
            and _max_repeat(r["regex"]) <= MAX_REGEX_REPEAT
        ]
        for rec in sorted(members, key=lambda r: _order(r["id"])):
            if len([x for x in out if x["subset"] == origin]) >= cap:
                break
            so = {"regex": rec["regex"]}
            if check.good(rec["id"], so):
                prompt = f"Write one string that matches /{rec['regex']}/."
                out.append(_record(rec["id"], prompt, 64, so, subset=origin))
    for rec in out:
        del rec["subset"]
    assert len(out) == NUM_REGEXES, f"only {len(out)} usable regexes"
    return out


def pick_bad(
    check: Checker, recs: list[dict], regexes: list[dict]
) -> tuple[list[dict], dict, dict]:
    """Bad records (no kind, empty choice, refused regex, uniqueItems), and
    the two copies of one spec that validates but fails to compile."""
    prompt = "Answer in the requested format."
    no_kind = _record(
        "bad/no-kind",
        prompt,
        64,
        {"disable_any_whitespace": True},
        expect_error="spec_no_kind",
    )
    empty = _record(
        "bad/empty-choice", prompt, 16, {"choice": []}, expect_error="spec_empty_choice"
    )
    refused = None
    for rec in sorted(regexes, key=lambda r: (len(r["regex"]), r["id"])):
        spec = check.validate({"regex": rec["regex"]})
        if not isinstance(spec, SpecError) and check.compile(rec["id"], spec) is None:
            refused = _record(
                "bad/regex-refused",
                f"Write one string that matches /{rec['regex']}/.",
                64,
                {"regex": rec["regex"]},
                expect_error="grammar_invalid",
                source_id=rec["id"],
            )
            break
    unique = None
    broken = None
    for rec in sorted(recs, key=lambda r: (r["size_bytes"], r["id"])):
        so = {"json": rec["schema"]}
        spec = check.validate(so)
        if isinstance(spec, SpecError):
            if (
                unique is None
                and spec.code == ErrorCode.schema_unsupported_feature
                and "uniqueItems" in spec.message
            ):
                unique = _record(
                    "bad/unique-items",
                    _prompt(rec),
                    128,
                    so,
                    expect_error="schema_unsupported_feature",
                    source_id=rec["id"],
                )
        elif broken is None and not spec.warnings and check.compile(rec["id"], spec) is None:
            broken = rec
        if unique is not None and broken is not None:
            break
    assert refused and unique and broken, "a bad-spec source is missing"
    copies = [
        _record(
            f"bad/compile-error-{i}",
            _prompt(broken),
            128,
            {"json": broken["schema"]},
            expect_error="grammar_invalid",
            source_id=broken["id"],
        )
        for i in (1, 2)
    ]
    return [no_kind, refused, empty, unique], copies[0], copies[1]


def interleave(groups: list[list[dict]]) -> list[dict]:
    """Spread each group evenly over the whole sequence (stable, no RNG)."""
    keyed = [
        ((i + 0.5) / len(group), g, i, rec)
        for g, group in enumerate(groups)
        for i, rec in enumerate(group)
    ]
    return [rec for *_, rec in sorted(keyed, key=lambda k: k[:3])]


def build(data: Path, tokenizer: Tokenizer) -> tuple[list[dict], Checker]:
    recs = _read(data / "schemas-dev.jsonl")
    labels = {x["id"]: x for x in _read(data / "schemas-dev.xgrammar-labels.jsonl")}
    regexes = _read(data / "regexes-dev.jsonl")
    check = Checker(tokenizer)
    schemas = pick_schemas(check, recs, labels)
    regex_recs = pick_regexes(check, regexes)
    others = []
    for rid, prompt, options in CHOICES:
        assert check.good(rid, {"choice": options}), rid
        others.append(_record(rid, prompt, 16, {"choice": options}))
    for rid, prompt, grammar, ref in GRAMMARS:
        assert check.good(rid, {"grammar": grammar}, ref), rid
        others.append(_record(rid, prompt, 96, {"grammar": grammar}, ref))
    obj = {"status": "ok", "items": [1, 2, 3], "note": "all checks passed"}
    assert check.good("gramcoord/json_object/status", {"json_object": True}, obj)
    others.append(
        _record(
            "gramcoord/json_object/status",
            "Summarize the job status as a JSON object.",
            128,
            {"json_object": True},
            obj,
        )
    )
    plain = [_record(rid, prompt, 24, None) for rid, prompt in PLAIN]
    bad, first_copy, second_copy = pick_bad(check, recs, regexes)
    # The two copies of the broken spec go near the start and near the end,
    # so the first has long failed (and poisoned its key) when the second
    # arrives.
    bad = [first_copy, *bad, second_copy]
    # Good records cycle schema, regex, other kinds; bad ones are spread
    # over the run, and the unconstrained ones sit among constrained ones.
    return interleave([schemas, regex_recs, others, plain, bad]), check


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data", type=Path, default=None, help="dev-data folder (default: dev_data_dir())"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="workload file written")
    args = p.parse_args(argv)
    records, check = build(args.data or dev_data_dir(), load_tokenizer())
    for rec in records:
        if "expect_error" in rec:
            got = check.error_code(rec["id"], rec["structured_outputs"])
            assert got == rec["expect_error"], (rec["id"], got)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "duplicate ids"
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    args.out.write_text(text, encoding="utf-8")
    picked = {r.get("source_id", r["id"]) for r in records}
    slow = {k: round(v) for k, v in check.compile_ms.items() if k in picked and v > SLOW_COMPILE_MS}
    if slow:
        print(f"warning: compiles over {SLOW_COMPILE_MS:.0f} ms: {slow}")
    print(f"{len(records)} records -> {args.out}")


if __name__ == "__main__":
    main()
