"""Nothing finished is lost: kill a run, read its journal, resume it, restart it.

The workload is the shipped one read twice (102 requests, bad records
included), dp=2 x tp=2 under torchrun (``configs/local.yaml``), short
outputs. A clean run is the reference. Each test kills a run part-way:

- a rank SIGKILLs itself at a step drawn from the seed (``faults.kill_rank``):
  the run exits 1; every line its journal holds is a request's complete
  output, equal to the clean run's; ``--resume`` runs only the rest and ends
  with the clean run's ``outputs.jsonl``, each request once;
- the same with ``distributed.max_restarts: 2``: the group restarts, resumes
  from its journal, and exits 0 with every request done;
- the whole launcher and its ranks are SIGKILLed from outside (the process
  group), one journal's last line is damaged on top, and ``--resume``
  reruns that request too.

No process or ``/dev/shm`` entry is left behind (the leak guard).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from gramcoord.launch.cli import main
from gramcoord.launch.journal import read_lines, read_prior
from tests import load
from tests.launch.e2e_support import (
    CONFIGS,
    SHM,
    aborts,
    fast,
    leak_guarded,
    read_outputs,
    read_summary,
    sets,
)

leak_guard = pytest.fixture(autouse=True)(leak_guarded)

COMPARED = ("id", "status", "finish_reason", "text", "token_ids")
RUN = ("workload.repeat=2", "workload.max_tokens=32", "workload.arrival=per_step")
RUN += ("workload.per_step=4",)


def _run(out: Path, *extra: str, resume: bool = False) -> int:
    """One ``gramcoord run``, its deadlines scaled by the load now (``fast``)."""
    argv = ["run", str(CONFIGS / "local.yaml")]
    argv += ["--resume", str(out)] if resume else ["--out", str(out)]
    return main(argv + sets(*RUN, *fast(), *extra))


def _view(outputs: list[dict]) -> list[tuple]:
    return [(*(str(o[k]) for k in COMPARED), (o["error"] or {}).get("code")) for o in outputs]


@pytest.fixture(scope="module")
def clean_out(tmp_path_factory) -> Path:
    """The clean run's output directory (read it, or copy it; never change it)."""
    out = tmp_path_factory.mktemp("clean")
    assert _run(out) == 0
    return out


@pytest.fixture(scope="module")
def clean(clean_out):
    outputs = read_outputs(clean_out)
    assert len(outputs) == 102
    return {o["id"]: o for o in outputs}, _view(outputs)


def _journaled_equal_clean(out: Path, clean_by_id: dict) -> int:
    prior = read_prior(out)
    for rid, line in prior.outputs.items():
        assert _view([msgspec.to_builtins(line.record)]) == _view([clean_by_id[rid]]), rid
    return len(prior.outputs)


@pytest.mark.spawn
@pytest.mark.timeout(400)
@pytest.mark.parametrize("seed", [1, 2])
def test_a_killed_rank_loses_nothing_finished_and_resume_ends_like_a_clean_run(
    tmp_path, clean, capfd, seed
):
    clean_by_id, clean_view = clean
    rng = random.Random(seed)
    rank, step = rng.randrange(4), rng.randrange(15, 45)
    rc = _run(tmp_path, f"faults.kill_rank={rank}", f"faults.at_step={step}")
    assert rc == 1, capfd.readouterr().err
    # The survivors lost a peer mid-collective or got the agent's SIGTERM.
    assert aborts(tmp_path / "logs") == []
    finished = _journaled_equal_clean(tmp_path, clean_by_id)
    assert 0 < finished < len(clean_by_id), finished
    assert _run(tmp_path, resume=True) == 0
    outputs = read_outputs(tmp_path)
    assert _view(outputs) == clean_view  # every request once, in workload order
    journal = read_summary(tmp_path)["journal"]
    assert journal["carried"] == finished and journal["ran"] == len(clean_by_id) - finished
    assert journal["attempt"] == 1 and journal["restarts"] == 0
    assert aborts(tmp_path / "logs") == []


@pytest.mark.spawn
@pytest.mark.timeout(400)
def test_max_restarts_survives_a_lost_rank(tmp_path, clean, capfd):
    _, clean_view = clean
    rc = _run(tmp_path, "distributed.max_restarts=2", "faults.kill_rank=3", "faults.at_step=25")
    assert rc == 0, capfd.readouterr().err
    assert aborts(tmp_path / "logs") == []  # neither the failed attempt nor the restart
    assert _view(read_outputs(tmp_path)) == clean_view
    summary = read_summary(tmp_path)
    journal = summary["journal"]
    assert journal["restarts"] == 1 and journal["carried"] > 0
    assert journal["carried"] + journal["ran"] == len(clean_view)
    assert summary["determinism"]["mismatches"] == 0


@pytest.mark.spawn
@pytest.mark.timeout(400)
def test_sigkill_of_the_whole_run_then_a_damaged_line_then_resume(tmp_path, clean, leak_guard):
    clean_by_id, clean_view = clean
    argv = [sys.executable, "-m", "gramcoord.launch.cli", "run", str(CONFIGS / "local.yaml")]
    argv += ["--out", str(tmp_path), *sets(*RUN, *fast())]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    folder = tmp_path / "journal" / "attempt-0"
    deadline = time.monotonic() + load.scaled(200)
    try:
        # Kill once a few dozen requests are on disk.
        while time.monotonic() < deadline and proc.poll() is None:
            files = list(folder.glob("outputs-rank*.jsonl")) if folder.is_dir() else []
            if sum(len(read_lines(f)[0]) for f in files) >= 30:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it was killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # The killed agent's multiprocessing semaphores outlive it: whoever
        # SIGKILLs a process group removes them (gramcoord's own segments are
        # swept by the next run's janitor).
        time.sleep(0.5)
        for name in leak_guard.leaked_shm():
            if name.startswith("sem.mp-"):
                (SHM / name).unlink(missing_ok=True)
    finished = _journaled_equal_clean(tmp_path, clean_by_id)
    assert finished >= 30
    # Damage the last line of one origin's journal: that request runs again.
    path = sorted(folder.glob("outputs-rank*.jsonl"))[0]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x20
    path.write_bytes(bytes(data))
    assert _run(tmp_path, resume=True) == 0
    assert _view(read_outputs(tmp_path)) == clean_view
    journal = read_summary(tmp_path)["journal"]
    assert journal["dropped_lines"] >= 1 and journal["carried"] == finished - 1


@pytest.mark.spawn
def test_resume_refuses_a_changed_config_and_an_empty_dir(tmp_path, clean_out, capfd):
    assert _run(tmp_path / "none", resume=True) == 2
    assert "holds no journal" in capfd.readouterr().out
    # A finished run's journal (a copy of the clean run's: no run of its own).
    out = tmp_path / "run"
    shutil.copytree(clean_out, out)
    capfd.readouterr()
    assert _run(out, "sampling.seed=9", resume=True) == 2
    assert "changed since the run being resumed" in capfd.readouterr().out
