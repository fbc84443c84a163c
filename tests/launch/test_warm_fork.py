"""torchrun's workers forked warm from the launcher start as spawned ones would."""

from __future__ import annotations

import atexit
import functools
import io
import json
import signal
import sys

import pytest

from gramcoord.launch import warm_fork
from gramcoord.launch.launchers import check_outcomes, launch_torchrun
from tests.launch import entries
from tests.load import scaled


def test_fork_unless_spawn_is_asked_for(monkeypatch):
    monkeypatch.delenv("GRAMCOORD_TORCHRUN_START", raising=False)
    assert warm_fork.start_method() == "fork"  # no CUDA in these tests
    monkeypatch.setenv("GRAMCOORD_TORCHRUN_START", "spawn")
    assert warm_fork.start_method() == "spawn"


@pytest.mark.timeout(300)
def test_a_forked_worker_keeps_the_imports_but_not_the_hosts_handlers(monkeypatch, tmp_path):
    # The host's state a worker must not inherit: a SIGTERM handler, a
    # replaced stdout (as pytest's capture or a progress display does), an
    # atexit hook that would run (and write the host's files) in every rank.
    marker = tmp_path / "host-atexit-ran"
    hook = functools.partial(marker.write_text, "ran")
    monkeypatch.setattr(entries, "PARENT_MARK", "set in the launcher")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    prior = signal.signal(signal.SIGTERM, lambda *_: None)
    atexit.register(hook)
    host_hooks = atexit._ncallbacks()
    try:
        outcomes = launch_torchrun(
            "tests.launch.entries:inherited", b"", nproc=2, deadline_s=scaled(120)
        )
    finally:
        atexit.unregister(hook)
        signal.signal(signal.SIGTERM, prior)
    reports = [json.loads(v) for v in check_outcomes(outcomes)]
    assert len(reports) == 2
    for report in reports:
        assert report["mark"] == "set in the launcher"  # forked: no import again
        assert report["sigterm_default"]
        assert report["stdout_fd"] == 1
        assert report["atexit_hooks"] < host_hooks  # only hooks of its own
    assert not marker.exists()  # the workers ended without running the host's hook
