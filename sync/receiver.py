"""The reader's end of the bitmask transport (a TP worker).

A TP worker's session (``rank_worker.session.reader``) builds one
:class:`BitmaskReceiver` from the leader's
:class:`~gramcoord.sync.handle.ChannelHandle`, then takes one step at a time::

    with BitmaskReceiver.connect(handle, "tp1", vocab_size=V) as rx:
        for step in steps:
            view, request_ids, num_drafts = rx.receive(step)
            ...  # apply view (read-only int32 [rows, W]) to the logits
            rx.release(step)

On the writer's host the view is the ring slot itself; elsewhere it is the
raw zmq frame, also without a copy. Either way it is valid until
:meth:`~BitmaskReceiver.release`; after that the writer may reuse the slot.

A reader on the writer's host learns of a step in one of two ways. It first
polls the next slot's header for up to ``spin_us`` (the writer stores the
announcement in the slot), which costs a busy core but wakes in
microseconds; then it sleeps on the control socket until the zmq
``BitmaskReady`` arrives. The writer always sends that message, so a reader
that stopped polling is never stranded; announcements of steps already
taken from the ring are recognised and skipped.

Nothing a peer sends can crash the reader: frames that do not decode, that
do not match the ring's slot header or that repeat an old step are counted
in ``dropped`` and skipped. What stops a reader is the writer going away
(:class:`~gramcoord.sync.errors.WriterLost`, :class:`~gramcoord.sync.errors.ChannelClosed`), a
deadline (:class:`~gramcoord.sync.errors.TransportTimeout`) or a genuine step out of
order (:class:`~gramcoord.sync.errors.ProtocolError`).
"""

from __future__ import annotations

import os
import time
from functools import partial

import msgspec
import numpy as np
import zmq

from gramcoord.sync.announcement import frame_rows
from gramcoord.sync.errors import (
    ChannelClosed,
    ProtocolError,
    TransportError,
    TransportTimeout,
    WriterLost,
)
from gramcoord.sync.handle import SLICE_S, ChannelHandle, Joined, join
from gramcoord.sync.hosts import pid_alive
from gramcoord.sync.messages import (
    PROTOCOL_VERSION,
    BitmaskFrame,
    BitmaskReady,
    Bye,
    ReadyDecoder,
    Release,
    Shutdown,
    WriterMessage,
)
from gramcoord.sync.ring import POLLING_IS_SAFE

__all__ = ["BitmaskReceiver"]

# How long a reader that saw the ring closed waits for the writer's Shutdown.
_SHUTDOWN_GRACE_S = 2.0

# What receive() returns: the read-only view, request ids, draft counts.
Received = tuple[np.ndarray, tuple[str, ...], tuple[int, ...]]


