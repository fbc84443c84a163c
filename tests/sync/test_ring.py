"""BitmaskRing in one process: layout, slot reuse, release accounting, ownership."""

from __future__ import annotations

import os
import pickle

import msgspec
import numpy as np
import pytest

from gramcoord.sync import BitmaskRing, ProtocolError, RingHandle, TransportError, TransportTimeout
from tests.sync.transport_peers import shm_names


@pytest.fixture
def ring(run_id):
    with BitmaskRing.create(
        run_id=run_id, readers=["a", "b"], max_rows=4, width=3, num_slots=2
    ) as writer:
        yield writer


def attach_all(ring):
    return [BitmaskRing.attach(ring.handle, name) for name in ring.handle.readers]


def put(ring, step, value, rows=2):
    view = ring.acquire_write(rows, timeout=0.05)
    view[:] = value
    return ring.publish(step)


def test_segment_is_private_and_named_after_the_run(run_id):
    first = BitmaskRing.create(run_id=run_id, readers=["a"], max_rows=1, width=1)
    second = BitmaskRing.create(run_id=run_id, readers=["a"], max_rows=1, width=1)
    try:
        names = [first.handle.name, second.handle.name]
        assert names[0] != names[1]
        assert all(run_id in n for n in names)
        assert shm_names(run_id) == sorted(names)
        for name in names:
            assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
    finally:
        first.close()
        second.close()
    assert shm_names(run_id) == []


@pytest.mark.parametrize(
    "codec",
    [
        pytest.param(lambda h: pickle.loads(pickle.dumps(h)), id="pickle"),
        pytest.param(
            lambda h: msgspec.msgpack.decode(msgspec.msgpack.encode(h), type=RingHandle),
            id="msgpack",
        ),
    ],
)
def test_handle_travels_and_attaches(ring, codec):
    handle = codec(ring.handle)
    assert handle == ring.handle
    reader = BitmaskRing.attach(handle, "b")
    put(ring, 0, 9)
    assert reader.read(0, 0, 2).tolist() == [[9, 9, 9]] * 2
    reader.close()


def test_reader_view_is_read_only_and_zero_copy(ring):
    a, b = attach_all(ring)
    put(ring, 0, 5)
    view = a.read(0, 0, 2)
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0, 0] = 1
    # Same memory as the writer's slot: once released and rewritten, the
    # (stale) view shows the new bytes, so nothing was copied.
    a.release(0)
    b.release(0)
    put(ring, 1, 0)
    ring.acquire_write(2, timeout=0.05)[:] = 6
    assert view[0, 0] == 6
    a.close()
    b.close()


def test_slot_is_reused_only_after_every_reader_released(ring):
    a, b = attach_all(ring)
    put(ring, 0, 1)
    put(ring, 1, 2)
    with pytest.raises(TransportTimeout):
        ring.acquire_write(1, timeout=0.05)
    a.release(0)
    with pytest.raises(TransportTimeout):
        ring.acquire_write(1, timeout=0.05)
    assert a.read(0, 0, 2).tolist() == [[1, 1, 1]] * 2  # untouched while b holds it
    b.release(0)
    assert put(ring, 2, 3) == 0
    assert b.read(0, 2, 2)[0, 0] == 3
    a.close()
    b.close()


@pytest.mark.parametrize(
    ("released", "lagging"),
    [
        pytest.param({}, ("a", "b"), id="none-released"),
        pytest.param({"a": 0}, ("b",), id="b-lags"),
        pytest.param({"b": 0}, ("a",), id="a-lags"),
    ],
)
def test_timeout_names_exactly_the_lagging_readers(ring, released, lagging):
    readers = dict(zip(ring.handle.readers, attach_all(ring)))
    put(ring, 0, 1)
    put(ring, 1, 1)
    for name, step in released.items():
        readers[name].release(step)
    with pytest.raises(TransportTimeout) as info:
        ring.acquire_write(1, timeout=0.05)
    assert info.value.peers == lagging
    for name in ring.handle.readers:
        assert (repr(name) in str(info.value)) == (name in lagging)
    assert ring.lagging(0) == lagging
    for reader in readers.values():
        reader.close()


def test_wait_hook_sees_laggards_and_may_abort(ring):
    a, b = attach_all(ring)
    put(ring, 0, 1)
    a.release(0)
    seen = []

    def hook(step, pause):
        seen.append((step, ring.lagging(step)))
        raise RuntimeError("stop waiting")

    with pytest.raises(RuntimeError, match="stop waiting"):
        ring.wait_released(0, timeout=5, on_wait=hook)
    assert seen == [(0, ("b",))]
    a.close()
    b.close()


