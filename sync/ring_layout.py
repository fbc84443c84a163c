"""The ring segment's byte layout, and the handle that describes one ring.

:class:`~gramcoord.sync.ring.BitmaskRing` maps its segment with the offsets
computed here; :class:`RingHandle` travels inside the channel's
:class:`~gramcoord.sync.handle.ChannelHandle` so that a reader can attach,
and :meth:`BitmaskRing.attach <gramcoord.sync.ring.BitmaskRing.attach>`
checks the segment's header against :func:`identity` before trusting it.

Layout of the segment (all offsets in bytes, all header words int64)::

    0            ring header (64 B)
                 [0] magic  [1] layout version  [2] num_slots K  [3] num_readers R
                 [4] max_rows  [5] width W (int32 words per row)
                 [6] writer pid  [7] closed (1 once the writer closed the ring)
    64           reader table: R lines of 64 B, one cache line per reader so
                 that readers never write the same line
                 [0] released step (-1 before the first release)  [1..7] unused
    64 * (1 + R) zero padding up to the next multiple of 4096 = D
    D            slot 0: header (64 B)
                   [0] step (-1 while empty)  [1] rows  [2] generation
                   (odd while the writer fills it, even once published)
                   [3] announcement length (-1: too long, only sent over zmq)
                 then the announcement: M bytes, M = roundup(max(4096,
                   64 * max_rows), 64); the encoded BitmaskReady, so that a
                   reader polling the slot needs no message
                 then data: max_rows * W int32, padded to 64 B
    D + S        slot 1, where S = 64 + M + roundup(max_rows * W * 4, 64)
    ...
    D + (K-1)*S  slot K-1
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import numpy as np

__all__ = [
    "H_CLOSED",
    "LINE",
    "S_GEN",
    "S_NOTE",
    "S_ROWS",
    "S_STEP",
    "RingHandle",
    "RingViews",
    "describe",
    "identity",
    "layout",
    "matches",
    "note_bytes",
    "views",
]

_MAGIC = int.from_bytes(b"GCRING\x00\x01", "little")
_LAYOUT_VERSION = 2
LINE = 64
_PAGE = 4096
# Header word set once the writer closed the ring.
H_CLOSED = 7
# Slot header words.
S_STEP, S_ROWS, S_GEN, S_NOTE = 0, 1, 2, 3


def _roundup(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class RingHandle(msgspec.Struct, frozen=True, kw_only=True):
    """What a reader needs to attach to a ring; picklable and msgspec-encodable."""

    # Segment name, without the leading slash.
    name: str
    # Run the ring belongs to (also part of the name).
    run_id: str
    # Number of slots K.
    num_slots: int
    # Rows per slot.
    max_rows: int
    # int32 words per row: ceil(vocab_size / 32).
    width: int
    # Bytes reserved per slot for the encoded announcement.
    note_bytes: int
    # Reader names; a reader's position is its line in the reader table.
    readers: tuple[str, ...]
    # Segment size in bytes.
    size: int


def note_bytes(max_rows: int) -> int:
    """Bytes reserved per slot for the encoded announcement (M above)."""
    # Room for ~60 bytes of request id per row; longer ids go over zmq only.
    return _roundup(max(4096, 64 * max_rows), LINE)


def layout(num_slots: int, num_readers: int, max_rows: int, width: int) -> tuple[int, int, int]:
    """``(D, S, size)``: where slot 0 starts, the slot stride and the segment size."""
    data_start = _roundup(LINE * (1 + num_readers), _PAGE)
    stride = LINE + note_bytes(max_rows) + _roundup(max_rows * width * 4, LINE)
    return data_start, stride, data_start + num_slots * stride


def identity(handle: RingHandle) -> list[int]:
    """Header words 0-5: what a reader checks before trusting the layout."""
    return [
        _MAGIC,
        _LAYOUT_VERSION,
        handle.num_slots,
        len(handle.readers),
        handle.max_rows,
        handle.width,
    ]


def describe(
    *, name: str, run_id: str, readers: Sequence[str], max_rows: int, width: int, num_slots: int
) -> RingHandle:
    """The handle of a ring of that shape, with its derived sizes filled in."""
    _, _, size = layout(num_slots, len(readers), max_rows, width)
    return RingHandle(
        name=name,
        run_id=run_id,
        num_slots=num_slots,
        max_rows=max_rows,
        width=width,
        note_bytes=note_bytes(max_rows),
        readers=tuple(readers),
        size=size,
    )


def matches(buf: mmap.mmap, size: int, handle: RingHandle) -> bool:
    """Whether a mapped segment of ``size`` bytes holds the ring ``handle`` describes."""
    found = np.ndarray((6,), np.int64, buf).tolist()
    return not (size < handle.size or found != identity(handle))


class RingViews(NamedTuple):
    """numpy views of one mapped segment at the offsets drawn above; no copies."""

    # The ring header: int64 [8].
    head: np.ndarray
    # The reader table: int64 [R, 8]; column 0 is each reader's released step.
    released: np.ndarray
    # The slot headers: int64 [K, 8], one row per slot.
    slots: np.ndarray
    # Each slot's announcement area: uint8 [M].
    notes: list[np.ndarray]
    # Each slot's rows: int32 [max_rows, W].
    data: list[np.ndarray]


def views(buf: mmap.mmap, handle: RingHandle) -> RingViews:
    """Views of ``buf``, a mapping of the segment ``handle`` describes."""
    k, r = handle.num_slots, len(handle.readers)
    data_start, stride, _ = layout(k, r, handle.max_rows, handle.width)
    head = np.ndarray((8,), np.int64, buf, 0)
    released = np.ndarray((r, 8), np.int64, buf, LINE)
    slots = np.ndarray((k, 8), np.int64, buf, data_start, (stride, 8))
    note = handle.note_bytes
    notes = [np.ndarray((note,), np.uint8, buf, data_start + i * stride + LINE) for i in range(k)]
    data = [
        np.ndarray(
            (handle.max_rows, handle.width),
            np.int32,
            buf,
            data_start + i * stride + LINE + note,
        )
        for i in range(k)
    ]
    return RingViews(head, released, slots, notes, data)
