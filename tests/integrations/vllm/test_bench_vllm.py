"""``gramcoord bench vllm --quick --parts step`` and ``--parts bill`` on the real engine: the reports' shape.

Two in-process engines (vLLM's xgrammar backend, then gramcoord), the same
requests; no timing is asserted, only that every record is there with its
figures and the head record carries the design's target. The TP=2
head-of-line part (two more engine pairs under torchrun) runs in the
benchmark itself; its records' shape is checked without an engine in
``tests/benchmarks/test_bench_vllm.py``.
"""

from __future__ import annotations

import json

import pytest

# conftest.py fails the run here without vLLM under GRAMCOORD_REQUIRE_VLLM=1.
pytest.importorskip("vllm")

from gramcoord.benchmarks._vllm_records import PARTS
from gramcoord.launch.cli import main

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(900)]


def test_quick_step_run_reports_every_record(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    args = ["--quick", "--parts", "step", "--workdir", str(tmp_path / "work")]
    assert main(["bench", "vllm", "--out", str(out), "--", *args]) == 0
    records = {r["name"]: r for r in json.loads((out / "bench.json").read_text())}
    head = records["vllm_engine_step_gramcoord"]
    assert head["baseline"] == "vllm_engine_step_xgrammar" and head["target"] == 1.0
    assert head["median_ms"] > 0 and head["baseline_median_ms"] > 0
    assert head["met"] in (True, False)
    # The plain steps side by side, and gramcoord's per-step hook timed in both phases.
    assert records["vllm_step_plain_gramcoord"]["baseline"] == "vllm_step_plain_xgrammar"
    for phase in ("plain", "constrained"):
        hook = records[f"vllm_step_hook_{phase}_gramcoord"]
        assert hook["median_ms"] > 0 and hook["baseline_median_ms"] > 0
    for backend in ("gramcoord", "xgrammar"):
        assert records[f"vllm_step_constrained_{backend}"]["baseline_median_ms"] > 0
        for part in PARTS:
            assert f"vllm_step_part_{part}_{backend}" in records
        # The worker applied masks, and the scheduler built them.
        assert records[f"vllm_step_part_apply_grammar_bitmask_{backend}"]["median_ms"] > 0
        assert records[f"vllm_step_part_grammar_bitmask_{backend}"]["median_ms"] > 0


def test_quick_bill_run_reports_its_table(tmp_path, monkeypatch) -> None:
    """``--parts bill``: OpenAI servers of both backends started, stopped and restarted
    (gramcoord on a spec store), offline children; every record there, outputs checked."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    args = ["--quick", "--parts", "bill", "--workdir", str(tmp_path / "work")]
    assert main(["bench", "vllm", "--out", str(out), "--", *args]) == 0
    records = {r["name"]: r for r in json.loads((out / "bench.json").read_text())}
    for what in ("cold", "warm", "restart"):
        row = records[f"vllm_bill_ttft_{what}_gramcoord"]
        assert row["baseline"] == f"vllm_bill_ttft_{what}_xgrammar"
        assert row["median_ms"] > 0 and row["baseline_median_ms"] > 0
        # Greedy on the same vocabulary and compile calls: the same reply on both.
        assert "identical across backends: True" in row["note"], row["note"]
    assert records["vllm_bill_restart_over_warm_gramcoord"]["target"] == round(1 / 1.2, 3)
    throughput = records["vllm_bill_constrained_gramcoord"]
    assert "identical across backends: True" in throughput["note"], throughput["note"]
    assert records["vllm_bill_mixing_radius_gramcoord"]["median_ms"] > 0
    # The restarted gramcoord server found its spec store and compiled nothing on the path.
    logs = "\n".join(p.read_text() for p in (tmp_path / "work").glob("bill-gramcoord-*.log"))
    assert "specs compiled at start, 0 refused" in logs
    assert "joined the warm-start compile" in logs
