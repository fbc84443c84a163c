"""The benchmark contract shared by every ``benchmarks/NAME.py``.

A benchmark script defines ``run(args: list[str]) -> list[BenchRecord]``.
``gramcoord bench NAME --out DIR`` loads ``benchmarks/NAME.py``, runs it,
prints the records as a table and writes ``DIR/bench.json``.

``ratio`` is the baseline's median time divided by ours, so higher is
better. ``target`` is the ratio the design asks for (``None`` when the row
only reports). Every figure is a median over repeats measured in the same
run as its baseline; never compare single timings.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


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
        checks = []
        if target is not None:
            checks.append(ratio >= target)
        if target_ms is not None:
            checks.append(ours_ms <= target_ms)
        met = all(checks) if checks else None
        return cls(
            name=name,
            baseline=baseline,
            median_ms=round(ours_ms, 6),
            baseline_median_ms=round(base_ms, 6),
            ratio=round(ratio, 4),
            target=target,
            target_ms=target_ms,
            met=met,
            note=note,
        )


def median_ms(fn: Callable[[], object], *, repeat: int = 21, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in milliseconds, with GC paused."""
    for _ in range(warmup):
        fn()
    samples = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    finally:
        if enabled:
            gc.enable()
    return statistics.median(samples)


def format_table(records: list[BenchRecord]) -> str:
    header = ("name", "baseline", "ours ms", "base ms", "ratio", "target", "met", "note")
    rows = [
        (
            r.name,
            r.baseline,
            f"{r.median_ms:.4f}",
            f"{r.baseline_median_ms:.4f}",
            f"{r.ratio:.2f}x",
            " ".join(
                t
                for t in (
                    "" if r.target is None else f">={r.target:g}x",
                    "" if r.target_ms is None else f"<={r.target_ms:g}ms",
                )
                if t
            )
            or "-",
            "-" if r.met is None else ("yes" if r.met else "NO"),
            r.note,
        )
        for r in records
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def write_records(records: list[BenchRecord], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(records), indent=2))
    return path


def add_data_arg(parser) -> None:
    """The ``--data`` option every benchmark that reads dev data takes."""
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="folder of schemas-dev.jsonl (default: $GRAMCOORD_DATA_DIR, ../shared/data, "
        "else tests/data)",
    )


def available() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


def run_bench(name: str, args: list[str], out_dir: Path) -> list[BenchRecord]:
    """Load ``benchmarks/NAME.py``, run it, print and write its records."""
    path = BENCH_DIR / f"{name}.py"
    if not path.is_file():
        raise SystemExit(f"unknown benchmark {name!r}; available: {', '.join(available())}")
    spec = importlib.util.spec_from_file_location(f"gramcoord_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    records = module.run(args)
    print(format_table(records))
    written = write_records(records, out_dir)
    print(f"wrote {written}")
    return records
