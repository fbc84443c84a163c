"""Run progress from the ranks to the launcher's console.

The channel is a private directory the launcher process makes inside the
run's output directory (``tempfile.mkdtemp``, ``.progress-*``: no fixed name,
no port) and passes to every rank in
``RankJob.progress_dir``. Each scheduler rank (the stage-0 leader of a DP
replica: the ranks that see requests finish) rewrites one small file there,
``progress-R.msgpack``, holding its ``ProgressCount``: written to a temporary
name and renamed over the last one, so a reader never sees half a count. It
writes when its count changes, at most every ``MIN_INTERVAL_S``, and always
the last count. The launcher sums the files it finds and draws one rich bar
on stderr, only when stderr is a terminal: elsewhere (a pipe, a CI log) it
draws nothing, and the table at the end is the only output. The directory is
removed when the launch ends; a launcher killed outright (SIGKILL) leaves
it in the run's directory, never in /tmp, and the next launch into that
directory removes it.

Every launcher gets the same bar: torchrun (the agent's workers redirect
their consoles to the run's logs), ray and inline. A rank on another host
(ray across nodes) has no such directory, writes nothing, and its replica's
requests are left out of the bar. Under ``launcher: external`` there is no
launcher process of ours: rank 0 draws its own replica's count in-process
(``local_bar``) when its stderr is a terminal.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = [
    "ProgressChannel",
    "ProgressCount",
    "ProgressDisplay",
    "ProgressWriter",
    "local_bar",
    "watch_progress",
]

# Least seconds between two writes of one rank (its last count is always written).
MIN_INTERVAL_S = 0.1
# Seconds between two reads of the launcher's bar.
REFRESH_S = 0.2
# The channel directory's name: .progress-XXXXXXXX in the run's output directory.
CHANNEL_PREFIX = ".progress-"
_PREFIX = "progress-"
_SUFFIX = ".msgpack"


class ProgressCount(msgspec.Struct, frozen=True, kw_only=True):
    """One scheduler rank's requests: finished so far, of its total."""

    rank: int
    finished: int
    total: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ProgressCount)


class ProgressWriter:
    """A scheduler rank's side: ``writer(finished, total)`` after each step.

    Writes nothing when ``directory`` does not exist here (a rank on another
    host), and stops writing at the first error (the launcher removed it):
    progress never fails a run.
    """

    def __init__(
        self,
        directory: str,
        rank: int,
        *,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(directory) / f"{_PREFIX}{rank}{_SUFFIX}"
        self._tmp = Path(directory) / f".{_PREFIX}{rank}.tmp"
        self.rank = rank
        self.enabled = bool(directory) and os.path.isdir(directory)
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._written: tuple[int, int] | None = None
        self._pending: tuple[int, int] | None = None
        self._at = float("-inf")

    def __call__(self, finished: int, total: int) -> None:
        if not self.enabled or (finished, total) in (self._written, self._pending):
            return
        self._pending = (finished, total)
        if finished >= total or self._clock() - self._at >= self._min_interval_s:
            self.flush()

    def flush(self) -> None:
        """Write the count not yet written, if any."""
        if not self.enabled or self._pending is None:
            return
        finished, total = self._pending
        data = _encoder.encode(ProgressCount(rank=self.rank, finished=finished, total=total))
        try:
            self._tmp.write_bytes(data)
            os.replace(self._tmp, self.path)
        except OSError:
            self.enabled = False
            return
        self._written, self._pending, self._at = self._pending, None, self._clock()


class ProgressChannel:
    """The launcher's side: a private directory, and the sum of the counts in it.

    Made inside ``parent`` (the run's output directory) when given, after
    removing the channels a killed launcher left there; else in the system's
    temporary directory.
    """

    def __init__(self, parent: Path | None = None) -> None:
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
            for stale in parent.glob(f"{CHANNEL_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
        self.directory = tempfile.mkdtemp(prefix=CHANNEL_PREFIX, dir=parent)

    def read(self) -> tuple[int, int | None]:
        """(finished, total) over the ranks that reported; total None before any did."""
        finished, total, seen = 0, 0, False
        try:
            names = os.listdir(self.directory)
        except OSError:
            return 0, None
        for name in names:
            if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)):
                continue
            try:
                count = _decoder.decode(Path(self.directory, name).read_bytes())
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                continue
            finished, total, seen = finished + count.finished, total + count.total, True
        return finished, (total if seen else None)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _bar(console: Console, label: str = "run") -> Progress:
    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


class ProgressDisplay:
    """Draws a channel's counts as a bar on ``console``, if it is a terminal.

    ``refresh`` reads the channel once and updates the bar; while the display
    is entered, a thread calls it every ``interval_s``.
    """

    def __init__(
        self, channel: ProgressChannel, console: Console, *, interval_s: float = REFRESH_S
    ) -> None:
        self.channel = channel
        self.active = console.is_terminal
        self.bar = _bar(console)
        self.task = self.bar.add_task("requests", total=None)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> tuple[int, int | None]:
        finished, total = self.channel.read()
        if total is not None:
            self.bar.update(self.task, completed=finished, total=total)
        return finished, total

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.refresh()

    def __enter__(self) -> ProgressDisplay:
        if self.active:
            self.bar.start()
            self._thread = threading.Thread(target=self._loop, name="gramcoord-progress")
            self._thread.daemon = True
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.active:
            self.refresh()  # the last counts, drawn once more as the bar stops
            self.bar.stop()


@contextmanager
def watch_progress(console: Console | None = None, *, parent: Path | None = None) -> Iterator[str]:
    """A channel in ``parent`` shown on ``console`` (stderr by default) for the block.

    Yields the channel's directory.
    """
    channel = ProgressChannel(parent)
    try:
        with ProgressDisplay(channel, console or Console(stderr=True)):
            yield channel.directory
    finally:
        channel.close()


def local_bar(console: Console | None = None, label: str = "run"):
    """(bar, callback) drawing one rank's own count in its process, if on a terminal.

    ``(None, None)`` when the console is not a terminal.
    """
    console = console or Console(stderr=True)
    if not console.is_terminal:
        return None, None
    bar = _bar(console, label)
    task = bar.add_task("requests", total=None)
    return bar, (lambda done, total: bar.update(task, completed=done, total=total))
