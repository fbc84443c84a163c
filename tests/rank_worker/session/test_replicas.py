"""``ReplicaPoison``: keys poisoned on one replica fail at once on the others."""

from __future__ import annotations

import pytest

from tests.procs import run_ranks
from tests.rank_worker.poison_ranks import replica_body


@pytest.mark.spawn
@pytest.mark.timeout(120)
def test_a_key_poisoned_on_one_replica_fails_at_once_on_another_with_its_message():
    r0, r1 = (r.value for r in run_ranks(replica_body, 2, timeout=90))
    status, code, message = r0["first"]
    assert (status, code) == ("failed", "grammar_invalid")
    # Rank 1 never compiled the spec: the key came poisoned, with rank 0's
    # message (the compiler's own words), though its manager came late.
    assert r1["compiles"] == 0
    cached = (
        "cached verdict, no compile ran for this request: an earlier compile of this "
        f"grammar failed: {message}; this grammar never compiles, so a retry fails the same"
    )
    assert r1["again"] == ("failed", "grammar_invalid", "poisoned", cached)
    assert r0["again"] == r1["again"]
    assert r0["received"] == r1["received"] == 1
