"""Fault injection through the ``faults`` config section.

Each test sets one fault with ``--set faults....`` and checks what must
notice it:

- a killed rank: run as a host would (one process per rank, no agent that
  stops the others), the survivor exits 1 within ``step_timeout_s + 10 s``
  (step timeout and slack both scaled by the load now, ``tests/load.py``)
  naming the lost rank (``PeerLostError``);
- a hung rank under ``gramcoord run`` (torchrun): the survivor names it, the
  run exits 1, and the hung process is ended with the run;
- a stalled TP reader: the writer names it (``TransportTimeout``);
- corrupted transport frames: counted, and the outputs do not change;
- an unset section: nothing is injected (every other e2e test runs that way).

Every test runs under the e2e leak guard: no process and no ``/dev/shm``
entry may outlive it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import pytest

from gramcoord.launch.cli import main
from gramcoord.launch.config import ConfigError, load_config
from tests import load
from tests.launch.e2e_support import (
    CONFIGS,
    SMALL_IDS,
    SMALL_MAX_TOKENS,
    aborts,
    leak_guarded,
    read_outputs,
    read_summary,
    sets,
    squash,
    write_workload,
)
from tests.procs import free_port

# On a quiet machine; every run scales them by the load measured at its start.
STEP_TIMEOUT_S = 5.0
RUN_TIMEOUT_S = 120.0
SLACK_S = 10.0


class Quick(NamedTuple):
    """A run's overrides and the bound a survivor exits within, for the load now."""

    load: float
    overrides: tuple[str, ...]
    bound_s: float


def quick() -> Quick:
    f = load.factor()
    step = load.step_timeout(STEP_TIMEOUT_S, f)
    overrides = (
        f"distributed.step_timeout_s={step}",
        f"distributed.run_timeout_s={load.step_timeout(RUN_TIMEOUT_S, f)}",
        "grammar.compile_mode=sync",
        "workload.arrival=all",
    )
    return Quick(f, overrides, step + load.scaled(SLACK_S, f))


leak_guard = pytest.fixture(autouse=True)(leak_guarded)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("workload") / "small.jsonl"
    return write_workload(path, SMALL_IDS, max_tokens=SMALL_MAX_TOKENS)


def _cli_raw(
    capfd, config, workload, out, *overrides, q: Quick | None = None
) -> tuple[int, str, str]:
    argv = ["run", str(CONFIGS / config), "--workload", str(workload), "--out", str(out)]
    rc = main(argv + sets(*(q or quick()).overrides, *overrides))
    captured = capfd.readouterr()
    raw = captured.out + "\n" + captured.err
    return rc, squash(raw), raw


def _cli(capfd, config, workload, out, *overrides) -> tuple[int, str]:
    return _cli_raw(capfd, config, workload, out, *overrides)[:2]


# -- the config section -------------------------------------------------------------


def test_faults_parse_from_overrides_and_name_bad_fields():
    config = load_config(
        CONFIGS / "local.yaml",
        [
            "faults.kill_rank=1",
            "faults.at_step=3",
            "faults.compile_delay={pattern: x, rank: 0, seconds: .inf}",
        ],
    )
    assert (config.faults.kill_rank, config.faults.at_step) == (1, 3)
    assert config.faults.compile_delay.seconds == float("inf")
    assert config.faults.ranks() == {"faults.kill_rank": 1, "faults.compile_delay.rank": 0}
    with pytest.raises(ConfigError, match=r"faults.hang_rank 4 is not a rank of a world of 4"):
        load_config(CONFIGS / "local.yaml", ["faults.hang_rank=4"])
    with pytest.raises(ConfigError, match=r"faults\.compile_delay\.pattern is not a regex"):
        load_config(None, ["faults.compile_delay={pattern: '(', rank: 0, seconds: 1}"])
    with pytest.raises(ConfigError, match="corrupt_frames_every"):
        load_config(None, ["faults.corrupt_frames_every=-1"])
    # Unset: no fault anywhere.
    assert load_config(CONFIGS / "local.yaml").faults.ranks() == {}


# -- a killed rank, ranks started as a host starts them -------------------------------


