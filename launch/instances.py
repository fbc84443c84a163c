"""``gramcoord check --instances``: does the grammar we would use enforce each schema?

Every schema of a ``schemas-dev.jsonl``-shaped file (``{"id", "schema",
"instances": [{"valid", "data"}]}``) goes through the admission a request
gets (``GrammarManager`` with the config's ``grammar`` section). Each test
instance is then written as our grammar writes JSON (properties in the
schema's order; the instance's own order is tried too) and walked through a
fresh matcher. Per schema, one verdict:

``exact``
    admitted; every valid instance accepted, every invalid one rejected;
``end_checked``
    admitted with a warning; the grammar accepts an invalid instance, and
    the end check (``grammars.end_check``) catches every one of them;
``under_constrained``
    admitted, and the grammar accepts an invalid instance nothing catches
    (``silent`` when the schema was admitted without a warning);
``over_constrained``
    admitted, and the grammar rejects a valid instance, with the reason:
    ``strict_mode`` (by design: no additional properties or items unless the
    schema allows them; the instance passes with ``strict_mode: false``) or
    ``defect`` (ours or xgrammar's);
``refused``
    refused at admission, with its code;
``untested``
    admitted, no instances.

``covered`` counts schemas admitted and not under-constrained: enforced
exactly, stricter than the schema, or checked at the end. With a labels
file (``schemas-dev.xgrammar-labels.jsonl``), raw xgrammar's counts are
printed beside ours.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

import msgspec
import xgrammar as xgr
from rich.console import Console
from rich.table import Table

from gramcoord.launch.config import ClusterConfig
from gramcoord.launch.instance_forms import searching, serializations, unescaped
from gramcoord.rank_worker.errors import SpecError
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.end_check import end_check
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.spec import validate_spec
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer
from gramcoord.rank_worker.native_log import native_stderr_redirected

COVERED = ("exact", "end_checked", "over_constrained", "untested")


class SchemaVerdict(msgspec.Struct, kw_only=True):
    """One line of the report."""

    id: str
    subset: str
    verdict: str
    code: str | None = None
    warnings: tuple[str, ...] = ()
    end_check: bool = False
    valid_total: int = 0
    valid_accepted: int = 0
    invalid_total: int = 0
    invalid_rejected: int = 0
    # Invalid instances the grammar accepted that the end check caught.
    invalid_caught: int = 0
    # Per rejected valid instance: strict_mode or defect.
    over_reasons: tuple[str, ...] = ()
    silent: bool = False


class InstanceReport(msgspec.Struct, kw_only=True):
    schemas: int
    by_verdict: dict[str, int]
    covered: int
    coverage: float
    silent_under: int
    over_reasons: dict[str, int]
    refused_codes: dict[str, int]
    # Raw xgrammar (labels file): schemas whose grammar accepts an invalid
    # instance, and that reject a valid one.
    xgrammar: dict[str, int] = msgspec.field(default_factory=dict)
    wall_s: float = 0.0


def _accepts(compiled: xgr.CompiledGrammar, texts: list[str]) -> str | None:
    """The first of ``texts`` the grammar accepts whole, or None."""
    for text in texts:
        matcher = xgr.GrammarMatcher(compiled)
        if matcher.accept_string(text) and matcher.is_completed():
            return text
    return None


class InstanceChecker:
    """Admit, compile and probe schemas with one config's grammar options."""

    def __init__(self, config: ClusterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.grammar = config.grammar
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer)
        self.manager = GrammarManager(self.grammar, self.tokenizer)
        self._lax = XGrammarBackend(self.tokenizer)

    def close(self) -> None:
        self.manager.close()

    def admit(self, records: list[dict]) -> dict[str, Any]:
        """Submit every schema; ``id -> Outcome`` once each is decided."""
        out: dict[str, Any] = {}
        live: set[str] = set()
        for rec in records:
            o = self.manager.add(rec["id"], {"json": rec["schema"]})
            if o.status == "failed":
                out[rec["id"]] = o
            else:
                live.add(rec["id"])
            while self.manager.num_pending >= self.grammar.max_pending:
                self._settle(out, live)
        while live:
            self._settle(out, live)
        return out

    def _settle(self, out: dict, live: set) -> None:
        for o in self.manager.step():
            out[o.request_id] = o
            live.discard(o.request_id)
        if live:
            self.manager.wait_pending(0.05)

    def verdict(self, rec: dict, outcome: Any) -> SchemaVerdict:
        """The report line of one decided schema."""
        instances = rec.get("instances") or []
        v = SchemaVerdict(
            id=rec["id"],
            subset=rec.get("subset", ""),
            verdict="refused",
            code=outcome.code,
            warnings=outcome.warnings,
            valid_total=sum(1 for i in instances if i.get("valid")),
            invalid_total=sum(1 for i in instances if not i.get("valid")),
        )
        if outcome.status != "admitted":
            return v
        compiled = self.manager.compiled(rec["id"])
        check = outcome.end_check
        v.end_check = check is not None
        reasons: list[str] = []
        slipped = 0
        for inst in instances:
            texts = serializations(rec["schema"], inst.get("data"))
            accepted = _accepts(compiled, texts)
            if inst.get("valid"):
                if accepted is not None:
                    v.valid_accepted += 1
                else:
                    reasons.append(self._why_rejected(rec["schema"], compiled, inst["data"], texts))
            elif accepted is None:
                v.invalid_rejected += 1
            elif check is not None and end_check(check, accepted) is not None:
                v.invalid_caught += 1
            else:
                slipped += 1
        self.manager.release(rec["id"])
        v.over_reasons = tuple(reasons)
        if slipped:
            v.verdict, v.silent = "under_constrained", not outcome.warnings
        elif v.invalid_caught:
            v.verdict = "end_checked"
        elif reasons:
            v.verdict = "over_constrained"
        else:
            v.verdict = "exact" if instances else "untested"
        return v

    def _why_rejected(self, schema: Any, compiled: Any, data: Any, texts: list[str]) -> str:
        """Why the grammar rejects a valid instance, found by probing xgrammar.

        ``strict_mode`` when the lax grammar accepts it (by design);
        ``xgrammar_bounded_string_escapes`` when the same instance with its
        escaped characters replaced is accepted (xgrammar 0.2.9 allows no
        escape sequence in a string with ``minLength`` / ``maxLength``);
        ``xgrammar_anchors_patterns`` when it is accepted once every
        ``pattern`` / ``patternProperties`` regex is made a search
        (xgrammar matches the whole string, JSON Schema searches; gramcoord
        keeps the host's semantics); else ``defect``.
        """
        if self.grammar.strict_mode:
            try:
                lax = validate_spec(
                    {"json": schema, "strict_mode": False}, self.grammar, vocab=self.tokenizer.name
                )
                if _accepts(self._lax(lax), texts) is not None:
                    return "strict_mode"
            except (SpecError, RuntimeError, ValueError):
                pass
        plain = unescaped(data)
        if plain != data and _accepts(compiled, serializations(schema, plain)) is not None:
            return "xgrammar_bounded_string_escapes"
        searching_schema = searching(schema)
        if searching_schema != schema:
            try:
                spec = validate_spec(
                    {"json": searching_schema}, self.grammar, vocab=self.tokenizer.name
                )
                if _accepts(self._lax(spec), texts) is not None:
                    return "xgrammar_anchors_patterns"
            except (SpecError, RuntimeError, ValueError):
                pass
        return "defect"


