"""The benchmark contract shared by every module of ``gramcoord.benchmarks``.

A benchmark is a module of the ``gramcoord.benchmarks`` package
(``benchmarks/NAME.py``, or ``benchmarks/NAME_bench.py`` where ``NAME``
would shadow a package; installed with the package) with a top-level
``run(args: list[str]) -> list[BenchRecord]``. Modules whose name starts
with ``_``, or that define no ``run``, are helpers. ``gramcoord bench NAME
--out DIR`` runs one, prints its records (``format_table``) and writes
``DIR/bench.json``; ``gramcoord bench all`` (``benchmarks/_all.py``) runs
every one.

``ratio`` is the baseline's median time divided by ours, so higher is
better. ``target`` is the ratio the design asks for (``None`` when the row
only reports). Every figure is a median over repeats measured in the same
run as its baseline; never compare single timings.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import re
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from gramcoord.launch.workload import DATA_DIR_ENV, dev_data_dir

PACKAGE = "gramcoord.benchmarks"
# The dev-data subset (tests/data in a checkout) installed with the package.
DATA_PACKAGE = "gramcoord.dev_data"


class BenchRecord(msgspec.Struct, kw_only=True):
    # What was measured, e.g. "cache_hit_admission".
    name: str
    # What it was compared with, e.g. "cold_compile".
    baseline: str
    median_ms: float
    baseline_median_ms: float
    # baseline_median_ms / median_ms: higher is better.
    ratio: float
    # Required ratio, or None when the row only reports.
    target: float | None = None
    # Absolute bound on median_ms, for targets stated in time.
    target_ms: float | None = None
    # Whether every target given holds (None without a target).
    met: bool | None = None
    # Free-form context: sizes, rank counts, absolute targets.
    note: str = ""
    # The benchmark that wrote the row (``gramcoord bench`` fills it in).
    bench: str = ""
    # Set on a row that stands for a benchmark that failed (crashed, timed
    # out, wrote nothing): why. Its figures are 0 and ``met`` is False.
    error: str | None = None
    # Set on a row this environment cannot measure (why): its baseline is a
    # package missing here. No figures; neither met nor missed.
    skipped: str | None = None

    @classmethod
    def failed(cls, bench: str, error: str) -> BenchRecord:
        """The row ``gramcoord bench all`` writes for a benchmark that produced no records."""
        return cls(
            name=bench,
            baseline="-",
            median_ms=0.0,
            baseline_median_ms=0.0,
            ratio=0.0,
            met=False,
            bench=bench,
            error=error,
        )

    @classmethod
    def needs_vllm(
        cls, name: str, baseline: str, bench: str, target: float | None = None
    ) -> BenchRecord:
        """The row of a baseline that is vLLM's own code, where vLLM is not importable."""
        return cls(
            name=name,
            baseline=baseline,
            median_ms=0.0,
            baseline_median_ms=0.0,
            ratio=0.0,
            target=target,
            skipped="needs vLLM, not importable here: run `make venv-vllm`, then "
            f"`.venv-vllm/bin/gramcoord bench {bench}`",
        )

    @classmethod
    def compare(
        cls,
        name: str,
        baseline: str,
        ours_ms: float,
        base_ms: float,
        target: float | None = None,
        note: str = "",
        target_ms: float | None = None,
    ) -> BenchRecord:
        ratio = base_ms / ours_ms if ours_ms > 0 else float("inf")
        checks = [ratio >= target] if target is not None else []
        if target_ms is not None:
            checks.append(ours_ms <= target_ms)
        return cls(
            name=name,
            baseline=baseline,
            median_ms=round(ours_ms, 6),
            baseline_median_ms=round(base_ms, 6),
            ratio=round(ratio, 4),
            target=target,
            target_ms=target_ms,
            met=all(checks) if checks else None,
            note=note,
        )


