"""SGLang's real ``GrammarManager`` driving our backend in a 2-rank gloo world.

- compile skew (rank 1 compiles 0.4 s later): both ranks admit every
  request on the same iteration; SGLang's intersection holds the fast rank
  back, and our agreement in ``Future.result()`` confirms the outcome;
- a compile that fails on rank 1 only: SGLang alone would abort the request
  on rank 1 and run it on rank 0; here both ranks abort it, with the same
  message, and the key is poisoned on both (a resubmission fails at once);
- a spec store's warm start (an operator's list, slower on rank 1): the
  listed schema joins each rank's warm compile, on the same iteration;
- mismatched queues (rank 0 got a request rank 1 never did): SGLang pairs
  queue positions, so it would hand rank 0's ``c0`` and rank 1's ``c1`` the
  same slot; our fingerprint refuses, every rank fails all its pending
  requests with one message, and both abort that slot's request.
  Then rank 1's queue is empty: SGLang's ``has_waiting_grammars`` guard keeps
  it out of SGLang's own all_gather, and rank 0 fails there (gloo: peer gone
  or the group's timeout) instead of hanging. A host that broadcasts every
  request in the group (SGLang's TP and DP-attention schedulers do) never
  gets there: see ``gramcoord.integrations.sglang.backend``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from tests.load import scaled
from tests.procs import run_ranks

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def results():
    out = run_ranks(
        "tests.integrations.sglang.ranks:scenarios",
        2,
        timeout=scaled(240),
        init_timeout_s=60,
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    return [r.value for r in out]


def test_compile_skew_admits_in_lockstep(results) -> None:
    a, b = (r["skew"] for r in results)
    assert a == b
    assert {rid for _, rid, _ in a} == {"a0", "a1", "a2", "a3", "a4"}
    assert all(what == "SglangGrammar" for _, _, what in a)
    assert all(r["skew_collectives"] >= 1 for r in results)


def test_compile_failing_on_one_rank_fails_everywhere(results) -> None:
    a, b = (r["fail"] for r in results)
    assert a == b
    got = {rid: what for _, rid, what in a}
    assert got["b1"] == "SglangGrammar"
    assert got["b0"].startswith("aborted: Failed to compile json grammar: grammar_invalid")
    assert "rank(s) [1]" in got["b0"]
    assert "cached verdict, no compile ran for this request" in got["b2"]


def test_a_warm_start_keeps_the_ranks_in_lockstep(results) -> None:
    a, b = (r["warm"] for r in results)
    assert a == b
    assert sorted((rid, what) for _, rid, what in a) == [
        ("w0", "SglangGrammar"),
        ("w1", "SglangGrammar"),
    ]
    # The listed schema joined each rank's own warm compile.
    assert [r["warm_joined"] for r in results] == [1, 1]


def test_mismatched_queues_never_admit_the_wrong_request(results) -> None:
    a, b = (r["mismatch"] for r in results)
    # SGLang paired rank 0's c0 with rank 1's c1 (queue slot 0): both refused.
    assert [row[1] for row in a] == ["c0", "*"]
    assert [row[1] for row in b] == ["c1"]
    for row in (a[0], b[0]):
        assert row[2].startswith("aborted: ")
        # The one agreement's divergence: the code, what each rank holds
        # (pending per rank: 2 and 1), and the first differing request.
        assert "grammar_divergence: pending sets diverged" in row[2]
        assert "ranks [0] hold 2 in the window" in row[2]
        assert "ranks [1] hold 1 in the window" in row[2]
        assert "first differing request at window position 0" in row[2]
    assert a[0][2] == b[0][2]  # one message on every rank
    assert a[0][0] == b[0][0]  # the same iteration
    # Then only rank 0 has a queued request: SGLang's own all_gather fails
    # there (here: rank 1 has left; alive, it would be the group's 5 s timeout).
    assert a[1][2].startswith("error: RuntimeError")
    assert results[0]["mismatch_s"] < scaled(60)
