"""What `gramcoord run` and `verify` print: the headline and the verdicts."""

from __future__ import annotations

import pytest

from gramcoord.launch import summary_table
from gramcoord.launch.run import _own_disagreement
from gramcoord.launch.summary import Determinism, Mismatch


@pytest.mark.parametrize(
    ("det", "start"),
    [
        pytest.param(Determinism(ranks_compared=2), "nothing compared: ", id="nothing"),
        pytest.param(Determinism(ranks_compared=1), "nothing compared: ", id="one-rank"),
        pytest.param(
            Determinism(ranks_compared=2, steps_compared=4, rows_compared=9), "identical: ", id="ok"
        ),
        pytest.param(
            Determinism(ranks_compared=2, rows_compared=9, mismatches=1), "1 MISMATCHES", id="bad"
        ),
    ],
)
def test_determinism_line_is_honest(det, start):
    assert summary_table.determinism_line(det).startswith(start)


class _Summary:
    def __init__(self) -> None:
        self.requests = {"total": 3}
        self.wall_s = 1.25
        self.loop_s = 0.5


def test_headline_includes_start_up(monkeypatch):
    monkeypatch.setattr(summary_table, "_command_started", None)
    assert "3 requests in 1.2s on rank 0 (step loop 0.5s)" in summary_table.headline(_Summary())
    summary_table.command_started()
    monkeypatch.setattr(summary_table, "_command_started", summary_table._command_started - 7.0)
    text = summary_table.headline(_Summary())
    assert "s wall, start-up included (rank 0 1.2s, step loop 0.5s)" in text
    assert float(text.split(" requests in ")[1].split("s wall")[0]) >= 7.0


def test_verify_names_the_first_own_disagreement():
    det = Determinism(mismatches=2, first=[Mismatch("mask digest", "r1", 4, (3,))])
    assert _own_disagreement(det) == (
        "the topology run's own ranks disagree: mask digest of request 'r1' at position 4 "
        "on rank(s) [3]"
    )
    det = Determinism(mismatches=1, first=[Mismatch("replica output", "r2", -1, (1,))])
    assert "replica output of request 'r2' in its output on rank(s) [1]" in _own_disagreement(det)
