"""``gramcoord bench jump_forward`` counts what it reports.

With the synthetic (text-keyed) model every output must keep its text and
no run may take more steps.
"""

from __future__ import annotations

import pytest

from gramcoord.benchmarks import jump_forward as bench
from gramcoord.engine.models import SyntheticModel


@pytest.fixture(scope="module")
def instances(qwen_tokenizer):
    args = bench._args(["--max-label-ms", "15"])
    return bench.usable_instances(qwen_tokenizer, bench.dev_records(args), False, 6)


def test_synthetic_model_keeps_every_output(qwen_tokenizer, instances):
    tally = bench.measure(qwen_tokenizer, SyntheticModel(qwen_tokenizer), instances, max_tokens=512)
    assert tally.num_runs == len(instances) >= 4
    assert tally.same_text == tally.num_runs == tally.stopped_off
    assert tally.num_jumps > 0
    assert tally.steps_on < tally.steps_off
    row = bench._record(False, 512, tally)
    assert row.name == "jump_forward_steps_synthetic_ws0" and row.target == 1.333
    assert row.ratio == pytest.approx(tally.steps_off / tally.steps_on, rel=1e-3)
