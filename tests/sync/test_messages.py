"""Control messages: round trips, direction, and decoders that only ever raise DecodeError."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gramcoord.sync.messages import (
    PROTOCOL_VERSION,
    BitmaskFrame,
    BitmaskReady,
    Bye,
    Hello,
    Release,
    Shutdown,
    Welcome,
    reader_decoder,
    valid_reader_name,
    writer_decoder,
)

ENC = msgspec.msgpack.Encoder()

TO_READER = [
    pytest.param(Welcome(PROTOCOL_VERSION, 151936, 2, "shm"), id="welcome"),
    pytest.param(BitmaskReady(7, 1, 4, ("a", "b"), (1, 1)), id="ready"),
    pytest.param(BitmaskFrame(7, 4, 4748, ("a",), (3,)), id="frame"),
    pytest.param(Shutdown("done"), id="shutdown"),
    pytest.param(Bye(PROTOCOL_VERSION, 151936, "tp1", "unknown reader"), id="bye-to-reader"),
]
TO_WRITER = [
    pytest.param(Hello(PROTOCOL_VERSION, 151936, "tp1", "node-1", 4242), id="hello"),
    pytest.param(Release("tp1", 9), id="release"),
    pytest.param(Bye(PROTOCOL_VERSION, 151936, "tp1", "reader closed"), id="bye-to-writer"),
]


@pytest.mark.parametrize("message", TO_READER)
def test_writer_messages_round_trip_and_only_readers_accept_them(message):
    data = ENC.encode(message)
    assert reader_decoder().decode(data) == message
    if not isinstance(message, Bye):
        with pytest.raises(msgspec.ValidationError):
            writer_decoder().decode(data)


@pytest.mark.parametrize("message", TO_WRITER)
def test_reader_messages_round_trip_and_only_writers_accept_them(message):
    data = ENC.encode(message)
    assert writer_decoder().decode(data) == message
    if not isinstance(message, Bye):
        with pytest.raises(msgspec.ValidationError):
            reader_decoder().decode(data)


def test_encoding_is_a_compact_tagged_array():
    assert msgspec.msgpack.decode(ENC.encode(Release("tp1", 9))) == ["release", "tp1", 9]


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(["nope", 1], id="unknown-tag"),
        pytest.param(["release", "tp1", 1, 2], id="too-long"),
        pytest.param(["release", "tp1"], id="too-short"),
        pytest.param(["release", "tp1", -1], id="negative-step"),
        pytest.param(["release", "tp1", "1"], id="string-step"),
        pytest.param(["release", "", 1], id="empty-name"),
        pytest.param(["release", "tp\n1", 1], id="newline-in-name"),
        pytest.param(["release", "\x00tp1", 1], id="zero-byte-name"),
        pytest.param(["release", "t" * 65, 1], id="name-too-long"),
        pytest.param(["hello", 0, 10, "tp1", "h", 1], id="version-zero"),
        pytest.param(["hello", 1, 0, "tp1", "h", 1], id="empty-vocab"),
        pytest.param(["hello", 1, 10, "tp1", "h", -1], id="negative-pid"),
        pytest.param({"tag": "release"}, id="map"),
        pytest.param("release", id="bare-string"),
    ],
)
def test_writer_decoder_rejects(value):
    with pytest.raises(msgspec.ValidationError):
        writer_decoder().decode(ENC.encode(value))


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(["ready", 1, 0, -4, [], []], id="negative-rows"),
        pytest.param(["ready", 1, -1, 4, [], []], id="negative-slot"),
        pytest.param(["ready", 2**63 - 1, 0, 4, [], []], id="absurd-step"),
        pytest.param(["ready", 1, 0, 4, [1], [0]], id="int-request-id"),
        pytest.param(["ready", 1, 0, 4, ["a"], [-1]], id="negative-drafts"),
        pytest.param(["welcome", 1, 10, 0, "udp"], id="unknown-mode"),
        pytest.param(["frame", 1, 4, 32.5, [], []], id="float-width"),
    ],
)
def test_reader_decoder_rejects(value):
    with pytest.raises(msgspec.ValidationError):
        reader_decoder().decode(ENC.encode(value))


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        pytest.param("tp1", True, id="plain"),
        pytest.param("dp0.pp1.tp3:worker-x_y", True, id="punctuation"),
        pytest.param("", False, id="empty"),
        pytest.param("a b", False, id="space"),
        pytest.param("tp1\n", False, id="trailing-newline"),
        pytest.param("x" * 64, True, id="64-chars"),
        pytest.param("x" * 65, False, id="65-chars"),
    ],
)
def test_valid_reader_name(name, ok):
    assert valid_reader_name(name) is ok


MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from(["ready", "frame", "welcome", "shutdown", "bye", "hello", "release"]),
    lambda children: (
        st.lists(children, max_size=7) | st.dictionaries(st.text(max_size=5), children)
    ),
    max_leaves=20,
)


@pytest.mark.parametrize("decoder", [reader_decoder, writer_decoder], ids=["reader", "writer"])
@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=256) | MSGPACK_VALUES.map(ENC.encode))
def test_decoders_raise_only_decode_errors(decoder, data):
    try:
        message = decoder().decode(data)
    except msgspec.DecodeError:
        return  # ValidationError is a DecodeError subclass
    # Anything that does decode is a fully validated message.
    assert ENC.encode(message) == ENC.encode(decoder().decode(ENC.encode(message)))


def test_admission_takes_no_request_id_the_wire_refuses():
    """Admission's bound is the wire's: one admitted id never breaks a batch's publish."""
    from gramcoord.rank_worker.grammars import manager
    from gramcoord.sync import messages

    assert manager.MAX_REQUEST_ID_CHARS == messages.MAX_REQUEST_ID_CHARS
    longest = "x" * manager.MAX_REQUEST_ID_CHARS
    assert manager.valid_request_id(longest)
    assert not manager.valid_request_id(longest + "x")
    wire = ENC.encode(BitmaskReady(7, 1, 1, (longest,), (0,)))
    assert reader_decoder().decode(wire).request_ids == (longest,)
    with pytest.raises(msgspec.DecodeError):
        reader_decoder().decode(ENC.encode(BitmaskReady(7, 1, 1, (longest + "x",), (0,))))
