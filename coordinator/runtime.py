"""Process groups for control traffic, with deadlines and peer-loss reporting.

``Runtime`` holds the gloo CPU groups that the coordinator talks over,
whatever backend the data plane uses. It either starts the world itself
(``Runtime.start``) or attaches to one the host already made
(``Runtime.attach``). Every call waits at most ``OP_SHARE`` of
``distributed.step_timeout_s``; when it fails, the surviving ranks hold a
short roll call through the rendezvous store to name the ranks that are
gone, release their groups, and raise ``PeerLostError`` -- all within the
step timeout.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.errors import CoordinatorError, PeerLostError
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.roll_call import roll_call

logger = logging.getLogger(__name__)

# Share of the step timeout that one call may wait; the rest is for the
# roll call that names the lost rank.
OP_SHARE = 0.8
MAX_ROLL_CALL_S = 2.0
# Bytes per rank in the start-up exchange of host names (Linux allows 64).
HOSTNAME_BYTES = 256
_generations = itertools.count()


_REDUCE_OPS = {"band": dist.ReduceOp.BAND, "max": dist.ReduceOp.MAX}


class PendingGather:
    """An ``all_gather`` in flight (``Runtime.all_gather_start``)."""

    def __init__(self, runtime, work, recv, shape, group: str, operation: str, step: int) -> None:
        self._runtime, self._work, self._recv = runtime, work, recv
        self._shape, self.group, self.operation, self.step = shape, group, operation, step

    def wait(self) -> np.ndarray:
        """Every member's row, int64[members, len(row)]; raises as ``all_gather``."""
        self._runtime._wait(self._work, self.group, self.operation, self.step, None)
        return self._recv.numpy().reshape(self._shape)


