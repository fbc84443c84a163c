"""The writer's end of the bitmask transport: a ring plus a control plane.

A stage leader (its session's roles, ``rank_worker.session.roles``) builds
one :class:`BitmaskChannel` naming its TP workers, hands
:attr:`BitmaskChannel.handle` to them (a
:class:`~gramcoord.sync.handle.ChannelHandle`, a small msgspec Struct: encode
it, broadcast it, or pickle it) and calls :meth:`~BitmaskChannel.accept`.
Each worker builds a :class:`~gramcoord.sync.receiver.BitmaskReceiver` from the
handle. Then, every step::

    leader:  channel.publish(step, mask, request_ids, num_drafts)
    worker:  view, request_ids, num_drafts = receiver.receive(step)
             ... apply view to the logits ...
             receiver.release(step)

Readers on the leader's host read the ring slot in place; readers elsewhere
(or every reader with ``transport: tcp``) get the same bytes as one raw zmq
frame. The leader blocks only when the slowest reader is ``num_slots``
steps behind, and then for at most ``timeout_s``; while it waits it checks
that the readers it waits for are alive (:class:`~gramcoord.sync.roster.Roster`), so a
dead reader is named at once rather than at the deadline.

Each step's ``BitmaskReady`` is stored in the slot as well as sent over zmq:
local readers poll the slot briefly before sleeping on their socket (see
:mod:`gramcoord.sync.receiver`), which is what makes the ring faster than any
message-based path for these sizes (``benchmarks/transport.py``).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Sequence

import numpy as np

from gramcoord.sync.announcement import Announcer, garbled
from gramcoord.sync.config import TransportConfig
from gramcoord.sync.control import ControlServer
from gramcoord.sync.errors import PeerGone, TransportError, TransportTimeout, quote_names
from gramcoord.sync.handle import ChannelHandle
from gramcoord.sync.hosts import local_hostname
from gramcoord.sync.messages import (
    PROTOCOL_VERSION,
    READER_NAME_PATTERN,
    Shutdown,
    valid_reader_name,
)
from gramcoord.sync.ring import BitmaskRing
from gramcoord.sync.roster import Roster

logger = logging.getLogger(__name__)

__all__ = ["BitmaskChannel"]

# How often a waiting writer checks whether lagging local readers still live.
_LIVENESS_EVERY_S = 0.1


class BitmaskChannel:
    """Writer's end: publishes one bitmask per step to a fixed set of readers.

    Parameters
    ----------
    readers
        Distinct reader names (``[A-Za-z0-9_.:-]``, at most 64 characters),
        e.g. ``["tp1", "tp2", "tp3"]``.
    vocab_size
        Padded model vocabulary; each row has ``ceil(vocab_size / 32)``
        int32 words.
    max_rows
        Rows per step at most: ``max_num_seqs * (1 + num_speculative_tokens)``.
    config
        Transport settings; defaults to ``TransportConfig()``.
    run_id
        Run id for the segment and directory names; random when None.
    label
        Distinguishes several channels of one run (e.g. one per stage).
    corrupt_every
        Fault injection: garble every N-th control frame (0 = never). An
        shm reader's announcement is garbled in place, since the reader can
        recover it from the ring slot; a tcp reader gets a garbled copy
        ahead of the real frame, which carries the rows' only copy.

    Notes
    -----
    One thread uses a channel at a time. Close it (or use ``with``) to send
    ``Shutdown`` to the readers and remove the segment and the ipc directory;
    ``atexit``, signal handlers and a reaper process remove them in every
    other exit path.
    """

    def __init__(
        self,
        *,
        readers: Sequence[str],
        vocab_size: int,
        max_rows: int,
        config: TransportConfig | None = None,
        run_id: str | None = None,
        label: str = "ring",
        corrupt_every: int = 0,
    ) -> None:
        self._config = config or TransportConfig()
        self._names = tuple(readers)
        bad = [n for n in self._names if not valid_reader_name(n)]
        if bad or not self._names:
            raise ValueError(
                f"need reader names matching {READER_NAME_PATTERN}, got {list(self._names)}"
            )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self._vocab_size = vocab_size
        self._width = (vocab_size + 31) // 32
        self._host = local_hostname()
        self._closed = False
        run_id = run_id or secrets.token_hex(4)
        self._ring = BitmaskRing.create(
            run_id=run_id,
            readers=self._names,
            max_rows=max_rows,
            width=self._width,
            num_slots=self._config.num_slots,
            label=label,
        )
        try:
            self._control = ControlServer(
                run_id=run_id, interface=self._config.interface, tcp=self._config.kind != "shm"
            )
        except BaseException:
            self._ring.close()
            raise
        self._roster = Roster(
            self._names,
            kind=self._config.kind,
            hostname=self._host,
            vocab_size=vocab_size,
            control=self._control,
            ring=self._ring,
        )
        self._handle = ChannelHandle(
            version=PROTOCOL_VERSION,
            run_id=run_id,
            kind=self._config.kind,
            hostname=self._host,
            pid=os.getpid(),
            vocab_size=vocab_size,
            ipc_endpoint=self._control.ipc_endpoint,
            tcp_endpoint=self._control.tcp_endpoint,
            ring=self._ring.handle,
            timeout_s=self._config.timeout_s,
            handshake_timeout_s=self._config.handshake_timeout_s,
            spin_us=self._config.spin_us,
        )
        self._next_liveness = 0.0
        self._acquired: np.ndarray | None = None  # the view acquire() handed out
        self._announce = Announcer(
            self._control.encode, width=self._width, corrupt_every=corrupt_every
        )

    @property
    def handle(self) -> ChannelHandle:
        """What readers need to connect; send it to them out of band."""
        return self._handle

    @property
    def ring(self) -> BitmaskRing:
        """The shared-memory ring (for inspection; publish through the channel)."""
        return self._ring

    @property
    def control(self) -> ControlServer:
        """The control socket (for inspection and fault-injection tests)."""
        return self._control

    @property
    def modes(self) -> dict[str, str]:
        """``{reader: "shm" | "tcp"}`` for every reader that said hello."""
        return self._roster.modes

    @property
    def dropped(self) -> int:
        """Control frames dropped as malformed, unknown or spoofed."""
        return self._control.dropped

    @property
    def corrupted(self) -> int:
        """Control frames garbled on purpose (``corrupt_every``)."""
        return self._announce.corrupted

    def accept(self, timeout: float | None = None) -> dict[str, str]:
        """Wait until every reader said hello; return their modes.

        Parameters
        ----------
        timeout
            Seconds; ``config.handshake_timeout_s`` when None.

        Returns
        -------
        dict
            ``{reader: "shm" | "tcp"}``.

        Raises
        ------
        TransportTimeout
            Naming the readers that never said hello.
        HandshakeError
            If a reader speaks another protocol version or vocabulary size,
            or cannot use the configured transport.
        """
        timeout = self._config.handshake_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while missing := self._roster.missing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeout(
                    f"reader(s) {quote_names(missing)} never said hello within {timeout:g} s "
                    f"(arrived: {quote_names(self._roster.peers) or 'none'})",
                    peers=missing,
                )
            self._pump(min(remaining, 0.1))
        return self.modes

    def acquire(self, rows: int, timeout: float | None = None) -> np.ndarray:
        """Writable view of the next slot, to fill in place before :meth:`publish`.

        Raises
        ------
        TransportTimeout
            If a reader still holds the slot after ``timeout`` (default
            ``config.timeout_s``); names it.
        PeerGone
            If a reader that holds the slot died or left.
        """
        self._check_open()
        if self._roster.missing:
            self.accept()
        timeout = self._config.timeout_s if timeout is None else timeout
        self._acquired = self._ring.acquire_write(rows, timeout, self._on_wait)
        return self._acquired

    def publish(
        self,
        step: int,
        array: np.ndarray,
        order: Sequence[str],
        drafts: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> int:
        """Publish the bitmask rows of ``step`` to every reader.

        Parameters
        ----------
        step
            Engine step, >= 0 and greater than the previous one.
        array
            int32 ``[rows, ceil(vocab_size / 32)]``. If it is the view from
            :meth:`acquire` (or any view of those same rows) it is published
            in place; otherwise it is copied into the next slot.
        order
            Request ids in scheduling order.
        drafts
            Draft-token count per request, aligned with ``order``.
        timeout
            Seconds to wait for a free slot; ``config.timeout_s`` when None.

        Returns
        -------
        int
            The slot used.

        Raises
        ------
        TransportTimeout
            If a reader did not release the slot in time; names it.
        PeerGone
            If a reader died or left.
        ValueError
            On a wrong shape, dtype, order/drafts mismatch or non-increasing step.
        """
        if array.ndim != 2 or array.shape[1] != self._width or array.dtype != np.int32:
            raise ValueError(
                f"expected int32 [rows, {self._width}], got {array.dtype} {list(array.shape)}"
            )
        rows = array.shape[0]
        order, drafts = tuple(order), tuple(drafts)
        ready, drafts = self._announce.ready(step, self._ring.next_slot, rows, order, drafts)
        self._roster.raise_if_gone(self._roster.peers)
        acquired, self._acquired = self._acquired, None
        view = self.acquire(rows, timeout)
        if array is not acquired and not _same_rows(array, view):
            np.copyto(view, array)
        # The announcement also goes into the slot, for readers polling it.
        slot = self._ring.publish(step, ready if self._roster.has_shm_readers else b"")
        frame = b""
        try:
            for peer in self._roster.peers.values():
                corrupt = self._announce.corrupt_next()
                if peer.mode == "shm":
                    self._control.send(peer.name, garbled(ready) if corrupt else ready)
                else:
                    frame = frame or self._announce.frame(step, rows, order, drafts)
                    if corrupt:
                        self._control.send(peer.name, garbled(frame), data=view)
                    # Zero-copy from the slot: safe because the slot is not
                    # rewritten before this reader's Release arrives.
                    self._control.send(peer.name, frame, data=view)
        except PeerGone as exc:
            self._pump(0)  # its Bye, if it said one, tells why
            self._roster.raise_if_gone(exc.peers)
            raise
        self._acquired = None
        self._pump(0)
        return slot

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every reader released every published step.

        Raises
        ------
        TransportTimeout
            Naming the readers still holding a step.
        PeerGone
            If one of them died or left.
        """
        self._check_open()
        timeout = self._config.timeout_s if timeout is None else timeout
        self._ring.wait_released(self._ring.last_step, timeout, self._on_wait)

    def close(self, reason: str = "writer closed the channel") -> None:
        """Send ``Shutdown`` to the readers, remove the segment and the directory.

        Idempotent. Readers' views stay valid until they drop them.
        """
        if self._closed:
            return
        self._closed = True
        try:
            payload = self._control.encode(Shutdown(reason))
            for peer in self._roster.peers.values():
                if peer.gone is None:
                    try:
                        self._control.send(peer.name, payload)
                    except TransportError as exc:
                        logger.debug("no shutdown for %s: %s", peer.name, exc)
        finally:
            try:
                self._control.close()
            finally:
                self._ring.close()

    def __enter__(self) -> BitmaskChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Internals ---------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("the channel is closed")

    def _on_wait(self, step: int, pause: float) -> None:
        if pause >= 1e-3:
            self._pump(pause)  # zmq polls in whole milliseconds
        else:
            self._pump(0)
            time.sleep(pause)
        now = time.monotonic()
        if now < self._next_liveness:
            return
        self._next_liveness = now + _LIVENESS_EVERY_S
        # Asked after the pump: a reader that released and then left is fine.
        self._roster.raise_if_dead(self._ring.lagging(step))

    def _pump(self, timeout: float) -> None:
        """Handle every queued reader message, waiting up to ``timeout`` for the first."""
        while (got := self._control.recv(timeout)) is not None:
            self._roster.handle(*got)
            timeout = 0


def _same_rows(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` already is the slot's rows (filled in place through another view)."""
    return a.shape == b.shape and a.ctypes.data == b.ctypes.data
