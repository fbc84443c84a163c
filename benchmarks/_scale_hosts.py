"""Placing the ranks of a ``bench scale`` world on simulated hosts.

``gramcoord bench scale --hosts H`` spreads each world over ``H`` hosts made
by ``gramcoord.benchmarks.simulated_hosts.SimulatedHosts`` (network namespaces joined by
veth pairs to a private bridge). The ranks are still spawned by
``gramcoord.launch.procs.run_procs`` -- one deadline, one reaper -- and each
child moves itself onto its host before it imports torch: ``setns`` into the
host's network namespace, a UTS namespace of its own with the host's name.
Gloo then binds the host's ``eth0`` address (``GLOO_SOCKET_IFNAME``), so
ranks of one host talk inside that namespace and ranks of different hosts
cross veth, bridge, veth. The file is named with a leading underscore so
that ``gramcoord bench`` does not list it as a benchmark.

Python 3.11 has no ``os.setns``, hence the libc call. Entering a namespace
only changes the calling thread, so it must happen before any thread that
opens a socket exists: first thing in the spawned child.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Literal

from gramcoord.launch.procs import resolve

CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
NETNS_DIR = "/run/netns"

Placement = Literal["block", "round"]


def placement(world: int, hosts: int, mode: Placement) -> tuple[int, ...]:
    """The host index of every rank.

    ``block`` gives host 0 ranks ``0 .. world/H - 1`` and so on (torchrun's
    ``--nproc-per-node`` layout); ``round`` deals ranks out in turn.

    Raises
    ------
    ValueError
        If there are fewer ranks than hosts (a host would be empty).
    """
    if world < hosts:
        raise ValueError(f"{world} ranks cannot fill {hosts} hosts; use at least {hosts} ranks")
    if mode == "round":
        return tuple(r % hosts for r in range(world))
    per, extra = divmod(world, hosts)
    out: list[int] = []
    for h in range(hosts):
        out += [h] * (per + (h < extra))
    return tuple(out)


def enter_host(namespace: str | None, hostname: str) -> None:
    """Move this process onto a host: its network namespace (None: stay) and its hostname."""
    libc = ctypes.CDLL(None, use_errno=True)
    if namespace is not None:
        fd = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
        finally:
            os.close(fd)
    if libc.unshare(CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUTS): {os.strerror(err)}")
    socket.sethostname(hostname)


def on_host(rank: int, world: int, seats: tuple[tuple[str | None, str], ...], target: str, *args):
    """``run_procs`` target: enter ``seats[rank]`` = (namespace, hostname), then run ``target``.

    A seat without a namespace is a virtual host: its own hostname on the
    machine's loopback.
    """
    enter_host(*seats[rank])
    return resolve(target)(rank, world, *args)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit`` for the block, so ``finally`` and ``with`` exits run.

    The simulated hosts are torn down by context managers and ``atexit``;
    a plain SIGTERM would skip both and leave namespaces behind.
    """

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
