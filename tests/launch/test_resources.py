"""``launch.resources``: what a run left behind, with its janitors' exit allowed for."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from gramcoord.launch import resources
from tests.load import scaled


def _start(script: str, run_id: str, seconds: float) -> subprocess.Popen:
    env = {**os.environ, resources.RUN_ID_ENV: run_id}
    return subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep({seconds})", script], env=env
    )


def test_a_janitor_on_its_way_out_is_not_a_leftover_but_anything_else_is():
    # Run ids of this test alone: the scan sees the whole machine, and two
    # suites at once (a loaded run) found each other's "run-o" process.
    tag = uuid.uuid4().hex[:8]
    janitor = _start("janitor.py", f"run-j-{tag}", 1.0)  # its rank's pipe closed: it exits soon
    other = _start("rank.py", f"run-o-{tag}", 600.0)
    try:
        assert resources._run_processes(f"run-j-{tag}", grace_s=scaled(20)) == []
        left = resources._run_processes(f"run-o-{tag}", grace_s=scaled(20))
        assert len(left) == 1 and left[0].startswith(f"{other.pid} ")
    finally:
        for p in (janitor, other):
            p.kill()
            p.wait()
