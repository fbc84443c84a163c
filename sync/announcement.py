"""A step's announcement on the wire: encoded once by the writer, read by a tcp reader.

Each step, :class:`~gramcoord.sync.channel.BitmaskChannel` tells every reader
where the rows are: an shm reader gets a ``BitmaskReady`` (the rows are in a
ring slot), a tcp reader a ``BitmaskFrame`` head followed by the rows as one
raw frame of little-endian int32. The channel's :class:`Announcer` encodes
both once per step, checks the ``BitmaskReady`` with the decoder readers
use, and garbles frames on request for fault injection.
:class:`~gramcoord.sync.receiver.BitmaskReceiver` turns a ``BitmaskFrame``
and its raw frame back into rows with :func:`frame_rows`.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np
import zmq

from gramcoord.sync.errors import ProtocolError
from gramcoord.sync.messages import BitmaskFrame, BitmaskReady, ReadyDecoder
from gramcoord.sync.ring_layout import RingHandle

__all__ = ["Announcer", "frame_rows", "garbled"]

_WIRE = np.dtype("<i4")


class Announcer:
    """The writer's encoder of each step's announcement, shared by every reader.

    Parameters
    ----------
    encode
        The control socket's encoder
        (:meth:`~gramcoord.sync.control.ControlServer.encode`).
    width
        int32 words per row.
    corrupt_every
        Fault injection: :meth:`corrupt_next` says yes for every N-th
        control frame sent (0 = never).
    """

    def __init__(
        self, encode: Callable[[msgspec.Struct], bytes], *, width: int, corrupt_every: int = 0
    ) -> None:
        self._encode = encode
        self._width = width
        self._validate = ReadyDecoder()
        # Fault injection (``faults.corrupt_frames_every``): 0 = off.
        self._corrupt_every = corrupt_every
        self._sent = 0
        # Control frames garbled so far.
        self.corrupted = 0

    def ready(
        self, step: int, slot: int, rows: int, order: tuple[str, ...], drafts: tuple[int, ...]
    ) -> tuple[bytes, tuple[int, ...]]:
        """Encode the step's BitmaskReady, checked by the decoder readers use.

        Decoding it again costs less than checking every request id and
        draft count in Python, and it checks exactly what readers will; an
        unchanged batch is not decoded again (see ReadyDecoder).

        Returns
        -------
        tuple
            The encoded message and the draft counts as Python ints.

        Raises
        ------
        ValueError
            If readers would refuse the message: an order/drafts mismatch,
            a negative step or draft count, a request id too long.
        """
        if len(order) != len(drafts):
            raise ValueError(f"{len(order)} request ids but {len(drafts)} draft counts")
        message = BitmaskReady(step, slot, rows, order, drafts)
        try:
            ready = self._encode(message)
        except TypeError:  # e.g. numpy integers as draft counts
            message = msgspec.structs.replace(message, num_drafts=tuple(map(int, drafts)))
            ready = self._encode(message)
        try:
            self._validate.decode(ready)
        except msgspec.ValidationError as exc:
            raise ValueError(f"bad step, request ids or draft counts: {exc}") from None
        return ready, message.num_drafts

    def frame(self, step: int, rows: int, order: tuple[str, ...], drafts: tuple[int, ...]) -> bytes:
        """Encode the BitmaskFrame head sent ahead of a tcp reader's rows."""
        return self._encode(BitmaskFrame(step, rows, self._width, order, drafts))

    def corrupt_next(self) -> bool:
        """Whether fault injection garbles the next control frame sent."""
        if not self._corrupt_every:
            return False
        self._sent += 1
        if self._sent % self._corrupt_every:
            return False
        self.corrupted += 1
        return True


def garbled(payload: bytes) -> bytes:
    """``payload`` with every byte inverted: it no longer decodes as a message."""
    return bytes(b ^ 0xFF for b in payload)


def frame_rows(message: BitmaskFrame, frame: zmq.Frame | None, ring: RingHandle) -> np.ndarray:
    """The rows a ``BitmaskFrame``'s raw frame carries, as a read-only view; no copy.

    Raises
    ------
    ProtocolError
        If the frame is missing or its size does not match the message and
        the ring's shape.
    """
    size = message.rows * message.width * _WIRE.itemsize
    if (
        frame is None
        or message.width != ring.width
        or message.rows > ring.max_rows
        or len(frame) != size
    ):
        raise ProtocolError(
            f"frame of {0 if frame is None else len(frame)} bytes for {message.rows} x {message.width} "
            f"(ring is {ring.max_rows} x {ring.width})"
        )
    view = np.frombuffer(frame.buffer, dtype=_WIRE).reshape(message.rows, message.width)
    view.flags.writeable = False
    return view