class BitmaskReceiver:
    """Reader's end of a channel; build it with :meth:`connect`.

    Attributes
    ----------
    name
        This reader's name.
    mode
        ``"shm"`` (ring slots) or ``"tcp"`` (raw frames), chosen by the writer.
    """

    def __init__(self, handle: ChannelHandle, name: str, joined: Joined, spin_us: int = 0) -> None:
        self.name = name
        self.mode = joined.mode
        self._handle = handle
        self._client = joined.client
        self._ring = ring = joined.ring
        self._local = joined.host == handle.hostname
        self._last = -1
        # step -> zmq frame (tcp) or None (shm); frames keep tcp views alive.
        self._held: dict[int, zmq.Frame | None] = {}
        self._closed = False
        self._writer_gone = False
        # Polling the ring: for how long, which slot comes next, and the steps
        # taken from the ring whose zmq announcement is still on its way.
        self._spin_s = spin_us * 1e-6 if ring is not None and POLLING_IS_SAFE else 0.0
        self._next_slot = 0
        self._polled: set[int] = set()
        # Announcements read from the socket ahead of their step: the step
        # before them was taken from the ring, its own announcement lost.
        self._early: list[tuple[WriterMessage, zmq.Frame | None]] = []
        self._notes = ReadyDecoder()

    @classmethod
    def connect(
        cls,
        handle: ChannelHandle,
        name: str,
        *,
        vocab_size: int,
        timeout: float | None = None,
        hostname: str | None = None,
        spin_us: int | None = None,
    ) -> BitmaskReceiver:
        """Say hello to the writer and wait for its welcome.

        Parameters
        ----------
        handle
            The writer's :attr:`~gramcoord.sync.channel.BitmaskChannel.handle`.
        name
            This reader's name; must be one the writer listed.
        vocab_size
            The vocabulary this reader applies masks to; must equal the
            writer's.
        timeout
            Seconds to wait for the welcome; ``handle.handshake_timeout_s``
            when None.
        hostname
            Host name to announce; this host's when None. Tests use it to
            play a reader on another node.
        spin_us
            Microseconds :meth:`receive` polls the ring before sleeping on
            the control socket; ``handle.spin_us`` when None. Only readers in
            shm mode on x86-64 poll (see ``gramcoord.sync.ring.POLLING_IS_SAFE``).

        Returns
        -------
        BitmaskReceiver
            Connected, with the ring mapped in shm mode.

        Raises
        ------
        HandshakeError
            If the writer turns this reader away (unknown name, version or
            vocabulary mismatch, shm across hosts).
        TransportError
            If the ring cannot be mapped (the writer is gone).
        TransportTimeout
            If the writer does not answer in time.
        """
        joined = join(handle, name, vocab_size=vocab_size, timeout=timeout, hostname=hostname)
        return cls(handle, name, joined, handle.spin_us if spin_us is None else spin_us)

    @property
    def dropped(self) -> int:
        """Control frames dropped: malformed, unknown, stale or not matching the ring."""
        return self._client.dropped

    def receive(self, step: int, timeout: float | None = None) -> Received:
        """Wait for the rows of ``step``.

        Parameters
        ----------
        step
            The step to receive; steps are received in the order the writer
            published them.
        timeout
            Seconds; ``handle.timeout_s`` when None.

        Returns
        -------
        view : numpy.ndarray
            Read-only int32 ``[rows, ceil(vocab_size / 32)]``, no copy; valid
            until :meth:`release`.
        request_ids : tuple of str
            Requests in scheduling order.
        num_drafts : tuple of int
            Draft tokens per request.

        Raises
        ------
        TransportTimeout
            If the step does not arrive in time.
        WriterLost
            If the writer died or its connection closed.
        ChannelClosed
            If the writer closed the channel.
        ProtocolError
            If the writer published another step than ``step`` next.
        """
        if self._closed:
            raise TransportError(f"reader {self.name!r} is closed")
        if step in self._held:
            raise ValueError(f"step {step} was received and not released yet")
        timeout = self._handle.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            while self._early:
                if (result := self._take(step, *self._early.pop(0))) is not None:
                    return result
            # First whatever is queued, so the socket is drained every step
            # even when the ring poll below finds every step first.
            while (got := self._client.recv(0)) is not None:
                if (result := self._take(step, *got)) is not None:
                    return result
            if self._spin_s:
                until = min(deadline, time.monotonic() + self._spin_s)
                if (result := self._poll_ring(step, until)) is not None:
                    return result
            while (remaining := deadline - time.monotonic()) > 0:
                got = self._client.recv(min(remaining, SLICE_S))
                if got is None:
                    self._check_writer()
                    # An announcement lost or garbled on the socket is still
                    # in the ring slot: look once per slice.
                    polled = self._ring is not None and POLLING_IS_SAFE
                    if polled and (result := self._poll_ring(step, 0.0)) is not None:
                        return result
                elif (result := self._take(step, *got)) is not None:
                    return result
        except WriterLost:
            self._writer_gone = True
            raise
        raise TransportTimeout(
            f"reader {self.name!r}: step {step} did not arrive within {timeout:g} s "
            f"(last received: {self._last})",
            peers=["writer"],
        )

    def release(self, step: int) -> None:
        """Give ``step`` (and any earlier held step) back to the writer.

        Raises
        ------
        ValueError
            If ``step`` is not held.
        """
        if step not in self._held:
            raise ValueError(f"step {step} is not held by reader {self.name!r}")
        for held in [s for s in self._held if s <= step]:
            del self._held[held]
        if self._ring is not None:
            self._ring.release(step)
        else:
            self._client.send(Release(self.name, step))

    def close(self) -> None:
        """Say bye and unmap; never removes the segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._held.clear()
        try:
            if not self._writer_gone:
                self._client.send(
                    Bye(PROTOCOL_VERSION, self._handle.vocab_size, self.name, "reader closed")
                )
        except zmq.ZMQError:
            pass  # the writer is gone; nothing to tell
        finally:
            # Nobody to flush to once the writer is gone: do not linger.
            self._client.close(flush=not self._writer_gone)
            if self._ring is not None:
                self._ring.close()

    def __enter__(self) -> BitmaskReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Internals ---------------------------------------------------------

    def _check_writer(self) -> None:
        if self._ring is not None and self._ring.writer_closed:
            self._read_to_shutdown()
            raise ChannelClosed("the writer closed the ring", peers=["writer"])
        if self._local and not pid_alive(self._handle.pid):
            raise WriterLost(f"the writer (pid {self._handle.pid}) died", peers=["writer"])

    def _read_to_shutdown(self) -> None:
        """Read what the writer sent before it closed the ring, up to its Shutdown.

        The writer sends ``Shutdown`` (with the reason, such as the leader's
        error) before it marks the ring closed, but zmq may deliver it after
        the flag is seen. Reading the socket in order until it comes makes
        the error carry the reason and counts every frame sent before it, in
        every interleaving; a writer that could not send it costs at most
        :data:`_SHUTDOWN_GRACE_S`.
        """
        end = time.monotonic() + _SHUTDOWN_GRACE_S
        while (left := end - time.monotonic()) > 0:
            try:
                got = self._client.recv(min(left, SLICE_S))
            except WriterLost:
                return  # the connection closed with nothing left to read
            if got is not None and isinstance(got[0], Shutdown | Bye):
                self._take(self._last + 1, *got)  # raises with the writer's reason

    def _poll_ring(self, step: int, until: float) -> Received | None:
        """Busy-poll the next slot for ``step`` until ``until``; None if it did not show.

        Announcements read from the ring are checked like messages, but a bad
        one is left to the zmq path (which counts it) instead of counted here.
        """
        ring, slot = self._ring, self._next_slot
        assert ring is not None
        while (note := ring.note(slot, step)) is None:
            if time.monotonic() >= until:
                return None
            os.sched_yield()  # on an oversubscribed host, let the writer run
        try:
            message = self._notes.decode(note)
            if (message.step, message.slot) != (step, slot):
                return None
            view = self._shm_view(message)
        except (msgspec.DecodeError, ProtocolError):
            return None
        self._polled.add(step)
        return self._accept(message, view, None)

    def _take(self, step: int, message: WriterMessage, frame: zmq.Frame | None) -> Received | None:
        match message:
            case Shutdown(reason=reason):
                raise ChannelClosed(f"the writer closed the channel: {reason}", peers=["writer"])
            case Bye(reason=reason):
                raise WriterLost(f"the writer said bye: {reason}", peers=["writer"])
            case BitmaskReady(step=polled) if polled in self._polled:
                # Already taken from the ring: its announcement, not a new step.
                self._polled = {s for s in self._polled if s > polled}
                return None
            case BitmaskReady() if self._ring is not None:
                make = self._shm_view
            case BitmaskFrame() if self._ring is None:
                make = partial(self._frame_view, frame=frame)
            case _:
                self._client.reject(f"{type(message).__name__} is unexpected in {self.mode} mode")
                return None
        try:
            view = make(message)
        except ProtocolError as exc:
            self._client.reject(str(exc))
            return None
        # A writer that runs ahead announced a later step, and this step's
        # announcement was lost or garbled: it is in the ring.
        ahead = message.step > step and isinstance(message, BitmaskReady) and POLLING_IS_SAFE
        if ahead and (result := self._poll_ring(step, 0.0)) is not None:
            self._early.append((message, frame))
            return result
        if message.step != step:
            raise ProtocolError(
                f"reader {self.name!r} waits for step {step} "
                f"but the writer published step {message.step}",
                peers=[self.name],
            )
        if self._polled:
            # Steps taken from the ring whose announcement never came (lost
            # or garbled on the socket) are forgotten once a later one does.
            self._polled = {s for s in self._polled if s > step}
        return self._accept(message, view, frame)

    def _accept(
        self, message: BitmaskReady | BitmaskFrame, view: np.ndarray, frame: zmq.Frame | None
    ) -> Received:
        self._last = message.step
        self._held[message.step] = frame
        if isinstance(message, BitmaskReady):
            self._next_slot = (message.slot + 1) % self._handle.ring.num_slots
        return view, message.request_ids, message.num_drafts

    def _check_new(self, message: BitmaskReady | BitmaskFrame) -> None:
        if message.step <= self._last:
            raise ProtocolError(f"step {message.step} is not newer than {self._last}")
        if len(message.request_ids) != len(message.num_drafts):
            raise ProtocolError(
                f"{len(message.request_ids)} request ids but {len(message.num_drafts)} draft counts"
            )

    def _shm_view(self, message: BitmaskReady) -> np.ndarray:
        self._check_new(message)
        assert self._ring is not None
        return self._ring.read(message.slot, message.step, message.rows)

    def _frame_view(self, message: BitmaskFrame, frame: zmq.Frame | None) -> np.ndarray:
        self._check_new(message)
        return frame_rows(message, frame, self._handle.ring)
