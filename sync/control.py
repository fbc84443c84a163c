"""The zmq control plane between one writer and its readers.

The writer binds one ROUTER socket (:class:`ControlServer`) to an ``ipc://``
endpoint in a private directory (mode 0700, removed at close) and, unless
the transport is shm-only, to ``tcp://<interface>:<port chosen by the
OS>``; ports are never fixed. Each reader connects one DEALER socket
(:class:`ControlClient`) whose routing id is its name, so the writer can
address readers one by one and tell who sent what. A
:class:`~gramcoord.sync.channel.BitmaskChannel` owns the server; each
:class:`~gramcoord.sync.receiver.BitmaskReceiver` owns a client.

Each socket has one typed decoder, built once. A frame that does not decode,
has the wrong number of parts, or claims to come from another reader is
counted in ``dropped``, logged (rate-limited, so a hostile peer cannot flood
the log) and dropped; it never raises out of ``recv``.

``ROUTER_MANDATORY`` makes a send to a reader that has disconnected fail at
once, and readers watch their connection with a zmq monitor, so a dead
writer surfaces as :class:`~gramcoord.sync.errors.WriterLost` rather than a silent
wait.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from gramcoord.sync.errors import PeerGone, TransportTimeout, WriterLost
from gramcoord.sync.hosts import resolve_interface
from gramcoord.sync.janitor import PREFIX, janitor
from gramcoord.sync.messages import (
    BitmaskFrame,
    ReaderMessage,
    WriterMessage,
    reader_decoder,
    writer_decoder,
)

logger = logging.getLogger(__name__)

__all__ = ["ControlClient", "ControlServer"]

# Log the first few drops in full, then one line per this many.
_LOG_FIRST, _LOG_EVERY = 10, 1000
# Seconds a closing socket may spend flushing (a Shutdown, a Bye).
_LINGER_MS = 500
# Longest ipc:// path zmq accepts (sun_path) with room for "/ctl".
_IPC_MAX = 100


class _DropCounter:
    """Counts dropped frames and logs them without flooding."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.count = 0

    def __call__(self, why: str, frames: Sequence[object]) -> None:
        self.count += 1
        if self.count <= _LOG_FIRST or self.count % _LOG_EVERY == 0:
            logger.warning(
                "%s dropped frame #%s (%s parts): %s", self.where, self.count, len(frames), why
            )


def _ipc_dir(run_id: str) -> str:
    for base in (None, "/tmp"):
        path = tempfile.mkdtemp(prefix=f"{PREFIX}-{run_id}-", dir=base)
        if len(path) <= _IPC_MAX:
            return path
        os.rmdir(path)
    raise OSError("no temporary directory with a path short enough for an ipc:// socket")


class ControlServer:
    """The writer's ROUTER socket.

    Parameters
    ----------
    run_id
        Run id, part of the private directory's name.
    interface
        Address for the tcp endpoint (``TransportConfig.interface``;
        ``"auto"`` is resolved by
        :func:`~gramcoord.sync.hosts.resolve_interface`).
    tcp
        Whether to bind a tcp endpoint (readers on other hosts).
    """

    def __init__(self, *, run_id: str, interface: str = "127.0.0.1", tcp: bool = True) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self._decoder = writer_decoder()
        self._encoder = msgspec.msgpack.Encoder()
        self._drops = _DropCounter("writer control")
        self._dir = _ipc_dir(run_id)
        janitor().own("dir", self._dir)
        self.ipc_endpoint = f"ipc://{self._dir}/ctl"
        self.tcp_endpoint: str | None = None
        try:
            self._sock.bind(self.ipc_endpoint)
            if tcp:
                interface = resolve_interface(interface)
                ipv6 = ":" in interface
                self._sock.setsockopt(zmq.IPV6, int(ipv6))
                self._sock.bind(f"tcp://[{interface}]:*" if ipv6 else f"tcp://{interface}:*")
                # Never a wildcard (resolve_interface refuses them): dialable as is.
                self.tcp_endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self.close()
            raise

    @property
    def dropped(self) -> int:
        """Frames dropped as malformed, unknown or spoofed."""
        return self._drops.count

    def reject(self, why: str) -> None:
        """Count and log a well-formed message the caller refused."""
        self._drops(why, ())

    @property
    def ipc_dir(self) -> str:
        """The private directory holding the ipc socket."""
        return self._dir

    def encode(self, message: msgspec.Struct) -> bytes:
        """Encode a message once, to send it to several readers."""
        return self._encoder.encode(message)

    def send(self, reader: str, payload: bytes, data: object = None) -> None:
        """Send an encoded message (and optionally one raw frame) to ``reader``.

        Parameters
        ----------
        reader
            The reader's name (its routing id).
        payload
            An encoded message from :meth:`encode`.
        data
            A buffer sent as a second frame without copying (``copy=False``);
            it must stay unchanged until the reader released it.

        Raises
        ------
        PeerGone
            If ``reader`` is not connected (it exited or never connected).
        TransportTimeout
            If ``reader``'s queue is full (it stopped reading).
        """
        if data is None:
            self.send_frames(reader, [payload])
        else:
            self.send_frames(reader, [payload, data], copy=False)

    def send_frames(self, reader: str, frames: Sequence[object], *, copy: bool = True) -> None:
        """Send arbitrary frames to ``reader``: the raw path under :meth:`send`.

        Also how tests deliver garbage to a reader. Raises as :meth:`send`.
        """
        try:
            self._sock.send_multipart([reader.encode(), *frames], flags=zmq.NOBLOCK, copy=copy)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                raise PeerGone(
                    f"reader {reader!r} is not connected (exited or never connected)",
                    peers=[reader],
                ) from exc
            if exc.errno == errno.EAGAIN:
                raise TransportTimeout(
                    f"reader {reader!r} stopped reading: its queue is full", peers=[reader]
                ) from exc
            raise

    def recv(self, timeout: float) -> tuple[str, ReaderMessage] | None:
        """Next well-formed message and its sender, or None after ``timeout`` s.

        Malformed frames are counted in :attr:`dropped` and skipped; they
        never raise.
        """
        if timeout <= 0 and not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return None  # the per-step check: no exception when nothing waits
        deadline = time.monotonic() + timeout
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._sock.poll(int(remaining * 1000) + 1):
                    return None
                continue
            got = self._parse(frames)
            if got is not None:
                return got

    def _parse(self, frames: list[bytes]) -> tuple[str, ReaderMessage] | None:
        if len(frames) != 2:
            self._drops("expected [identity, message]", frames)
            return None
        try:
            sender = frames[0].decode()
            message = self._decoder.decode(frames[1])
        except (UnicodeDecodeError, msgspec.DecodeError) as exc:
            self._drops(str(exc), frames)
            return None
        if message.reader != sender:
            self._drops(f"message for {message.reader!r} sent by {sender!r}", frames)
            return None
        return sender, message

    def close(self) -> None:
        """Close the socket (flushing for up to 0.5 s) and remove the directory."""
        if not self._sock.closed:
            self._sock.close()
            self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        janitor().disown("dir", self._dir)


