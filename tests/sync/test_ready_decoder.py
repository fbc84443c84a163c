"""ReadyDecoder must accept and reject exactly what the full typed decoder does."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gramcoord.sync.messages import BitmaskReady, ReadyDecoder

FULL = msgspec.msgpack.Decoder(BitmaskReady)
ENC = msgspec.msgpack.Encoder()

batches = st.tuples(
    st.lists(st.text(min_size=1, max_size=6), max_size=5).map(tuple),
    st.lists(st.integers(0, 8), max_size=5).map(tuple),
)


def _frame(draw_batch, step, slot, rows):
    ids, drafts = draw_batch
    return ENC.encode(BitmaskReady(step, slot, rows, ids, drafts))


@st.composite
def frames(draw):
    """A stream that repeats batches (cache hits) and corrupts some frames."""
    pool = draw(st.lists(batches, min_size=1, max_size=3))
    out = []
    for _ in range(draw(st.integers(1, 12))):
        frame = bytearray(
            _frame(
                draw(st.sampled_from(pool)),
                draw(st.integers(-2, 50)),
                draw(st.integers(-1, 4)),
                draw(st.integers(-1, 6)),
            )
        )
        if draw(st.booleans()) and frame:
            i = draw(st.integers(0, len(frame) - 1))
            frame[i] = draw(st.integers(0, 255))
        out.append(frame)
    return out


def _outcome(decoder, data):
    try:
        return ("ok", decoder(data))
    except msgspec.DecodeError:
        return ("error", None)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(frames())
def test_same_verdicts_as_full_decoder(stream):
    ready = ReadyDecoder()
    for frame in stream:
        got = _outcome(ready.decode, bytes(frame))
        want = _outcome(FULL.decode, bytes(frame))
        assert got == want


def test_reused_buffer_cannot_corrupt_the_cache():
    ready = ReadyDecoder()
    buf = bytearray(ENC.encode(BitmaskReady(1, 0, 2, ("a", "b"), (0, 1))))
    first = ready.decode(memoryview(buf))
    # The caller reuses its buffer for a different batch of the same size.
    other = ENC.encode(BitmaskReady(2, 1, 2, ("x", "y"), (1, 0)))
    assert len(other) == len(buf)
    buf[:] = other
    second = ready.decode(memoryview(buf))
    assert first.request_ids == ("a", "b") and second.request_ids == ("x", "y")
    assert second == FULL.decode(bytes(buf))
