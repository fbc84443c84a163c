"""The host-engine checks both plugins share: internals and the version series."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from gramcoord.integrations.internals import check, check_version


@pytest.fixture
def engine(monkeypatch):
    """An importable module standing for an installed engine, version set per test."""
    module = types.ModuleType("gramcoord_test_engine")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


@pytest.mark.parametrize(
    ("version", "ok", "warns"),
    [
        ("1.4.2", True, False),
        ("1.4.9", True, True),
        ("1.4", True, True),
        ("1.40.0", False, False),
        ("1.5.0", False, False),
        ("1.3.9", False, False),
    ],
)
def test_version_series(engine, caplog, version, ok, warns):
    engine.__version__ = version
    caplog.set_level(logging.WARNING, logger="gramcoord.integrations.internals")
    if ok:
        assert check_version("Engine", engine.__name__, "1.4", "1.4.2") == version
        assert ("untested" in caplog.text) == warns
    else:
        with pytest.raises(RuntimeError, match=rf"supports Engine 1\.4\.x .*Engine {version} is"):
            check_version("Engine", engine.__name__, "1.4", "1.4.2")


def test_a_module_without_a_version_is_refused(engine):
    with pytest.raises(RuntimeError, match="Engine unknown is installed"):
        check_version("Engine", engine.__name__, "1.4", "1.4.2")


def test_internals_name_what_is_missing_or_changed(monkeypatch):
    def f(a, b):
        return a + b

    here = __name__
    monkeypatch.setattr(sys.modules[here], "sample", f, raising=False)
    problems = check(
        [
            (here, "sample", ("a", "b"), "matches"),
            (here, "sample", ("a",), "changed"),
            (here, "no_such_thing", None, "missing"),
            ("no_such_module_here", "x", None, "missing"),
        ]
    )
    assert len(problems) == 3
    assert "sample: parameters ('a', 'b'), expected ('a',)" in problems[0]
    assert "no_such_thing: missing" in problems[1]
    assert "no_such_module_here.x: missing" in problems[2]
