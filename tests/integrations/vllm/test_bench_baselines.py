"""The benchmarks whose baseline is vLLM's own code, run with vLLM.

``gramcoord bench transport`` and ``gramcoord bench step`` send through
``vllm.distributed.device_communicators.shm_broadcast.MessageQueue`` (the
queue vLLM's executor sends every RPC through, the grammar bitmask
included); where vLLM is missing those rows are skipped, which the main
suite checks (``tests/benchmarks``). Here they run: the transport rows have
figures, for a mask in the pickle stream (8 rows) and one sent out of band
(64 rows, over 1 MiB); the vLLM-style step loop produces the same outputs
as ours and the SGLang-style loop in a dp=2 x tp=2 gloo world; and neither
leaves a segment in /dev/shm or a socket in the temp dir. ``bench
compile``'s ``VllmRefail`` (vLLM's own per-request validation, then its
compiler settings) rejects the bad specs where vLLM does and passes good ones.
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path

import pytest

# conftest.py fails the run here without vLLM under GRAMCOORD_REQUIRE_VLLM=1.
pytest.importorskip("vllm")

from gramcoord.benchmarks import compile as compile_bench
from gramcoord.benchmarks import step as bench
from gramcoord.benchmarks import transport
from gramcoord.launch.workload import dev_data_dir
from tests.benchmarks.test_compile_bench import check_poisoned_rows
from tests.benchmarks.test_step_bench import way_outputs, world

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(300)]


def _left() -> set[str]:
    """vLLM queue segments that no process maps, and the folders of the queues' sockets."""
    shm = {p.name for p in Path("/dev/shm").glob("psm_*")}
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:
            continue
        shm = {n for n in shm if n not in text}
    return shm | {p.name for p in Path(tempfile.gettempdir()).glob("gramcoord-vllm-mq-*")}


@pytest.fixture
def no_leaks():
    """Nothing of vLLM's queues outlives the test (other processes' are left alone)."""
    before = _left()
    yield
    gc.collect()
    assert _left() - before == set()


def test_transport_measures_vllms_queue(no_leaks):
    records = transport.run(["--iters", "5", "--warmup", "1", "--rounds", "1", "--rows", "8,64"])
    vllm = [r for r in records if r.baseline == "vllm_shm_broadcast"]
    assert [r.name for r in vllm] == [
        "shm_ring_inplace[8x4748]",
        "shm_ring[8x4748]",
        "shm_ring_inplace[64x4748]",
        "shm_ring[64x4748]",
    ]
    assert all(r.skipped is None and r.baseline_median_ms > 0 for r in records)
    assert vllm[0].target == 2.0 and vllm[1].target is None


def test_three_ways_agree_in_a_dp2_tp2_world(run_id, no_leaks):
    values, opts = world(run_id, ("ours", "sglang", "vllm"))
    # It raises OutputsDiffer on any difference between the three runs.
    records = bench.way_records(values, opts)
    names = {r.name for r in records}
    assert {"step_overhead_vs_sglang", "step_overhead_vs_vllm", "step_overhead_vs_floor"} <= names
    outputs = way_outputs(values, "vllm")
    assert len(outputs) == 4
    assert all(o.status == "ok" and o.token_ids for o in outputs.values())
    assert all(r.skipped is None and r.median_ms > 0 for r in records)
    assert all(r.baseline_median_ms > 0 for r in records)


STR = {"type": "string"}


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        pytest.param(compile_bench.BAD_EBNF, "validation", id="undefined-rule"),
        pytest.param({"grammar": 'root ::= "a"'}, "", id="good-ebnf"),
        pytest.param({"json": {"type": "integer", "multipleOf": 3}}, "validation", id="walk"),
        pytest.param(
            {"json": {"type": "object", "properties": {"a": False}, "required": ["a"]}},
            "validation",
            id="unsatisfiable",
        ),
        pytest.param({"json": {"type": "object", "properties": {"a": STR}}}, "", id="good"),
        pytest.param({"json": json.dumps({"type": "boolean"})}, "", id="good-text"),
    ],
)
def test_vllm_refail_rejects_where_vllm_does(tiny_tokenizer, spec, where):
    request = compile_bench.VllmRefail(tiny_tokenizer).request(spec)
    assert request() == where
    assert request() == where  # nothing is remembered: the same verdict again


def test_poisoned_rows_measure_vllms_own_validation(qwen_tokenizer):
    check_poisoned_rows(qwen_tokenizer)


def test_bad_dev_specs_are_refused_by_vllm(qwen_tokenizer):
    specs = compile_bench._bad_dev_specs(dev_data_dir())
    assert specs, "the dev data holds schemas xgrammar refuses"
    vllm = compile_bench.VllmRefail(qwen_tokenizer)
    assert all(vllm.request(s)() for s in specs)
