"""Calls over named gloo groups, each with a deadline: the ``Comm`` every host uses.

``GroupCalls`` is the body of the ``Comm`` protocol (``coordinator.comm``):
all_gather, all_reduce, gather, broadcast and point-to-point calls over
named gloo CPU groups, each waiting at most ``OP_SHARE`` of the step
timeout and turning a failure into ``PeerLostError``. Two hosts fill it:

- ``runtime.Runtime``: gramcoord's own engine, whose groups come from the
  ``ParallelLayout`` and which names lost peers with a roll call;
- ``HostGroup``: a host engine's existing process group (vLLM's TP or DP
  group, SGLang's sync group), under every group name the coordinator asks
  for. Its ranks are the group's own (0..size-1).

Arrays passed in and returned are int64 numpy arrays; a returned array is
valid until the next call on the same group.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from gramcoord.coordinator.errors import CoordinatorError, PeerLostError

logger = logging.getLogger(__name__)

# Share of the step timeout that one call may wait; the rest is for naming
# the lost rank.
OP_SHARE = 0.8
_REDUCE_OPS = {"band": dist.ReduceOp.BAND, "max": dist.ReduceOp.MAX}


class PendingGather:
    """An ``all_gather`` in flight (``GroupCalls.all_gather_start``)."""

    def __init__(self, calls, work, recv, shape, group: str, operation: str, step: int) -> None:
        self._calls, self._work, self._recv = calls, work, recv
        self._shape, self.group, self.operation, self.step = shape, group, operation, step

    def wait(self) -> np.ndarray:
        """Every member's row, int64[members, len(row)]; raises as ``all_gather``."""
        self._calls._wait(self._work, self.group, self.operation, self.step, None)
        return self._recv.numpy().reshape(self._shape)


