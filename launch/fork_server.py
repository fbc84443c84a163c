"""Children forked from one warm server process instead of spawned cold.

A spawned child imports torch and xgrammar before it runs a line of its
target: 3-5 s of CPU on this 2-core machine, which is most of what a short
multi-rank test or benchmark costs. ``context()`` returns multiprocessing's
``forkserver`` context with a server that imported those modules once; each
child is a ``fork`` of it and starts in milliseconds.

A forked child inherits the *server's* process state, not the caller's. What
a spawned child would have taken from the caller at start, the caller sends
and the child puts back before its target runs (``Launch`` and
``_forked_main``):

- the whole environment (``os.environ`` replaced, so ``putenv`` reaches C
  code that reads it later: gloo's ``MASTER_ADDR``, a fault switch);
- the working directory;
- stdout and stderr (the caller's descriptors, passed over the server's
  socket, so a test's ``capfd`` sees its own children);
- a higher CPU niceness, if the caller has one;
- and at its end the atexit hooks run, as at a spawned child's ``sys.exit``.

What only counts at interpreter start cannot be sent, so the server starts
with the caller's environment plus ``OMP_NUM_THREADS=1`` (``child_env``), and
preloads only third-party modules: none of gramcoord's own, so a module that
reads a variable at import reads the child's (third-party modules read the
environment the server started with: huggingface_hub's ``HF_*`` constants,
for one). All children share the server's string-hash seed.

``gramcoord run``'s own ranks are not started here: torch's elastic agent
starts them (spawned), and its workers must die with the launcher
(``PR_SET_PDEATHSIG`` names their parent, which would be the server).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import forkserver, reduction
from multiprocessing import util as mp_util
from typing import Any

__all__ = ["PRELOAD", "Launch", "context", "forked_main", "server_pid"]

# Imported once in the server; a child that needs one starts with it loaded.
PRELOAD = ("numpy", "msgspec", "zmq", "torch", "torch.distributed", "xgrammar")

_lock = threading.Lock()
_started_by: int | None = None


def context(env: dict[str, str]) -> mp.context.BaseContext:
    """The forkserver context, its server running (started with ``env`` on top of ours)."""
    with _lock:
        if _started_by != os.getpid():
            # A forked child inherits its parent's bookkeeping but not its
            # server (it is not the child's child): start its own.
            _start(env)
    return mp.get_context("forkserver")


def _start(env: dict[str, str]) -> None:
    global _started_by
    mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _started_by = os.getpid()


def server_pid() -> int | None:
    """This process's fork server, if it started one (a helper, not a leak)."""
    if _started_by != os.getpid():
        return None
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


@dataclass
class Launch:
    """What a spawned child would have inherited, sent to a forked one."""

    target: Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    environ: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    nice: int = 0
    # The caller's open descriptors among 1 and 2; each goes to the child as
    # a duplicate (over the server's socket) when the launch is pickled.
    stdio: tuple[int, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["stdio"] = tuple((fd, reduction.DupFd(fd)) for fd in self.stdio)
        return state

    @classmethod
    def here(cls, target, args, kwargs, env: dict[str, str]) -> Launch:
        """The caller's state now, with ``env`` on top of its environment."""
        stdio = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:
                continue  # closed here: the child keeps the server's
            stdio.append(fd)
        return cls(
            target=target,
            args=args,
            kwargs=kwargs,
            environ={**os.environ, **env},
            cwd=os.getcwd(),
            nice=os.getpriority(os.PRIO_PROCESS, 0),
            stdio=tuple(stdio),
        )


def forked_main(launch: Launch) -> Any:
    """The child's first step: put the caller's state back, then run the target."""
    for want, dup in launch.stdio:
        fd = dup.detach()
        if fd != want:
            os.dup2(fd, want)
            os.close(fd)
    os.environ.clear()
    os.environ.update(launch.environ)
    if launch.cwd:
        os.chdir(launch.cwd)
    more = launch.nice - os.getpriority(os.PRIO_PROCESS, 0)
    if more > 0:
        os.nice(more)
    # A spawned child ends in sys.exit, which runs the atexit hooks (segment
    # cleanup, temporary directories); a forked one ends in os._exit. Run
    # them as the last of multiprocessing's exit steps, after the result
    # queues are flushed, where a spawned child would.
    mp_util.Finalize(None, atexit._run_exitfuncs, exitpriority=-100)
    return launch.target(*launch.args, **launch.kwargs)
