"""The report of ``gramcoord bench all``: per-benchmark runs, the step breakdown, ``bench.md``.

``bench.md`` holds Markdown tables: the records that have a target, against
their baselines (a missed target reads **NO**, a failed benchmark
**ERROR**); each benchmark's arguments and wall time; the default config's
per-step latency breakdown; and every record, report-only ones too.
``page_section`` puts the same tables, under the command and the commit
that produced them, between the markers of a page (``docs/performance.md``).
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import msgspec

from gramcoord.benchmarks._contract import BenchRecord
from gramcoord.engine.timings import Percentiles

# (label, key in summary.json's latency_ms): the parts of one step.
PHASES = (
    ("agreement", "agreement"),
    ("build", "mask_build"),
    ("transport", "transport"),
    ("apply", "apply"),
    ("model", "forward"),
)


# The generated part of a page (docs/performance.md) lies between these lines.
PAGE_BEGIN = "<!-- bench-all: begin -->"
PAGE_END = "<!-- bench-all: end -->"


class BenchRun(msgspec.Struct, kw_only=True):
    """One benchmark's child process."""

    name: str
    args: list[str]
    wall_s: float = 0.0
    # None: killed on its deadline (or never started).
    exit_code: int | None = None
    num_records: int = 0
    error: str | None = None
    # Set when it was not run because this environment cannot run it (why).
    skipped: str | None = None


class Phase(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    # Percentiles over every (step, rank) sample the run recorded.
    p50_ms: float
    p99_ms: float
    count: int


class _SummaryTimes(msgspec.Struct):
    """The part of ``launch.summary.Summary`` read here; other fields are ignored."""

    latency_ms: dict[str, Percentiles]
    steps: int
    wall_s: float


class StepBreakdown(msgspec.Struct, kw_only=True):
    """Per-step latency of one run of a config, from its ``summary.json``."""

    config: str
    # The ``gramcoord run`` child, launcher start-up included.
    wall_s: float
    phases: list[Phase] = msgspec.field(default_factory=list)
    # Phases that summary.json does not record.
    missing: list[str] = msgspec.field(default_factory=list)
    steps: int = 0
    # The run itself, from rank start (summary.json's wall_s).
    run_wall_s: float = 0.0
    # Why there is no breakdown (the run failed or wrote no summary).
    error: str | None = None


class BenchMeta(msgspec.Struct, kw_only=True):
    """Where one ``bench all`` run's figures come from (``bench_meta.json``)."""

    # The command as it was given, e.g. "gramcoord bench all --out bench-out".
    command: str
    # The code that ran: a commit of the checkout ("-dirty" when tracked files
    # had changes), or why it is unknown.
    commit: str
    cpus: int
    # The 1-minute load average when the run started.
    load_avg: float
    breakdown: StepBreakdown | None = None


def code_commit() -> str:
    """The checkout's commit that this code is, ``-dirty`` with tracked changes."""
    here = str(Path(__file__).resolve().parent)

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", here, *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not run from a git checkout)"
    return f"{commit}-dirty" if dirty else commit


def breakdown_of(summary_path: Path, config: str, wall_s: float) -> StepBreakdown:
    """The breakdown in a run's ``summary.json``; ``error`` set if it cannot be read."""
    try:
        summary = msgspec.json.decode(summary_path.read_bytes(), type=_SummaryTimes)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        return StepBreakdown(config=config, wall_s=wall_s, error=f"no summary.json: {exc}")
    out = StepBreakdown(config=config, wall_s=wall_s, steps=summary.steps)
    out.run_wall_s = summary.wall_s
    for label, key in PHASES:
        p = summary.latency_ms.get(key)
        if p is None or p.count == 0:
            out.missing.append(label)
        else:
            out.phases.append(Phase(name=label, p50_ms=p.p50, p99_ms=p.p99, count=p.count))
    return out


def _ms(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.2f}" if x >= 1 else f"{x:.4f}"


def target_text(r: BenchRecord) -> str:
    parts = []
    if r.target is not None:
        parts.append(f">= {r.target:g}x")
    if r.target_ms is not None:
        parts.append(f"<= {r.target_ms:g} ms")
    return ", ".join(parts) or "-"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def records_table(records: list[BenchRecord]) -> str:
    lines = [
        "| benchmark | record | baseline | ours ms | baseline ms | ratio | target | met | note |",
        "|---|---|---|---:|---:|---:|---|---|---|",
    ]
    for r in records:
        if r.error is not None:
            cells = [r.bench, "-", "-", "-", "-", "-", "-", "**ERROR**", r.error]
        else:
            cells = [r.bench, r.name, *_figures(r, "**NO**")]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def _figures(r: BenchRecord, missed: str) -> list[str]:
    """A record's cells from its baseline on: times, ratio, target, met, note."""
    met = "-" if r.met is None else ("yes" if r.met else missed)
    return [
        r.baseline,
        _ms(r.median_ms),
        _ms(r.baseline_median_ms),
        f"{r.ratio:.2f}x",
        target_text(r),
        met,
        r.note,
    ]


def target_counts(records: list[BenchRecord]) -> tuple[int, int, int]:
    """Records with a target: (met, missed, benchmarks failed)."""
    targeted = [r for r in records if r.met is not None]
    met = sum(1 for r in targeted if r.met)
    failed = sum(1 for r in targeted if r.error is not None)
    return met, len(targeted) - met - failed, failed


def targets_line(records: list[BenchRecord]) -> str:
    """The verdict ``gramcoord bench all`` ends with, as ``bench.md`` opens with it."""
    met, missed, failed = target_counts(records)
    return f"targets: {met} met, {missed} missed, {failed} benchmarks failed"


def shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


# Widest a name or baseline cell gets on the console (bench.md has them whole).
_NAME_W = 36


def console_table(records: list[BenchRecord], width: int) -> str:
    """The records as a plain table no line of which is wider than ``width``.

    Names and baselines are cut at ``_NAME_W``, the note takes what is left
    of the line (none when too little is); ``bench.md`` holds every cell whole.
    """
    header = ("benchmark: record", "baseline", "ours ms", "base ms", "ratio", "target", "met")
    rows = []
    for r in records:
        if r.error is not None:
            rows.append((f"{r.bench}: ERROR", "-", "-", "-", "-", "-", "NO", r.error))
            continue
        rows.append((f"{r.bench}: {r.name}", *_figures(r, "NO")))
    cells = [[shorten(c, _NAME_W) for c in row[:2]] + list(row[2:7]) for row in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *cells)]
    used = sum(widths) + 2 * len(widths)
    note_w = width - used if width - used >= 12 else 0
    full = (*header, "note") if note_w else header

    def line(cols, note: str = "") -> str:
        text = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
        if note_w:
            text += "  " + shorten(note, note_w)
        return shorten(text.rstrip(), width)

    lines = [line(full[:7], full[7] if note_w else "")]
    lines.append(shorten("  ".join("-" * w for w in widths), width))
    lines += [line(c, row[7]) for c, row in zip(cells, rows)]
    return "\n".join(lines)


