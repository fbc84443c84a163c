"""The run summary's per-role call counts (``launch.summary.calls_per_step``)."""

from __future__ import annotations

import pytest

from gramcoord.engine.loop import RankReport
from gramcoord.launch.summary import calls_per_step, role_of


@pytest.mark.parametrize(
    ("coords", "role"),
    [
        pytest.param((0, 0, 0), "stage-0 leader", id="stage-0-leader"),
        pytest.param((1, 2, 0), "later stage leader", id="later-stage-leader"),
        pytest.param((0, 0, 1), "TP worker", id="tp-worker"),
    ],
)
def test_role_of(coords, role):
    assert role_of(coords) == role


def test_calls_per_step_average_the_ranks_of_a_role_per_step():
    def report(rank, coords, steps, calls):
        return RankReport(rank=rank, coords=coords, steps=steps, wall_s=1.0, calls=calls)

    reports = [
        report(0, (0, 0, 0), 10, {"agreement: blocking": 5, "poison: posted": 10}),
        report(1, (1, 0, 0), 20, {"agreement: blocking": 20}),
        report(2, (0, 0, 1), 10, {"batch frame: blocking": 10}),
        report(3, (1, 0, 1), 10, {}),  # one process: no runtime, no counts
    ]
    assert calls_per_step(reports) == {
        "TP worker": {"batch frame: blocking": 1.0},
        "stage-0 leader": {"agreement: blocking": 0.75, "poison: posted": 0.5},
    }
