"""Variable-length byte messages over a runtime's gloo groups.

The step loop moves small typed messages between ranks every step: new
requests and batches down each pipeline chain, sampled tokens back to stage
0, the transport handle to TP workers at start-up, per-rank reports to rank 0
at the end. They are msgspec-encoded by the caller; this module only moves
bytes, so ``coordinator`` still knows nothing of grammars.

A message of up to ``INLINE_BYTES`` is one point-to-point transfer on the
``world`` group: ``[length, payload padded to whole int64 words]``, received
into a buffer of the largest inline size (gloo fills a prefix of a larger
receive buffer). A longer one is that header alone, ``[length]``, then the
payload in a second transfer. Both go through :meth:`Runtime.send` /
:meth:`Runtime.recv`, so they carry the runtime's deadline and peer-loss
report. Sends are asynchronous with at most one in flight (the runtime
drains earlier sends first), so a sender waits on its receiver only when it
sends again before the receiver took the previous transfer: one transfer
per message keeps a sender that sends once per step from ever waiting on a
receiver that keeps up. The step loop orders its messages so that every
receiver posts them in the order they are sent.
"""

from __future__ import annotations

import numpy as np

from gramcoord.coordinator.comm import Comm

_WORD = 8
# Tags of the step loop's messages, apart from the coordinator's chain tags.
TAG_HEADER = 101
TAG_PAYLOAD = 102
# Largest message that travels in its header's transfer.
INLINE_BYTES = 16 * 1024
_INLINE_WORDS = INLINE_BYTES // _WORD


def _words(data: bytes) -> np.ndarray:
    padded = data + b"\0" * (-len(data) % _WORD)
    return np.frombuffer(padded, dtype=np.int64) if padded else np.zeros(0, dtype=np.int64)


class ByteLink:
    """Send and receive byte messages to and from global ranks.

    Parameters
    ----------
    comm:
        The rank's runtime; it must have a ``world`` group (any world of
        more than one rank does).
    group:
        The group the transfers use.
    """

    def __init__(self, comm: Comm, group: str = "world") -> None:
        self.comm = comm
        self.group = group
        self.bytes_sent = 0
        self.bytes_received = 0
        # Receive buffer of a message's first transfer (header and inline payload).
        self._inbox = np.zeros(1 + _INLINE_WORDS, dtype=np.int64)

    def send(self, dst: int, data: bytes, *, operation: str, step: int) -> None:
        """Send ``data`` to global rank ``dst`` (returns once its first transfer is posted)."""
        words = _words(data)
        if len(data) <= INLINE_BYTES:
            message = np.empty(1 + len(words), dtype=np.int64)
            message[0] = len(data)
            message[1:] = words
            self.comm.send(self.group, dst, message, tag=TAG_HEADER, operation=operation, step=step)
        else:
            header = np.array([len(data)], dtype=np.int64)
            self.comm.send(self.group, dst, header, tag=TAG_HEADER, operation=operation, step=step)
            self.comm.send(self.group, dst, words, tag=TAG_PAYLOAD, operation=operation, step=step)
        self.bytes_sent += len(data)

    def recv(self, src: int, *, operation: str, step: int) -> bytes:
        """Receive one message from global rank ``src``."""
        first = self._inbox
        self.comm.recv(self.group, src, first, tag=TAG_HEADER, operation=operation, step=step)
        size = int(first[0])
        if size < 0:
            raise ValueError(f"rank {src} sent a negative message length {size}")
        if size <= INLINE_BYTES:
            data = first[1 : 1 + (size + _WORD - 1) // _WORD].tobytes()[:size]
        else:
            words = np.zeros((size + _WORD - 1) // _WORD, dtype=np.int64)
            self.comm.recv(self.group, src, words, tag=TAG_PAYLOAD, operation=operation, step=step)
            data = words.tobytes()[:size]
        self.bytes_received += size
        return data

    def gather(self, root: int, data: bytes, ranks: tuple[int, ...], *, step: int) -> list[bytes]:
        """Every rank of ``ranks`` sends ``data`` to ``root``; root gets them in order.

        Returns the messages (root's own included) on ``root`` and ``[]``
        elsewhere.
        """
        me = self.comm.rank
        if me != root:
            self.send(root, data, operation="gather reports", step=step)
            return []
        return [
            data if r == me else self.recv(r, operation="gather reports", step=step) for r in ranks
        ]
