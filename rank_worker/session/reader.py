"""The TP side of the last stage: take the leader's rows, apply, release.

Two roles read the rows a last-stage leader published:

- ``MaskReader`` (``session.reader``), a TP worker of our step loop:
  ``receive(step)``, ``apply``, ``commit``, ``release(step)``;
- ``FollowerRows`` (``session.masks`` of a ``read`` TP follower, one that
  runs a scheduler of its own): the same calls as the leader's
  ``StageMasks`` (``bitmask(ids, step=n)``, ``apply``, ``advance``), the
  rows read instead of built.

The rows arrive as a read-only view of the shared-memory slot (or of a raw
zmq frame from another host); they are valid until ``release``, after which
the leader may reuse the slot. Both roles apply through a ``MaskApplier``,
so every TP rank aligns and digests exactly as the leader does.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import numpy as np

from gramcoord.rank_worker.session.applier import AppliesRows, MaskApplier
from gramcoord.rank_worker.session.types import MaskBatch, SessionStats, StaleGrammarState
from gramcoord.sync.handle import ChannelHandle
from gramcoord.sync.receiver import BitmaskReceiver


class ReceivedMask(NamedTuple):
    """One step's rows as the leader published them."""

    # Read-only int32 [rows, W]; valid until release(step).
    rows: np.ndarray
    request_ids: tuple[str, ...]
    num_drafts: tuple[int, ...]


class MaskReader(AppliesRows):
    """Receive, apply, then release the bitmask rows of each step.

    Use :meth:`connect`; close with :meth:`close`.
    """

    def __init__(
        self, receiver: BitmaskReceiver, applier: MaskApplier, stats: SessionStats
    ) -> None:
        self._receiver = receiver
        self._applier = applier
        self._stats = stats

    @classmethod
    def connect(
        cls,
        handle: ChannelHandle,
        name: str,
        *,
        vocab_size: int,
        applier: MaskApplier,
        stats: SessionStats,
    ) -> MaskReader:
        """Join the leader's channel as reader ``name``."""
        return cls(BitmaskReceiver.connect(handle, name, vocab_size=vocab_size), applier, stats)

    @property
    def dropped(self) -> int:
        """Control frames dropped as malformed or stale."""
        return self._receiver.dropped

    def receive(self, step: int, timeout: float | None = None) -> ReceivedMask:
        """Wait for the rows of ``step``.

        Raises
        ------
        TransportTimeout, WriterLost, ChannelClosed, ProtocolError
            From the transport; see ``BitmaskReceiver.receive``.
        """
        rows, ids, drafts = self._receiver.receive(step, timeout)
        return ReceivedMask(rows, ids, drafts)

    def release(self, step: int) -> None:
        """Give the slot of ``step`` (and every earlier one) back to the leader."""
        self._receiver.release(step)

    def close(self) -> None:
        """Say goodbye to the leader and unmap the ring (never removes it)."""
        self._receiver.close()


class FollowerRows(AppliesRows):
    """A ``read`` follower's mask calls: the leader's rows, read by step.

    Parameters
    ----------
    reader:
        This rank's ``MaskReader``.
    applier, stats:
        The reader's applier and the session's counters.
    running:
        The requests running here (the follower's book).
    stop_ids:
        The vocabulary's stop tokens: with no grammar here, a request's
        grammar ends with its stop token.
    """

    def __init__(
        self,
        reader: MaskReader,
        applier: MaskApplier,
        stats: SessionStats,
        running: Collection[str],
        stop_ids: Collection[int],
        *,
        rank: int,
    ) -> None:
        self._reader = reader
        self._applier = applier
        self._stats = stats
        self._running = running
        self._stop_ids = frozenset(stop_ids)
        self.rank = rank

    def is_running(self, request_id: str) -> bool:
        """Whether the leader admitted ``request_id`` and it has not ended."""
        return request_id in self._running

    def bitmask(
        self,
        request_ids: Sequence[str],
        drafts: Sequence[Sequence[int]] | None = None,
        *,
        copy: bool = False,
        step: int | None = None,
    ) -> MaskBatch:
        """The rows the leader published for ``step`` (required), read in place.

        Call ``release(step)`` after applying them.

        Raises
        ------
        StaleGrammarState
            The leader published rows for other requests: the schedulers
            diverged.
        """
        if step is None:
            raise ValueError(f"[rank {self.rank}] a read follower needs the step to read")
        got = self._reader.receive(step)
        ids = tuple(request_ids)
        num_drafts = tuple(len(d) for d in drafts) if drafts is not None else (0,) * len(ids)
        if got.request_ids != ids or got.num_drafts != num_drafts:
            self._reader.release(step)
            raise StaleGrammarState(
                f"[rank {self.rank}] step {step}: the leader published rows for "
                f"{list(got.request_ids)[:4]} (drafts {list(got.num_drafts)[:4]}), this "
                f"scheduler asked for {list(ids)[:4]} (drafts {list(num_drafts)[:4]}): "
                "the schedulers diverged"
            )
        self._stats.masks_built += 1
        return MaskBatch(got.rows.copy() if copy else got.rows, ids, num_drafts, {})

    def release(self, step: int) -> None:
        """Give step ``step``'s rows back to the leader."""
        self._reader.release(step)

    def advance(self, request_id: str, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` end the request (no grammar here: its stop token does)."""
        return any(t in self._stop_ids for t in tokens)
