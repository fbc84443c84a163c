"""Hosts: the interface a tcp endpoint binds, transport choice, liveness."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from gramcoord.sync.hosts import choose_mode, pid_alive, resolve_interface
from tests.sync.transport_peers import wait_until


def test_auto_interface_is_the_hosts_address_or_loopback():
    got = resolve_interface("auto")
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    assert got == ("127.0.0.1" if addr.startswith("127.") else addr)
    assert resolve_interface("192.0.2.7") == "192.0.2.7"
    for wildcard in ("0.0.0.0", "::", "[::]", "*", ""):
        with pytest.raises(ValueError):
            resolve_interface(wildcard)


@pytest.mark.parametrize(
    ("kind", "writer", "reader", "mode"),
    [
        pytest.param("auto", "n1", "n1", "shm", id="auto-same-host"),
        pytest.param("auto", "n1", "n2", "tcp", id="auto-other-host"),
        pytest.param("shm", "n1", "n1", "shm", id="shm-same-host"),
        pytest.param("shm", "n1", "n2", None, id="shm-other-host-impossible"),
        pytest.param("tcp", "n1", "n1", "tcp", id="tcp-same-host"),
        pytest.param("tcp", "n1", "n2", "tcp", id="tcp-other-host"),
    ],
)
def test_choose_mode(kind, writer, reader, mode):
    assert choose_mode(kind, writer, reader) == mode


def test_pid_alive_tells_running_zombie_and_reaped_apart():
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Not waited for yet: a zombie, which must count as dead.
    wait_until(lambda: not pid_alive(child.pid), 30, "the child to exit")
    child.wait()
    assert not pid_alive(child.pid)
