"""BitmaskChannel and BitmaskReceiver in one process (readers joined from threads)."""

from __future__ import annotations

import itertools
import os
import stat
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gramcoord.sync import (
    BitmaskChannel,
    BitmaskReady,
    BitmaskReceiver,
    ChannelClosed,
    ChannelHandle,
    HandshakeError,
    Hello,
    PeerGone,
    ProtocolError,
    TransportConfig,
    TransportTimeout,
)
from gramcoord.sync.control import ControlClient
from tests.sync.transport_peers import MAX_ROWS, VOCAB, digest, mask_for

WIDTH = -(-VOCAB // 32)


def make_channel(run_id, names=("tp1",), **config) -> BitmaskChannel:
    settings_ = {"num_slots": 2, "timeout_s": 5.0, "handshake_timeout_s": 5.0, **config}
    return BitmaskChannel(
        readers=list(names),
        vocab_size=VOCAB,
        max_rows=MAX_ROWS,
        config=TransportConfig(**settings_),
        run_id=run_id,
    )


def join(channel, hosts=None, **kwargs) -> dict[str, BitmaskReceiver]:
    """Connect every reader from threads while the writer accepts.

    ``hosts`` maps reader names to the host name they announce.
    """
    names = channel.handle.ring.readers
    hosts = hosts or {}
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {
            n: pool.submit(
                BitmaskReceiver.connect,
                channel.handle,
                n,
                vocab_size=VOCAB,
                hostname=hosts.get(n),
                **kwargs,
            )
            for n in names
        }
        channel.accept()
        return {n: f.result(timeout=10) for n, f in futures.items()}


@pytest.fixture
def pair(run_id):
    with make_channel(run_id) as channel:
        reader = join(channel)["tp1"]
        yield channel, reader
        reader.close()


def roundtrip(channel, reader, step):
    array, order, drafts = mask_for(step)
    channel.publish(step, array, order, drafts)
    view, got_order, got_drafts = reader.receive(step)
    assert digest(step, view, got_order, got_drafts) == digest(step, array, order, drafts)
    reader.release(step)


def test_handle_is_plain_data(pair):
    channel, _ = pair
    data = msgspec.msgpack.encode(channel.handle)
    assert msgspec.msgpack.decode(data, type=ChannelHandle) == channel.handle


def test_segment_and_ipc_directory_are_private(pair):
    channel, _ = pair
    assert stat.S_IMODE(os.stat(f"/dev/shm/{channel.handle.ring.name}").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(channel.control.ipc_dir).st_mode) == 0o700


def test_publish_in_place_from_acquire(pair):
    channel, reader = pair
    view = channel.acquire(3)
    view[:] = np.arange(3 * WIDTH, dtype=np.int32).reshape(3, WIDTH)
    channel.publish(0, view, ["a", "b"], [1, 0])
    got, order, drafts = reader.receive(0)
    np.testing.assert_array_equal(got, np.arange(3 * WIDTH).reshape(3, WIDTH))
    assert (order, drafts) == (("a", "b"), (1, 0))
    assert not got.flags.writeable
    reader.release(0)


@pytest.mark.parametrize(
    ("array", "order", "drafts"),
    [
        pytest.param(np.zeros((2, WIDTH), np.int64), [], [], id="int64"),
        pytest.param(np.zeros((2, WIDTH + 1), np.int32), [], [], id="wrong-width"),
        pytest.param(np.zeros(WIDTH, np.int32), [], [], id="one-dimensional"),
        pytest.param(np.zeros((MAX_ROWS + 1, WIDTH), np.int32), [], [], id="too-many-rows"),
        pytest.param(np.zeros((2, WIDTH), np.int32), ["a"], [], id="order-drafts-mismatch"),
        pytest.param(np.zeros((2, WIDTH), np.int32), ["a"], [-1], id="negative-drafts"),
        pytest.param(np.zeros((2, WIDTH), np.int32), [7], [0], id="non-string-request-id"),
    ],
)
def test_publish_rejects_bad_arguments(pair, array, order, drafts):
    channel, reader = pair
    with pytest.raises(ValueError):
        channel.publish(0, array, order, drafts)
    roundtrip(channel, reader, 0)  # the channel is still usable


def test_accept_names_the_reader_that_never_said_hello(run_id):
    with make_channel(run_id, names=("tp1", "tp2")) as channel, ThreadPoolExecutor(1) as pool:
        early = pool.submit(BitmaskReceiver.connect, channel.handle, "tp1", vocab_size=VOCAB)
        with pytest.raises(TransportTimeout) as info:
            channel.accept(timeout=0.5)
        early.result(timeout=10).close()
    assert info.value.peers == ("tp2",)
    assert "'tp2'" in str(info.value) and "never said hello" in str(info.value)


@pytest.mark.parametrize(
    ("name", "kwargs", "kind", "writer_error"),
    [
        pytest.param("tp1", {"vocab_size": VOCAB + 1}, "auto", HandshakeError, id="vocab-mismatch"),
        pytest.param("stranger", {}, "auto", TransportTimeout, id="unknown-reader"),
        pytest.param("tp1", {"hostname": "elsewhere"}, "shm", None, id="shm-across-hosts"),
    ],
)
def test_handshake_rejections_are_clear_on_both_ends(run_id, name, kwargs, kind, writer_error):
    with make_channel(run_id, kind=kind) as channel:
        args = {"vocab_size": VOCAB, **kwargs}
        with ThreadPoolExecutor(1) as pool:
            reader = pool.submit(BitmaskReceiver.connect, channel.handle, name, **args)
            if writer_error is not None:
                with pytest.raises(writer_error):
                    channel.accept(timeout=1.0)
            with pytest.raises(HandshakeError) as info:
                reader.result(timeout=10)
    assert name in str(info.value)


def test_protocol_version_mismatch_is_rejected(run_id):
    with make_channel(run_id) as channel:
        rogue = ControlClient(channel.handle.ipc_endpoint, name="tp1")
        rogue.send(Hello(99, VOCAB, "tp1", "h", os.getpid()))
        with pytest.raises(HandshakeError, match="protocol version 99"):
            channel.accept(timeout=5)
        answer, _ = rogue.recv(5)
        assert "protocol version" in answer.reason
        rogue.close()


def test_writer_turns_away_strangers_without_stopping(run_id):
    with make_channel(run_id) as channel:
        stranger = ControlClient(channel.handle.ipc_endpoint, name="stranger")
        stranger.send(Hello(1, VOCAB, "stranger", "h", os.getpid()))
        with pytest.raises(TransportTimeout):
            channel.accept(timeout=0.5)  # still waiting for tp1, not crashed
        answer, _ = stranger.recv(5)
        assert "unknown reader" in answer.reason
        assert channel.dropped == 1
        stranger.close()


@pytest.mark.parametrize(
    ("hello", "dropped"),
    [
        pytest.param(Hello(1, VOCAB, "tp1", "h", os.getpid()), 1, id="repeat-gets-welcome"),
        pytest.param(Hello(1, VOCAB + 1, "tp1", "h", os.getpid()), 0, id="mismatch-dropped"),
    ],
)
def test_a_second_hello_from_a_joined_reader_changes_nothing(pair, hello, dropped):
    channel, reader = pair
    roundtrip(channel, reader, 0)
    reader._client.send(hello)
    # The hello and any answer travel asynchronously: go on until both ends
    # have seen them (a Bye to the joined reader would end this loop early).
    for step in range(1, 200):
        roundtrip(channel, reader, step)
        if (channel.dropped, reader.dropped) == (1 - dropped, dropped):
            break
    assert (channel.dropped, reader.dropped) == (1 - dropped, dropped)


def test_reader_without_writer_times_out_naming_the_writer(pair):
    channel, _ = pair
    handle = msgspec.structs.replace(channel.handle, ipc_endpoint=channel.handle.ipc_endpoint + "x")
    with pytest.raises(TransportTimeout) as info:
        BitmaskReceiver.connect(handle, "tp1", vocab_size=VOCAB, timeout=0.3)
    assert info.value.peers == ("writer",)


def test_receive_times_out_when_nothing_is_published(pair):
    _, reader = pair
    with pytest.raises(TransportTimeout) as info:
        reader.receive(0, timeout=0.3)
    assert info.value.peers == ("writer",) and "step 0" in str(info.value)


def test_a_skipped_step_is_a_protocol_error(pair):
    channel, reader = pair
    channel.publish(5, *mask_for(5))
    with pytest.raises(ProtocolError, match="waits for step 4"):
        reader.receive(4)


def test_release_and_receive_misuse(pair):
    channel, reader = pair
    with pytest.raises(ValueError, match="not held"):
        reader.release(0)
    channel.publish(0, *mask_for(0))
    reader.receive(0)
    with pytest.raises(ValueError, match="not released"):
        reader.receive(0)
    reader.release(0)


def test_writer_close_reaches_readers_as_channel_closed(run_id):
    with make_channel(run_id, names=("tp1", "far")) as channel:
        joined = join(channel, {"far": "far-node"})
        assert channel.modes == {"tp1": "shm", "far": "tcp"}
        channel.close("stage finished")
    for reader in joined.values():
        with pytest.raises(ChannelClosed, match="stage finished"):
            reader.receive(0)
        reader.close()


def test_reader_bye_makes_the_next_publish_name_it(run_id):
    with make_channel(run_id, names=("tp1", "tp2")) as channel:
        readers = join(channel)
        readers["tp2"].close()
        with pytest.raises(PeerGone) as info:
            for step in range(10):
                channel.publish(step, *mask_for(step))
                readers["tp1"].receive(step)
                readers["tp1"].release(step)
        readers["tp1"].close()
    assert info.value.peers == ("tp2",) and "said bye" in str(info.value)


def test_tcp_reader_releases_through_messages(run_id):
    with make_channel(run_id, kind="tcp") as channel:
        reader = join(channel)["tp1"]
        assert reader.mode == "tcp"
        for step in range(6):  # three times around a two-slot ring
            roundtrip(channel, reader, step)
        channel.drain()
        assert channel.ring.released() == {"tp1": 5}
        reader.close()


FRAMES = st.lists(st.binary(max_size=64), min_size=1, max_size=3) | st.builds(
    lambda step, slot, rows: [msgspec.msgpack.encode(BitmaskReady(step, slot, rows, (), ()))],
    # Far from the steps the test publishes, or nonsensical slots and rows.
    st.integers(min_value=10**6, max_value=2**40),
    st.integers(min_value=0, max_value=2**20),
    st.integers(min_value=0, max_value=2**20),
)


@pytest.mark.parametrize(
    ("kind", "spin_us"),
    [
        pytest.param("auto", 0, id="shm"),
        pytest.param("auto", 1000, id="shm-polling"),
        pytest.param("tcp", 0, id="tcp"),
    ],
)
def test_hypothesis_frames_never_break_a_reader(run_id, kind, spin_us):
    with make_channel(run_id, kind=kind) as channel:
        reader = join(channel, spin_us=spin_us)["tp1"]
        steps = itertools.count()

        @settings(
            max_examples=150,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(frames=FRAMES)
        def check(frames):
            channel.control.send_frames("tp1", frames)
            roundtrip(channel, reader, next(steps))

        check()
        sent = next(steps)
        channel.close()  # Shutdown follows every fuzzed frame
    with pytest.raises(ChannelClosed):
        reader.receive(sent)
    assert reader.dropped == sent  # one per example, each counted once
    reader.close()


@pytest.mark.parametrize(
    ("kind", "spin_us"),
    [
        pytest.param("auto", 0, id="shm"),
        pytest.param("auto", 1000, id="shm-polling"),
        pytest.param("tcp", 0, id="tcp"),
    ],
)
def test_garbled_frames_are_dropped_and_every_step_still_arrives(run_id, kind, spin_us):
    # faults.corrupt_frames_every: an shm announcement is garbled in place
    # (the reader finds the step in the ring slot), a tcp reader gets a
    # garbled copy before the real frame.
    channel = BitmaskChannel(
        readers=["tp1"],
        vocab_size=VOCAB,
        max_rows=MAX_ROWS,
        config=TransportConfig(kind=kind, num_slots=2, timeout_s=5.0, handshake_timeout_s=5.0),
        run_id=run_id,
        corrupt_every=2,
    )
    with channel:
        reader = join(channel, spin_us=spin_us)["tp1"]
        for step in range(8):
            roundtrip(channel, reader, step)
        channel.drain()
        assert channel.corrupted == 4
        reader.close()
    # A reader that waits on its socket reads every announcement in order, so
    # it meets (and counts) each garbled one before the next real step. A
    # polling reader takes steps from the ring and drains its socket only at
    # the start of each receive: how many garbled frames it has met by then
    # depends on when zmq delivered them, in any interleaving from none to
    # all four. What holds in every one: all 8 steps arrived intact (above),
    # and no good frame was counted as dropped.
    if spin_us:
        assert 0 <= reader.dropped <= channel.corrupted
    else:
        assert reader.dropped == channel.corrupted == 4


def test_a_garbled_announcement_overtaken_by_the_next_step_is_read_from_the_ring(run_id):
    # A writer a step ahead of its reader: step 1's announcement is garbled
    # and step 2's is queued behind it before the reader asks for step 1.
    channel = BitmaskChannel(
        readers=["tp1"],
        vocab_size=VOCAB,
        max_rows=MAX_ROWS,
        config=TransportConfig(kind="auto", num_slots=4, timeout_s=5.0, handshake_timeout_s=5.0),
        run_id=run_id,
        corrupt_every=2,  # the second announcement sent: step 1's
    )
    with channel:
        reader = join(channel, spin_us=0)["tp1"]
        roundtrip(channel, reader, 0)
        sent = {step: mask_for(step) for step in (1, 2)}
        for step, (array, order, drafts) in sent.items():
            channel.publish(step, array, order, drafts)
        assert channel.corrupted == 1
        for step, (array, order, drafts) in sent.items():
            view, got_order, got_drafts = reader.receive(step)
            assert digest(step, view, got_order, got_drafts) == digest(step, array, order, drafts)
            reader.release(step)
        assert reader.dropped == 1
        roundtrip(channel, reader, 3)  # and the steps after go on as usual
        reader.close()


def test_rows_filled_through_another_view_of_the_slot_are_not_copied(pair, monkeypatch):
    channel, reader = pair
    array, order, drafts = mask_for(0)
    slot = channel.acquire(len(array))
    slot[:] = array
    same = slot[: len(array)]  # a new view object of the same rows
    copies = []
    real = np.copyto
    monkeypatch.setattr(np, "copyto", lambda *a, **k: (copies.append(1), real(*a, **k)))
    channel.publish(0, same, order, drafts)
    assert copies == []
    view, got_order, _ = reader.receive(0)
    assert np.array_equal(view, array) and got_order == tuple(order)
    reader.release(0)
