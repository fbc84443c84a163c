"""Variable-length byte messages over a runtime's gloo groups.

The step loop moves small typed messages between ranks every step: new
requests and batches down each pipeline chain, sampled tokens back to stage
0, the transport handle to TP workers at start-up, per-rank reports to rank 0
at the end. They are msgspec-encoded by the caller; this module only moves
bytes, so ``coordinator`` still knows nothing of grammars.

A message is two point-to-point transfers on the ``world`` group: an int64
header ``[length]`` and the payload padded to whole int64 words. Both go
through :meth:`Runtime.send` / :meth:`Runtime.recv`, so they carry the
runtime's deadline and peer-loss report. Sends are asynchronous with at most
one in flight (the runtime drains earlier sends first), so a sender never
waits on its own receiver unless it sends twice in a row to a peer that has
not posted its receive yet; the step loop orders its messages so that every
receiver posts them in the order they are sent.
"""

from __future__ import annotations

import numpy as np

from gramcoord.coordinator.runtime import Comm

_WORD = 8
# Tags of the step loop's messages, apart from the coordinator's chain tags.
TAG_HEADER = 101
TAG_PAYLOAD = 102


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

    def send(self, dst: int, data: bytes, *, operation: str, step: int) -> None:
        """Send ``data`` to global rank ``dst`` (returns once the header is out)."""
        header = np.array([len(data)], dtype=np.int64)
        self.comm.send(self.group, dst, header, tag=TAG_HEADER, operation=operation, step=step)
        if data:
            self.comm.send(
                self.group, dst, _words(data), tag=TAG_PAYLOAD, operation=operation, step=step
            )
        self.bytes_sent += len(data)

    def recv(self, src: int, *, operation: str, step: int) -> bytes:
        """Receive one message from global rank ``src``."""
        header = np.zeros(1, dtype=np.int64)
        self.comm.recv(self.group, src, header, tag=TAG_HEADER, operation=operation, step=step)
        size = int(header[0])
        if size < 0:
            raise ValueError(f"rank {src} sent a negative message length {size}")
        if size == 0:
            return b""
        words = np.zeros((size + _WORD - 1) // _WORD, dtype=np.int64)
        self.comm.recv(self.group, src, words, tag=TAG_PAYLOAD, operation=operation, step=step)
        self.bytes_received += size
        return words.tobytes()[:size]

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
