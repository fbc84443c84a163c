"""Run progress: the ranks' counts reach the launcher's bar (``launch/progress.py``).

The channel is driven by hand (a fake clock, explicit refreshes): nothing
here depends on how fast anything runs. The end-to-end tests run real
launches and read what the ranks left in the channel as it closes, and one
runs ``gramcoord run`` with its stderr on a pseudo-terminal.
"""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

import gramcoord.launch.progress as progress_mod
from gramcoord.launch.config import load_config
from gramcoord.launch.progress import (
    ProgressChannel,
    ProgressDisplay,
    ProgressWriter,
    local_bar,
    watch_progress,
)
from gramcoord.launch.run import launch
from tests import load
from tests.launch.e2e_support import (
    CONFIGS,
    ROOT,
    SMALL_IDS,
    SMALL_MAX_TOKENS,
    fast,
    leak_guarded,
    write_workload,
)

leak_guard = pytest.fixture(autouse=True)(leak_guarded)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_counts_of_every_origin_are_summed_and_throttled_writes_are_not_lost():
    channel = ProgressChannel()
    clock = Clock()
    try:
        assert channel.read() == (0, None)  # nobody reported yet
        a = ProgressWriter(channel.directory, 0, min_interval_s=1.0, clock=clock)
        b = ProgressWriter(channel.directory, 2, min_interval_s=1.0, clock=clock)
        a(0, 4)
        b(1, 3)
        assert channel.read() == (1, 7)
        a(1, 4)  # inside the interval: kept, not written
        assert channel.read() == (1, 7)
        clock.now += 1.0
        a(2, 4)  # the interval passed: the newest count is written
        assert channel.read() == (3, 7)
        b(2, 3)
        b.flush()  # the end of the loop writes what is pending
        assert channel.read() == (4, 7)
        a(4, 4)  # the last count is written at once
        b(3, 3)
        assert channel.read() == (7, 7)
        # Only the counts are in the directory (temporary names are renamed away).
        assert sorted(os.listdir(channel.directory)) == ["progress-0.msgpack", "progress-2.msgpack"]
    finally:
        channel.close()
    assert not Path(channel.directory).exists()
    a(4, 5)  # the launcher went away: no error, no directory made again
    assert not Path(channel.directory).exists()


def test_a_rank_without_the_directory_writes_nothing(tmp_path):
    missing = tmp_path / "elsewhere"  # e.g. a rank on another host
    w = ProgressWriter(str(missing), 1)
    w(1, 2)
    w(2, 2)
    w.flush()
    assert not w.enabled and not missing.exists()
    assert not ProgressWriter("", 0).enabled


def test_the_bar_is_drawn_on_a_terminal_only():
    out = io.StringIO()
    term = Console(file=out, force_terminal=True, width=80)
    channel = ProgressChannel()
    try:
        display = ProgressDisplay(channel, term, interval_s=3600)
        with display:
            assert display.refresh() == (0, None)
            ProgressWriter(channel.directory, 0)(3, 8)
            assert display.refresh() == (3, 8)
            (task,) = display.bar.tasks
            assert (task.completed, task.total) == (3, 8)
            ProgressWriter(channel.directory, 1)(5, 5)
        # Leaving draws the last counts once more before the bar goes.
        assert "8/13" in out.getvalue()

        plain = io.StringIO()
        display = ProgressDisplay(channel, Console(file=plain, force_terminal=False))
        with display:
            display.refresh()
        assert not display.active and plain.getvalue() == ""
    finally:
        channel.close()
    assert local_bar(Console(file=io.StringIO(), force_terminal=False)) == (None, None)
    bar, cb = local_bar(Console(file=io.StringIO(), force_terminal=True))
    cb(1, 2)
    assert (bar.tasks[0].completed, bar.tasks[0].total) == (1, 2)


def test_watch_progress_removes_its_directory_on_an_exception():
    with pytest.raises(KeyboardInterrupt), watch_progress(Console(file=io.StringIO())) as d:
        assert Path(d).is_dir()
        raise KeyboardInterrupt
    assert not Path(d).exists()


def test_a_channel_lives_in_the_run_directory_and_the_next_removes_a_killed_ones(tmp_path):
    out = tmp_path / "out"  # made by the channel if missing
    left = ProgressChannel(out)  # as a SIGKILLed launcher leaves it: never closed
    ProgressWriter(left.directory, 0)(1, 2)
    assert Path(left.directory).parent == out and Path(left.directory).is_dir()
    (out / "summary.json").write_text("{}")  # the run's own files stay
    with watch_progress(Console(file=io.StringIO()), parent=out) as d:
        assert not Path(left.directory).exists()
        assert Path(d).parent == out and Path(d).name.startswith(".progress-")
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


# -- real launches ------------------------------------------------------------------------


@pytest.fixture
def small_workload(tmp_path):
    return write_workload(tmp_path / "small.jsonl", SMALL_IDS, max_tokens=SMALL_MAX_TOKENS)


@pytest.fixture
def last_counts(monkeypatch):
    """What the channel holds as each launch closes it."""
    seen: list[tuple[int, int | None]] = []
    close = ProgressChannel.close

    def record(self):
        seen.append(self.read())
        close(self)

    monkeypatch.setattr(progress_mod.ProgressChannel, "close", record)
    return seen


@pytest.mark.spawn
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        pytest.param(
            "local.yaml", ["launcher=inline", "parallel.dp=1", "parallel.tp=1"], id="inline"
        ),
        pytest.param("ray.yaml", [], id="ray"),
    ],
)
def test_every_origin_reports_to_the_launcher(
    tmp_path, small_workload, last_counts, config, overrides
):
    cfg = load_config(CONFIGS / config, [*fast(), *overrides])
    result = launch(cfg, str(small_workload), tmp_path / "out", progress=True)
    assert result.exit_code == 0, result.error
    n = len(SMALL_IDS)
    # Replicated DP: each replica runs every request.
    replicas = cfg.parallel.dp if cfg.parallel.requests == "replicated" else 1
    assert last_counts == [(n * replicas, n * replicas)]


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_gramcoord_run_under_torchrun_draws_the_bar_on_a_terminal(tmp_path, small_workload):
    """stdout a pipe, stderr a pseudo-terminal: the launcher's bar reaches it with
    the counts of both DP replicas (the workers' own consoles go to the logs)."""
    master, slave = pty.openpty()
    argv = [sys.executable, "-m", "gramcoord.launch.cli", "run", str(CONFIGS / "local.yaml")]
    argv += ["--workload", str(small_workload), "--out", str(tmp_path / "out")]
    for item in fast():
        argv += ["--set", item]
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL
    )
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed it
                break
            if not data:
                break
            chunks.append(data)
        out, _ = proc.communicate(timeout=load.scaled(200))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    term = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, term + out.decode()
    n = len(SMALL_IDS)
    assert f"{n}/{n}" in term, term
    assert "gramcoord run:" in out.decode()  # the table, on stdout
    assert f"{n}/{n}" not in out.decode()  # no bar where there is no terminal