def runs_table(runs: list[BenchRun]) -> str:
    lines = ["| benchmark | arguments | wall s | result |", "|---|---|---:|---|"]
    for run in runs:
        result = run.error or run.skipped or _records(run.num_records)
        args = f"`{shlex.join(run.args)}`" if run.args else "(its defaults)"
        lines.append(f"| {run.name} | {_cell(args)} | {run.wall_s:.1f} | {_cell(result)} |")
    return "\n".join(lines)


def breakdown_table(b: StepBreakdown) -> str:
    if b.error:
        return f"The run of `{b.config}` failed ({_cell(b.error)}): no breakdown."
    lines = ["| part of a step | p50 ms | p99 ms | samples |", "|---|---:|---:|---:|"]
    lines += [f"| {p.name} | {_ms(p.p50_ms)} | {_ms(p.p99_ms)} | {p.count} |" for p in b.phases]
    lines += [f"| {name} | - | - | not in summary.json |" for name in b.missing]
    return "\n".join(lines)


def _records(n: int) -> str:
    return f"{n} record" if n == 1 else f"{n} records"


def markdown(
    records: list[BenchRecord], runs: list[BenchRun], breakdown: StepBreakdown | None
) -> str:
    """``bench.md``: each table under a line that says what it holds.

    The first table (records with a target, and failed benchmarks) is the
    one docs/performance.md shows first; every record, report-only ones too, is in the
    last.
    """
    targeted = [r for r in records if r.met is not None]
    met, missed, failed = target_counts(records)
    parts = [
        f"**Targets**: {met} met, {missed} missed (**NO**), {failed} "
        "benchmarks failed (**ERROR**). `ratio` = baseline ms / ours ms, higher is better; "
        "each pair is measured side by side in one run.",
        "",
        records_table(targeted),
        "",
        f"**Runs**: {sum(r.wall_s for r in runs):.0f} s of benchmarks.",
        "",
        runs_table(runs),
    ]
    if breakdown is not None:
        parts += [
            "",
            f"**Per-step latency of the default config** (`{breakdown.config}`, "
            f"{breakdown.steps} loop steps in {breakdown.run_wall_s:.1f} s from rank start, "
            f"{breakdown.wall_s:.0f} s with start-up): percentiles over every step and rank "
            "that did the part.",
            "",
            breakdown_table(breakdown),
        ]
    parts += [
        "",
        f"**All records** ({len(records)}; those without a target only report).",
        "",
        records_table(records),
    ]
    return "\n".join(parts) + "\n"


def page_section(records: list[BenchRecord], runs: list[BenchRun], meta: BenchMeta) -> str:
    """The tables of ``bench.md`` between the page markers, under their provenance."""
    source = (
        f"Generated by `{meta.command}` at commit `{meta.commit}`, on a machine with "
        f"{meta.cpus} CPUs (load average {meta.load_avg:.1f} when it started)."
    )
    body = markdown(records, runs, meta.breakdown).rstrip("\n")
    return "\n".join([PAGE_BEGIN, "", source, "", body, "", PAGE_END])


def splice(page: str, section: str) -> str:
    """``page`` with its marked block replaced by ``section``.

    Raises
    ------
    ValueError
        The page has no ``PAGE_BEGIN`` ... ``PAGE_END`` block.
    """
    start, end = page.find(PAGE_BEGIN), page.find(PAGE_END)
    if start < 0 or end < start:
        raise ValueError(f"no block between {PAGE_BEGIN} and {PAGE_END}")
    return page[:start] + section + page[end + len(PAGE_END) :]
