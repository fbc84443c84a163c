"""``gramcoord bench all`` end to end on a cheap selection: one real benchmark with
tiny arguments, one that fails, one past its deadline.
"""

from __future__ import annotations

import importlib.util
import json

import msgspec
import pytest

from gramcoord.benchmarks._all import PAGE_BEGIN, PAGE_END, target_counts, targets_line
from gramcoord.benchmarks._contract import BenchRecord, format_table
from gramcoord.launch.cli import main
from tests.launch.entries import descendants

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(180)]

TINY_TRANSPORT = "transport=--iters 5 --warmup 1 --rounds 1 --rows 8"


@pytest.fixture
def no_strays(tmp_path, monkeypatch):
    """Run from outside the checkout; no process of the run may outlive it."""
    monkeypatch.chdir(tmp_path)
    before = descendants()
    yield
    assert descendants() - before == set()


def test_a_failing_benchmark_is_an_error_row_and_the_others_still_run(
    tmp_path, no_strays, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "100")
    out = tmp_path / "out"
    page = tmp_path / "performance.md"
    page.write_text(f"# Performance\n\n{PAGE_BEGIN}\n{PAGE_END}\n")
    argv = ["bench", "all", "--out", str(out), "--only", "compile,transport"]
    argv += ["--args", TINY_TRANSPORT, "--args", "compile=--repeat not-a-number"]
    assert main([*argv, "--page", str(page)]) == 1
    console = capsys.readouterr().out
    # Every line fits, but those that name the output directory or the page.
    paths = (str(out), str(page))
    fits = [len(ln) for ln in console.splitlines() if not any(p in ln for p in paths)]
    assert max(fits) <= 100, console
    met, missed, failed = target_counts(
        msgspec.json.decode((out / "bench.json").read_bytes(), type=list[BenchRecord])
    )
    assert failed == 1
    assert console.splitlines()[-1].startswith(
        f"bench all: targets: {met} met, {missed} missed, 1 benchmarks failed"
    ), console
    records = json.loads((out / "bench.json").read_text())
    by_bench = {}
    for r in records:
        by_bench.setdefault(r["bench"], []).append(r)
    assert set(by_bench) == {"compile", "transport"}
    (err,) = by_bench["compile"]
    assert err["error"].startswith("exit 2:") and "--repeat" in err["error"]
    assert err["met"] is False
    transport = by_bench["transport"]
    assert transport and all(r["error"] is None for r in transport)
    # vLLM's own queue is the baseline of the rows skipped where vLLM is not
    # importable (the main venv); they say so and carry no figure.
    skipped = [r for r in transport if r["skipped"] is not None]
    assert bool(skipped) == (importlib.util.find_spec("vllm") is None)
    assert {r["baseline"] for r in skipped} <= {"vllm_shm_broadcast"}
    assert all(r["skipped"].startswith("needs vLLM") and r["met"] is None for r in skipped)
    assert all(r["median_ms"] > 0 for r in transport if r not in skipped)
    # Each benchmark's own output stays beside the merged one.
    assert json.loads((out / "transport" / "bench.json").read_text()) == transport
    assert "invalid int value" in (out / "compile" / "log.txt").read_text()
    runs = {r["name"]: r for r in json.loads((out / "bench_runs.json").read_text())}
    assert runs["transport"]["exit_code"] == 0 and runs["compile"]["exit_code"] == 2
    assert runs["transport"]["num_records"] == len(transport)
    md = (out / "bench.md").read_text()
    assert "**ERROR**" in md and "| transport | shm_ring[8x4748] |" in md
    assert ("| skipped | needs vLLM" in md) == bool(skipped)
    # The page gets bench.md's tables under the command and the commit.
    meta = json.loads((out / "bench_meta.json").read_text())
    assert meta["command"].startswith("gramcoord bench all --out ")
    block = page.read_text().split(PAGE_BEGIN)[1]
    assert f"`{meta['command']}` at commit `{meta['commit']}`" in block
    assert md.rstrip() in block


def test_a_benchmark_past_its_deadline_is_killed_with_its_group(tmp_path, no_strays):
    out = tmp_path / "out"
    argv = ["bench", "all", "--out", str(out), "--only", "transport"]
    # One second, for a run of minutes: the deadline, never the machine's speed, ends it.
    argv += ["--args", "transport=--iters 100000 --rounds 50", "--timeout-s", "1"]
    assert main(argv) == 1
    (row,) = json.loads((out / "bench.json").read_text())
    assert row["bench"] == "transport" and row["error"] == "timed out after 1 s"
    (run,) = json.loads((out / "bench_runs.json").read_text())
    assert run["exit_code"] is None and run["wall_s"] < 30


def test_a_spent_budget_skips_what_is_left(tmp_path, no_strays):
    out = tmp_path / "out"
    argv = ["bench", "all", "--out", str(out), "--only", "transport"]
    argv += ["--budget-s", "0"]
    assert main(argv) == 1
    (row,) = json.loads((out / "bench.json").read_text())
    assert row["error"] == "not run: the run's budget is spent"
    assert not (out / "transport").exists()


def _record(**kw) -> BenchRecord:
    base = dict(name="r", baseline="b", median_ms=1.0, baseline_median_ms=2.0, ratio=2.0)
    return BenchRecord(**{**base, **kw})


@pytest.mark.parametrize("width", [60, 100, 200])
def test_the_console_table_fits_the_width_and_the_verdict_counts_targets(width):
    long_note = "a note that goes on " * 40  # 800 characters, as the real ones can be
    records = [
        _record(name="x" * 80, baseline="shm_ring_inplace_vs_vllm_queue" * 2, note=long_note),
        _record(name="met", target=1.5, met=True, bench="fill", note="short"),
        _record(name="missed", target=3.0, met=False, bench="fill"),
        BenchRecord.failed("agreement", "timed out after 240 s " + "x" * 500),
    ]
    text = format_table(records, width)
    lines = text.splitlines()
    assert len(lines) == 2 + len(records)
    assert max(len(ln) for ln in lines) <= width, text
    assert "fill: met" in text and "agreement: ERROR" in text
    # Notes take what the other columns leave: none at 60 columns.
    assert ("note" in lines[0]) == (width == 200)
    if width == 200:
        assert "a note that goes on" in text and "short" in text
    assert target_counts(records) == (1, 1, 1)
    assert targets_line(records) == "targets: 1 met, 1 missed, 1 benchmarks failed"
