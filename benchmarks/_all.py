"""``gramcoord bench all --out DIR``: every benchmark, one report.

Each benchmark runs as ``gramcoord bench NAME`` in a child process of this
one, in a session of its own, so a crash or a hang costs one row, not the
run: the child gets a deadline, and on the deadline (or when it exits) its
whole process group (gloo ranks, transport receivers) is terminated, then
killed. The shared-memory reaper of ``gramcoord.sync.janitor`` runs in a
session of its own, so it outlives the group and removes what a killed
child left in ``/dev/shm``.

Written to ``DIR``: ``NAME/bench.json`` and ``NAME/log.txt`` per benchmark;
``bench.json`` (every record, ``bench`` naming its benchmark, one error row
per benchmark that failed); ``bench_runs.json`` (per benchmark its
arguments, exit, wall time); ``bench_meta.json`` (the command, the commit
of the code, the machine's CPUs and load); ``bench.md`` (the tables). On
the console: a line per benchmark as it runs, the records cut to the
terminal's width (``$COLUMNS``), and the count of targets met and missed.

The arguments of each benchmark (``PLANS``) keep the whole run under ten
minutes on a shared 2-core machine; ``--quick`` takes smaller ones for a
smoke run, ``--args NAME=ARGS`` replaces them, ``--only`` picks benchmarks.
``--page docs/performance.md`` also writes the tables of ``bench.md``, under
the command and the commit, between that page's ``bench-all`` markers;
``--render`` runs nothing and rebuilds ``bench.md`` (and the page) from the
files of an earlier run in ``DIR``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from gramcoord.benchmarks._contract import (
    BenchRecord,
    available,
    cells,
    end_group,
    format_table,
    shorten,
    spawn,
    write_records,
)

# Seconds a terminated process group gets before it is killed.
# A benchmark's finally blocks stop its servers (up to 10 s each) on SIGTERM.
GRACE_S = 30.0
# The whole run; a benchmark's deadline never passes it.
BUDGET_S = 590.0
# The generated part of a page (docs/performance.md) lies between these lines.
PAGE_BEGIN = "<!-- bench-all: begin -->"
PAGE_END = "<!-- bench-all: end -->"


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    # Arguments of the full run: the benchmark's defaults, trimmed only where
    # they do not fit the ten minutes, and then only in rows without a target.
    args: tuple[str, ...] = ()
    # Arguments of ``--quick``: a smoke run, figures too noisy to quote.
    quick: tuple[str, ...] = ()
    timeout_s: float = 240.0


# The full plans took 166 s on the shared 2-core machine when quiet and 499 s
# at load 8-15 (per benchmark: each run's bench_runs.json); each timeout is about
# twice a benchmark's loaded wall time. A benchmark without a plan runs with
# its defaults. Trimmed: compile's cold-compile row (30 -> 10 schemas).
PLANS: dict[str, Plan] = {
    "agreement": Plan(quick=("--worlds", "2", "--pending", "64", "--repeat", "11"), timeout_s=180),
    "compile": Plan(args=("--schemas", "10"), quick=("--repeat", "5", "--schemas", "8")),
    "fill": Plan(quick=("--batches", "64", "--repeat", "11", "--max-schemas", "40"), timeout_s=120),
    "jump_forward": Plan(quick=("--schemas", "30")),
    "step": Plan(quick=("--limit", "8", "--rounds", "1")),
    "transport": Plan(quick=("--iters", "50", "--warmup", "5", "--rounds", "1")),
    # Four real vLLM engines (two in-process, two TP=2 pairs): about 5 min.
    "vllm": Plan(quick=("--quick",), timeout_s=600),
}
# Benchmarks that need a package the main venv lacks: (module, where it is).
# Without it the benchmark is skipped with a note, not failed.
NEEDS: dict[str, tuple[str, str]] = {
    "vllm": (
        "vllm",
        "run it from .venv-vllm (`make venv-vllm`): .venv-vllm/bin/gramcoord bench vllm",
    ),
}


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


class BenchMeta(msgspec.Struct, kw_only=True):
    """Where one ``bench all`` run's figures come from (``bench_meta.json``)."""

    # The command as it was given, e.g. "gramcoord bench all --out bench-out".
    command: str
    # The checkout's commit ("-dirty" when tracked files had changes), or why unknown.
    commit: str
    cpus: int
    # The 1-minute load average when the run started.
    load_avg: float


