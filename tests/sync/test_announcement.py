"""Announcer and frame_rows: one step's announcement encoded, checked and read back."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from gramcoord.sync import BitmaskFrame, BitmaskReady, ProtocolError
from gramcoord.sync.announcement import Announcer, frame_rows, garbled
from gramcoord.sync.ring_layout import describe

ENC = msgspec.msgpack.Encoder()
RING = describe(name="n", run_id="r", readers=("tp1",), max_rows=4, width=3, num_slots=2)


def test_ready_is_what_readers_decode_and_drafts_become_ints():
    announcer = Announcer(ENC.encode, width=RING.width)
    ready, drafts = announcer.ready(7, 1, 3, ("a", "b"), (np.int64(1), np.int64(0)))
    assert msgspec.msgpack.decode(ready, type=BitmaskReady) == BitmaskReady(
        7, 1, 3, ("a", "b"), (1, 0)
    )
    assert drafts == (1, 0) and all(type(d) is int for d in drafts)


@pytest.mark.parametrize(
    ("order", "drafts", "match"),
    [
        pytest.param(("a",), (), "1 request ids but 0 draft counts", id="mismatch"),
        pytest.param(("a",), (-1,), "bad step", id="negative-drafts"),
        pytest.param(("a" * 1025,), (0,), "bad step", id="request-id-too-long"),
    ],
)
def test_ready_refuses_what_readers_would_drop(order, drafts, match):
    with pytest.raises(ValueError, match=match):
        Announcer(ENC.encode, width=RING.width).ready(0, 0, 1, order, drafts)


def test_every_nth_frame_is_corrupted_and_counted():
    announcer = Announcer(ENC.encode, width=RING.width, corrupt_every=3)
    assert [announcer.corrupt_next() for _ in range(7)] == [False, False, True] * 2 + [False]
    assert announcer.corrupted == 2
    assert not any(Announcer(ENC.encode, width=1).corrupt_next() for _ in range(5))
    assert garbled(b"\x00\xff\x0f") == b"\xff\x00\xf0"


def test_frame_rows_is_a_read_only_view_of_the_frame():
    rows = np.arange(6, dtype="<i4").reshape(2, 3)
    frame = zmq.Frame(rows.tobytes())
    view = frame_rows(BitmaskFrame(0, 2, 3, ("a",), (1,)), frame, RING)
    np.testing.assert_array_equal(view, rows)
    assert not view.flags.writeable


@pytest.mark.parametrize(
    ("message", "data"),
    [
        pytest.param(BitmaskFrame(0, 2, 3, (), ()), None, id="no-frame"),
        pytest.param(BitmaskFrame(0, 2, 3, (), ()), b"\x00" * 20, id="short-frame"),
        pytest.param(BitmaskFrame(0, 2, 4, (), ()), b"\x00" * 32, id="other-width"),
        pytest.param(BitmaskFrame(0, 5, 3, (), ()), b"\x00" * 60, id="more-rows-than-the-ring"),
    ],
)
def test_frame_rows_refuses_frames_that_do_not_fit(message, data):
    with pytest.raises(ProtocolError):
        frame_rows(message, None if data is None else zmq.Frame(data), RING)
