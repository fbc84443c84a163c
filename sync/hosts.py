"""Where the transport's processes run, and whether they still do.

Both ends of the bitmask transport apply these rules, so that the two ends
cannot disagree: this host's name (:func:`local_hostname`), the address a
tcp endpoint binds (:func:`resolve_interface`, for
:class:`~gramcoord.sync.control.ControlServer`), how a reader gets its rows
given the two hosts (:func:`choose_mode`, asked by the writer's
:class:`~gramcoord.sync.roster.Roster` and by the reader when it connects)
and whether a process on this host is alive (:func:`pid_alive`, with which
the roster and :class:`~gramcoord.sync.receiver.BitmaskReceiver` tell a dead
peer from a slow one). :class:`~gramcoord.sync.channel.BitmaskChannel` and
the receiver name their host with :func:`local_hostname`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Literal

__all__ = ["choose_mode", "local_hostname", "pid_alive", "resolve_interface"]


def local_hostname() -> str:
    """This host's name, as readers announce it and the writer compares it."""
    return socket.gethostname()


def resolve_interface(interface: str) -> str:
    """The address a tcp endpoint binds for ``TransportConfig.interface``.

    ``"auto"`` is the address this host's name resolves to
    (``socket.gethostbyname(socket.gethostname())``), so readers on other
    hosts can dial it; when that is a loopback address, or the name does not
    resolve, it is ``127.0.0.1``. Any other value is returned unchanged,
    except wildcards (``0.0.0.0``, ``::``, ``*``, empty), which are refused:
    the endpoint never listens on every interface.

    Raises
    ------
    ValueError
        For a wildcard address.
    """
    value = interface.strip()
    if value.lower() == "auto":
        try:
            addr = socket.gethostbyname(local_hostname())
        except OSError:
            return "127.0.0.1"
        try:
            ip = ipaddress.ip_address(addr)
        except ValueError:
            return "127.0.0.1"
        return "127.0.0.1" if ip.is_loopback or ip.is_unspecified else addr
    bare = value.strip("[]")
    if bare in ("", "*"):
        raise ValueError(f"transport.interface {interface!r} is a wildcard; name one address")
    try:
        wildcard = ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        wildcard = False  # an interface name such as eth0
    if wildcard:
        raise ValueError(
            f"transport.interface {interface!r} would listen on every interface; "
            "name one address (or 'auto')"
        )
    return value


def choose_mode(kind: str, writer_host: str, reader_host: str) -> Literal["shm", "tcp"] | None:
    """How a reader gets its rows: ``"shm"``, ``"tcp"`` or None (impossible).

    Parameters
    ----------
    kind
        ``TransportConfig.kind``: ``"auto"``, ``"shm"`` or ``"tcp"``.
    writer_host, reader_host
        Host names of both ends.

    Returns
    -------
    str or None
        ``auto``: shm on the writer's host, tcp elsewhere. ``shm``: shm, or
        None for a reader on another host. ``tcp``: always tcp.
    """
    local = writer_host == reader_host
    if kind == "tcp":
        return "tcp"
    if kind == "shm":
        return "shm" if local else None
    return "shm" if local else "tcp"


def pid_alive(pid: int) -> bool:
    """Whether a process on this host is alive (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The state follows the parenthesised command name.
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        pass  # no procfs: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
