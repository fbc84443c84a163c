"""The measured load factor (``tests/load.py``) and the limits that grow with it."""

from __future__ import annotations

import pytest

from tests import load


@pytest.mark.parametrize(
    ("load1", "ncores", "expected"),
    [(0.3, 2, 1.0), (2.0, 2, 1.0), (30.0, 2, 15.0), (6.0, 4, 1.5)],
)
def test_the_run_queue_per_core_is_at_least_one(load1, ncores, expected):
    assert load.queue_factor(load1, ncores) == expected


def test_a_busy_loop_gets_at_most_a_whole_core():
    assert load.share_factor(0.01) >= 1.0


def test_the_factor_is_measured_at_least_one_and_capped():
    assert 1.0 <= load.factor() <= load.MAX_FACTOR


def test_the_override_sets_the_factor_and_refuses_nonsense(monkeypatch):
    monkeypatch.setenv(load.ENV, "3")
    assert load.factor() == 3.0
    assert load.scaled(5) == 15.0
    for bad in ("0.5", "fast", "inf"):
        monkeypatch.setenv(load.ENV, bad)
        with pytest.raises(ValueError, match=load.ENV):
            load.factor()


def test_deadlines_scale_and_a_step_timeout_rounds_up_to_a_tenth():
    assert load.scaled(4.0, 2.5) == 10.0
    assert load.step_timeout(5.0, 1.0) == 5.0
    assert load.step_timeout(5.0, 1.234) == 6.2


def test_a_factor_is_kept_between_measurements(monkeypatch):
    monkeypatch.delenv(load.ENV, raising=False)
    monkeypatch.setattr(load, "_last", None)
    calls = []
    monkeypatch.setattr(load, "share_factor", lambda: calls.append(1) or 2.0)
    monkeypatch.setattr(load, "queue_factor", lambda: 1.0)
    assert load.factor() == load.factor() == 2.0
    assert len(calls) == 1


@pytest.mark.timeout(7)
def test_a_tests_own_timeout_is_scaled_by_the_factor_measured_at_its_start(request):
    [f] = [v for k, v in request.node.user_properties if k == "load_factor"]
    assert request.node.get_closest_marker("timeout").args[0] == 7 * f


def test_the_default_timeout_is_scaled_too(request):
    [f] = [v for k, v in request.node.user_properties if k == "load_factor"]
    base = float(request.config.getoption("timeout", None) or request.config.getini("timeout"))
    assert request.node.get_closest_marker("timeout").args[0] == base * f