class GroupCalls:
    """This rank's named groups and the calls made over them (see the module docstring).

    Parameters
    ----------
    rank:
        This rank, in the numbering the groups' member lists use.
    step_timeout_s:
        Deadline of a steady-state call (``OP_SHARE`` of it per call).
    init_timeout_s:
        Deadline inside ``startup()`` (start-up exchanges; never below the
        step's).
    """

    def __init__(
        self, *, rank: int, step_timeout_s: float, init_timeout_s: float | None = None
    ) -> None:
        self.rank = rank
        self.step_timeout_s = step_timeout_s
        self._op_timeout = datetime.timedelta(seconds=step_timeout_s * OP_SHARE)
        self._init_timeout = datetime.timedelta(
            seconds=max(step_timeout_s, init_timeout_s or 0.0) * OP_SHARE
        )
        self._groups: dict[str, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        self._buffers: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor, int, str]] = []
        self._closed = False
        # When the call now made began waiting (``time_left``).
        self._call_began = time.monotonic()
        # Every rank's host name, where a two-level agreement needs them.
        self.hosts: tuple[str, ...] = ()
        # Calls made inside steps, by "operation: kind": "blocking" (waited
        # for at once), "posted" (settled later) or "send"; summary.json
        # reads them.
        self.calls: Counter[str] = Counter()

    def members(self, group: str) -> tuple[int, ...]:
        """The ranks of this rank's group ``group``; empty if none."""
        entry = self._groups.get(group)
        return entry[1] if entry else ()

    @contextmanager
    def startup(self) -> Iterator[None]:
        """Calls inside wait up to ``init_timeout_s`` instead of the step's share.

        Before the first step, peers are still building their rings and
        loading vocabularies: on a busy machine that takes longer than one
        step may, and a slow peer there is not a lost one. A peer that died
        is still reported, once the longer deadline passes.
        """
        saved, self._op_timeout = self._op_timeout, self._init_timeout
        try:
            yield
        finally:
            self._op_timeout = saved

    def process_group(self, group: str) -> dist.ProcessGroup | None:
        """The gloo process group ``group`` of this rank (e.g. ``"tp"``), or None.

        For callers that need their own calls on a control group; the
        coordinator's own calls go through the methods below.
        """
        entry = self._groups.get(group)
        return entry[0] if entry else None

    def _count(self, operation: str, kind: str, step: int) -> None:
        if step >= 0:  # start-up exchanges are not a step's
            self.calls[f"{operation}: {kind}"] += 1

    # -- for subclasses --------------------------------------------------------

    def _peer(self, pg: dist.ProcessGroup, rank: int) -> int:
        """The global rank torch's point-to-point and rooted calls take for ``rank``."""
        return rank

    def _lost(
        self, group: str, operation: str, step: int, peer: int | None, exc: BaseException
    ) -> None:
        """Release the groups and raise ``PeerLostError`` (subclasses name the lost rank)."""
        self._raise_lost(group, operation, step, (peer,) if peer is not None else (), "", exc)

    def _raise_lost(
        self,
        group: str,
        operation: str,
        step: int,
        lost: tuple[int, ...],
        how: str,
        exc: BaseException,
    ) -> None:
        logger.error(
            "[rank %d] %s failed at step %d; lost %s (%s): %s",
            self.rank,
            operation,
            step,
            list(lost) or "unknown",
            how or "no answer in time",
            exc,
        )
        ranks = self.members(group)
        self.close(drain=False)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PeerLostError(
            rank=self.rank,
            ranks=lost,
            operation=operation,
            step=step,
            group=ranks,
            detail=f"{how}; {first}" if how else first,
        ) from exc

    def close(self, *, drain: bool = True) -> None:
        """Stop making calls; subclasses release what they own."""
        self._closed = True
        self._sends.clear()
        self._buffers.clear()

    # -- calls -----------------------------------------------------------------

    def time_left(self) -> float:
        """What is left of the current call's whole timeout: the time a roll call may take.

        A call waits ``OP_SHARE`` of its timeout (the step's, or the start-up
        one inside ``startup()``); naming the lost then has the rest of it,
        from when the wait began. A call that failed at once (a peer closed
        its groups) leaves nearly all of it, so a peer that is slow but alive
        gets there and answers, as late as the configured timeout; one that
        timed out leaves the rest, never less.
        """
        whole = self._op_timeout.total_seconds() / OP_SHARE
        return max(whole * (1 - OP_SHARE), whole - (time.monotonic() - self._call_began))

    def _group(self, name: str) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
        self._call_began = time.monotonic()
        if self._closed:
            raise CoordinatorError(f"[rank {self.rank}] runtime is closed")
        entry = self._groups.get(name)
        assert entry is not None, f"rank {self.rank} has no {name!r} group"
        return entry

    def _wait(self, work: dist.Work, name: str, operation: str, step: int, peer: int | None):
        self._call_began = time.monotonic()
        try:
            work.wait(timeout=self._op_timeout)
        except RuntimeError as exc:
            self._lost(name, operation, step, peer, exc)

    def _pair(self, group: str, n: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Send and receive buffers of ``n`` rows of ``size``, kept per group and size."""
        bufs = self._buffers.get((group, size))
        if bufs is None:
            bufs = (
                torch.empty(n * size, dtype=torch.int64),
                torch.empty(n * size, dtype=torch.int64),
            )
            self._buffers[(group, size)] = bufs
        return bufs

    def all_gather_start(
        self, group: str, row: np.ndarray, *, operation: str, step: int
    ) -> PendingGather:
        """``all_gather`` posted without waiting: ``.wait()`` returns its result.

        Its buffers are its own, so other calls may run meanwhile; every
        member must post the same calls in the same order, as always.
        """
        pg, ranks = self._group(group)
        self._count(operation, "posted", step)
        n, size = len(ranks), row.size
        send = torch.from_numpy(np.tile(np.asarray(row, dtype=np.int64), n))
        recv = torch.empty(n * size, dtype=torch.int64)
        try:
            work = dist.all_to_all_single(recv, send, group=pg, async_op=True)
        except RuntimeError as exc:
            self._lost(group, operation, step, None, exc)
        return PendingGather(self, work, recv, (n, size), group, operation, step)

    def all_gather(self, group: str, row: np.ndarray, *, operation: str, step: int) -> np.ndarray:
        """Every member's ``row``, stacked in group order: int64[members, len(row)].

        One ``all_to_all_single`` with the row repeated per member: gloo's
        alltoall posts every transfer at once, a single round, where its
        all_gather walks a ring of ``members - 1`` rounds.
        """
        pg, ranks = self._group(group)
        self._count(operation, "blocking", step)
        n, size = len(ranks), row.size
        send, recv = self._pair(group, n, size)
        send.numpy().reshape(n, size)[:] = row
        try:
            work = dist.all_to_all_single(recv, send, group=pg, async_op=True)
        except RuntimeError as exc:
            self._lost(group, operation, step, None, exc)
        self._wait(work, group, operation, step, None)
        return recv.numpy().reshape(n, size)

    def all_reduce(
        self, group: str, row: np.ndarray, op: Literal["band", "max"], *, operation: str, step: int
    ) -> np.ndarray:
        """Element-wise ``op`` of every member's ``row``."""
        pg, _ = self._group(group)
        self._count(operation, "blocking", step)
        t = torch.from_numpy(np.array(row, dtype=np.int64))
        try:
            work = dist.all_reduce(t, op=_REDUCE_OPS[op], group=pg, async_op=True)
        except RuntimeError as exc:
            self._lost(group, operation, step, None, exc)
        self._wait(work, group, operation, step, None)
        return t.numpy()

    def gather(
        self, group: str, row: np.ndarray, dst: int, *, operation: str, step: int
    ) -> np.ndarray | None:
        """Every member's ``row`` as int64[members, len(row)] on rank ``dst``; None elsewhere."""
        pg, ranks = self._group(group)
        self._count(operation, "blocking", step)
        n, size = len(ranks), row.size
        t = torch.from_numpy(np.array(row, dtype=np.int64))
        out = self._pair(group, n, size)[1] if self.rank == dst else None
        try:
            parts = list(out.split(size)) if out is not None else None
            work = dist.gather(t, parts, dst=self._peer(pg, dst), group=pg, async_op=True)
        except RuntimeError as exc:
            self._lost(group, operation, step, None, exc)
        self._wait(work, group, operation, step, None)
        return out.numpy().reshape(n, size) if out is not None else None

    def broadcast(
        self, group: str, buf: np.ndarray, src: int, *, operation: str, step: int
    ) -> np.ndarray:
        """Rank ``src``'s ``buf`` on every member, written into ``buf`` (contiguous int64)."""
        pg, _ = self._group(group)
        self._count(operation, "blocking", step)
        try:
            work = dist.broadcast(
                torch.from_numpy(buf), self._peer(pg, src), group=pg, async_op=True
            )
        except RuntimeError as exc:
            self._lost(group, operation, step, None, exc)
        self._wait(work, group, operation, step, None)
        return buf

    def drain(self, *, operation: str = "drain sends", step: int = -1) -> None:
        """Wait for every earlier asynchronous send."""
        sends, self._sends = self._sends, []
        for work, _tensor, dst, group in sends:
            self._wait(work, group, operation, step, dst)

    def send(
        self, group: str, dst: int, payload: np.ndarray, *, tag: int, operation: str, step: int
    ) -> None:
        """Send ``payload`` to rank ``dst`` without waiting.

        Earlier sends are drained first, so at most one is in flight. The
        payload is copied; the caller may reuse its array at once.
        """
        self.drain(operation=operation, step=step)
        pg, _ = self._group(group)
        self._count(operation, "send", step)
        t = torch.from_numpy(np.array(payload, dtype=np.int64))
        try:
            work = dist.isend(t, dst=self._peer(pg, dst), group=pg, tag=tag)
        except RuntimeError as exc:
            self._lost(group, operation, step, dst, exc)
        self._sends.append((work, t, dst, group))

    def recv(
        self, group: str, src: int, out: np.ndarray, *, tag: int, operation: str, step: int
    ) -> None:
        """Receive into ``out`` (int64) from rank ``src``.

        ``out`` may be longer than the message: gloo fills its prefix.
        """
        pg, _ = self._group(group)
        self._count(operation, "blocking", step)
        t = torch.from_numpy(out)
        try:
            work = dist.irecv(t, src=self._peer(pg, src), group=pg, tag=tag)
        except RuntimeError as exc:
            self._lost(group, operation, step, src, exc)
        self._wait(work, group, operation, step, src)


# The group names the coordinator asks for (``Coordinator``, ``PoisonShare``,
# ``ByteLink``); a host's one group answers to each of them.
HOST_GROUP_NAMES = ("agreement", "poison", "replicas", "world")


class HostGroup(GroupCalls):
    """A host engine's process group as the coordinator's ``Comm``.

    The host made the group and owns it (closing this releases nothing of
    it). Ranks are the group's own, ``0 .. size - 1``; a lost member is
    named when the failed call had a peer, else reported as unidentified
    (there is no rendezvous store of ours to hold a roll call in).

    Parameters
    ----------
    group:
        A gloo process group (vLLM's and SGLang's ``cpu_group``), or
        ``None`` for a group of one.
    step_timeout_s:
        Deadline of each call (``OP_SHARE`` of it).
    names:
        The group names it answers to.
    """

    def __init__(
        self,
        group: Any | None,
        *,
        step_timeout_s: float,
        names: tuple[str, ...] = HOST_GROUP_NAMES,
    ) -> None:
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        super().__init__(rank=rank, step_timeout_s=step_timeout_s)
        self.size = size
        members = tuple(range(size))
        if group is not None and size > 1:
            for name in names:
                self._groups[name] = (group, members)

    def _peer(self, pg: dist.ProcessGroup, rank: int) -> int:
        return dist.get_global_rank(pg, rank)
