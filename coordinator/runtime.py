"""gramcoord's own engine's control groups: the world, the layout's groups, the roll call.

``Runtime`` holds the gloo CPU groups that the coordinator talks over,
whatever backend the data plane uses (the calls themselves are
``groups.GroupCalls``). It either starts the world itself
(``Runtime.start``) or attaches to one the host already made
(``Runtime.attach``). Every call waits at most ``OP_SHARE`` of
``distributed.step_timeout_s``; when it fails, the surviving ranks hold a
short **roll call** through the rendezvous store to name the ranks that are
gone, release their groups, and raise ``PeerLostError`` -- all within the
step timeout: the roll call takes what the failed call left of it
(``GroupCalls.time_left``), so a slow but live peer has until the configured
timeout to answer.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import socket
import threading
import time
from typing import Literal

import numpy as np
import torch.distributed as dist

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.errors import CoordinatorError, PeerLostError
from gramcoord.coordinator.groups import OP_SHARE, GroupCalls, PendingGather
from gramcoord.coordinator.layout import ParallelLayout

__all__ = ["OP_SHARE", "PendingGather", "Runtime", "roll_call"]

logger = logging.getLogger(__name__)

# Bytes per rank in the start-up exchange of host names (Linux allows 64).
HOSTNAME_BYTES = 256
_generations = itertools.count()


class Runtime(GroupCalls):
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
        super().__init__(rank=rank, step_timeout_s=step_timeout_s, init_timeout_s=init_timeout_s)
        self.layout = layout
        self._store = store
        self._owns_world = owns_world
        self._generation = next(_generations)
        # self.hosts: every rank's host name, with agreement_levels "host".
        self._meet()
        self._add_groups(layout.control_groups())
        if agreement_levels == "host" and layout.world_size > 1:
            self.hosts = self._host_names()
            self._add_groups(layout.level_groups(self.hosts))
        logger.info(
            "[rank %d] control groups ready: %s",
            rank,
            ", ".join(f"{n}={list(r)}" for n, (_, r) in self._groups.items()) or "none",
        )

    def _meet(self) -> None:
        """Wait, up to the start-up deadline, until every rank is here.

        Creating a group waits for every member with the group's own
        timeout, the step deadline, which is also how long its connections
        wait later; a peer still importing or loading its vocabulary is slow,
        not lost. So the ranks first meet on the rendezvous store (a roll
        call with the start-up deadline), and then create the groups within
        moments of each other. Without a store there is nothing to meet on.
        """
        world = tuple(range(self.layout.world_size))
        if self._store is None or len(world) == 1:
            return
        prefix = f"gramcoord/rt{self._generation}/start/"
        lost, how = roll_call(
            self._store,
            prefix,
            self.rank,
            world,
            timeout_s=self._init_timeout.total_seconds() / OP_SHARE,
        )
        if lost:
            logger.error(
                "[rank %d] ranks %s never came to start-up: %s", self.rank, list(lost), how
            )
            raise PeerLostError(
                rank=self.rank,
                ranks=lost,
                operation="start-up",
                step=-1,
                group=world,
                detail=f"{how}; the ranks never reached Runtime start-up",
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

    # -- failure -------------------------------------------------------------

    def _lost(self, group: str, operation: str, step: int, peer: int | None, exc: BaseException):
        ranks = self.members(group)
        lost, how = roll_call(
            self._store,
            f"gramcoord/rt{self._generation}/alive/",
            self.rank,
            ranks,
            timeout_s=self.time_left(),
        )
        if not lost and peer is not None:
            lost, how = (peer,), "point-to-point peer"
        self._raise_lost(group, operation, step, lost, how, exc)

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
        super().close()
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


def roll_call(
    store: dist.Store | None,
    prefix: str,
    rank: int,
    ranks: tuple[int, ...],
    *,
    timeout_s: float,
) -> tuple[tuple[int, ...], str]:
    """Ask the store who of ``ranks`` is still alive, within ``timeout_s``.

    When a collective or a point-to-point call fails, the survivors each
    write "alive" under one key prefix of the rendezvous store and look for
    the others' keys for a short while; whoever is missing at the end is
    reported lost. A store call can block without bound when the store's
    host is cut off (a network partition): its own timeout does not cover
    ``check``. So the calls run on a daemon thread, and a roll call that
    does not finish in time counts as "the store host is unreachable",
    unless the store answered a whole pass of checks: then it is reachable
    and whoever that pass missed is lost (on a loaded machine the last pass
    can outlast the wait by seconds).

    Returns
    -------
    lost, how:
        The ranks that did not answer, and how that was found out.
    """
    if store is None:
        return (), "no store for a roll call"
    box: dict[str, object] = {}

    def call() -> None:
        try:
            store.set(f"{prefix}{rank}", "1")
            missing = {r for r in ranks if r != rank}
            deadline = time.monotonic() + timeout_s
            while missing and time.monotonic() < deadline:
                missing = {r for r in missing if not store.check([f"{prefix}{r}"])}
                box["seen"] = missing  # a whole pass: the store is reachable
                if missing:
                    time.sleep(0.02)
            box["missing"] = missing
        except Exception as exc:
            box["error"] = exc

    worker = threading.Thread(target=call, name="roll-call", daemon=True)
    worker.start()
    worker.join(timeout_s + 0.5)
    found = box.get("missing", box.get("seen"))
    if found is not None:
        return tuple(sorted(found)), f"no answer to the roll call within {timeout_s:.1f}s"
    what = type(box["error"]).__name__ if "error" in box else "no answer in time"
    if rank != 0:  # the store lives with rank 0 (Runtime.start, and torchrun's agent)
        return (0,), f"the store host (rank 0) is unreachable ({what})"
    return (), f"roll call failed ({what}; the store host may be lost)"