def missing_need(name: str) -> str | None:
    """Why benchmark ``name`` cannot run here, or None when it can."""
    need = NEEDS.get(name)
    if need is None or importlib.util.find_spec(need[0]) is not None:
        return None
    return f"skipped: {need[0]} is not importable here; {need[1]}"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gramcoord bench all --out DIR",
        description="Run every benchmark, each in a child process with a deadline, and write "
        "DIR/bench.json, bench.md and each benchmark's own DIR/NAME/.",
    )
    p.add_argument("--quick", action="store_true", help="smaller arguments: a smoke run")
    p.add_argument("--only", help="comma-separated benchmarks to run (default: all of them)")
    p.add_argument(
        "--args",
        dest="bench_args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="arguments for one benchmark, replacing its plan, e.g. 'transport=--iters 50'",
    )
    p.add_argument("--timeout-s", type=float, help="deadline of each benchmark (default: its plan)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="deadline of the whole run")
    p.add_argument(
        "--page",
        type=Path,
        help="also write the tables, with the command and commit, between the bench-all "
        "markers of this Markdown page, e.g. docs/performance.md",
    )
    p.add_argument(
        "--render",
        action="store_true",
        help="run nothing: rebuild bench.md (and --page) from an earlier run's files in DIR",
    )
    return p.parse_args(argv)


def _selection(opts: argparse.Namespace) -> dict[str, list[str]]:
    """Benchmark name -> its arguments, in run order; bad names exit with the known ones."""
    names = available()
    if "all" in names:
        raise SystemExit("a benchmark module may not be called 'all'")
    chosen = [n.strip() for n in opts.only.split(",") if n.strip()] if opts.only else names
    given: dict[str, list[str]] = {}
    for item in opts.bench_args:
        name, sep, args = item.partition("=")
        if not sep:
            raise SystemExit(f"--args {item!r}: expected NAME=ARGS")
        given[name.strip()] = shlex.split(args)
    unknown = sorted({*chosen, *given} - set(names))
    if unknown:
        raise SystemExit(
            f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(names)}"
        )
    plans = {n: PLANS.get(n, Plan()) for n in chosen}
    return {n: given.get(n, list(p.quick if opts.quick else p.args)) for n, p in plans.items()}


def _say(text: str) -> None:
    """A line on the console, cut to its width ($COLUMNS, else the terminal's, else 100)."""
    print(shorten(text, _width()), flush=True)


def _width() -> int:
    return max(shutil.get_terminal_size((100, 24)).columns, 40)


def _bench_one(
    name: str, args: list[str], out: Path, timeout_s: float
) -> tuple[BenchRun, list[BenchRecord]]:
    """Run ``gramcoord bench NAME`` in a child with a deadline; its group is ended on every path."""
    cmd = [sys.executable, "-m", "gramcoord.launch.cli", "bench", name, "--out", str(out)]
    (out / "bench.json").unlink(missing_ok=True)  # never report a previous run's rows
    t0 = time.monotonic()
    proc = spawn([*cmd, "--", *args], out / "log.txt")
    try:
        rc: int | None = proc.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        rc = None
    finally:  # a Ctrl-C here must not leave the group running
        end_group(proc, GRACE_S)
    run = BenchRun(name=name, args=args, wall_s=round(time.monotonic() - t0, 1), exit_code=rc)
    records: list[BenchRecord] = []
    if rc is None:
        run.error = f"timed out after {timeout_s:.0f} s"
    elif rc != 0:
        lines = (out / "log.txt").read_text(errors="replace").strip().splitlines()
        run.error = f"exit {rc}: {lines[-1].strip()[:300] if lines else ''}"
    else:
        try:
            records = msgspec.json.decode((out / "bench.json").read_bytes(), type=list[BenchRecord])
        except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
            run.error = f"exit 0 but no readable bench.json: {exc}"
    for r in records:
        r.bench = r.bench or name
    run.num_records = len(records)
    return run, records


# -- the report -------------------------------------------------------------------


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


def target_counts(records: list[BenchRecord]) -> tuple[int, int, int]:
    """Records with a target: (met, missed, benchmarks failed)."""
    targeted = [r for r in records if r.met is not None]
    met = sum(1 for r in targeted if r.met)
    failed = sum(1 for r in targeted if r.error is not None)
    return met, len(targeted) - met - failed, failed


def targets_line(records: list[BenchRecord]) -> str:
    """The verdict ``gramcoord bench all`` ends with."""
    return "targets: {} met, {} missed, {} benchmarks failed".format(*target_counts(records))


