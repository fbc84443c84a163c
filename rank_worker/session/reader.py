"""The TP worker's side of a session: receive a step's rows, apply, release.

A ``MaskReader`` wraps the transport's ``BitmaskReceiver``. The rows arrive
as a read-only view of the shared-memory slot (or of a raw zmq frame from
another host); they are valid until ``release``, after which the leader may
reuse the slot. Apply them with the session's ``MaskApplier`` so that every
TP rank aligns and digests exactly as the leader does.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from gramcoord.sync.channel import ChannelHandle
from gramcoord.sync.receiver import BitmaskReceiver


class ReceivedMask(NamedTuple):
    """One step's rows as the leader published them."""

    # Read-only int32 [rows, W]; valid until release(step).
    rows: np.ndarray
    request_ids: tuple[str, ...]
    num_drafts: tuple[int, ...]


class MaskReader:
    """Receive, then release, the bitmask rows of each step.

    Use :meth:`connect`; close with :meth:`close`.
    """

    def __init__(self, receiver: BitmaskReceiver) -> None:
        self.receiver = receiver

    @classmethod
    def connect(cls, handle: ChannelHandle, name: str, *, vocab_size: int) -> MaskReader:
        """Join the leader's channel as reader ``name``."""
        return cls(BitmaskReceiver.connect(handle, name, vocab_size=vocab_size))

    @property
    def dropped(self) -> int:
        """Control frames dropped as malformed or stale."""
        return self.receiver.dropped

    def receive(self, step: int, timeout: float | None = None) -> ReceivedMask:
        """Wait for the rows of ``step``.

        Raises
        ------
        TransportTimeout, WriterLost, ChannelClosed, ProtocolError
            From the transport; see ``BitmaskReceiver.receive``.
        """
        rows, ids, drafts = self.receiver.receive(step, timeout)
        return ReceivedMask(rows, ids, drafts)

    def release(self, step: int) -> None:
        """Give the slot of ``step`` back to the leader."""
        self.receiver.release(step)

    def close(self) -> None:
        """Say goodbye to the leader and unmap the ring (never removes it)."""
        self.receiver.close()