def read_schemas(path: Path, limit: int = 0) -> list[dict]:
    """The schema records of ``path`` (JSON schemas only), in file order."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if isinstance(rec.get("schema"), dict | bool):
                    out.append(rec)
                if limit and len(out) >= limit:
                    break
    return out


def read_labels(path: Path | None) -> dict[str, int]:
    """Raw xgrammar's verdicts: schemas accepting an invalid / rejecting a valid instance."""
    if path is None or not path.is_file():
        return {}
    under = over = ok = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            lab = json.loads(line)
            if lab.get("status") != "ok":
                continue
            ok += 1
            under += lab["invalid_rejected"] < lab["invalid_total"]
            over += lab["valid_accepted"] < lab["valid_total"]
    return {"compiled": ok, "under_constrained": under, "over_constrained": over}


def summarize(lines: list[SchemaVerdict], labels: dict[str, int], wall_s: float) -> InstanceReport:
    by = Counter(ln.verdict for ln in lines)
    covered = sum(by[v] for v in COVERED)
    return InstanceReport(
        schemas=len(lines),
        by_verdict=dict(by),
        covered=covered,
        coverage=round(covered / len(lines), 4) if lines else 0.0,
        silent_under=sum(ln.silent for ln in lines),
        over_reasons=dict(Counter(r for ln in lines for r in set(ln.over_reasons))),
        refused_codes=dict(Counter(ln.code for ln in lines if ln.verdict == "refused")),
        xgrammar=labels,
        wall_s=round(wall_s, 2),
    )


