"""``gramcoord bench jump_forward`` counts what it reports.

With the synthetic (text-keyed) model every output must keep its text and
no run may take more steps; with the token-conditioned tiny Qwen2 the
counts must add up, whatever the outputs.
"""

from __future__ import annotations

import pytest

from gramcoord.benchmarks import jump_forward as bench
from gramcoord.engine.models import HFModel, SyntheticModel, build_tiny_qwen2


@pytest.fixture(scope="module")
def instances(qwen_tokenizer):
    args = bench._args(["--max-label-ms", "15"])
    return bench.usable_instances(qwen_tokenizer, bench.dev_records(args), False, 6)


def test_synthetic_model_keeps_every_output(qwen_tokenizer, instances):
    tally = bench.measure(
        qwen_tokenizer, SyntheticModel(qwen_tokenizer), "synthetic", instances, max_tokens=512
    )
    assert tally.num_runs == len(instances) >= 4
    assert tally.same_text == tally.num_runs == tally.stopped_off
    assert tally.num_jumps > 0
    assert tally.steps_on < tally.steps_off
    row = bench._record("synthetic", False, 512, tally)
    assert row.name == "jump_forward_steps_synthetic_ws0" and row.target == 1.333
    assert row.ratio == pytest.approx(tally.steps_off / tally.steps_on, rel=1e-3)


def test_hf_model_counts_add_up(qwen_tokenizer, instances):
    model = HFModel(
        build_tiny_qwen2(vocab_size=qwen_tokenizer.vocab_size), vocab_size=qwen_tokenizer.vocab_size
    )
    tally = bench.measure(qwen_tokenizer, model, "hf", instances[:3], max_tokens=24)
    assert tally.num_runs == 3
    assert tally.stopped_off + tally.length_off == 3
    assert tally.same_text_stopped <= tally.same_text <= 3
    assert tally.same_ids <= tally.same_text
    assert tally.steps_on > 0
    assert 0 < tally.steps_off <= 3 * 24
    assert bench._record("hf", True, 24, tally).target is None
