"""Rank bodies for the two-level agreement tests (importable by spawned children).

``levels_body`` gives each spawned rank a hostname of its own in a private
UTS namespace (root), so the runtime groups the world by host exactly as on
real hosts, while gloo stays on loopback. Every step, a flat and a two-level
coordinator of each op decide the same per-rank statuses with the same
clocks; the parent compares everything they decided.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import time

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.coordinator import Coordinator
from gramcoord.coordinator.errors import PeerLostError
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.runtime import Runtime
from gramcoord.coordinator.status import LocalStatus, PendingState
from gramcoord.coordinator.two_level import HOST_GROUP, LEADER_GROUP

CLONE_NEWUTS = 0x04000000
WINDOW = 96
OPS = ("all_gather", "all_reduce")
# Gloo cannot resolve the made-up hostnames; it binds loopback instead.
ENV = {"GLOO_SOCKET_IFNAME": "lo"}


def take_hostname(name: str) -> None:
    """Give this process its own hostname (a UTS namespace of its own; needs root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS)")
    socket.sethostname(name)


def status(step: int, rank: int) -> LocalStatus:
    """A window that differs by rank and step: entries pending or failed on some ranks only."""
    n = 40 + step % 7
    states, reasons = [], []
    for i in range(n):
        k = (i * 7 + step * 3 + rank * 5) % 11
        state = {0: PendingState.PENDING, 1: PendingState.FAILED}.get(k, PendingState.READY)
        states.append(state)
        reasons.append(1 + (i + rank) % 40 if state == PendingState.FAILED else 0)
    seqs = tuple(range(100 * step, 100 * step + n))
    return LocalStatus(seqs=seqs, states=tuple(states), reasons=tuple(reasons))


class StatusMember:
    """A member whose status is ``status(step, rank)``; it keeps every decision."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.step = 0
        self.decisions: list[tuple] = []

    def local_status(self) -> LocalStatus:
        return status(self.step, self.rank)

    def apply_decision(self, decision):
        self.decisions.append((decision.ready, decision.failed, decision.clock_ms))

    def new_failures(self):
        return ()

    def apply_poison(self, records):
        return None


def coordinators(layout, comm, levels) -> dict[str, Coordinator]:
    """A flat and a two-level coordinator of each op; clocks differ by rank and step."""
    out = {}
    for name, lv in (("flat", None), ("host", levels)):
        for op in OPS:
            member_clock = [0]
            out[f"{name}/{op}"] = (
                Coordinator(
                    layout,
                    comm,
                    window=WINDOW,
                    agreement_op=op,
                    levels=lv,
                    clock=lambda c=member_clock: c[0],
                ),
                member_clock,
            )
    return out


def run_steps(rank: int, coords: dict, steps: int) -> dict[str, list[tuple]]:
    """Step every coordinator ``steps`` times; the decisions each one made."""
    members = {name: StatusMember(rank) for name in coords}
    for step in range(1, steps + 1):
        for name, (coord, clock) in coords.items():
            clock[0] = 1_000 * step + 7 * rank
            members[name].step = step
            coord.step(step, members[name])
    return {name: m.decisions for name, m in members.items()}


def levels_body(rank: int, world: int, hosts: str, steps: int) -> dict:
    """On host ``hosts[rank]``: decide ``steps`` steps flat and two-level, both ops."""
    take_hostname(f"host{hosts[rank]}")
    layout = ParallelLayout(dp=world, pp=1, tp=1, requests="replicated")
    cfg = DistributedConfig(step_timeout_s=30, agreement_levels="host")
    with Runtime.attach(layout, distributed=cfg) as runtime:
        built = Coordinator.from_config(layout, runtime, cfg, max_pending=WINDOW)
        decided = run_steps(rank, coordinators(layout, runtime, built.levels), steps)
        groups = {g: runtime.members(g) for g in (HOST_GROUP, LEADER_GROUP)}
        return {
            "decided": decided,
            "groups": groups,
            "hosts": runtime.hosts,
            "levels": built.levels,
        }


def lost_body(rank: int, world: int, hosts: str, victim: int, step_timeout_s: float) -> dict:
    """Two-level steps until ``victim`` is killed at step 5; report how each survivor ends."""
    take_hostname(f"host{hosts[rank]}")
    layout = ParallelLayout(dp=world, pp=1, tp=1, requests="replicated")
    cfg = DistributedConfig(step_timeout_s=step_timeout_s, agreement_levels="host")
    runtime = Runtime.attach(layout, distributed=cfg)
    coord = Coordinator.from_config(layout, runtime, cfg, max_pending=WINDOW)
    member = StatusMember(rank)
    last_ok = time.monotonic()
    try:
        for step in range(1, 10_000):
            if rank == victim and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            member.step = step
            coord.step(step, member)
            last_ok = time.monotonic()
    except PeerLostError as exc:
        return dict(ranks=exc.ranks, waited_s=time.monotonic() - last_ok, message=str(exc))
    return dict(ranks=None)