def test_remote_release_moves_forward_only(ring):
    ring.set_released("b", 4)
    ring.set_released("b", 2)
    assert ring.released() == {"a": -1, "b": 4}


@pytest.mark.parametrize(
    ("slot", "step", "rows"),
    [
        pytest.param(0, 1, 2, id="wrong-step"),
        pytest.param(0, 0, 3, id="wrong-rows"),
        pytest.param(1, 0, 2, id="empty-slot"),
        pytest.param(2, 0, 2, id="slot-out-of-range"),
        pytest.param(0, 0, 5, id="rows-out-of-range"),
    ],
)
def test_read_rejects_announcements_that_do_not_match_the_slot(ring, slot, step, rows):
    reader = BitmaskRing.attach(ring.handle, "a")
    put(ring, 0, 1)
    with pytest.raises(ProtocolError):
        reader.read(slot, step, rows)
    reader.close()


def test_read_rejects_a_slot_being_written(ring):
    reader = BitmaskRing.attach(ring.handle, "a")
    ring.acquire_write(2, timeout=0.05)
    with pytest.raises(ProtocolError, match="generation"):
        reader.read(0, -1, 0)
    reader.close()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        pytest.param(lambda r: r.publish(0), ValueError, id="publish-without-acquire"),
        pytest.param(lambda r: r.acquire_write(5, timeout=0.05), ValueError, id="too-many-rows"),
        pytest.param(lambda r: r.release(0), ValueError, id="writer-release"),
    ],
)
def test_writer_misuse_is_a_value_error(ring, call, error):
    with pytest.raises(error):
        call(ring)


def test_steps_must_increase_and_reacquire_keeps_the_slot(ring):
    put(ring, 3, 1)
    first = ring.acquire_write(1, timeout=0.05)
    again = ring.acquire_write(2, timeout=0.05)
    assert again.ctypes.data == first.ctypes.data
    with pytest.raises(ValueError, match="increase"):
        ring.publish(3)
    assert ring.publish(4) == 1


def test_readers_cannot_publish_or_unlink_and_closing_them_keeps_the_segment(ring, run_id):
    reader = BitmaskRing.attach(ring.handle, "a")
    with pytest.raises(ValueError):
        reader.acquire_write(1, timeout=0.05)
    with pytest.raises(PermissionError):
        reader._segment.unlink()
    reader.close()
    reader.close()
    assert shm_names(run_id) == [ring.handle.name]


def test_writer_close_unlinks_but_mapped_views_stay_valid(run_id):
    writer = BitmaskRing.create(run_id=run_id, readers=["a"], max_rows=2, width=2)
    reader = BitmaskRing.attach(writer.handle, "a")
    put(writer, 0, 7)
    view = reader.read(0, 0, 2)
    writer.close()
    assert shm_names(run_id) == []
    assert reader.writer_closed
    assert view.tolist() == [[7, 7], [7, 7]]  # still mapped until dropped
    reader.close()
    with pytest.raises(TransportError, match="does not exist"):
        BitmaskRing.attach(writer.handle, "a")


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"readers": ["a", "a"]}, id="duplicate-readers"),
        pytest.param({"max_rows": 0}, id="no-rows"),
        pytest.param({"run_id": "bad/id"}, id="run-id-with-slash"),
    ],
)
def test_create_rejects_bad_arguments(run_id, kwargs):
    args = {"run_id": run_id, "readers": ["a"], "max_rows": 2, "width": 2, **kwargs}
    with pytest.raises(ValueError):
        BitmaskRing.create(**args)


def test_attach_checks_the_handle(ring):
    with pytest.raises(ValueError, match="not one of"):
        BitmaskRing.attach(ring.handle, "stranger")
    wrong = msgspec.structs.replace(ring.handle, width=ring.handle.width + 1)
    with pytest.raises(TransportError, match="does not match"):
        BitmaskRing.attach(wrong, "a")


def test_rows_are_independent_slices_of_a_full_slot(run_id):
    with BitmaskRing.create(run_id=run_id, readers=["a"], max_rows=3, width=2) as writer:
        reader = BitmaskRing.attach(writer.handle, "a")
        data = np.arange(6, dtype=np.int32).reshape(3, 2)
        writer.acquire_write(3, timeout=0.05)[:] = data
        writer.publish(0)
        np.testing.assert_array_equal(reader.read(0, 0, 3), data)
        writer.acquire_write(0, timeout=0.05)
        writer.publish(1)
        assert reader.read(1, 1, 0).shape == (0, 2)
        reader.close()
