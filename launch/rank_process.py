"""How a rank's process ends: with its own status and a one-line cause, never an abort.

A rank's process holds C++ threads that Python never joins: gloo's
(``ProcessGroup`` and its connections), the ``TCPStore``'s, and a roll call
still blocked on a lost store host (``coordinator.runtime.roll_call`` runs
it on a daemon thread). If the interpreter finalizes while one of them is
alive, it can wake into a dying runtime and end the process with
"terminate called without an active exception" (SIGABRT, status 134): on a
lost store host, a peer lost in the middle of a collective, or at the end
of a restarted or resumed attempt -- whatever the rank had found out.

So once a rank has its outcome it flushes its files, logs and streams and
leaves with ``os._exit`` (``native_exit.leave_now``), before finalization
can begin:

- ``rank_process(main)``: the per-rank program under the user's own
  launcher (``python -m gramcoord.launch.rank_main``). ``main`` prints the
  cause of a failure in one line and returns the status; what escapes it
  (Ctrl-C, an exit) is turned into a status and a line here.
- ``worker()``: a worker that torch's elastic agent spawned
  (``launchers._torchrun_rank``). Its end is torch's code, which exits
  through ``sys.exit``: ``native_exit.always_leave`` makes that exit leave
  with ``os._exit`` and the same status. SIGTERM from the agent keeps its
  default action (the process dies of it, nothing finalizes).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

from gramcoord.rank_worker.grammars import native_exit

INTERRUPTED = 130


def status_of(code: object) -> int:
    """The exit status of a ``SystemExit`` code, as CPython maps it."""
    if code is None:
        return 0
    return int(code) if isinstance(code, int) else 1


def outcome(main: Callable[[], int]) -> tuple[int, str]:
    """Run ``main``: its status, and a one-line cause for what escaped it ("" if nothing did)."""
    rank = os.environ.get("RANK", "0")
    try:
        return int(main()), ""
    except KeyboardInterrupt:
        return INTERRUPTED, f"gramcoord: rank {rank} interrupted"
    except SystemExit as exc:
        if isinstance(exc.code, str):
            return 1, f"gramcoord: rank {rank}: {exc.code}"
        return status_of(exc.code), ""
    except BaseException as exc:
        first = (str(exc).splitlines() or [""])[0]
        return 1, f"gramcoord: rank {rank} failed: {type(exc).__name__}: {first}"


def rank_process(main: Callable[[], int]) -> NoReturn:
    """Run the rank's ``main`` and leave the process with its status (see the module)."""
    native_exit.always_leave()
    status, cause = outcome(main)
    if cause:
        print(cause, file=sys.stderr)
    native_exit.leave_now(status)


def worker() -> None:
    """In a worker torch's agent spawned: its exit leaves with ``os._exit``, status kept."""
    native_exit.always_leave()
