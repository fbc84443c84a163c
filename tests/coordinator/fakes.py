"""In-process stand-ins for the runtime and the grammar manager.

``ThreadHub`` / ``ThreadComm`` implement the coordinator's ``Comm`` calls for
members that run as threads of one process (one thread per rank), so the
single-process tests exercise the same coordinator code as the spawned ones.
``FakeMember`` follows the ``GrammarManager`` contract with plain values:
requests are ``(seq, key)`` pairs whose local compile state the test sets.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gramcoord.coordinator.coordinator import Coordinator
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.status import Decision, LocalStatus, PendingState, PoisonRecord

TIMEOUT_S = 10.0


class ThreadHub:
    """Shared state of the fake groups: barriers, slots, p2p queues."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._barriers: dict[tuple[int, ...], threading.Barrier] = {}
        self._slots: dict[tuple[int, ...], dict[int, np.ndarray]] = {}
        self._queues: dict[tuple[int, int, int], queue.Queue] = {}
        self.calls: list[tuple[int, str, str]] = []

    def barrier(self, ranks: tuple[int, ...]) -> threading.Barrier:
        with self._lock:
            return self._barriers.setdefault(ranks, threading.Barrier(len(ranks)))

    def slots(self, ranks: tuple[int, ...]) -> dict[int, np.ndarray]:
        with self._lock:
            return self._slots.setdefault(ranks, {})

    def queue(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault((src, dst, tag), queue.Queue())


class _Done:
    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def wait(self) -> np.ndarray:
        return self.rows


class ThreadComm:
    """The ``Comm`` calls of one rank, over a ``ThreadHub``."""

    def __init__(self, hub: ThreadHub, layout: ParallelLayout, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self._groups = {n: g for n, g in layout.control_groups() if rank in g}

    def members(self, group: str) -> tuple[int, ...]:
        return self._groups.get(group, ())

    def all_gather(self, group, row, *, operation, step):
        ranks = self._groups[group]
        self.hub.calls.append((self.rank, "all_gather", operation))
        barrier, slots = self.hub.barrier(ranks), self.hub.slots(ranks)
        slots[self.rank] = np.array(row, dtype=np.int64)
        barrier.wait(TIMEOUT_S)
        out = np.stack([slots[r] for r in ranks])
        barrier.wait(TIMEOUT_S)
        return out

    def all_gather_start(self, group, row, *, operation, step):
        # Every member thread steps together, so the gather can complete now.
        rows = self.all_gather(group, row, operation=operation, step=step)
        return _Done(rows)

    def all_reduce(self, group, row, op, *, operation, step):
        rows = self.all_gather(group, row, operation=operation, step=step)
        return np.bitwise_and.reduce(rows, axis=0) if op == "band" else rows.max(axis=0)

    def send(self, group, dst, payload, *, tag, operation, step):
        self.hub.calls.append((self.rank, "send", operation))
        self.hub.queue(self.rank, dst, tag).put(np.array(payload, dtype=np.int64))

    def recv(self, group, src, out, *, tag, operation, step):
        msg = self.hub.queue(src, self.rank, tag).get(timeout=TIMEOUT_S)
        assert msg.size <= out.size, "message larger than the posted buffer"
        out[: msg.size] = msg  # like gloo: a shorter message fills a prefix


class FakeMember:
    """A GrammarManager stand-in: pending ``(seq, key)`` with test-set states.

    Poison entries are ``key -> (reason, clock_ms)``; a TIMEOUT-like reason
    (``ttl_reasons``) expires ``ttl_ms`` after its clock, judged against the
    agreed clock of the last decision, as the real manager does.
    """

    def __init__(self, *, ttl_ms: int = 1000, ttl_reasons: tuple[int, ...] = (21,)) -> None:
        self.pending: dict[int, bytes] = {}
        self.states: dict[int, tuple[int, int]] = {}
        self.admitted: list[int] = []
        self.failed: list[tuple[int, int]] = []
        self.failed_at_add: list[int] = []
        self.poisoned: dict[bytes, tuple[int, int]] = {}
        self.decisions: list[Decision] = []
        self.agreed_ms = 0
        self.ttl_ms = ttl_ms
        self.ttl_reasons = ttl_reasons
        self._new: list[PoisonRecord] = []

    def _poison_hit(self, key: bytes) -> tuple[int, int] | None:
        hit = self.poisoned.get(key)
        if hit and hit[0] in self.ttl_reasons and self.agreed_ms >= hit[1] + self.ttl_ms:
            return None
        return hit

    def add(self, seq: int, key: bytes, state: int = PendingState.PENDING, reason: int = 0):
        if self._poison_hit(key) is not None:
            self.failed_at_add.append(seq)
            return "failed"
        self.pending[seq] = key
        self.states[seq] = (int(state), reason)
        return "pending"

    def set(self, seq: int, state: int, reason: int = 0) -> None:
        self.states[seq] = (int(state), reason)

    def abort(self, seq: int) -> None:
        self.pending.pop(seq, None)

    def local_status(self) -> LocalStatus:
        seqs = sorted(self.pending)
        states, reasons = [], []
        for s in seqs:
            state, reason = self.states[s]
            hit = self._poison_hit(self.pending[s])
            if hit is not None:
                state, reason = PendingState.FAILED, hit[0]
            states.append(int(state))
            reasons.append(reason)
        return LocalStatus(seqs=tuple(seqs), states=tuple(states), reasons=tuple(reasons))

    def apply_decision(self, decision: Decision):
        self.decisions.append(decision)
        self.agreed_ms = max(self.agreed_ms, decision.clock_ms)
        failed = dict(decision.failed)
        for seq in sorted(set(decision.ready) | failed.keys()):
            key = self.pending.pop(seq, None)
            if key is None:
                continue
            if seq in failed:
                self.failed.append((seq, failed[seq]))
                if self._poison_hit(key) is None:
                    self.poisoned[key] = (failed[seq], self.agreed_ms)
                    self._new.append(PoisonRecord(key, failed[seq], self.agreed_ms))
            else:
                self.admitted.append(seq)
        return len(decision.ready), len(decision.failed)

    def new_failures(self) -> list[PoisonRecord]:
        out, self._new = self._new, []
        return out

    def apply_poison(self, records) -> None:
        for r in records:
            self.poisoned.setdefault(r.key, (r.reason, r.clock_ms))


class Cluster:
    """Stage leaders of a layout as threads: one coordinator and member each."""

    def __init__(self, layout: ParallelLayout, *, window: int = 16, clocks=None, **kw) -> None:
        self.layout = layout
        self.hub = ThreadHub()
        self.ranks = [r for r in range(layout.world_size) if layout.is_stage_leader(r)]
        self.members = {r: FakeMember() for r in self.ranks}
        clocks = clocks or {}
        self.coords = {
            r: Coordinator(
                layout,
                ThreadComm(self.hub, layout, r),
                window=window,
                clock=clocks.get(r, lambda: 1000),
                **kw,
            )
            for r in self.ranks
        }
        self._pool = ThreadPoolExecutor(len(self.ranks))

    def step(self, step: int, busy: dict[int, bool] | None = None) -> dict:
        """Run ``step`` on every stage leader (``busy``: votes by rank); re-raise the first error."""
        busy = busy or {}
        futures = {
            r: self._pool.submit(self.coords[r].step, step, self.members[r], busy=busy.get(r))
            for r in self.ranks
        }
        return {r: f.result(timeout=TIMEOUT_S * 2) for r, f in futures.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
