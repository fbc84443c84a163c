"""A shared-memory ring of bitmask slots: one writer, a fixed set of readers.

:class:`~gramcoord.sync.channel.BitmaskChannel` creates the ring and writes
it; each :class:`~gramcoord.sync.receiver.BitmaskReceiver` in shm mode
attaches to it and reads slots in place, and the writer's
:class:`~gramcoord.sync.roster.Roster` records there the releases of readers
on other hosts. The segment's byte layout is drawn in
:mod:`gramcoord.sync.ring_layout`.

Steps are published in strictly increasing order into slots 0, 1, ..., K-1,
0, 1, ... A reader releases a step by storing it in its own line of the
reader table; releasing step s releases every earlier step too. Slot i can
be rewritten when every reader's released step is at least the step it
holds, so a slot is reused only after every reader released it. The writer
stores a slot's data, announcement, rows and length before its step, and
its step before the even generation, so a reader that sees the step sees
everything else.

NOTE: release counters in shared memory, not Release messages: a local
reader releases with one 8-byte store and no syscall, and the writer
checks all readers with one numpy ``min``. Readers that are not on this
host send ``Release`` messages and the writer copies them into their line,
so one rule covers both. Aligned 8-byte stores are atomic on every
supported CPU. A reader told of a slot by zmq is ordered by the syscalls on
both sides; a reader that polls the slot header relies on the CPU keeping
stores in order (x86-64), see :data:`POLLING_IS_SAFE`.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence

import numpy as np

from gramcoord.sync.errors import ProtocolError, TransportError, TransportTimeout, quote_names
from gramcoord.sync.ring_layout import (
    H_CLOSED,
    S_GEN,
    S_NOTE,
    S_ROWS,
    S_STEP,
    RingHandle,
    describe,
    identity,
    matches,
    views,
)
from gramcoord.sync.segment import Segment, segment_name

__all__ = ["POLLING_IS_SAFE", "BitmaskRing"]

# Whether readers may learn of a slot by polling its header. Python has no
# memory fences, so this needs a CPU that keeps one core's stores in order
# for every other core (total store order): x86-64. Elsewhere readers wait
# for the zmq announcement, whose syscalls order memory.
POLLING_IS_SAFE = platform.machine().lower() in ("x86_64", "amd64")

# Called while the writer waits: (step every reader must release, seconds to
# pause). It may block up to the pause (e.g. polling a socket), may learn of
# releases (set_released) and may raise to stop the wait.
WaitHook = Callable[[int, float], None]


class BitmaskRing:
    """K slots of ``[max_rows, width]`` int32 in one shared-memory segment.

    Build it with :meth:`create` (the writer, which owns and unlinks the
    segment) or :meth:`attach` (a reader, which only closes its mapping).
    One thread per process uses a ring.
    """

    def __init__(self, segment: Segment, handle: RingHandle, *, reader: int | None) -> None:
        self._segment = segment
        self._handle = handle
        self._reader = reader
        self._head, self._released, self._slots, self._notes, self._data = views(
            segment.buf, handle
        )
        if reader is not None:
            for view in self._data:
                view.flags.writeable = False
        self._next = 0  # writer: publications so far; the next slot is _next % K
        self._last_step = -1
        self._pending: int | None = None  # writer: rows acquired, not yet published
        # Writer: Python copies of what it wrote to each slot header, so the
        # per-step path only stores to shared memory.
        self._held = [-1] * handle.num_slots
        self._gens = [0] * handle.num_slots
        self._note_views = [memoryview(n.data).cast("B") for n in self._notes]

    @classmethod
    def create(
        cls,
        *,
        run_id: str,
        readers: Sequence[str],
        max_rows: int,
        width: int,
        num_slots: int = 4,
        label: str = "ring",
    ) -> BitmaskRing:
        """Create a ring (the writer's side); it owns the segment.

        Parameters
        ----------
        run_id
            Run id, part of the segment name ``[A-Za-z0-9_-]{1,32}``.
        readers
            Distinct reader names; the writer waits for all of them.
        max_rows
            Rows per slot: ``max_num_seqs * (1 + num_speculative_tokens)``.
        width
            int32 words per row: ``ceil(vocab_size / 32)``.
        num_slots
            Slots K; the writer can run K steps ahead of the slowest reader.
        label
            Tells several rings of one run apart in the segment name.

        Returns
        -------
        BitmaskRing
            The writer's ring, mode 0600, every slot empty.

        Raises
        ------
        ValueError
            On a non-positive size or duplicate reader names.
        """
        if max_rows < 1 or width < 1 or num_slots < 1:
            raise ValueError(
                f"need max_rows, width, num_slots >= 1, got {max_rows}, {width}, {num_slots}"
            )
        if len(set(readers)) != len(readers):
            raise ValueError(f"reader names must be distinct, got {list(readers)}")
        handle = describe(
            name=segment_name(run_id, label),
            run_id=run_id,
            readers=readers,
            max_rows=max_rows,
            width=width,
            num_slots=num_slots,
        )
        ring = cls(Segment.create(handle.name, handle.size), handle, reader=None)
        ring._head[:] = [*identity(handle), os.getpid(), 0]
        ring._released[:, 0] = -1
        ring._slots[:, S_STEP] = -1
        return ring

    @classmethod
    def attach(cls, handle: RingHandle, reader: str) -> BitmaskRing:
        """Map a ring as reader ``reader`` (a reader's side; it never unlinks).

        Raises
        ------
        TransportError
            If the segment is gone or does not match the handle.
        ValueError
            If ``reader`` is not one of ``handle.readers``.
        """
        if reader not in handle.readers:
            raise ValueError(f"reader {reader!r} is not one of {list(handle.readers)}")
        try:
            segment = Segment.attach(handle.name)
        except FileNotFoundError as exc:
            raise TransportError(
                f"ring segment {handle.name} does not exist (writer gone?)"
            ) from exc
        if not matches(segment.buf, segment.size, handle):
            segment.close()
            raise TransportError(f"ring segment {handle.name} does not match its handle")
        return cls(segment, handle, reader=handle.readers.index(reader))

    @property
    def handle(self) -> RingHandle:
        """The handle to pass to readers."""
        return self._handle

    @property
    def last_step(self) -> int:
        """The newest step this writer published (-1 before the first)."""
        return self._last_step

    @property
    def writer_closed(self) -> bool:
        """True once the writer closed the ring (or this mapping was closed)."""
        return self._segment.buf is None or bool(self._head[H_CLOSED])

    # Writer side -------------------------------------------------------

    def acquire_write(
        self, rows: int, timeout: float, on_wait: WaitHook | None = None
    ) -> np.ndarray:
        """Wait for the next slot to be free and return its first ``rows`` rows.

        Parameters
        ----------
        rows
            Rows the step needs, ``0 <= rows <= max_rows``.
        timeout
            Seconds to wait for the slowest reader.
        on_wait
            Called while waiting (see ``WaitHook``); sleeps when None.

        Returns
        -------
        numpy.ndarray
            Writable ``[rows, width]`` int32 view into the slot. Fill it, then
            call :meth:`publish`.

        Raises
        ------
        TransportTimeout
            If a reader still holds the slot after ``timeout``; names it.
        """
        self._require_writer()
        if not 0 <= rows <= self._handle.max_rows:
            raise ValueError(f"rows must be in [0, {self._handle.max_rows}], got {rows}")
        slot = self._next % self._handle.num_slots
        if self._pending is None:
            self._wait(self._held[slot], timeout, on_wait, f"slot {slot}")
            self._gens[slot] += 1
            self._slots[slot, S_GEN] = self._gens[slot]  # odd: being written
        # else: acquired again before publishing; the slot is already ours.
        self._pending = rows
        return self._data[slot][:rows]

    @property
    def next_slot(self) -> int:
        """The slot the next :meth:`acquire_write` fills."""
        return self._next % self._handle.num_slots

    def publish(self, step: int, note: bytes = b"") -> int:
        """Mark the acquired slot as holding ``step``; return the slot index.

        Parameters
        ----------
        step
            Greater than every step published before.
        note
            The encoded announcement, stored in the slot so that readers
            polling it need no message; skipped (length -1) if it does not
            fit in ``handle.note_bytes``.

        Raises
        ------
        ValueError
            If nothing was acquired or ``step`` does not increase.
        """
        self._require_writer()
        if self._pending is None:
            raise ValueError("publish() without acquire_write()")
        if step <= self._last_step:
            raise ValueError(f"steps must increase: {step} after {self._last_step}")
        slot = self._next % self._handle.num_slots
        fits = len(note) <= self._handle.note_bytes
        if fits:
            self._note_views[slot][: len(note)] = note
        self._slots[slot, S_ROWS] = self._pending
        self._slots[slot, S_NOTE] = len(note) if fits else -1
        # Order matters (see the module docstring): the step, then the generation.
        self._slots[slot, S_STEP] = self._held[slot] = step
        self._gens[slot] += 1
        self._slots[slot, S_GEN] = self._gens[slot]  # even: published
        self._pending = None
        self._last_step = step
        self._next += 1
        return slot

    def wait_released(self, step: int, timeout: float, on_wait: WaitHook | None = None) -> None:
        """Block until every reader released ``step`` (the writer drains).

        Raises
        ------
        TransportTimeout
            Naming the readers that did not release it in time.
        """
        self._require_writer()
        self._wait(step, timeout, on_wait, f"step {step}")

    def set_released(self, reader: str, step: int) -> None:
        """Record a remote reader's ``Release`` (counters only move forward)."""
        index = self._handle.readers.index(reader)
        if step > self._released[index, 0]:
            self._released[index, 0] = step

    def released(self) -> dict[str, int]:
        """Each reader's newest released step (-1 before any)."""
        return dict(zip(self._handle.readers, self._released[:, 0].tolist()))

    def lagging(self, step: int) -> tuple[str, ...]:
        """Readers that have not released ``step`` yet."""
        behind = np.flatnonzero(self._released[:, 0] < step)
        return tuple(self._handle.readers[i] for i in behind)

    def _wait(self, step: int, timeout: float, on_wait: WaitHook | None, what: str) -> None:
        # NOTE: min() of a short list, not numpy's: a ufunc reduction costs
        # ~1.5 us, several times more, on every step.
        if step < 0 or min(self._released[:, 0].tolist(), default=step) >= step:
            return  # the common case: no wait, no clock read
        deadline = time.monotonic() + timeout
        pause = 0.0
        while lag := self.lagging(step):
            now = time.monotonic()
            if now >= deadline:
                seen = ", ".join(f"{n}={s}" for n, s in self.released().items() if n in lag)
                raise TransportTimeout(
                    f"{what} is still held: reader(s) {quote_names(lag)} did not release step "
                    f"{step} within {timeout:g} s (last released: {seen})",
                    peers=lag,
                )
            if on_wait is not None:
                on_wait(step, min(pause, deadline - now))
            else:
                time.sleep(min(pause, deadline - now))
            # Yield first (a release is usually microseconds away), then back
            # off to 1 ms so a stuck reader does not cost a core.
            pause = min(max(pause * 2, 2e-5), 1e-3)

    # Reader side -------------------------------------------------------

    def read(self, slot: int, step: int, rows: int) -> np.ndarray:
        """Read-only ``[rows, width]`` view of ``step`` in ``slot``; no copy.

        Raises
        ------
        ProtocolError
            If the slot does not hold ``step`` with ``rows`` rows, e.g. for a
            forged or stale announcement.
        """
        if not (0 <= slot < self._handle.num_slots and 0 <= rows <= self._handle.max_rows):
            raise ProtocolError(
                f"slot {slot} / rows {rows} out of range for ring {self._handle.name}"
            )
        held, held_rows, gen = self._slots[slot, :3].tolist()
        if gen % 2 or held != step or held_rows != rows:
            raise ProtocolError(
                f"slot {slot} holds step {held} with {held_rows} rows (generation {gen}), "
                f"not step {step} with {rows} rows"
            )
        return self._data[slot][:rows]

    def note(self, slot: int, step: int) -> bytes | None:
        """The announcement stored with ``step`` in ``slot``, or None.

        None while the slot holds another step, is being written, or the
        announcement did not fit. Only meaningful where
        :data:`POLLING_IS_SAFE`.
        """
        if int(self._slots[slot, S_STEP]) != step:
            return None
        gen, length = self._slots[slot, S_GEN : S_NOTE + 1].tolist()
        if gen % 2 or length < 0:
            return None
        return self._notes[slot][:length].tobytes()

    def release(self, step: int) -> None:
        """Release ``step`` and every earlier step (this reader's line only)."""
        if self._reader is None:
            raise ValueError("release() is for readers; the writer never holds a slot")
        if step > self._released[self._reader, 0]:
            self._released[self._reader, 0] = step

    # Both --------------------------------------------------------------

    def close(self) -> None:
        """Drop the mapping; the writer also marks the ring closed and unlinks it.

        Idempotent. Views handed out earlier stay valid until freed.
        """
        if self._segment.buf is None:
            return
        if self._reader is None:
            self._head[H_CLOSED] = 1
        for view in self._note_views:
            view.release()
        del self._head, self._released, self._slots, self._notes, self._note_views, self._data
        self._segment.close()
        if self._segment.owner:
            self._segment.unlink()

    def __enter__(self) -> BitmaskRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_writer(self) -> None:
        if self._reader is not None:
            raise ValueError("this is a reader's view of the ring; only the writer publishes")

    def __repr__(self) -> str:
        h = self._handle
        role = "writer" if self._reader is None else f"reader {h.readers[self._reader]!r}"
        return f"BitmaskRing({h.name!r}, slots={h.num_slots}, rows={h.max_rows}, width={h.width}, {role})"