def report_table(r: InstanceReport) -> Table:
    t = Table(title=f"gramcoord check --instances: {r.schemas} schemas in {r.wall_s:.1f}s")
    t.add_column("what")
    t.add_column("schemas", justify="right")
    for k in (
        "exact",
        "end_checked",
        "over_constrained",
        "untested",
        "under_constrained",
        "refused",
    ):
        t.add_row(k, str(r.by_verdict.get(k, 0)))
    t.add_row("  under-constrained without a warning", str(r.silent_under))
    for k, n in sorted(r.over_reasons.items()):
        t.add_row(f"  over-constrained because {k}", str(n))
    for k, n in sorted(r.refused_codes.items(), key=lambda kv: -kv[1]):
        t.add_row(f"  refused {k}", str(n))
    t.add_row("covered (admitted, not under-constrained)", f"{r.covered} ({r.coverage:.1%})")
    if r.xgrammar:
        x = r.xgrammar
        t.add_row("raw xgrammar: compiled", str(x["compiled"]))
        t.add_row("raw xgrammar: accepts an invalid instance", str(x["under_constrained"]))
        t.add_row("raw xgrammar: rejects a valid instance", str(x["over_constrained"]))
    return t


def run_instances(
    config: ClusterConfig,
    schemas: Path,
    out: IO[bytes],
    *,
    labels: Path | None = None,
    console: Console | None = None,
    tokenizer: Tokenizer | None = None,
) -> InstanceReport:
    """Write one ``SchemaVerdict`` line per schema of ``schemas``; return the counts.

    The table goes to ``console`` when one is given.
    """
    t0 = time.perf_counter()
    records = read_schemas(schemas, config.workload.limit)
    checker = InstanceChecker(config, tokenizer)
    try:
        outcomes = checker.admit(records)
        lines = [checker.verdict(rec, outcomes[rec["id"]]) for rec in records]
    finally:
        checker.close()
    enc = msgspec.json.Encoder()
    for ln in lines:
        out.write(enc.encode(ln) + b"\n")
    out.flush()
    report = summarize(lines, read_labels(labels), time.perf_counter() - t0)
    if console is not None:
        console.print(report_table(report))
    return report


def main_instances(
    config: ClusterConfig, schemas: str | None, labels: str | None, out_path: str | None
) -> int:
    """``gramcoord check --instances``: lines to ``out_path`` (or stdout), the table to stderr."""
    import shutil
    import sys
    import tempfile

    from gramcoord.launch.workload import dev_data_dir

    path = Path(schemas) if schemas else dev_data_dir() / "schemas-dev.jsonl"
    if not path.is_file():
        print(f"gramcoord: no schemas file {path}", file=sys.stderr)
        return 2
    label_path = Path(labels) if labels else path.with_name("schemas-dev.xgrammar-labels.jsonl")
    if labels and not label_path.is_file():
        print(f"gramcoord: no labels file {label_path}", file=sys.stderr)
        return 2
    # xgrammar's C++ warnings go to a log file, not the console.
    logs = Path(out_path).resolve().parent if out_path else Path(tempfile.mkdtemp())
    try:
        with native_stderr_redirected(logs, 0) as native:
            if out_path:
                with open(out_path, "wb") as out:
                    report = run_instances(config, path, out, labels=label_path)
            else:
                report = run_instances(config, path, sys.stdout.buffer, labels=label_path)
    except (ValueError, KeyError) as exc:  # a line that is not a schema record
        print(f"gramcoord: {path}: {exc}", file=sys.stderr)
        return 2
    Console(stderr=True).print(report_table(report))
    if native.stat().st_size:
        print(f"native library messages: {native}", file=sys.stderr)
    elif out_path:
        native.unlink()
    else:
        shutil.rmtree(logs, ignore_errors=True)
    return 0