def _rank_procs(
    tmp_path, workload, world: int, overrides: list[str], q: Quick
) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        argv = [sys.executable, "-m", "gramcoord.launch.rank_main", str(CONFIGS / "local.yaml")]
        argv += ["--workload", str(workload), "--out", str(tmp_path), "--run-id", "faultkill"]
        argv += sets("launcher=external", *q.overrides, *overrides)
        procs.append(
            subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_killed_rank_is_named_by_the_survivor_within_the_bound(tmp_path, workload):
    q = quick()
    procs = _rank_procs(
        tmp_path,
        workload,
        2,
        ["parallel.tp=1", "parallel.requests=replicated", "faults.kill_rank=1", "faults.at_step=3"],
        q,
    )
    try:
        killed, survivor = procs[1], procs[0]
        killed.wait(timeout=load.scaled(120, q.load))
        died = time.monotonic()
        assert killed.returncode == -9, killed.stderr.read()
        _, err = survivor.communicate(timeout=q.bound_s + load.scaled(30, q.load))
        took = time.monotonic() - died
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert survivor.returncode == 1, err
    assert aborts(err, tmp_path / "logs") == []
    assert took <= q.bound_s, f"the survivor took {took:.1f} s after the kill"
    assert re.search(r"gramcoord: PeerLostError: .*rank 1\b", err), err
    assert "kills itself at step 3" in (tmp_path / "logs" / "rank1.log").read_text()


# -- a hung rank under gramcoord run ---------------------------------------------------


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_hung_rank_fails_the_run_naming_it(tmp_path, workload, capfd):
    q = quick()
    start = time.monotonic()
    rc, text, raw = _cli_raw(
        capfd,
        "local.yaml",
        workload,
        tmp_path,
        "parallel.tp=1",
        "faults.hang_rank=1",
        "faults.at_step=3",
        q=q,
    )
    took = time.monotonic() - start
    assert rc == 1, text
    assert "PeerLostError" in text and re.search(r"rank 1\b", text), text
    # Start-up, three steps, then the step timeout and the bound.
    assert took <= load.scaled(60, q.load) + q.bound_s, took
    assert "hangs at step 3" in (tmp_path / "logs" / "rank1.log").read_text()
    # Rank 0 lost its peer, rank 1 got torch's agent's SIGTERM: neither aborts.
    assert aborts(raw, tmp_path / "logs") == []
    # The cause in a line (and where the rest is), the traceback in the logs.
    lines = [ln for ln in raw.splitlines() if ln.strip()]
    assert len(lines) == 2 and "Traceback" not in raw, raw
    assert lines[0].startswith("gramcoord: the run failed: rank 0: PeerLostError:"), raw
    rank0 = (tmp_path / "logs" / "rank0.log").read_text()
    assert "Traceback" in rank0 and "PeerLostError" in rank0
    assert "--- rank 0 (PeerLostError" in (tmp_path / "logs" / "failures.log").read_text()


# -- the TP transport ------------------------------------------------------------------------


@pytest.mark.spawn
@pytest.mark.timeout(180)
def test_stalled_reader_is_named_by_the_writer(tmp_path, workload, capfd):
    rc, text = _cli(
        capfd,
        "local.yaml",
        workload,
        tmp_path,
        "parallel.dp=1",
        "transport.timeout_s=2",
        "distributed.step_timeout_s=30",
        "faults.stall_reader={rank: 1, seconds: 60, step: 1}",
    )
    assert rc == 1, text
    assert "TransportTimeout" in text and "rank1" in text, text


@pytest.mark.spawn
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_corrupted_frames_are_counted_and_change_nothing(tmp_path, workload, capfd, kind):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    common = ("parallel.dp=1", f"transport.kind={kind}")
    rc, text = _cli(capfd, "local.yaml", workload, clean, *common)
    assert rc == 0, text
    rc, text = _cli(capfd, "local.yaml", workload, faulty, *common, "faults.corrupt_frames_every=2")
    assert rc == 0, text
    transport = read_summary(faulty)["transport"]
    assert transport["corrupted"] >= 2, transport
    # Garbled frames reached the reader and were dropped there (the last
    # ones may still be queued when an shm reader, polling the ring, ends).
    assert 0 < transport["dropped"] <= transport["corrupted"], transport
    assert read_summary(clean)["transport"] == {"dropped": 0, "corrupted": 0}
    assert [(o["id"], o["token_ids"], o["status"]) for o in read_outputs(faulty)] == [
        (o["id"], o["token_ids"], o["status"]) for o in read_outputs(clean)
    ]


# -- Ctrl-C --------------------------------------------------------------------------------


@pytest.mark.spawn
@pytest.mark.timeout(240)
@pytest.mark.parametrize("to", ["group", "launcher"])
def test_ctrl_c_stops_every_rank_in_one_line_with_130(tmp_path, workload, to):
    """SIGINT while a rank hangs (so the run is certainly still going), to the
    whole process group as a terminal's Ctrl-C sends it, or to the launcher
    alone (``kill -INT``): one line, exit 130, and the leak guard finds no
    process and no /dev/shm entry left."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "gramcoord.launch.cli", "run", str(CONFIGS / "local.yaml")]
    argv += ["--workload", str(workload), "--out", str(out)]
    argv += sets(*quick().overrides, "parallel.tp=1", "faults.hang_rank=1", "faults.at_step=2")
    argv += sets("distributed.step_timeout_s=150")
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "COLUMNS": "1000"},
    )
    try:
        log = out / "logs" / "rank1.log"
        while not (log.is_file() and "hangs at step 2" in log.read_text()):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        if to == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=load.scaled(90))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    text = stdout + stderr
    assert proc.returncode == 130, text
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert lines == [f"gramcoord: interrupted; ranks stopped, partial logs in {out / 'logs'}"], text
