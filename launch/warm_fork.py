"""torch's elastic workers forked warm from the launcher instead of spawned cold.

A spawned worker imports torch, xgrammar (and transformers, which xgrammar
imports) and gramcoord before its rank's first line: about 6.5 s of CPU on
this 2-core machine, 470 of the main test suite's 1,600 CPU-seconds. Forked
from the launcher, which imported them once, it starts in milliseconds.

The launcher stays the worker's parent (torch's ``_wrap`` sets the parent-
death signal; it names the launcher, as with spawn), and the exit status is
the launcher's own ``waitpid``. What a forked worker would inherit that a
spawned one starts without is put back, in the child, before torch's code
runs (``os.register_at_fork``), and only for forks made by a launch's agent
thread (``forking``):

- ``sys.stdout``/``sys.stderr``: new text streams on descriptors 1 and 2 (a
  host may have replaced them: pytest's capture, a progress display); torch
  redirects a worker's output by ``sys.stdout.fileno()``;
- logging: the root logger without handlers at WARNING, as at start;
- signal handlers: Python's defaults (a host's SIGTERM or SIGALRM handler
  would otherwise run in the worker);
- atexit: the host's hooks dropped; the worker's own run when it ends, as a
  spawned child's do at ``sys.exit`` (``after_start``).

Fork is used only where it is safe: CUDA is not initialized here (a forked
CUDA context is unusable), and ``GRAMCOORD_TORCHRUN_START`` is not
``spawn``.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import util as mp_util

__all__ = ["after_start", "forking", "start_method"]

_local = threading.local()


def start_method() -> str:
    """``fork`` where it is safe and wanted, else ``spawn``."""
    if os.environ.get("GRAMCOORD_TORCHRUN_START", "fork") == "spawn":
        return "spawn"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "spawn"
    return "fork"


@contextmanager
def forking() -> Iterator[None]:
    """Forks made by this thread meanwhile start their child as a spawned one would."""
    _local.active = True
    try:
        yield
    finally:
        _local.active = False


def after_start() -> None:
    """In the worker, first thing: run its own atexit hooks when it ends."""
    if not getattr(_local, "forked", False):
        return
    # A forked multiprocessing child leaves with os._exit; run the hooks as
    # the last of its exit steps, where a spawned child's sys.exit would.
    mp_util.Finalize(None, atexit._run_exitfuncs, exitpriority=-100)


def _text_stream(fd: int) -> io.TextIOWrapper | None:
    try:
        os.fstat(fd)
    except OSError:
        return None
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        raw if unbuffered else io.BufferedWriter(raw),
        encoding=sys.getdefaultencoding() if sys.flags.utf8_mode else None,
        errors="backslashreplace" if fd == 2 else None,
        line_buffering=not unbuffered and os.isatty(fd),
        write_through=unbuffered,
    )


def _in_child() -> None:
    if not getattr(_local, "active", False):
        return
    _local.active = False
    _local.forked = True
    sys.stdout, sys.stderr = _text_stream(1), _text_stream(2)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if sig == signal.SIGINT:
            signal.signal(sig, signal.default_int_handler)
        elif callable(handler):
            signal.signal(sig, signal.SIG_DFL)
    atexit._clear()


os.register_at_fork(after_in_child=_in_child)
