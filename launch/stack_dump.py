"""Where a process that ran past its deadline is waiting.

A group deadline that passes says nothing by itself: a slow machine and a
hang look the same. Each child arms :func:`arm` before it runs, so that
``SIGUSR1`` makes the interpreter write every thread's Python stack to a
file of its own (``faulthandler``, which works even while the main thread is
blocked inside a C call such as a gloo collective). At the deadline the
parent calls :func:`dump` on the survivors before it stops them, and
:func:`waiting_in` turns a dump into one line: the innermost Python frame (a
C call such as ``select`` shows as the Python function that made it), and
the innermost frame of our own code that led there, e.g.::

    rank 1 waiting in all_gather (torch/distributed/distributed_c10d.py:3950)
    from coordinator/agreement.py:118 in _exchange

Ranks of ``gramcoord run`` arm it too, into ``logs/rank{R}.stacks``: ``kill
-USR1 PID`` shows where a live rank is, and the e2e tests' deadline reads
those files. Nothing here runs unless asked.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

__all__ = ["arm", "collect", "disarm", "dump", "waiting_in"]

# The signal a parent sends to ask for the stacks; chosen because neither
# torch nor our ranks use it.
DUMP_SIGNAL = signal.SIGUSR1
# How long the parent waits for the files after signalling.
DUMP_WAIT_S = 2.0

_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_OURS = ("/gramcoord/", "/coordinator/", "/rank_worker/", "/sync/", "/launch/", "/tests/")
_keep: list[tuple[IO[str], Path]] = []


def arm(path: str | os.PathLike[str]) -> None:
    """Write all thread stacks to ``path`` on ``SIGUSR1`` (until :func:`disarm`).

    ``path`` appears only once the handler is in place (the file is opened
    under another name and renamed): :func:`dump` signals only armed
    processes, since ``SIGUSR1`` kills one that is still starting.
    """
    path = Path(path)
    arming = path.with_name(f"{path.name}.arming")
    handle = open(arming, "w")  # noqa: SIM115 - open until disarm or exit
    _keep.append((handle, path))
    faulthandler.register(DUMP_SIGNAL, file=handle, all_threads=True, chain=False)
    os.replace(arming, path)


def disarm() -> None:
    """Undo :func:`arm`: the file is removed if empty (first, so that no one
    signals a process without the handler), the handler goes, the file closes."""
    for _, path in _keep:
        if path.is_file() and path.stat().st_size == 0:
            path.unlink()
    faulthandler.unregister(DUMP_SIGNAL)
    while _keep:
        _keep.pop()[0].close()


def collect(paths: Iterable[Path], wait_s: float = DUMP_WAIT_S) -> dict[Path, str]:
    """The non-empty dumps among ``paths``, waiting up to ``wait_s`` for the first."""
    paths = list(paths)
    end = time.monotonic() + wait_s
    while time.monotonic() < end and not any(_read(p) for p in paths):
        time.sleep(0.05)
    time.sleep(0.1)  # let a dump in progress finish
    return {p: text for p in paths if (text := _read(p))}


def dump(pids: dict[int, int], paths: dict[int, Path]) -> dict[int, str]:
    """Signal every live ``pids[rank]`` and return each rank's stack text.

    Waits at most :data:`DUMP_WAIT_S` in all; a rank that wrote nothing in
    that time (it was past the point of answering, or never armed) maps to
    an empty string.
    """
    asked = []
    for rank, pid in pids.items():
        if not paths[rank].exists():  # not armed yet: SIGUSR1 would kill it
            continue
        try:
            os.kill(pid, DUMP_SIGNAL)
            asked.append(rank)
        except (ProcessLookupError, PermissionError):
            continue
    texts: dict[int, str] = {}
    end = time.monotonic() + DUMP_WAIT_S
    while asked and time.monotonic() < end:
        for rank in list(asked):
            text = _read(paths[rank])
            # faulthandler writes one block per thread; the dump is complete
            # once the text stops growing, which a short pause approximates.
            if text:
                texts[rank] = text
                asked.remove(rank)
        time.sleep(0.05)
    time.sleep(0.1)
    for rank in texts:
        texts[rank] = _read(paths[rank]) or texts[rank]
    return {rank: texts.get(rank, "") for rank in pids}


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _main_thread(text: str) -> list[tuple[str, int, str]]:
    """The frames (innermost first) of the thread that took the last signal."""
    blocks: list[tuple[bool, list[tuple[str, int, str]]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append((line.startswith("Current"), []))
        elif blocks and (m := _FRAME.match(line)):
            blocks[-1][1].append((m["file"], int(m["line"]), m["func"]))
    for current, frames in reversed(blocks):
        if current:
            return frames
    return blocks[0][1] if blocks else []


# The checkout (or installed package) root: our frames are named relative to it.
_ROOT = str(Path(__file__).resolve().parents[1]) + os.sep


def _short(path: str) -> str:
    if path.startswith(_ROOT):
        return path[len(_ROOT) :]
    for marker in ("/site-packages/", "/gramcoord/", "/lib/python"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def waiting_in(text: str) -> str:
    """One line naming the operation a dumped process was waiting in."""
    frames = _main_thread(text)
    if not frames:
        return "no stack (it did not answer the dump signal)"
    file, line, func = frames[0]
    where = f"waiting in {func} ({_short(file)}:{line})"
    for f, n, fn in frames:
        if any(m in f for m in _OURS) and "/launch/stack_dump.py" not in f:
            if (f, n) != (file, line):
                where += f" from {_short(f)}:{n} in {fn}"
            break
    return where
