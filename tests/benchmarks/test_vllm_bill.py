"""``gramcoord bench vllm --parts bill`` without an engine: the big schema, and the records
the rounds and the decode children give (their JSON made up here; the engine run is
``tests/integrations/vllm/test_bench_vllm.py``)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gramcoord.benchmarks._vllm_bill import (
    RESTART_TARGET,
    big_schema,
    bill_records,
    decode_records,
)


def test_the_big_schema_is_a_valid_schema_of_required_fields_of_six_kinds():
    schema = big_schema(500)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert len(schema["properties"]) == 500 == len(schema["required"])
    kinds = {json.dumps(p, sort_keys=True) for p in schema["properties"].values()}
    assert len(kinds) == 6
    assert big_schema(500) == schema  # the same schema on every call


def _round(cold: float, warm: float, restart: float, text: str = '{"a"', start: float = 30.0):
    return {
        "cold_s": cold,
        "warm_s": warm,
        "restart_s": restart,
        "start_s": start,
        "restart_start_s": start,
        "plain_s": 0.5,
        "restart_plain_s": 0.5,
        "text": text,
        "same_text": True,
    }


def test_bill_records_compare_ttft_with_xgrammar_and_restart_with_warm():
    got = {
        "rounds": 2,
        "properties": 500,
        "gramcoord": [_round(3.0, 0.050, 0.055), _round(3.2, 0.052, 0.060)],
        "xgrammar": [_round(3.4, 0.054, 2.2), _round(3.6, 0.056, 2.4)],
    }
    records = {r.name: r for r in bill_records(got)}
    cold = records["vllm_bill_ttft_cold_gramcoord"]
    assert cold.baseline == "vllm_bill_ttft_cold_xgrammar"
    assert cold.median_ms == pytest.approx(3100) and cold.baseline_median_ms == pytest.approx(3500)
    assert cold.met and records["vllm_bill_ttft_warm_gramcoord"].met
    restart = records["vllm_bill_restart_over_warm_gramcoord"]
    assert restart.target == RESTART_TARGET
    assert restart.ratio == pytest.approx(51 / 57.5, abs=1e-3) and restart.met
    assert "identical across backends: True" in cold.note

    got["gramcoord"][0]["text"] = "other"
    records = {r.name: r for r in bill_records(got)}
    assert "identical across backends: False" in records["vllm_bill_ttft_cold_gramcoord"].note


def test_a_restart_past_1_2x_its_warm_ttft_misses_the_target():
    got = {
        "rounds": 1,
        "properties": 500,
        "gramcoord": [_round(3.0, 0.050, 0.300)],
        "xgrammar": [_round(3.4, 0.054, 2.2)],
    }
    (restart,) = [r for r in bill_records(got) if r.name == "vllm_bill_restart_over_warm_gramcoord"]
    assert restart.met is False


def _decode(constrained: float, plain: float, mixed: float, alone: float, ids=((1, 2),)):
    return {
        "tokens": 64,
        "requests": 32,
        "ids": [list(i) for i in ids],
        "constrained_s": [constrained] * 3,
        "plain_s": [plain] * 3,
        "mixed_s": [mixed] * 3,
        "alone_s": [alone] * 3,
    }


def test_decode_records_give_throughput_and_the_mixing_radius():
    got = {
        "gramcoord": [_decode(3.0, 1.2, 1.02, 1.0)],
        "xgrammar": [_decode(3.1, 1.2, 1.03, 1.0)],
    }
    throughput, radius = decode_records(got)
    assert throughput.ratio == pytest.approx(3.1 / 3.0, abs=1e-3) and throughput.met
    assert f"gramcoord {32 * 64 / 3.0:.0f}" in throughput.note
    assert radius.median_ms == pytest.approx(1.02) and radius.met
    assert "identical across backends: True" in throughput.note
    got["xgrammar"][0]["ids"] = [[9]]
    assert "identical across backends: False" in decode_records(got)[0].note
