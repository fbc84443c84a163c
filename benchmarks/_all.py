"""``gramcoord bench all --out DIR``: every benchmark, one report.

Each benchmark runs as ``gramcoord bench NAME`` in a child process of this
one, in a session of its own, so a crash or a hang costs one row, not the
run: the child gets a deadline, and on the deadline (or when it exits) its
whole process group (gloo ranks, transport receivers) is terminated, then
killed. The shared-memory reaper of ``gramcoord.sync.janitor`` runs in a
session of its own, so it outlives the group and removes what a killed
child left in ``/dev/shm``.

Before the benchmarks, the default config (``configs/local.yaml``, as
installed with the package) runs its workload once (``gramcoord run``), and
its ``summary.json`` gives the per-step latency breakdown.

Written to ``DIR``:

- ``NAME/bench.json`` and ``NAME/log.txt`` per benchmark, ``run/`` for the
  default config's run (``run/log.txt`` its console);
- ``bench.json``: every record (``BenchRecord``, ``bench`` naming its
  benchmark), one error row (``error`` set) per benchmark that failed;
- ``bench_runs.json``: per benchmark its arguments, exit, wall time;
- ``bench_meta.json``: the command, the commit of the code, the machine's
  CPUs and load, and the breakdown;
- ``bench.md``: the tables (``benchmarks/_tables.py``);
- ``bench.png``: ratio against target per record, and the breakdown
  (``benchmarks/_plot.py``).

On the console: a line per benchmark as it runs, then the records as a
table cut to the terminal's width (``$COLUMNS``; notes shortened, whole in
``bench.md``), and last the count of targets met and missed.

The arguments of each benchmark (``PLANS``) keep the whole run under ten
minutes on a shared 2-core machine; ``--quick`` takes smaller ones for a
smoke run, ``--args NAME=ARGS`` replaces them, ``--only`` picks benchmarks.

``--page docs/performance.md`` also writes the tables of ``bench.md``, under
the command and the commit, into that page between its ``bench-all``
markers; ``--render`` runs nothing and rebuilds ``bench.md`` (and the page)
from the files of an earlier run in ``DIR``.
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
    end_group,
    package_dir,
    spawn,
    write_records,
)
from gramcoord.benchmarks._tables import (
    BenchMeta,
    BenchRun,
    StepBreakdown,
    breakdown_of,
    code_commit,
    console_table,
    markdown,
    page_section,
    shorten,
    splice,
    targets_line,
)

# Seconds a terminated process group gets before it is killed.
GRACE_S = 5.0
# The whole run, config run included; a benchmark's deadline never passes it.
BUDGET_S = 590.0
RUN_TIMEOUT_S = 180.0
# For a benchmark with no plan (one added since): its own defaults.
DEFAULT_TIMEOUT_S = 240.0


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    # Arguments of the full run: the benchmark's defaults, trimmed only where
    # they do not fit the ten minutes, and then only in rows without a target.
    args: tuple[str, ...] = ()
    # Arguments of ``--quick``: a smoke run, figures too noisy to quote.
    quick: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S


# The full plans took 166 s on the shared 2-core machine when quiet and 499 s
# at load 8-15 (per benchmark: each run's bench_runs.json); each timeout is about
# twice a benchmark's loaded wall time.
# Trimmed: compile's thread-vs-subprocess row (30 -> 10 schemas),
# jump_forward's tiny-LM rows (32 -> 16 instances), scale's 16-rank world.
PLANS: dict[str, Plan] = {
    "agreement": Plan(quick=("--worlds", "2", "--pending", "64", "--repeat", "11"), timeout_s=180),
    "compile": Plan(args=("--schemas", "10"), quick=("--repeat", "5", "--schemas", "8")),
    "fill": Plan(quick=("--batches", "64", "--repeat", "11", "--max-schemas", "40"), timeout_s=120),
    "jump_forward": Plan(
        args=("--hf-schemas", "16"),
        quick=("--models", "synthetic", "--schemas", "30"),
        timeout_s=240,
    ),
    "scale": Plan(
        args=("--ranks", "2", "4", "8", "--repeat", "10"),
        quick=("--ranks", "2", "4", "--pending", "64", "--repeat", "5"),
        timeout_s=240,
    ),
    "step": Plan(quick=("--limit", "8", "--rounds", "1"), timeout_s=240),
    "tp_followers": Plan(quick=("--requests", "8", "--max-tokens", "32"), timeout_s=120),
    "transport": Plan(quick=("--iters", "50", "--warmup", "5", "--rounds", "1"), timeout_s=240),
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
        "DIR/bench.json, bench.md, bench.png and each benchmark's own DIR/NAME/.",
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
    p.add_argument("--no-run", action="store_true", help="skip the default config's run")
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
    out = {}
    for name in chosen:
        plan = PLANS.get(name, Plan())
        out[name] = given.get(name, list(plan.quick if opts.quick else plan.args))
    return out


def _width() -> int:
    """The console's width ($COLUMNS, else the terminal's, else 100 columns)."""
    return max(shutil.get_terminal_size((100, 24)).columns, 40)


def run_child(cmd: list[str], log: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run ``cmd`` with its output in ``log``; (exit status or None on the deadline, wall s)."""
    t0 = time.monotonic()
    proc = spawn(cmd, log)
    try:
        rc: int | None = proc.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        rc = None
    finally:  # a Ctrl-C here must not leave the group running
        end_group(proc, GRACE_S)
    return rc, time.monotonic() - t0


