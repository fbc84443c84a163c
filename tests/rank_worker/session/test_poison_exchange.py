"""``poison_exchange: host``: replicas step at their own rates, poison moves at host syncs."""

from __future__ import annotations

import pytest

from tests.procs import run_ranks
from tests.rank_worker.poison_ranks import host_exchange_body


@pytest.mark.spawn
@pytest.mark.timeout(120)
def test_host_exchange_shares_poison_between_replicas_stepping_apart():
    results = [r.value for r in run_ranks(host_exchange_body, 2, timeout=90)]
    assert results[0]["steps"] == 8 and results[1]["steps"] != 8
    # Between the exchange and the next step rank 0 still compiles the spec.
    assert results[0]["before"] == "pending"
    assert [r["shared"] for r in results] == [1, 1]
    # Rank 0 never saw the spec before the exchange; now it fails at once.
    for r in results:
        assert (r["status"], r["code"], r["cache"]) == ("failed", "grammar_invalid", "poisoned")
    # With the message of the replica that learnt it (the compiler's own words).
    assert results[0]["message"] == results[1]["message"], results
    assert "undefined_rule" in results[0]["message"], results
