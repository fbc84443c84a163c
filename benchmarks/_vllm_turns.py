"""Rounds of two benchmark children taken in turns (A B A B ...), and CPU pinning.

Two engines measured one after the other see different load on a shared
machine: in one run the plain steps of two engines running the same code
differed by 24%. ``gramcoord bench vllm`` therefore starts both backends'
children at once and lets them take turns, one round each, so load that
drifts over the run falls on both alike; only one runs at a time.

The turns are files in one folder. The parent writes ``{round}.{name}.go``;
every rank of that child waits for it before the round, and writes
``{round}.{name}.{rank}.done`` after it; the parent then gives the next child
its turn. Waiting costs a ``stat`` every ``POLL_S``.

``parse_cpus`` reads the ``--cpus`` style lists (``"0"``, ``"0,1"``, ``"0-3"``)
the children pin themselves with (``os.sched_setaffinity``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gramcoord.benchmarks._contract import end_group, spawn

POLL_S = 0.01


@contextmanager
def turn(folder: Path | None, name: str, round_no: int, rank: int = 0) -> Iterator[None]:
    """Inside: this child's round ``round_no`` (waits for its turn first; no-op without a folder)."""
    if folder is None:
        yield
        return
    go = folder / f"{round_no}.{name}.go"
    while not go.exists():
        time.sleep(POLL_S)
    yield
    done = folder / f"{round_no}.{name}.{rank}.done"
    done.with_suffix(".tmp").write_text("ok\n")
    done.with_suffix(".tmp").rename(done)


@dataclass
class Child:
    """One child of a turn-taking run: its command, log, and how many ranks report."""

    name: str
    cmd: list[str]
    log: Path
    ranks: int = 1
    proc: subprocess.Popen | None = None

    def done(self, folder: Path, round_no: int) -> bool:
        return all(
            (folder / f"{round_no}.{self.name}.{r}.done").exists() for r in range(self.ranks)
        )


class ChildFailed(RuntimeError):
    """A child exited early or the run passed its deadline."""

    def __init__(self, child: Child, why: str) -> None:
        tail = "\n".join(child.log.read_text(errors="replace").splitlines()[-25:])
        super().__init__(f"{child.name} {why}; {child.log}:\n{tail}")


def run_in_turns(children: list[Child], rounds: int, folder: Path, timeout_s: float) -> float:
    """Start every child, give each its turn for each round in order, wait for their exits.

    Every child's process group is ended on every path. Returns the wall
    seconds. Raises ``ChildFailed`` when one exits before its last round, exits
    with an error, or the run passes ``timeout_s``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    try:
        for child in children:
            child.proc = spawn(child.cmd, child.log)
        for round_no in range(rounds):
            for child in children:
                (folder / f"{round_no}.{child.name}.go").write_text("go\n")
                while not child.done(folder, round_no):
                    _check(children, folder, rounds, deadline)
                    time.sleep(POLL_S)
        for child in children:
            assert child.proc is not None
            try:
                rc = child.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise ChildFailed(child, f"timed out after {timeout_s:.0f} s") from None
            if rc != 0:
                raise ChildFailed(child, f"exit {rc}")
    finally:
        for child in children:
            if child.proc is not None:
                end_group(child.proc)
    return time.monotonic() - t0


def _check(children: list[Child], folder: Path, rounds: int, deadline: float) -> None:
    for child in children:
        assert child.proc is not None
        rc = child.proc.poll()
        if rc is None or (rc == 0 and child.done(folder, rounds - 1)):
            continue  # running, or through all its rounds
        raise ChildFailed(child, f"exited ({rc}) before its last round")
    if time.monotonic() > deadline:
        raise ChildFailed(children[0], "the run passed its deadline")


def parse_cpus(text: str) -> set[int]:
    """``"0"``, ``"0,1"``, ``"0-3,6"`` as a set of CPU numbers."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out:
        raise ValueError(f"no CPUs in {text!r}")
    return out
