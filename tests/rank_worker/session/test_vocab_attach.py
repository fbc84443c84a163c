"""Ranks that attach with different vocabularies fail at attach, before any request."""

from __future__ import annotations

import pytest

from tests.procs import run_ranks
from tests.rank_worker.vocab_ranks import attach_body


@pytest.mark.spawn
@pytest.mark.timeout(120)
def test_same_vocabulary_attaches_and_runs():
    results = run_ranks(attach_body, 2, args=(("host-vocab", "host-vocab"),), timeout=90)
    assert [r.value["mismatch"] for r in results] == [None, None]
    assert all(r.value["seq"] == 0 for r in results)


@pytest.mark.spawn
@pytest.mark.timeout(120)
def test_different_vocabularies_fail_on_every_rank_at_attach():
    results = run_ranks(attach_body, 2, args=(("host-vocab", "other-vocab"),), timeout=90)
    for r in results:
        assert r.value["mismatch"] == [1], r.value
        assert "ranks [1] attached a different vocabulary" in r.value["message"]
