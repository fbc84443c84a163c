"""Rank bodies that need only the runtime and coordinator (lost peers, own world).

It imports no grammar machinery (xgrammar costs seconds per spawned rank);
a ``FakeMember`` with one ready request stands in for the manager.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import torch.distributed as dist

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.coordinator import Coordinator
from gramcoord.coordinator.errors import PeerLostError
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.runtime import Runtime
from gramcoord.coordinator.status import PendingState
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


def own_world_body(rank, world, port):
    """Runtime.start: gramcoord makes the world itself, agrees, and tears it down."""
    layout = ParallelLayout(dp=world, pp=1, tp=1, requests="replicated")
    cfg = DistributedConfig(master_port=port, init_timeout_s=30, step_timeout_s=10)
    runtime = Runtime.start(layout, rank=rank, distributed=cfg)
    coordinator = Coordinator(layout, runtime, window=8)
    member = FakeMember()
    member.add(0, bytes(16), PendingState.READY if rank else PendingState.PENDING)
    first = coordinator.step(1, member).decision
    member.set(0, PendingState.READY)
    second = coordinator.step(2, member).decision
    runtime.close()
    return dict(first=first.ready, second=second.ready, initialized=dist.is_initialized())


def late_peer_body(rank, world, late_s):
    """Rank 1 reaches Runtime.attach ``late_s`` after rank 0: past the step
    timeout (1 s), well inside the start-up one (60 s)."""
    if rank == 1:
        time.sleep(late_s)
    layout = ParallelLayout(dp=world, pp=1, tp=1, requests="replicated")
    cfg = DistributedConfig(init_timeout_s=60, step_timeout_s=1)
    runtime = Runtime.attach(layout, distributed=cfg)
    groups = sorted(runtime._groups)
    runtime.close()
    return groups


def absent_peer_body(rank, world):
    """Rank 1 never attaches (it waits for rank 0 to give up): rank 0 names
    it lost at start-up once the start-up deadline (1 s) passes."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["test/gave-up"], datetime.timedelta(seconds=120))
        return None
    layout = ParallelLayout(dp=world, pp=1, tp=1, requests="replicated")
    cfg = DistributedConfig(init_timeout_s=1, step_timeout_s=1)
    try:
        Runtime.attach(layout, distributed=cfg)
    except PeerLostError as exc:
        return dict(ranks=exc.ranks, operation=exc.operation, message=str(exc))
    finally:
        store.set("test/gave-up", "1")
    return None