def median_ms(fn: Callable[[], object], *, repeat: int = 21, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in milliseconds, with GC paused."""
    return round_robin_ms([fn], repeat=repeat, warmup=warmup, pause_gc=True)[0]


def round_robin_ms(fns, *, repeat: int, warmup: int = 1, pause_gc: bool = False) -> list[float]:
    """Median ms of each function, timed one call each in turn, so that a change
    in the machine's load hits every contender alike (same-run baselines)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    enabled = gc.isenabled()
    if pause_gc:
        gc.disable()
    try:
        for _ in range(repeat):
            for fn, out in zip(fns, samples):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
    finally:
        if pause_gc and enabled:
            gc.enable()
    return [statistics.median(s) for s in samples]


def interleaved_ms(fns: dict, repeat: int) -> dict[str, float]:
    """Median ms of each function, measured in alternating rounds of ``median_ms``.

    The machine is shared, so load drifts; alternating short rounds puts every
    contender under the same drift. The order is fixed, so every rank of a
    multi-rank benchmark runs the same sequence and its collectives pair up.
    """
    per: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(3, repeat // 5)):
        for name, fn in fns.items():
            per[name].append(median_ms(fn, repeat=5, warmup=1))
    return {name: statistics.median(v) for name, v in per.items()}


# -- the table ---------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else (f"{x:.2f}" if x >= 1 else f"{x:.4f}")


def target_text(r: BenchRecord) -> str:
    parts = [] if r.target is None else [f">= {r.target:g}x"]
    if r.target_ms is not None:
        parts.append(f"<= {r.target_ms:g} ms")
    return ", ".join(parts) or "-"


def cells(r: BenchRecord, bold: bool = False) -> list[str]:
    """A record's cells from its baseline on: baseline, ours ms, baseline ms,
    ratio, target, met, note (``bold``: Markdown's **NO** and **ERROR**)."""
    star = "**" if bold else ""
    if r.error is not None:
        return ["-"] * 5 + [f"{star}ERROR{star}", r.error]
    if r.skipped is not None:
        return [r.baseline, "-", "-", "-", target_text(r), "skipped", r.skipped]
    met = "-" if r.met is None else ("yes" if r.met else f"{star}NO{star}")
    ratio = f"{r.ratio:.2f}x"
    return [
        r.baseline,
        _ms(r.median_ms),
        _ms(r.baseline_median_ms),
        ratio,
        target_text(r),
        met,
        r.note,
    ]


def shorten(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def format_table(records: list[BenchRecord], width: int | None = None) -> str:
    """The records as a plain table. With ``width`` no line is wider: names and
    baselines are cut at 36 columns and the note gets what is left (none when
    fewer than 12 columns are); ``bench.json`` and ``bench.md`` have them whole."""
    head = ["benchmark: record", "baseline", "ours ms", "base ms", "ratio", "target", "met"]
    rows = [[*head, "note"]]
    rows += [[f"{r.bench}: {'ERROR' if r.error else r.name}", *cells(r)] for r in records]
    cut = 36 if width else 1 << 30
    rows = [[shorten(row[0], cut), shorten(row[1], cut), *row[2:]] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(7)]
    room = (width - sum(widths) - 14) if width else 1 << 30
    rows.insert(1, ["-" * w for w in widths] + [""])

    def line(row: list[str]) -> str:
        text = "  ".join(c.ljust(w) for c, w in zip(row, widths))
        if room >= 12:
            text += "  " + shorten(row[7], room)
        text = text.rstrip()
        return text if not width or len(text) <= width else text[: width - 1] + "…"

    return "\n".join(line(row) for row in rows)


def write_records(records: list[BenchRecord], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(records), indent=2))
    return path


# -- data ----------------------------------------------------------------------------


def installed_data_dir() -> Path | None:
    """The dev-data subset installed with the package, where no other is found.

    ``dev_data_dir()`` finds the data of a checkout (``$GRAMCOORD_DATA_DIR``,
    ``../shared/data``, ``tests/data``). An installed package has no
    checkout, so it ships the ``tests/data`` subset as ``gramcoord.dev_data``;
    this is that folder, or None when the checkout's data is there (or
    ``$GRAMCOORD_DATA_DIR`` names a folder), so a checkout keeps its order.
    """
    if os.environ.get(DATA_DIR_ENV) or (dev_data_dir() / "schemas-dev.jsonl").is_file():
        return None
    return package_dir(DATA_PACKAGE, "schemas-dev.jsonl")


def package_dir(package: str, holding: str) -> Path | None:
    """The folder of ``package`` that holds the file ``holding``, or None.

    These data packages are namespace packages, whose ``__path__`` may also
    hold an editable install's path hook, which ``importlib.resources`` does
    not accept; so the folders are searched directly.
    """
    try:
        pkg = importlib.import_module(package)
    except ModuleNotFoundError:
        return None
    return next((Path(e) for e in pkg.__path__ if (Path(e) / holding).is_file()), None)


# The shipped workload: installed with the package, or the checkout's configs/.
WORKLOAD = (
    package_dir("gramcoord.configs", "workload.jsonl")
    or Path(__file__).resolve().parents[1] / "configs"
) / "workload.jsonl"


def dev_labelled(data: Path) -> Iterator[tuple[dict, dict]]:
    """Every record of ``data/schemas-dev.jsonl`` with its xgrammar label ({} without one)."""
    labels = {}
    for line in (data / "schemas-dev.xgrammar-labels.jsonl").read_text().splitlines():
        rec = json.loads(line)
        labels[rec["id"]] = rec
    for line in (data / "schemas-dev.jsonl").read_text().splitlines():
        rec = json.loads(line)
        yield rec, labels.get(rec["id"], {})


def add_data_arg(parser, *, max_label_ms: float | None = None) -> None:
    """The ``--data`` option every benchmark that reads dev data takes; with
    ``max_label_ms``, also ``--max-label-ms`` (that default)."""
    parser.add_argument(
        "--data",
        type=Path,
        default=installed_data_dir() or dev_data_dir(),
        help="folder of schemas-dev.jsonl (default: $GRAMCOORD_DATA_DIR, ../shared/data, "
        "tests/data; installed without a checkout: the subset installed with the package)",
    )
    if max_label_ms is not None:
        parser.add_argument(
            "--max-label-ms",
            type=float,
            default=max_label_ms,
            help="skip schemas whose labelled compile is slower",
        )


# -- discovery ---------------------------------------------------------------------


def _modules(package: str) -> dict[str, str]:
    """Benchmark name -> module: the public modules of ``package`` that define ``run``.

    A module ``NAME_bench`` is benchmark ``NAME`` (``vllm_bench``: a module
    named ``vllm`` would shadow the vLLM package wherever ``benchmarks/`` is
    on ``sys.path``). Found by reading the sources, so listing them imports
    no benchmark (and none of torch or xgrammar).
    """
    out = {}
    for folder in importlib.import_module(package).__path__:
        for path in Path(folder).glob("[!_]*.py"):
            if re.search(r"^def run\(", path.read_text(encoding="utf-8"), re.M):
                out[path.stem.removesuffix("_bench")] = path.stem
    return dict(sorted(out.items()))


def available(package: str = PACKAGE) -> list[str]:
    """Names of the benchmarks in ``package`` (``_modules``), sorted."""
    return list(_modules(package))


def load(name: str, package: str = PACKAGE) -> ModuleType:
    """Import benchmark ``name``; an unknown name exits with the list of known ones."""
    modules = _modules(package)
    if name not in modules:
        raise SystemExit(f"unknown benchmark {name!r}; available: {', '.join(modules)}, all")
    return importlib.import_module(f"{package}.{modules[name]}")


def run_bench(
    name: str, args: list[str], out_dir: Path, *, package: str = PACKAGE
) -> list[BenchRecord]:
    """Run benchmark ``name`` with ``args``, print its records and write ``bench.json``.

    A SIGTERM (``bench all``'s deadline) ends the run as an exception would,
    so the benchmark's ``finally`` blocks stop what it started in sessions
    of its own (vLLM's servers), which ending this process's group misses.
    """
    module = load(name, package)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        records = module.run(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    for r in records:
        r.bench = r.bench or name
    print(format_table(records))
    print(f"wrote {write_records(records, out_dir)}")
    return records


def _exit_on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


# -- child processes -----------------------------------------------------------------


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def spawn(cmd: list[str], log: Path, **kw) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (``end_group`` ends it), its output in ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **kw,
        )


def end_group(proc: subprocess.Popen, grace_s: float = 5.0) -> bool:
    """Terminate, then kill, the process group ``proc`` leads (started with
    ``start_new_session``) and reap ``proc``; True if nothing of the group is left.

    Runs after a normal exit too: a child that returned may still have left a
    rank, a receiver or an engine core behind in its group.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_alive(proc.pid):
            break
        os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, or the group never empties
            if not _group_alive(proc.pid):
                break
            time.sleep(0.05)
    proc.wait()
    return not _group_alive(proc.pid)
