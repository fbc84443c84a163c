"""TP workers with schedulers of their own follow the leader: read its rows, or fill their own.

SGLang runs a scheduler on every TP rank and every one compiles and masks
the same grammar (sglang#13809); vLLM's external launcher does the same per
rank. With ``parallel.tp_followers`` each worker follows its leader's
decision every step, so the schedules never diverge, and either reads the
leader's rows from shared memory (``read``: no compile on the worker) or
fills its own (``fill``: what SGLang does).
"""

from __future__ import annotations

import statistics

import pytest

from tests.procs import run_ranks
from tests.rank_worker.follower_ranks import scheduler_body


@pytest.mark.spawn
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["read", "fill"])
def test_followers_schedule_and_mask_like_the_leader(mode):
    leader, follower = (r.value for r in run_ranks(scheduler_body, 2, args=(mode,), timeout=150))
    assert leader["log"] == follower["log"]
    assert leader["outputs"] == follower["outputs"]
    assert leader["outputs"]["bad"] == ("failed", "grammar_invalid")
    assert sum(1 for s, _ in leader["outputs"].values() if s == "ok") >= 5
    assert leader["digests"] == follower["digests"] and leader["digests"]
    # Only a filling follower compiles; a reading one never does.
    assert leader["compiles"] > 0
    assert (follower["compiles"] > 0) == (mode == "fill")
    print(
        f"{mode}: follower mask ms p50 {statistics.median(follower['mask_ms']):.3f} "
        f"(leader build {statistics.median(leader['mask_ms']):.3f}) over "
        f"{len(follower['mask_ms'])} steps"
    )
