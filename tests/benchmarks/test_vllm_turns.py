"""``benchmarks._vllm_turns``: children take their rounds in turns, failures end the run.

Real child processes (plain Python, no engine) that log when each round
starts and ends; nothing here depends on speed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gramcoord.benchmarks._vllm_turns import Child, ChildFailed, parse_cpus, run_in_turns

CHILD = """
import sys, time
from pathlib import Path
from gramcoord.benchmarks._vllm_turns import turn
folder, name, rounds, ranks, trace = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
for r in range(rounds):
    for rank in range(ranks):
        with turn(folder, name, r, rank):
            with open(trace, "a") as f:
                f.write(f"{name} {r} {rank} start\\n")
            time.sleep(0.01)
            with open(trace, "a") as f:
                f.write(f"{name} {r} {rank} end\\n")
"""


def _child(tmp: Path, name: str, rounds: int, ranks: int = 1, code: str = CHILD) -> Child:
    script = tmp / f"{name}.py"
    script.write_text(code)
    cmd = [sys.executable, str(script), str(tmp / "turns"), name, str(rounds), str(ranks)]
    return Child(name, [*cmd, str(tmp / "trace")], tmp / f"{name}.log", ranks=ranks)


def test_rounds_alternate_between_children_one_at_a_time(tmp_path) -> None:
    children = [_child(tmp_path, "a", 3), _child(tmp_path, "b", 3, ranks=2)]
    run_in_turns(children, 3, tmp_path / "turns", timeout_s=120)
    lines = (tmp_path / "trace").read_text().split()
    events = [tuple(lines[i : i + 4]) for i in range(0, len(lines), 4)]
    order = [(name, r) for name, r, _, what in events if what == "start"]
    assert order == [("a", "0"), ("b", "0"), ("b", "0"), ("a", "1"), ("b", "1"), ("b", "1"),
                     ("a", "2"), ("b", "2"), ("b", "2")]  # fmt: skip
    # Never two rounds at once: every start is followed by its own end.
    for (n1, r1, k1, w1), (n2, r2, k2, w2) in zip(events[::2], events[1::2]):
        assert (n1, r1, k1, w1, w2) == (n2, r2, k2, "start", "end")


LAST_WAITS = """
import os, sys, time
from pathlib import Path
from gramcoord.benchmarks._vllm_turns import turn
folder = Path(sys.argv[1])
with turn(folder, "b", 0):
    pass
with turn(folder, "b", 1):
    # Hold the last round until child a, through all its rounds, has exited.
    pid = int((folder.parent / "a.pid").read_text())
    while Path(f"/proc/{pid}").exists() and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
        time.sleep(0.01)
"""

PID_FIRST = "import os\nfrom pathlib import Path\nPath(__file__).with_name('a.pid').write_text(str(os.getpid()))\n"


def test_a_child_through_all_its_rounds_may_exit_while_another_runs(tmp_path) -> None:
    children = [
        _child(tmp_path, "a", 2, code=PID_FIRST + CHILD),
        _child(tmp_path, "b", 2, code=LAST_WAITS),
    ]
    run_in_turns(children, 2, tmp_path / "turns", timeout_s=120)
    assert [c.proc.returncode for c in children] == [0, 0]


def test_a_child_that_exits_early_fails_the_run_with_its_log(tmp_path) -> None:
    crash = "import sys\nprint('boom: no engine')\nsys.exit(3)\n"
    children = [_child(tmp_path, "a", 2), _child(tmp_path, "b", 2, code=crash)]
    with pytest.raises(ChildFailed, match=r"(?s)b exited \(3\) before its last round.*boom"):
        run_in_turns(children, 2, tmp_path / "turns", timeout_s=120)
    assert all(c.proc is not None and c.proc.returncode is not None for c in children)


def test_a_child_that_never_reports_times_out(tmp_path) -> None:
    hang = "import time\ntime.sleep(600)\n"
    children = [_child(tmp_path, "a", 1, code=hang)]
    with pytest.raises(ChildFailed, match="deadline"):
        run_in_turns(children, 1, tmp_path / "turns", timeout_s=1)
    assert children[0].proc.returncode is not None  # its group was ended


def test_parse_cpus() -> None:
    assert parse_cpus("0") == {0}
    assert parse_cpus("0,1") == {0, 1}
    assert parse_cpus("0-2, 5") == {0, 1, 2, 5}
    with pytest.raises(ValueError):
        parse_cpus(" , ")
