"""Keep the native libraries' stderr off the console: into a per-rank file.

xgrammar's C++ code writes warnings straight to file descriptor 2
(``[02:57:44] /project/cpp/json_schema_converter.cc:870: Warning: oneOf
...``), bypassing Python's ``sys.stderr`` and ``logging``. The warnings that
can be attributed to a request are predicted by the schema lint and travel
with the request (``WarningCode``); this module sends whatever the native
side prints to ``DIR/native-rank{R}.log`` instead of the terminal.

How: the terminal's descriptor is duplicated first, descriptor 2 is then
pointed at the log file, and ``sys.stderr`` (plus the ``logging`` handlers
and ``faulthandler`` that were writing to it) is rebound to the duplicate.
So Python-level output still reaches the console; only what is written to
descriptor 2 directly lands in the file. ``restore_native_stderr`` undoes
it all.

NOTE: descriptor 2 is process-wide. Subprocesses started while redirected
inherit it, so their stderr lands in the log file too; start them with an
explicit ``stderr=`` if their output should reach the console.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "native_log_path",
    "native_stderr_redirected",
    "redirect_native_stderr",
    "redirected_path",
    "restore_native_stderr",
]


class _Redirect:
    def __init__(self, path: Path, saved_fd: int, console: IO[str] | None, old_stderr: Any) -> None:
        self.path = path
        # Duplicate of the original descriptor 2 (the terminal).
        self.saved_fd = saved_fd
        # Text stream over saved_fd that sys.stderr now is (None when
        # descriptor 2 was closed to begin with).
        self.console = console
        self.old_stderr = old_stderr
        # logging handlers moved from old_stderr to console.
        self.handlers: list[logging.StreamHandler] = []
        self.faulthandler = False


_lock = threading.Lock()
_active: _Redirect | None = None


def _open_log(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers: list[Any] = [logging.getLogger()]
    loggers += [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    out = []
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                out.append(h)
    return out


def _flush(stream: Any) -> None:
    with contextlib.suppress(Exception):
        stream.flush()


def native_log_path(out_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank``'s native output goes: ``out_dir/native-rank{rank}.log``."""
    return Path(out_dir) / f"native-rank{int(rank)}.log"


def redirect_native_stderr(out_dir: str | os.PathLike[str], rank: int) -> Path:
    """Send descriptor 2 (native stderr) to ``native_log_path(out_dir, rank)``.

    Python's ``sys.stderr``, the ``logging`` stream handlers that wrote to
    it, and ``faulthandler`` keep writing to the original terminal. The file
    is appended to and created with its folder if missing.

    Meant to be called once per process, at rank start. Calling it again
    while redirected only moves descriptor 2 to the new file (the terminal
    stays the one saved by the first call). Thread-safe.

    Returns
    -------
    Path
        The log file.

    Raises
    ------
    OSError
        The log file cannot be created; nothing was changed.
    """
    return _redirect_to(native_log_path(out_dir, rank))


def _console_stream(fd: int, like: Any) -> io.TextIOWrapper:
    # Built like Python's own stderr: line-buffered and write-through, so
    # partial lines (progress bars) show at once.
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        io.BufferedWriter(raw),
        encoding=getattr(like, "encoding", None) or "utf-8",
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )


def _redirect_to(path: Path) -> Path:
    global _active
    with _lock:
        log_fd = _open_log(path)
        try:
            _flush(sys.stderr)
            if _active is not None:
                os.dup2(log_fd, 2)
                _active.path = path
                return path
            try:
                saved_fd = os.dup(2)
            except OSError:  # descriptor 2 was closed: no console to keep
                saved_fd = -1
            os.write(log_fd, f"--- native stderr of pid {os.getpid()} ---\n".encode())
            os.dup2(log_fd, 2)
        finally:
            os.close(log_fd)
        old_stderr = sys.stderr
        console = _console_stream(saved_fd, old_stderr) if saved_fd >= 0 else None
        state = _Redirect(path, saved_fd, console, old_stderr)
        if console is not None:
            sys.stderr = console
            for h in _stream_handlers():
                if h.stream is old_stderr or h.stream is sys.__stderr__:
                    h.setStream(console)
                    state.handlers.append(h)
            if faulthandler.is_enabled():
                _enable_faulthandler(console)
                state.faulthandler = True
        _active = state
        return path


def _enable_faulthandler(stream: Any) -> None:
    """Point faulthandler at ``stream``, or at descriptor 2 when it has none.

    A ``sys.stderr`` without a usable descriptor (pytest's ``capsys``, a
    notebook, a ``StringIO``) cannot take faulthandler's writes.
    """
    try:
        faulthandler.enable(file=stream)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        faulthandler.enable(file=sys.__stderr__)


def restore_native_stderr() -> None:
    """Undo ``redirect_native_stderr``; a no-op when nothing is redirected."""
    global _active
    with _lock:
        state = _active
        if state is None:
            return
        _active = None
        if state.console is not None:
            _flush(state.console)
        if state.saved_fd >= 0:
            os.dup2(state.saved_fd, 2)
        if state.console is not None:
            if sys.stderr is state.console:
                sys.stderr = state.old_stderr
            for h in state.handlers:
                if h.stream is state.console:
                    h.setStream(state.old_stderr)
            if state.faulthandler:
                _enable_faulthandler(state.old_stderr)
            state.console.close()
        if state.saved_fd >= 0:
            os.close(state.saved_fd)


def redirected_path() -> Path | None:
    """The log file descriptor 2 currently goes to, or None."""
    state = _active
    return state.path if state is not None else None


@contextlib.contextmanager
def native_stderr_redirected(out_dir: str | os.PathLike[str], rank: int) -> Iterator[Path]:
    """``redirect_native_stderr`` for the duration of a ``with`` block.

    On exit descriptor 2 goes back to where it went before: the console, or
    the log file of a redirect that was already active.
    """
    before = redirected_path()
    path = redirect_native_stderr(out_dir, rank)
    try:
        yield path
    finally:
        if before is None:
            restore_native_stderr()
        else:
            _redirect_to(before)
