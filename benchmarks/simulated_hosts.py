"""Simulated hosts on one machine: network namespaces with their own names and addresses.

Multi-node paths (torchrun's c10d rendezvous, a Ray cluster, the TCP bitmask
transport, partitions) need real network stacks. ``SimulatedHosts(n)``
builds ``n`` hosts on this machine (docs/scaling.md), each with:

- its own network namespace (``ip netns``), loopback up;
- its own address on a documentation range (``192.0.2.0/24``, never a real
  network), on one veth pair to a private switch: a bridge inside a switch
  namespace of its own, so nothing is added to the machine's own namespace;
- its own hostname, which what runs there takes in a UTS namespace of its
  own;
- an ``/etc/netns/<ns>/hosts`` listing every simulated host, which
  ``ip netns exec`` mounts over ``/etc/hosts`` (c10d resolves hostnames).

``gramcoord bench scale --hosts`` spawns its ranks with ``on_host``, which
moves each child onto its host (``enter_host``) before it imports torch;
the tests' subclass (``tests/simulated_hosts.py``) adds running commands on
a host, and partitions. Everything is torn down on ``close`` / ``__exit__``
and at interpreter exit (names carry a fixed prefix, so what a killed
process left behind can be found with ``ip netns list``). Needs root and
namespace support; ``available()`` says whether this machine has them.
Traffic goes only to the hosts' own addresses.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from gramcoord.launch.procs import resolve

PREFIX = "gcsim"
SUBNET = "192.0.2"
NETNS_ETC = Path("/etc/netns")
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def available() -> tuple[bool, str]:
    """Whether network namespaces can be made here, and why not if not."""
    if os.geteuid() != 0:
        return False, "simulated hosts need root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return False, "the ip and unshare commands are missing"
    probe = f"{PREFIX}probe{secrets.token_hex(2)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return False, f"network namespaces are refused: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def _teardown_ns(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


class SimulatedHosts:
    """``n`` simulated hosts joined by a private switch; see the module docstring.

    Parameters
    ----------
    n:
        Number of hosts (1..200).

    Attributes
    ----------
    names:
        Host names (``hostA``, ``hostB``, ...), also their hostnames.
    addresses:
        Their IPv4 addresses, ``192.0.2.1`` upwards.
    namespaces:
        Their network namespace names.
    """

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"between 1 and 200 simulated hosts, not {n}")
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        tag = secrets.token_hex(2)
        self.names = [f"host{chr(ord('A') + i)}" if i < 26 else f"host{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.namespaces = [f"{PREFIX}{tag}h{i}" for i in range(n)]
        self._switch = f"{PREFIX}{tag}sw"
        self._links = [f"{PREFIX[:2]}{tag}s{i}" for i in range(n)]  # switch side, <= 15 chars
        self._closed = False
        atexit.register(self.close)
        try:
            self._build(tag)
        except BaseException:
            self.close()
            raise

    def _build(self, tag: str) -> None:
        _ip("netns", "add", self._switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self._switch)
        _ip("link", "set", "br0", "up", ns=self._switch)
        hosts = "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
        hosts = "127.0.0.1 localhost\n" + hosts
        for ns, link, addr in zip(self.namespaces, self._links, self.addresses):
            _ip("netns", "add", ns)
            peer = f"{PREFIX[:2]}{tag}p"
            _ip(
                "link", "add", link, "netns", self._switch,
                "type", "veth", "peer", "name", peer, "netns", ns,
            )  # fmt: skip
            _ip("link", "set", link, "master", "br0", "up", ns=self._switch)
            _ip("link", "set", peer, "name", "eth0", ns=ns)
            _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)

    def close(self) -> None:
        """Kill every process on the hosts and remove every namespace and file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for ns in [*self.namespaces, self._switch]:
            _teardown_ns(ns)
        atexit.unregister(self.close)

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def enter_host(namespace: str | None, hostname: str) -> None:
    """Move this process onto a host: its network namespace (None: stay) and its hostname.

    Python 3.11 has no ``os.setns``, hence the libc call. Entering a namespace
    only changes the calling thread, so it must happen before any thread that
    opens a socket exists: first thing in a spawned child.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if namespace is not None:
        fd = os.open(os.path.join("/run/netns", namespace), os.O_RDONLY)
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
    machine's loopback. Gloo then binds the host's ``eth0`` address
    (``GLOO_SOCKET_IFNAME``), so ranks of one host talk inside that namespace
    and ranks of different hosts cross veth, bridge, veth.
    """
    enter_host(*seats[rank])
    return resolve(target)(rank, world, *args)