class Runtime:
    """This rank's control groups and the calls made over them.

    Use :meth:`start` or :meth:`attach`; close with :meth:`close` (or as a
    context manager). Arrays passed in and returned are int64 numpy arrays;
    a returned array is valid until the next call on the same group.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        *,
        rank: int,
        step_timeout_s: float,
        store: dist.Store | None,
        owns_world: bool,
        agreement_levels: Literal["flat", "host"] = "flat",
        init_timeout_s: float | None = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.step_timeout_s = step_timeout_s
        self._op_timeout = datetime.timedelta(seconds=step_timeout_s * OP_SHARE)
        # Exchanges of the start-up phase (see ``startup``) wait this long.
        self._init_timeout = datetime.timedelta(
            seconds=max(step_timeout_s, init_timeout_s or 0.0) * OP_SHARE
        )
        self._roll_call_s = min(MAX_ROLL_CALL_S, step_timeout_s * (1 - OP_SHARE))
        self._store = store
        self._owns_world = owns_world
        self._generation = next(_generations)
        self._groups: dict[str, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        self._buffers: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor, int]] = []
        self._closed = False
        # Every rank's host name, with agreement_levels "host" (else empty).
        self.hosts: tuple[str, ...] = ()
        self._add_groups(layout.control_groups())
        if agreement_levels == "host" and layout.world_size > 1:
            self.hosts = self._host_names()
            self._add_groups(layout.level_groups(self.hosts))
        logger.info(
            "[rank %d] control groups ready: %s",
            rank,
            ", ".join(f"{n}={list(r)}" for n, (_, r) in self._groups.items()) or "none",
        )

    def _add_groups(self, named: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        timeout = datetime.timedelta(seconds=self.step_timeout_s)
        # Every rank creates every group, in the layout's fixed order.
        for name, ranks in named:
            group = dist.new_group(list(ranks), timeout=timeout, backend="gloo")
            if self.rank in ranks:
                self._groups[name] = (group, ranks)

    def _host_names(self) -> tuple[str, ...]:
        """Every rank's hostname, in rank order: one exchange over the world group at start."""
        name = socket.gethostname().encode()
        if len(name) > HOSTNAME_BYTES:
            raise CoordinatorError(
                f"[rank {self.rank}] hostname longer than {HOSTNAME_BYTES} bytes"
            )
        row = np.zeros(HOSTNAME_BYTES // 8, dtype=np.int64)
        row.view(np.uint8)[: len(name)] = np.frombuffer(name, dtype=np.uint8)
        rows = self.all_gather("world", row, operation="host names", step=-1)
        return tuple(bytes(r.view(np.uint8)).rstrip(b"\0").decode() for r in rows)

    @classmethod
    def start(cls, layout: ParallelLayout, *, rank: int, distributed: DistributedConfig) -> Runtime:
        """Create the world (rank 0 hosts the store) and the control groups.

        The port is ``distributed.master_port`` or, when that is 0, the
        ``MASTER_PORT`` the launcher exported after picking a free one.

        Raises
        ------
        CoordinatorError
            If no port is known or the world is already initialized.
        """
        if dist.is_initialized():
            raise CoordinatorError("torch.distributed is already initialized; use Runtime.attach")
        port = distributed.master_port or int(os.environ.get("MASTER_PORT", "0"))
        if not port:
            raise CoordinatorError(
                "distributed.master_port is 0 and MASTER_PORT is unset; "
                "the launcher must pick a free port"
            )
        init = datetime.timedelta(seconds=distributed.init_timeout_s)
        # Under torch's elastic agent the store may be the agent's own, which
        # outlives a restart of the group: every attempt keys its world under
        # its own prefix, or it would meet the dead attempt's addresses.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            distributed.master_addr,
            port,
            layout.world_size,
            is_master=rank == 0 and not agent_store,
            timeout=init,
        )
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is not None:
            store = dist.PrefixStore(f"gramcoord/restart-{restart}/", store)
        dist.init_process_group(
            distributed.backend,
            store=store,
            rank=rank,
            world_size=layout.world_size,
            timeout=init,
        )
        return cls(
            layout,
            rank=rank,
            step_timeout_s=distributed.step_timeout_s,
            store=store,
            owns_world=True,
            agreement_levels=distributed.agreement_levels,
            init_timeout_s=distributed.init_timeout_s,
        )

    @classmethod
    def attach(cls, layout: ParallelLayout, *, distributed: DistributedConfig) -> Runtime:
        """Create the control groups inside a world the host already made.

        Raises
        ------
        CoordinatorError
            If the world is not initialized or its size differs from the
            layout's.
        """
        if not dist.is_initialized():
            raise CoordinatorError(
                "torch.distributed is not initialized; the host must call "
                "init_process_group before attaching"
            )
        world = dist.get_world_size()
        if world != layout.world_size:
            raise CoordinatorError(
                f"layout has {layout.world_size} ranks but the world has {world}"
            )
        try:
            # NOTE: private, but the only way to reach the host's store; the
            # roll call is skipped without it.
            store = dist.distributed_c10d._get_default_store()
        except Exception:
            store = None
        return cls(
            layout,
            rank=dist.get_rank(),
            step_timeout_s=distributed.step_timeout_s,
            store=store,
            owns_world=False,
            agreement_levels=distributed.agreement_levels,
            init_timeout_s=distributed.init_timeout_s,
        )

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def members(self, group: str) -> tuple[int, ...]:
        """Global ranks of this rank's group ``group``; empty if none."""
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

    # -- calls ---------------------------------------------------------------

    def _group(self, name: str) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
        if self._closed:
            raise CoordinatorError(f"[rank {self.rank}] runtime is closed")
        entry = self._groups.get(name)
        assert entry is not None, f"rank {self.rank} has no {name!r} group"
        return entry

    def _wait(self, work: dist.Work, name: str, operation: str, step: int, peer: int | None):
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
        """Every member's ``row`` as int64[members, len(row)] on global rank ``dst``; None elsewhere."""
        pg, ranks = self._group(group)
        n, size = len(ranks), row.size
        t = torch.from_numpy(np.array(row, dtype=np.int64))
        out = self._pair(group, n, size)[1] if self.rank == dst else None
        try:
            parts = list(out.split(size)) if out is not None else None
            work = dist.gather(t, parts, dst=dst, group=pg, async_op=True)
        except RuntimeError as exc:
            self._lost(group, operation, step, None, exc)
        self._wait(work, group, operation, step, None)
        return out.numpy().reshape(n, size) if out is not None else None

    def broadcast(
        self, group: str, buf: np.ndarray, src: int, *, operation: str, step: int
    ) -> np.ndarray:
        """Global rank ``src``'s ``buf`` on every member, written into ``buf`` (contiguous int64)."""
        pg, _ = self._group(group)
        try:
            work = dist.broadcast(torch.from_numpy(buf), src, group=pg, async_op=True)
        except RuntimeError as exc:
            self._lost(group, operation, step, None, exc)
        self._wait(work, group, operation, step, None)
        return buf

    def drain(self, *, operation: str = "drain sends", step: int = -1) -> None:
        """Wait for every earlier asynchronous send."""
        sends, self._sends = self._sends, []
        for work, _tensor, dst in sends:
            self._wait(work, "pp_chain", operation, step, dst)

    def send(
        self, group: str, dst: int, payload: np.ndarray, *, tag: int, operation: str, step: int
    ) -> None:
        """Send ``payload`` to global rank ``dst`` without waiting.

        Earlier sends are drained first, so at most one is in flight. The
        payload is copied; the caller may reuse its array at once.
        """
        self.drain(operation=operation, step=step)
        pg, _ = self._group(group)
        t = torch.from_numpy(np.array(payload, dtype=np.int64))
        try:
            work = dist.isend(t, dst=dst, group=pg, tag=tag)
        except RuntimeError as exc:
            self._lost(group, operation, step, dst, exc)
        self._sends.append((work, t, dst))

    def recv(
        self, group: str, src: int, out: np.ndarray, *, tag: int, operation: str, step: int
    ) -> None:
        """Receive into ``out`` (int64) from global rank ``src``.

        ``out`` may be longer than the message: gloo fills its prefix.
        """
        pg, _ = self._group(group)
        t = torch.from_numpy(out)
        try:
            work = dist.irecv(t, src=src, group=pg, tag=tag)
        except RuntimeError as exc:
            self._lost(group, operation, step, src, exc)
        self._wait(work, group, operation, step, src)

    # -- failure -------------------------------------------------------------

    def _lost(self, group: str, operation: str, step: int, peer: int | None, exc: BaseException):
        ranks = self.members(group)
        lost, how = roll_call(
            self._store,
            f"gramcoord/rt{self._generation}/alive/",
            self.rank,
            ranks,
            timeout_s=self._roll_call_s,
        )
        if not lost and peer is not None:
            lost, how = (peer,), "point-to-point peer"
        logger.error(
            "[rank %d] %s failed at step %d; lost %s (%s): %s",
            self.rank,
            operation,
            step,
            list(lost) or "unknown",
            how,
            exc,
        )
        self.close(drain=False)
        raise PeerLostError(
            rank=self.rank,
            ranks=lost,
            operation=operation,
            step=step,
            group=ranks,
            detail=f"{how}; {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
        ) from exc

    def close(self, *, drain: bool = True) -> None:
        """Release the control groups (and the world if this runtime made it).

        With ``drain`` (the default), sends still in flight are completed
        first, within the call timeout: destroying a group under an
        unfinished send would reset the receiver's connection, and it would
        report this rank as lost.
        """
        if self._closed:
            return
        if drain and self._sends:
            try:
                self.drain(operation="close")
            except PeerLostError as exc:  # already closed by _lost
                logger.warning("[rank %d] a send in flight at close failed: %s", self.rank, exc)
                return
        self._closed = True
        self._sends.clear()
        self._buffers.clear()
        if not dist.is_initialized():
            return
        for group, _ in self._groups.values():
            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # a broken group still gets the others released
                logger.warning("[rank %d] destroying a control group failed: %s", self.rank, exc)
        self._groups.clear()
        if self._owns_world:
            dist.destroy_process_group()
        logger.info("[rank %d] control groups released", self.rank)
