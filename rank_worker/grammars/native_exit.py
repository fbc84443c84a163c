"""Leaving the process while a native compile is still running.

A compile that overran its deadline keeps running on its daemon thread
(``compile_service``). If the interpreter starts finalizing meanwhile,
CPython 3.11 marks the runtime as finalizing right after the ``atexit``
handlers, and a daemon thread that then asks for the GIL back is ended with
``pthread_exit``. xgrammar's binding (tvm_ffi) takes the GIL back in a
``noexcept`` destructor (``~TVMFFIPyCallContext`` -> ``PyGILState_Ensure``),
so the forced unwind calls ``std::terminate``: "terminate called without an
active exception", SIGABRT, exit 134, after all the work was done.

So native calls are counted (``native_call``), and an ``atexit`` handler,
registered when this module is imported (early, so it runs late), looks at
the count. None in flight: nothing happens and the interpreter finalizes as
usual. Some in flight: later ones are parked, open files, logging and stdio
are flushed, and the process leaves with ``os._exit`` before finalization
can begin, with the status it would have had:

- the one given to ``exiting`` (the CLI and a rank's main pass theirs);
- else the code of ``sys.exit``, as the interpreter read it to exit (a
  ``SystemExit`` that is caught is never read that way);
- else 1 for an unhandled exception (death by SIGINT for Ctrl-C);
- else 0. ``raise SystemExit(n)`` bypasses ``sys.exit``: a host that exits
  that way with compiles in flight should call ``exiting(n)`` first.

A rank's process holds more native threads than compiles: gloo's, the
TCPStore's, a roll call blocked on a lost store host. None of them is ever
joined, and one that wakes into a finalizing interpreter aborts the same
way. So a rank process calls ``always_leave`` (the handler then leaves
whatever is in flight), or ``leave_now`` once it has its status.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, NoReturn

_UNSET: Any = object()

_lock = threading.Lock()
_in_flight = 0
_callers: dict[int, int] = {}  # thread ident -> its counted calls in flight
_closing = False
_status: int | None = None
_exit_code: Any = _UNSET
_hooked = False
_always = False
_parked = threading.Event()  # never set


def in_flight() -> int:
    """Native calls running now."""
    return _in_flight


def threads_in_calls() -> frozenset[int]:
    """Idents of the threads inside a counted native call now."""
    with _lock:
        return frozenset(_callers)


@contextmanager
def native_call() -> Iterator[None]:
    """Count the GIL-releasing native call inside; once exit has begun a
    thread other than the main one waits here for the process to end."""
    global _in_flight
    _hook_sys_exit()
    me = threading.get_ident()
    with _lock:
        counted = not _closing
        if counted:
            _in_flight += 1
            _callers[me] = _callers.get(me, 0) + 1
    if not counted and threading.current_thread() is not threading.main_thread():
        _parked.wait()
    try:
        yield
    finally:
        if counted:
            with _lock:
                _in_flight -= 1
                if _callers[me] == 1:
                    del _callers[me]
                else:
                    _callers[me] -= 1


def always_leave() -> None:
    """At exit, leave with ``os._exit`` (files and streams flushed) even with
    nothing counted in flight: for a rank's process, whose native threads
    are never joined. Its exit must go through ``sys.exit`` or ``exiting``."""
    global _always
    _hook_sys_exit()
    _always = True


def leave_now(status: int) -> NoReturn:
    """Flush what finalization would write and leave with ``status`` at once."""
    _leave(exiting(status), 0)
    raise AssertionError("unreachable")  # os._exit returned


def exiting(status: int) -> int:
    """Record the status this process is about to exit with; returns it."""
    global _status
    _status = status
    return status


class _SysExit(SystemExit):
    """What ``sys.exit`` raises here: a ``SystemExit`` that notes its code
    when the interpreter itself reads it (no Python caller) to exit."""

    @property  # type: ignore[override]
    def code(self) -> Any:
        global _exit_code
        code = SystemExit.code.__get__(self)  # type: ignore[attr-defined]
        if threading.current_thread() is threading.main_thread():
            try:
                sys._getframe(1)
            except ValueError:
                _exit_code = code
        return code

    @code.setter
    def code(self, value: Any) -> None:
        SystemExit.code.__set__(self, value)  # type: ignore[attr-defined]


def _sys_exit(status: object = None, /) -> None:
    """``sys.exit``, raising ``_SysExit`` with the same arguments."""
    if status is None:
        raise _SysExit()
    if isinstance(status, tuple):
        raise _SysExit(*status)
    raise _SysExit(status)


def _hook_sys_exit() -> None:
    global _hooked
    if not _hooked:
        _hooked = True
        sys.exit = _sys_exit  # type: ignore[assignment]


def _code_status(code: Any) -> int:
    # As CPython maps a SystemExit code (the text was already printed).
    if code is None:
        return 0
    return int(code) if isinstance(code, int) else 1


def _unhandled() -> type[BaseException] | None:
    """The exception that ended the main thread, if one did: the one
    ``PyErr_Print`` left in ``sys.last_*``, raised from the stack's top."""
    kind, tb = getattr(sys, "last_type", None), getattr(sys, "last_traceback", None)
    if kind is None or tb is None or tb.tb_frame.f_back is not None:
        return None
    return kind


def _derived_status() -> tuple[int, int]:
    """(exit status, signal to die of or 0)."""
    if _status is not None:
        return _status, 0
    if _exit_code is not _UNSET:
        return _code_status(_exit_code), 0
    kind = _unhandled()
    if kind is None:
        return 0, 0
    if issubclass(kind, KeyboardInterrupt):  # as CPython: die of SIGINT
        return 128 + int(signal.SIGINT), int(signal.SIGINT)
    return 1, 0


def _flush() -> None:
    """What finalization would have written: files, logging, stdio."""
    with suppress(Exception):
        weakref.finalize._exitfunc()  # type: ignore[attr-defined]
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        # Its own atexit hook would unlink the named semaphores this process
        # made (spawn-context queues and locks) and close its queues.
        with suppress(Exception):
            mp_util._run_finalizers(0)  # type: ignore[attr-defined]
    with warnings.catch_warnings():  # some objects warn when their class is read
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)):
                with suppress(Exception):
                    if not obj.closed:
                        obj.flush()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with suppress(Exception):
            if stream is not None:
                stream.flush()


def _leave(status: int, sig: int) -> None:
    _flush()
    if sig:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(status & 0xFF)


def _at_exit() -> None:
    global _closing
    with _lock:
        _closing = True
        busy = _in_flight
    if busy or _always:
        _leave(*_derived_status())


def _after_fork() -> None:
    # The child has none of the parent's threads, so none of its calls.
    global _lock, _in_flight, _closing
    _lock = threading.Lock()
    _in_flight, _closing = 0, False
    _callers.clear()


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork)