def _last_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _bench_one(
    name: str, args: list[str], out: Path, timeout_s: float
) -> tuple[BenchRun, list[BenchRecord]]:
    cmd = [sys.executable, "-m", "gramcoord.launch.cli", "bench", name, "--out", str(out)]
    cmd += ["--", *args]
    (out / "bench.json").unlink(missing_ok=True)  # never report a previous run's rows
    rc, wall = run_child(cmd, out / "log.txt", timeout_s)
    run = BenchRun(name=name, args=args, wall_s=round(wall, 1), exit_code=rc)
    records: list[BenchRecord] = []
    if rc is None:
        run.error = f"timed out after {timeout_s:.0f} s"
    elif rc != 0:
        run.error = f"exit {rc}: {_last_line(out / 'log.txt')}"
    else:
        try:
            records = msgspec.json.decode((out / "bench.json").read_bytes(), type=list[BenchRecord])
        except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
            run.error = f"exit 0 but no readable bench.json: {exc}"
    for r in records:
        r.bench = r.bench or name
    run.num_records = len(records)
    return run, records


def default_config() -> tuple[Path, Path]:
    """The default config and its workload, as installed (``configs/`` in a checkout)."""
    root = package_dir("gramcoord.configs", "local.yaml")
    if root is None:
        raise SystemExit("gramcoord.configs (configs/local.yaml) is not installed; use --no-run")
    return root / "local.yaml", root / "workload.jsonl"


def _config_run(out: Path, timeout_s: float) -> StepBreakdown:
    config, workload = default_config()
    cmd = [sys.executable, "-m", "gramcoord.launch.cli", "run", str(config)]
    cmd += ["--workload", str(workload), "--out", str(out)]
    (out / "summary.json").unlink(missing_ok=True)
    rc, wall = run_child(cmd, out / "log.txt", timeout_s)
    label = "configs/local.yaml"
    if rc != 0:
        why = (
            f"timed out after {timeout_s:.0f} s"
            if rc is None
            else f"exit {rc}: {_last_line(out / 'log.txt')}"
        )
        return StepBreakdown(config=label, wall_s=round(wall, 1), error=why)
    return breakdown_of(out / "summary.json", label, round(wall, 1))


def _write_report(
    out_dir: Path,
    records: list[BenchRecord],
    runs: list[BenchRun],
    meta: BenchMeta,
    page: Path | None,
) -> None:
    """``bench.md``, and with ``page`` the tables in that page."""
    (out_dir / "bench.md").write_text(markdown(records, runs, meta.breakdown))
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

    def left() -> float:
        return deadline - time.monotonic()

    breakdown = None
    if not opts.no_run:
        print("bench all: default config run ...", flush=True)
        breakdown = _config_run(out_dir / "run", min(RUN_TIMEOUT_S, left()))
    runs: list[BenchRun] = []
    records: list[BenchRecord] = []
    for name, args in selection.items():
        timeout = opts.timeout_s or PLANS.get(name, Plan()).timeout_s
        skip = missing_need(name)
        if skip is not None:
            run = BenchRun(name=name, args=args, skipped=skip)
        elif left() <= 1:
            run = BenchRun(name=name, args=args, error="not run: the run's budget is spent")
        else:
            print(shorten(f"bench all: {name} {shlex.join(args)}", _width()), flush=True)
            run, got = _bench_one(name, args, out_dir / name, min(timeout, left()))
            records += got
        runs.append(run)
        if run.skipped:
            print(shorten(f"bench all: {name} {run.skipped}", _width()), flush=True)
            continue
        result = run.error or f"records: {run.num_records}"
        print(shorten(f"  {result} in {run.wall_s:.1f} s", _width()), flush=True)
    records += [BenchRecord.failed(run.name, run.error) for run in runs if run.error]
    write_records(records, out_dir)
    (out_dir / "bench_runs.json").write_bytes(
        msgspec.json.format(msgspec.json.encode(runs), indent=2)
    )
    meta.breakdown = breakdown
    (out_dir / "bench_meta.json").write_bytes(
        msgspec.json.format(msgspec.json.encode(meta), indent=2)
    )
    _write_report(out_dir, records, runs, meta, opts.page)
    from gramcoord.benchmarks._plot import plot

    plot(records, breakdown, out_dir / "bench.png")
    width = _width()
    print(console_table(records, width))
    total = sum(r.wall_s for r in runs) + (breakdown.wall_s if breakdown else 0.0)
    print(f"wrote {out_dir}/bench.json, bench.md, bench.png; {total:.0f} s in children")
    print(f"bench all: {targets_line(records)}; every record whole in bench.md")
    failed = any(r.error for r in runs) or (breakdown is not None and breakdown.error)
    return 1 if failed else 0
