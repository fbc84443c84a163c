"""``SimulatedHosts`` (``gramcoord.benchmarks.simulated_hosts``) as the tests use it.

The benchmark (``gramcoord bench scale --hosts``) only needs the hosts; the
tests also run commands on them and cut them off: ``run`` and ``popen``
start ``argv`` in a host's network namespace under ``unshare --uts`` with
the host's name set first, and ``partition(i)`` takes host ``i``'s link
down (``heal(i)`` brings it back). ``close`` also kills what ``popen``
started.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from gramcoord.benchmarks import simulated_hosts as _hosts


class SimulatedHosts(_hosts.SimulatedHosts):
    def __init__(self, n: int) -> None:
        # What popen started: killed by pid at close, since one that has not
        # yet entered its namespace is not among the namespace's pids.
        self._started: list[subprocess.Popen] = []
        super().__init__(n)

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
        _hosts._ip("link", "set", self._links[host], "down", ns=self._switch)

    def heal(self, host: int) -> None:
        """Reconnect host ``host``."""
        _hosts._ip("link", "set", self._links[host], "up", ns=self._switch)

    def close(self) -> None:
        """Kill what ``popen`` started, then tear the hosts down (idempotent)."""
        if not self._closed:
            for proc in self._started:
                if proc.poll() is None:
                    proc.kill()  # the same pid whatever it has exec'd into
        super().close()
