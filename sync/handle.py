"""Joining a channel: the handle a writer hands out, and the reader's handshake with it.

:class:`~gramcoord.sync.channel.BitmaskChannel` builds a :class:`ChannelHandle`
and the leader sends it to each TP worker out of band (it is a small msgspec
Struct: encode it, broadcast it, or pickle it).
:meth:`BitmaskReceiver.connect <gramcoord.sync.receiver.BitmaskReceiver.connect>`
calls :func:`join` with it: choose the transport, map the ring in shm mode,
say ``Hello`` and wait for the writer's ``Welcome``. The writer's half of the
handshake is :class:`~gramcoord.sync.roster.Roster`.
"""

from __future__ import annotations

import os
import time
from typing import Literal, NamedTuple

import msgspec

from gramcoord.sync.control import ControlClient
from gramcoord.sync.errors import HandshakeError, TransportTimeout
from gramcoord.sync.hosts import choose_mode, local_hostname
from gramcoord.sync.messages import (
    PROTOCOL_VERSION,
    READER_NAME_PATTERN,
    Bye,
    Hello,
    Welcome,
    valid_reader_name,
)
from gramcoord.sync.ring import BitmaskRing
from gramcoord.sync.ring_layout import RingHandle

__all__ = ["SLICE_S", "ChannelHandle", "Joined", "join"]

# A waiting reader wakes this often to check the deadline and the writer.
SLICE_S = 0.1


class ChannelHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a reader needs to join a channel; picklable and msgspec-encodable."""

    # PROTOCOL_VERSION of the writer.
    version: int
    # Run id (also in the segment and directory names).
    run_id: str
    # TransportConfig.kind of the writer; readers choose their endpoint with it.
    kind: Literal["auto", "shm", "tcp"]
    # The writer's host name.
    hostname: str
    # The writer's pid.
    pid: int
    # Vocabulary size of the masks; rows are ceil(vocab_size / 32) words.
    vocab_size: int
    # Endpoint for readers on the writer's host.
    ipc_endpoint: str
    # Endpoint for the others; None with kind "shm".
    tcp_endpoint: str | None
    # The ring's segment and shape.
    ring: RingHandle
    # Seconds a reader waits for a step before giving up.
    timeout_s: float
    # Seconds a reader waits for the writer's answer to its hello.
    handshake_timeout_s: float
    # Microseconds a local reader polls the ring before sleeping on zmq.
    spin_us: int


class Joined(NamedTuple):
    """A reader's end of a finished handshake."""

    # Connected to the writer's endpoint for ``mode``.
    client: ControlClient
    # How the reader gets its rows, as the writer confirmed.
    mode: Literal["shm", "tcp"]
    # The mapped ring in shm mode; None in tcp mode.
    ring: BitmaskRing | None
    # The host name the reader announced.
    host: str


def join(
    handle: ChannelHandle,
    name: str,
    *,
    vocab_size: int,
    timeout: float | None = None,
    hostname: str | None = None,
) -> Joined:
    """Say hello to the writer as reader ``name`` and wait for its welcome.

    Parameters and errors are those of
    :meth:`BitmaskReceiver.connect <gramcoord.sync.receiver.BitmaskReceiver.connect>`;
    on any error nothing stays open.
    """
    if not valid_reader_name(name):
        raise ValueError(f"reader name must match {READER_NAME_PATTERN}, got {name!r}")
    if name not in handle.ring.readers:
        raise HandshakeError(
            f"reader {name!r} is not one of the writer's readers {list(handle.ring.readers)}",
            peers=[name],
        )
    host = hostname or local_hostname()
    mode = choose_mode(handle.kind, handle.hostname, host)
    endpoint = handle.ipc_endpoint if mode == "shm" else handle.tcp_endpoint
    if mode is None or endpoint is None:
        raise HandshakeError(
            f"reader {name!r} on {host!r} cannot reach a {handle.kind!r} writer on {handle.hostname!r}",
            peers=[name],
        )
    timeout = handle.handshake_timeout_s if timeout is None else timeout
    # Map the ring before saying hello: a reader that cannot read the
    # slots never joins, and the writer's handshake names it.
    ring = BitmaskRing.attach(handle.ring, name) if mode == "shm" else None
    client = ControlClient(endpoint, name=name)
    try:
        client.send(Hello(PROTOCOL_VERSION, vocab_size, name, host, os.getpid()))
        welcome = _await_welcome(client, name, endpoint, timeout)
        if welcome.mode != mode or welcome.vocab_size != vocab_size:
            raise HandshakeError(
                f"reader {name!r}: writer answered mode {welcome.mode!r} / vocab "
                f"{welcome.vocab_size}, expected {mode!r} / {vocab_size}",
                peers=[name],
            )
    except BaseException:
        client.close()
        if ring is not None:
            ring.close()
        raise
    return Joined(client, mode, ring, host)


def _await_welcome(client: ControlClient, name: str, endpoint: str, timeout: float) -> Welcome:
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        got = client.recv(min(remaining, SLICE_S))
        if got is None:
            continue
        match got[0]:
            case Welcome() as welcome:
                return welcome
            case Bye(reason=reason):
                raise HandshakeError(f"writer turned reader {name!r} away: {reason}", peers=[name])
            case other:
                client.reject(f"{type(other).__name__} before the welcome")
    raise TransportTimeout(
        f"reader {name!r}: the writer at {endpoint} did not answer hello within {timeout:g} s",
        peers=["writer"],
    )