def _table(head: str, rows: list[list[str]]) -> str:
    """A Markdown table: ``head`` is its first two lines; pipes in cells are escaped."""
    esc = [" | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) for row in rows]
    return "\n".join([head, *(f"| {row} |" for row in esc)])


RECORDS_HEAD = (
    "| benchmark | record | baseline | ours ms | baseline ms | ratio | target | met | note |\n"
    "|---|---|---|---:|---:|---:|---|---|---|"
)


def markdown(records: list[BenchRecord], runs: list[BenchRun]) -> str:
    """``bench.md``: the records with a target, failed benchmarks and skipped rows (the table
    docs/performance.md shows first), the runs, then every record."""

    def rows(rs: list[BenchRecord]) -> list[list[str]]:
        return [[r.bench, "-" if r.error else r.name, *cells(r, bold=True)] for r in rs]

    met, missed, failed = target_counts(records)
    run_rows = [
        [
            run.name,
            f"`{shlex.join(run.args)}`" if run.args else "(its defaults)",
            f"{run.wall_s:.1f}",
            run.error or run.skipped or f"{run.num_records} records",
        ]
        for run in runs
    ]
    parts = [
        f"**Targets**: {met} met, {missed} missed (**NO**), {failed} benchmarks failed "
        "(**ERROR**). `ratio` = baseline ms / ours ms, higher is better; each pair is "
        "measured side by side in one run.",
        _table(RECORDS_HEAD, rows([r for r in records if r.met is not None or r.skipped])),
        f"**Runs**: {sum(r.wall_s for r in runs):.0f} s of benchmarks.",
        _table("| benchmark | arguments | wall s | result |\n|---|---|---:|---|", run_rows),
        f"**All records** ({len(records)}; those without a target only report).",
        _table(RECORDS_HEAD, rows(records)),
    ]
    return "\n\n".join(parts) + "\n"


def page_section(records: list[BenchRecord], runs: list[BenchRun], meta: BenchMeta) -> str:
    """The tables of ``bench.md`` between the page markers, under their provenance."""
    source = (
        f"Generated by `{meta.command}` at commit `{meta.commit}`, on a machine with "
        f"{meta.cpus} CPUs (load average {meta.load_avg:.1f} when it started)."
    )
    body = markdown(records, runs).rstrip("\n")
    return "\n".join([PAGE_BEGIN, "", source, "", body, "", PAGE_END])


def splice(page: str, section: str) -> str:
    """``page`` with its marked block replaced by ``section``; ValueError without the block."""
    start, end = page.find(PAGE_BEGIN), page.find(PAGE_END)
    if start < 0 or end < start:
        raise ValueError(f"no block between {PAGE_BEGIN} and {PAGE_END}")
    return page[:start] + section + page[end + len(PAGE_END) :]


def _write_report(out_dir: Path, records, runs, meta: BenchMeta, page: Path | None) -> None:
    """``bench.md``, and with ``page`` the tables in that page."""
    (out_dir / "bench.md").write_text(markdown(records, runs))
    if page is not None:
        try:
            text = splice(page.read_text(), page_section(records, runs, meta))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--page {page}: {exc}") from exc
        page.write_text(text)
        print(f"wrote the tables into {page}")


def _render(out_dir: Path, page: Path | None) -> int:
    """Rebuild the report from an earlier run's files; exit status 2 when they are missing."""
    try:
        records = msgspec.json.decode((out_dir / "bench.json").read_bytes(), type=list[BenchRecord])
        runs = msgspec.json.decode((out_dir / "bench_runs.json").read_bytes(), type=list[BenchRun])
        meta = msgspec.json.decode((out_dir / "bench_meta.json").read_bytes(), type=BenchMeta)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        print(f"bench all --render: no complete earlier run in {out_dir}: {exc}", file=sys.stderr)
        return 2
    _write_report(out_dir, records, runs, meta, page)
    print(f"bench all: {targets_line(records)}; rendered from {out_dir}")
    return 0


def bench_all(argv: list[str], out_dir: Path) -> int:
    """Run the selected benchmarks and write the report; 1 if any of them failed."""
    opts = _parse(argv)
    if opts.render:
        return _render(out_dir, opts.page)
    selection = _selection(opts)
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + opts.budget_s
    meta = BenchMeta(
        command=shlex.join(["gramcoord", "bench", "all", "--out", str(out_dir), *argv]),
        commit=code_commit(),
        cpus=os.cpu_count() or 1,
        load_avg=round(os.getloadavg()[0], 2),
    )
    runs: list[BenchRun] = []
    records: list[BenchRecord] = []
    for name, args in selection.items():
        left = deadline - time.monotonic()
        run = BenchRun(name=name, args=args, skipped=missing_need(name))
        if run.skipped:
            _say(f"bench all: {name} {run.skipped}")
        elif left <= 1:
            run.error = "not run: the run's budget is spent"
        else:
            _say(f"bench all: {name} {shlex.join(args)}")
            timeout = min(opts.timeout_s or PLANS.get(name, Plan()).timeout_s, left)
            run, got = _bench_one(name, args, out_dir / name, timeout)
            records += got
            _say(f"  {run.error or f'records: {run.num_records}'} in {run.wall_s:.1f} s")
        runs.append(run)
    records += [BenchRecord.failed(run.name, run.error) for run in runs if run.error]
    write_records(records, out_dir)
    for name, value in (("bench_runs.json", runs), ("bench_meta.json", meta)):
        (out_dir / name).write_bytes(msgspec.json.format(msgspec.json.encode(value), indent=2))
    _write_report(out_dir, records, runs, meta, opts.page)
    print(format_table(records, _width()))
    print(f"wrote {out_dir}/bench.json, bench.md; {sum(r.wall_s for r in runs):.0f} s in children")
    print(f"bench all: {targets_line(records)}; every record whole in bench.md")
    return 1 if any(r.error for r in runs) else 0
