"""Rank body for the lost-peer tests: the runtime and coordinator only.

It imports no grammar machinery (xgrammar costs seconds per spawned rank);
a ``FakeMember`` with one ready request stands in for the manager.
"""

from __future__ import annotations

import os
import signal
import time

from coordinator.config import DistributedConfig
from coordinator.coordinator import Coordinator
from coordinator.errors import PeerLostError
from coordinator.layout import ParallelLayout
from coordinator.runtime import Runtime
from coordinator.status import PendingState
from tests.coordinator.fakes import FakeMember


def lost_peer_body(rank, world, layout_kw, victim, how, step_timeout_s, pid_dir):
    """Step until ``victim`` dies (SIGKILL) or hangs at step 5; report the error."""
    with open(os.path.join(pid_dir, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    layout = ParallelLayout(**layout_kw)
    runtime = Runtime.attach(layout, distributed=DistributedConfig(step_timeout_s=step_timeout_s))
    coordinator = Coordinator(layout, runtime, window=4)
    member = FakeMember()
    last_ok = time.monotonic()
    try:
        for step in range(1, 10_000):
            member.add(step, step.to_bytes(16, "little"), PendingState.READY)
            if rank == victim and step == 5:
                if how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(step_timeout_s + 1.5)  # outlive the survivors' deadline
                return dict(hung=True)
            coordinator.step(step, member)
            last_ok = time.monotonic()
            time.sleep(0.01)
    except PeerLostError as exc:
        return dict(
            error=type(exc).__name__,
            ranks=exc.ranks,
            operation=exc.operation,
            message=str(exc),
            waited_s=time.monotonic() - last_ok,
            closed=runtime._closed,
        )
    return dict(error=None)
