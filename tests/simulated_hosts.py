"""Simulated hosts on one machine, for the multi-host tests: network namespaces, names, addresses.

Multi-node paths (torchrun's c10d rendezvous, a Ray cluster, the TCP bitmask
transport, two-level agreement, partitions) need real network stacks.
``SimulatedHosts(n)`` builds ``n`` hosts on this machine (docs/scaling.md),
each with:

- its own network namespace (``ip netns``), loopback up;
- its own address on a documentation range (``192.0.2.0/24``, never a real
  network), on one veth pair to a private switch: a bridge inside a switch
  namespace of its own, so nothing is added to the machine's own namespace;
- its own hostname, which what runs there takes in a UTS namespace of its
  own;
- an ``/etc/netns/<ns>/hosts`` listing every simulated host, which
  ``ip netns exec`` mounts over ``/etc/hosts`` (c10d resolves hostnames).

The tests under ``tests/launch/`` and ``tests/coordinator/`` run commands on
a host (``run``, ``popen``: ``argv`` in the host's network namespace under
``unshare --uts``, the host's name set first) and cut hosts off:
``partition(i)`` takes host ``i``'s link down, ``heal(i)`` brings it back.
Everything is torn down on ``close`` / ``__exit__`` (which also kills what
``popen`` started) and at interpreter exit (names carry a fixed prefix, so
what a killed process left behind can be found with ``ip netns list``).
Needs root and namespace support; ``available()`` says whether this machine
has them. Traffic goes only to the hosts' own addresses.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

PREFIX = "gcsim"
SUBNET = "192.0.2"
NETNS_ETC = Path("/etc/netns")


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
        # What popen started: killed by pid at close, since one that has not
        # yet entered its namespace is not among the namespace's pids.
        self._started: list[subprocess.Popen] = []
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

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on host ``host`` (its namespace and hostname)."""
        return [
            "ip", "netns", "exec", self.namespaces[host],
            "unshare", "--uts", "--",
            "sh", "-c", f'hostname {self.names[host]} && exec "$@"', "sh", *argv,
        ]  # fmt: skip

    def run(self, host: int, argv: Sequence[str], *, timeout: float = 60, **kw):
        """Run ``argv`` on host ``host`` to completion (``subprocess.run``)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(host, argv), timeout=timeout, **kw)

    def popen(self, host: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` on host ``host``; ``close`` kills whatever still runs there."""
        proc = subprocess.Popen(self.command(host, argv), **kw)
        self._started.append(proc)
        return proc

    def partition(self, host: int) -> None:
        """Cut host ``host`` off the switch (its link goes down)."""
        _ip("link", "set", self._links[host], "down", ns=self._switch)

    def heal(self, host: int) -> None:
        """Reconnect host ``host``."""
        _ip("link", "set", self._links[host], "up", ns=self._switch)

    def close(self) -> None:
        """Kill what ``popen`` started and every process on the hosts, then remove every
        namespace and file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._started:
            if proc.poll() is None:
                proc.kill()  # the same pid whatever it has exec'd into
        for ns in [*self.namespaces, self._switch]:
            _teardown_ns(ns)
        atexit.unregister(self.close)

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
