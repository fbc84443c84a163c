"""``gramcoord bench step`` compares like with like.

- the workload slice holds only requests every way can run, and ``copies``
  / ``max_tokens`` shape it as documented;
- per-step figures come from the forward calls and the logits work between
  them, nothing else;
- a difference between the ways' outputs is an error, never a figure;
- on a small workload in a real dp=2 x tp=2 gloo world, ours and the
  SGLang-style loop produce identical outputs, no segment is left behind, and
  without the vLLM-style way (it needs vLLM) its rows say so. The three ways
  together, vLLM's queue included, run in the vLLM suite
  (``tests/integrations/vllm/test_bench_baselines.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gramcoord.benchmarks import step as bench
from gramcoord.benchmarks._step_common import (
    Output,
    RankRun,
    bench_requests,
    step_samples_ms,
)
from gramcoord.benchmarks._step_ranks import WorldOptions
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.spec import validate_spec
from tests.procs import run_ranks

WORKLOAD = Path(__file__).resolve().parents[2] / "configs" / "workload.jsonl"


def test_slice_holds_only_runnable_json_and_regex_requests():
    base = bench_requests(WORKLOAD)
    assert base, "the shipped workload has usable records"
    for r in base:
        assert r.kind in ("json", "regex")
        validate_spec(r.raw, GrammarConfig())  # ours would admit it
    ids = {r.request_id for r in base}
    assert not any("bad/" in i for i in ids)


def test_copies_and_token_cap():
    base = bench_requests(WORKLOAD, limit=3)
    got = bench_requests(WORKLOAD, limit=3, copies=3, max_tokens=5)
    assert len(base) == 3 and len(got) == 9
    assert [r.request_id for r in got[3:6]] == [f"{r.request_id}#1" for r in base]
    assert {r.max_tokens for r in got} == {5}
    assert [r.text for r in got[6:]] == [r.text for r in base]


def test_step_samples_subtract_only_logits_work_between_forwards():
    ms = 1e-3
    run = RankRun(
        way="x",
        rank=0,
        # forward 0-1 ms (2 rows), next at 5 ms; an idle step (0 rows) at 5-6 ms;
        # the last call closes the step before it.
        calls=[(0.0, 1 * ms, 2), (5 * ms, 6 * ms, 0), (8 * ms, 9 * ms, 1), (12 * ms, 13 * ms, 1)],
        # 2 ms of kernel + pick after the first forward; 0.5 ms after the third;
        # one call inside a forward is not in any gap.
        logits_work=[(1 * ms, 2 * ms), (2 * ms, 3 * ms), (9 * ms, 9.5 * ms), (0.5 * ms, 0.6 * ms)],
    )
    got = [x for pair in step_samples_ms(run) for x in pair]
    assert got == pytest.approx([4.0, 2.0, 3.0, 2.5])


def test_outputs_that_differ_are_an_error():
    a = {"r1": Output("ok", "grammar_end", [1, 2, 3])}
    same = {"r1": Output("ok", "grammar_end", [1, 2, 3])}
    assert bench.check_outputs({"ours": [a], "sglang": [same]}) == (1, 3)
    other = {"r1": Output("ok", "grammar_end", [1, 9, 3])}
    with pytest.raises(bench.OutputsDiffer, match=r"vllm \(round 0\).*'r1'.*position 1"):
        bench.check_outputs({"ours": [a], "sglang": [same], "vllm": [other]})
    with pytest.raises(bench.OutputsDiffer, match="missing"):
        bench.check_outputs({"ours": [a], "sglang": [{}]})


def world(run_id: str, ways: tuple[str, ...]) -> tuple[list, WorldOptions]:
    """A small workload through ``ways`` in a dp=2 x tp=2 gloo world: the ranks' results."""
    opts = WorldOptions(
        workload=str(WORKLOAD),
        limit=4,
        copies=1,
        max_tokens=6,
        max_num_seqs=2,
        rounds=1,
        step_timeout_s=60.0,
        ways=ways,
        run_id=run_id,
    )
    results = run_ranks("gramcoord.benchmarks._step_ranks:child", 4, args=(opts,), timeout=150)
    return [r.value for r in results], opts


def way_outputs(values: list, way: str) -> dict:
    return {
        k: v for res in values for run in res.runs if run.way == way for k, v in run.outputs.items()
    }


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_ours_and_sglang_style_agree_and_vllm_rows_say_they_need_vllm(run_id):
    values, opts = world(run_id, ("ours", "sglang"))
    # It raises OutputsDiffer on any difference between the runs.
    records = {r.name: r for r in bench.way_records(values, opts)}
    assert {"step_overhead_vs_sglang", "step_overhead_vs_floor"} <= records.keys()
    outputs = way_outputs(values, "sglang")
    assert len(outputs) == 4
    assert all(o.status == "ok" and o.token_ids for o in outputs.values())
    for name, r in records.items():
        if name.endswith("_vs_vllm"):
            assert r.skipped.startswith("needs vLLM") and r.met is None and r.target == 2.0
        else:
            assert r.skipped is None and r.median_ms > 0 and r.baseline_median_ms > 0
