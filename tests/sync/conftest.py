"""Fixtures for the transport tests: run ids, spawned peers, leak checks."""

from __future__ import annotations

import time
from queue import Empty

import pytest

from gramcoord.launch.procs import ProcGroup


class Peers(ProcGroup):
    """Spawned peers (daemonic) that are terminated, killed and joined at teardown."""

    def __init__(self) -> None:
        super().__init__(daemon=True)

    def results(self, queue, count: int, timeout: float = 90.0) -> dict[str, tuple]:
        """``count`` reports from ``queue``, by name; fails after ``timeout`` s."""
        got: dict[str, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(got) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"only {sorted(got)} of {count} peers reported within {timeout} s")
            try:
                report = queue.get(timeout=min(remaining, 0.5))
            except Empty:
                if not any(p.is_alive() for p in self.started) and queue.empty():
                    codes = [p.exitcode for p in self.started]
                    pytest.fail(f"peers exited (codes {codes}) with only {sorted(got)} reported")
                continue
            got[report[0]] = report
        return got


@pytest.fixture
def peers(run_id):
    """Spawn helper; every process it started is reaped afterwards.

    It depends on ``run_id`` so that the children are gone before the leak
    check runs.
    """
    helper = Peers()
    try:
        yield helper
    finally:
        helper.close()
