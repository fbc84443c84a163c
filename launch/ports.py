"""Free TCP ports for listeners: rendezvous stores, servers, Ray heads.

No port is fixed anywhere: every listener is given one picked here at run
time, from a range no outgoing connection can take in the gap before it
binds.
"""

from __future__ import annotations

import random
import socket

# Ports a listener is given: above Ray's worker ports (10002-19999 by default),
# below the kernel's ephemeral range.
_LISTEN_LOW = 20000
_PICK_TRIES = 64
_PICKER = random.SystemRandom()  # not the global one: tests seed that


def ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now, for a listener to bind.

    Not one the OS hands out for ``bind(0)``: that comes from the ephemeral
    range, which every outgoing connection on the machine also draws from,
    so in the gap before the listener binds it, any connect could take it
    (``EADDRINUSE`` on a busy machine). A random port between Ray's worker
    ports and that range is only ever taken by an explicit bind.
    """
    low, high = _LISTEN_LOW, ephemeral_low()
    for _ in range(_PICK_TRIES if high - low > 1000 else 0):
        port = _PICKER.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
