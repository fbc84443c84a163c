"""Simulated hosts: namespaces with their own names and addresses, torn down on every path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.load import scaled
from tests.simulated_hosts import NETNS_ETC, PREFIX, SimulatedHosts, available

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=WHY or "simulated hosts unavailable")

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 29999)); s.listen(1); s.settimeout(20)
c, _ = s.accept(); c.sendall(socket.gethostname().encode()); c.close()
"""
CLIENT = """
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], 29999), timeout=2); break
    except OSError:
        time.sleep(0.1)
print(socket.gethostname(), c.recv(64).decode())
"""


def _ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(PREFIX)]


@pytest.mark.timeout(120)
def test_two_hosts_resolve_and_reach_each_other_then_vanish():
    with SimulatedHosts(2) as hosts:
        assert hosts.addresses == ["192.0.2.1", "192.0.2.2"]
        names = hosts.run(0, [sys.executable, "-c", "import socket; print(socket.gethostname())"])
        assert names.stdout.strip() == "hostA"
        server = hosts.popen(1, [sys.executable, "-c", SERVER, "hostB"])
        try:
            got = hosts.run(0, [sys.executable, "-c", CLIENT, "hostB"], timeout=scaled(60))
            assert got.stdout.split() == ["hostA", "hostB"], got.stderr
        finally:
            server.wait(timeout=30)
        made = set(hosts.namespaces)
        assert made <= set(_ours())
        # This instance's names share its tag (another test's hosts, on the
        # other pytest worker, may exist meanwhile: they are not ours).
        tag = hosts.namespaces[0][: -len("h0")]
    assert not [ns for ns in _ours() if ns.startswith(tag)]
    assert not any((NETNS_ETC / ns).exists() for ns in made)


@pytest.mark.timeout(120)
def test_partition_cuts_a_host_off_and_heal_reconnects_it():
    probe = "import socket, sys; socket.create_connection((sys.argv[1], 9), float(sys.argv[2]))"
    # A refusal answers at once, so its wait may be long (a loaded run's 1 s
    # ran out first); a cut host never answers, so its wait is short.
    room = str(scaled(10))
    with SimulatedHosts(2) as hosts:
        # Reachable: the connection is refused (nobody listens), not timed out.
        refused = hosts.run(0, [sys.executable, "-c", probe, "hostB", room])
        assert "ConnectionRefusedError" in refused.stderr, refused.stderr
        hosts.partition(1)
        cut = hosts.run(0, [sys.executable, "-c", probe, "hostB", "1"])
        assert "TimeoutError" in cut.stderr or "timed out" in cut.stderr, cut.stderr
        hosts.heal(1)
        again = hosts.run(0, [sys.executable, "-c", probe, "hostB", room])
        assert "ConnectionRefusedError" in again.stderr, again.stderr


@pytest.mark.timeout(60)
def test_processes_left_on_a_host_are_killed_at_close():
    hosts = SimulatedHosts(1)
    proc = hosts.popen(0, ["sleep", "300"])
    hosts.close()
    assert proc.wait(timeout=10) != 0
    assert not set(hosts.namespaces) & set(_ours())
