"""``gramcoord bench all`` end to end on a cheap selection: one real benchmark with
tiny arguments, one that fails, one past its deadline.

The default config's run is skipped (``--no-run``): ``test_bench.py`` covers
reading its summary, and ``make run`` covers the run itself.
"""

from __future__ import annotations

import json

import pytest

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


def test_a_failing_benchmark_is_an_error_row_and_the_others_still_run(tmp_path, no_strays):
    out = tmp_path / "out"
    argv = ["bench", "all", "--out", str(out), "--no-run", "--only", "compile,transport"]
    argv += ["--args", TINY_TRANSPORT, "--args", "compile=--repeat not-a-number"]
    assert main(argv) == 1
    records = json.loads((out / "bench.json").read_text())
    by_bench = {}
    for r in records:
        by_bench.setdefault(r["bench"], []).append(r)
    assert set(by_bench) == {"compile", "transport"}
    (err,) = by_bench["compile"]
    assert err["error"].startswith("exit 2:") and "--repeat" in err["error"]
    assert err["met"] is False
    transport = by_bench["transport"]
    assert transport and all(r["error"] is None and r["median_ms"] > 0 for r in transport)
    # Each benchmark's own output stays beside the merged one.
    assert json.loads((out / "transport" / "bench.json").read_text()) == transport
    assert "invalid int value" in (out / "compile" / "log.txt").read_text()
    runs = {r["name"]: r for r in json.loads((out / "bench_runs.json").read_text())}
    assert runs["transport"]["exit_code"] == 0 and runs["compile"]["exit_code"] == 2
    assert runs["transport"]["num_records"] == len(transport)
    md = (out / "bench.md").read_text()
    assert "**ERROR**" in md and "| transport | shm_ring[8x4748] |" in md
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_a_benchmark_past_its_deadline_is_killed_with_its_group(tmp_path, no_strays):
    out = tmp_path / "out"
    argv = ["bench", "all", "--out", str(out), "--no-run", "--only", "transport"]
    # One second: still importing torch, let alone done.
    argv += ["--args", TINY_TRANSPORT, "--timeout-s", "1"]
    assert main(argv) == 1
    (row,) = json.loads((out / "bench.json").read_text())
    assert row["bench"] == "transport" and row["error"] == "timed out after 1 s"
    (run,) = json.loads((out / "bench_runs.json").read_text())
    assert run["exit_code"] is None and run["wall_s"] < 30


def test_a_spent_budget_skips_what_is_left(tmp_path, no_strays):
    out = tmp_path / "out"
    argv = ["bench", "all", "--out", str(out), "--no-run", "--only", "transport"]
    argv += ["--budget-s", "0"]
    assert main(argv) == 1
    (row,) = json.loads((out / "bench.json").read_text())
    assert row["error"] == "not run: the run's budget is spent"
    assert not (out / "transport").exists()
