"""Removal of this process's shared-memory names and private directories in every exit path.

The transport creates two kinds of named resources that outlive a process
unless someone removes them: POSIX shared-memory segments (``/dev/shm``) and
the private directory that holds the ``ipc://`` sockets. Their creator
removes them in ``close()``. The :class:`Janitor` covers every other way a
creator can end:

- normal interpreter exit: an ``atexit`` hook;
- ``SIGTERM`` / ``SIGINT``: a handler that removes the names and then chains
  to the handler that was installed before (re-raising the signal when that
  was the default action, so the exit status still says which signal);
- ``SIGKILL``, a segfault, ``os._exit``: nothing in the process runs, so a
  tiny reaper process (this file run as a script) holds the read end of a
  pipe; when the pipe closes because its owner is gone, it removes whatever
  the owner still held.

NOTE: the standard library's ``resource_tracker`` is not used. Spawned
children share their parent's tracker, which keeps names in a set, so a
reader that attached and unregistered would erase its creator's
registration (CPython gh-82300); ``track=False`` exists only from 3.13.

Only names carrying :data:`PREFIX` are ever removed, so a bug here cannot
delete anything the transport did not create. Only unlinking happens in
signal handlers: mappings stay valid until their users drop them.

:class:`~gramcoord.sync.segment.Segment` registers each segment it creates
with :func:`janitor`, :class:`~gramcoord.sync.control.ControlServer` its
ipc directory.
"""

from __future__ import annotations

# NOTE: the POSIX primitive under multiprocessing.shared_memory; used
# directly so that nothing registers with the resource tracker.
import _posixshmem
import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["PREFIX", "Janitor", "janitor", "remove"]

# Every segment and directory name starts with this.
PREFIX = "gramcoord"
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def remove(kind: str, name: str) -> bool:
    """Remove one resource; True if it existed.

    Parameters
    ----------
    kind
        ``"shm"`` for a shared-memory segment name, ``"dir"`` for a directory
        path.
    name
        The segment name (without a leading slash) or the directory path.

    Returns
    -------
    bool
        Whether something was removed. Names without :data:`PREFIX` are
        refused (False).
    """
    if not _ours(kind, name):
        return False
    if kind == "shm":
        try:
            _posixshmem.shm_unlink("/" + name)
        except FileNotFoundError:
            return False
        return True
    if not os.path.isdir(name):
        return False
    shutil.rmtree(name, ignore_errors=True)
    return True


def _ours(kind: str, name: str) -> bool:
    if kind == "shm":
        return name.startswith(PREFIX) and "/" not in name
    if kind == "dir":
        return os.path.isabs(name) and os.path.basename(name).startswith(PREFIX)
    return False


class Janitor:
    """Registry of the resources this process created and must remove.

    Use the process-wide instance from :func:`janitor`. ``own`` a resource
    right after creating it and ``disown`` it right after removing it.
    """

    def __init__(self) -> None:
        # Re-entrant: a signal handler runs on the main thread, possibly while
        # that thread holds the lock.
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._owned: set[tuple[str, str]] = set()
        self._reaper: subprocess.Popen[bytes] | None = None
        self._prior: dict[int, Any] = {}
        self._atexit = False

    def own(self, kind: str, name: str) -> None:
        """Remove ``name`` whenever this process ends, however it ends.

        Parameters
        ----------
        kind
            ``"shm"`` or ``"dir"``.
        name
            Segment name or directory path; must carry :data:`PREFIX`.

        Raises
        ------
        ValueError
            If the name does not carry the prefix, or a directory path is not
            absolute (it could never be removed).
        """
        if not _ours(kind, name):
            raise ValueError(
                f"janitor only handles {PREFIX}* shm names and dirs, got {kind} {name!r}"
            )
        with self._lock:
            self._adopt_after_fork()
            self._owned.add((kind, name))
            if not self._atexit:
                atexit.register(self.cleanup)
                self._atexit = True
            self._install_signals()
            self._tell(f"+{kind} {name}\n")

    def disown(self, kind: str, name: str) -> None:
        """Forget a resource its owner removed itself."""
        with self._lock:
            if os.getpid() != self._pid:
                return
            self._owned.discard((kind, name))
            self._tell(f"-{kind} {name}\n")
            if not self._owned:
                self._restore_signals()

    def owned(self) -> set[tuple[str, str]]:
        """The resources currently held, as ``(kind, name)`` pairs."""
        with self._lock:
            return set(self._owned) if os.getpid() == self._pid else set()

    def cleanup(self) -> None:
        """Remove everything still owned (atexit and signal path)."""
        with self._lock:
            if os.getpid() != self._pid:
                return  # a forked child must not remove its parent's names
            for kind, name in sorted(self._owned):
                try:
                    remove(kind, name)
                except OSError as exc:
                    logger.warning("could not remove %s %s: %s", kind, name, exc)
            self._owned.clear()

    def _adopt_after_fork(self) -> None:
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._owned = set()
            self._reaper = None
            self._prior = {}

    def _tell(self, line: str) -> None:
        if self._reaper is None:
            self._reaper = self._start_reaper()
            # A new reaper learns everything still owned, not just this line.
            line = "".join(f"+{kind} {name}\n" for kind, name in sorted(self._owned))
        if self._reaper is None or self._reaper.stdin is None:
            return
        try:
            self._reaper.stdin.write(line.encode())
            self._reaper.stdin.flush()
        except (OSError, ValueError) as exc:  # ValueError: the pipe was closed
            logger.warning(
                "reaper process is gone (%s); a SIGKILL would leak %s", exc, line.strip()
            )
            self._reaper = None

    def _start_reaper(self) -> subprocess.Popen[bytes] | None:
        # -I -S: no site, no user paths; the script needs only the stdlib.
        # start_new_session: a Ctrl-C or killpg aimed at the owner's group
        # must not take the reaper down with it.
        try:
            return subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            logger.warning("cannot start the reaper (%s); a SIGKILL may leak shared memory", exc)
            return None

    def _install_signals(self) -> None:
        if self._prior or threading.current_thread() is not threading.main_thread():
            # Handlers can only be set from the main thread; the reaper still
            # covers a killed process.
            return
        for sig in _SIGNALS:
            self._prior[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prior in self._prior.items():
            # Leave a handler installed after ours alone: it may chain to us.
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prior if prior is not None else signal.SIG_DFL)
        self._prior = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        prior = self._prior.get(signum, signal.SIG_DFL)
        self.cleanup()
        if callable(prior):
            prior(signum, frame)
        elif prior == signal.SIG_IGN:
            return
        else:
            # Default action: die of the same signal, as if we were never here.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


_JANITOR = Janitor()


def janitor() -> Janitor:
    """The process-wide :class:`Janitor`."""
    return _JANITOR


def _reap(owner: str) -> None:
    """Reaper main loop: track lines from the owner, clean up at EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    held: set[tuple[str, str]] = set()
    for raw in sys.stdin.buffer:
        op, _, rest = raw.decode(errors="replace").rstrip("\n").partition(" ")
        key = (op[1:], rest)
        if op[:1] == "+":
            held.add(key)
        elif op[:1] == "-":
            held.discard(key)
    for kind, name in sorted(held):
        try:
            if remove(kind, name):
                print(
                    f"gramcoord reaper: removed {kind} {name} left by pid {owner}", file=sys.stderr
                )
        except OSError as exc:
            print(f"gramcoord reaper: cannot remove {kind} {name}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    _reap(sys.argv[1] if len(sys.argv) > 1 else "?")