class ControlClient:
    """A reader's DEALER socket, connected to the writer's endpoint.

    Parameters
    ----------
    endpoint
        The writer's ``ipc://`` or ``tcp://`` endpoint.
    name
        The reader's name; becomes its routing id.
    """

    def __init__(self, endpoint: str, *, name: str) -> None:
        self.endpoint = endpoint
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self._sock.setsockopt(zmq.ROUTING_ID, name.encode())
        # Created before connect so that no disconnect can be missed.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._decoder = reader_decoder()
        self._encoder = msgspec.msgpack.Encoder()
        self._drops = _DropCounter(f"reader {name!r} control")
        self._lost = False

    @property
    def dropped(self) -> int:
        """Frames dropped as malformed or unknown."""
        return self._drops.count

    def reject(self, why: str) -> None:
        """Count and log a well-formed message the caller refused."""
        self._drops(why, ())

    def send(self, message: msgspec.Struct) -> None:
        """Send one message to the writer (queued if not yet connected)."""
        self._sock.send(self._encoder.encode(message), copy=True)

    def recv(self, timeout: float) -> tuple[WriterMessage, zmq.Frame | None] | None:
        """Next well-formed message, with its raw frame if it has one.

        Returns
        -------
        tuple or None
            ``(message, frame)``; ``frame`` (zero-copy) only follows a
            :class:`~gramcoord.sync.messages.BitmaskFrame`. None after ``timeout`` s.

        Raises
        ------
        WriterLost
            If the connection to the writer closed and nothing is left to
            read.
        """
        deadline = time.monotonic() + timeout
        while True:
            got = self._take()
            if got is not None:
                return got
            if self._lost:
                raise WriterLost(
                    f"connection to the writer at {self.endpoint} closed", peers=["writer"]
                )
            remaining = deadline - time.monotonic()
            events = dict(self._poller.poll(int(remaining * 1000) + 1)) if remaining > 0 else {}
            if not events:
                return None
            if self._monitor in events:
                event = recv_monitor_message(self._monitor)
                # Messages that arrived before the disconnect are still read.
                self._lost = self._lost or event["event"] == zmq.EVENT_DISCONNECTED

    def _take(self) -> tuple[WriterMessage, zmq.Frame | None] | None:
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            got = self._parse(frames)
            if got is not None:
                return got

    def _parse(self, frames: list[zmq.Frame]) -> tuple[WriterMessage, zmq.Frame | None] | None:
        try:
            message = self._decoder.decode(frames[0].buffer)
        except msgspec.DecodeError as exc:
            self._drops(str(exc), frames)
            return None
        wants = 2 if isinstance(message, BitmaskFrame) else 1
        if len(frames) != wants:
            self._drops(
                f"{type(message).__name__} with {len(frames)} parts, expected {wants}", frames
            )
            return None
        return message, frames[1] if wants == 2 else None

    def close(self, *, flush: bool = True) -> None:
        """Close the socket, flushing queued messages for up to 0.5 s if ``flush``."""
        if not self._sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=_LINGER_MS if flush else 0)
            self._ctx.term()
