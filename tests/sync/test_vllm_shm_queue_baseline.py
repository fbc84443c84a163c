"""The vLLM-style broadcast queue that ``bench transport`` measures as its baseline.

A baseline that loses or corrupts messages would flatter our ring, so this
checks it delivers what was sent: arrays in the stream, out of band in the
chunk (as views of shared memory), through the zmq overflow path, to several
readers, across many laps of a small ring, and with the writer blocked on a
full ring. Every wait has a deadline; the peers and run_id fixtures reap the
readers and the segment even when an assertion fails.
"""

from __future__ import annotations

import hashlib
import mmap
import traceback

import numpy as np
import pytest

from gramcoord.benchmarks.vllm_shm_queue import INLINE_BELOW, BroadcastQueue

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(120)]

WAIT_S = 30.0
WIDTH = 4748  # Qwen2.5's ceil(151936 / 32)


def _mask(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-(2**31), 2**31, size=(rows, WIDTH), dtype=np.int32)


def _digest(obj) -> tuple:
    """What the parent compares; for an array also whether it lives in the segment."""
    if isinstance(obj, np.ndarray):
        base = obj.base
        while isinstance(base, np.ndarray):  # reshape adds a view of the flat array
            base = base.base
        in_segment = isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)
        return (obj.shape, str(obj.dtype), hashlib.sha1(obj.tobytes()).hexdigest(), in_segment)
    if isinstance(obj, tuple):
        return tuple(_digest(x) for x in obj)
    return ("obj", repr(obj))


def _reader(handle, index: int, count: int, out) -> None:
    try:
        with BroadcastQueue.attach(handle, index) as queue:
            queue.wait_until_ready(WAIT_S)
            # Digest each message before the next dequeue: an array is a view
            # of its chunk, which the writer may reuse once it has been read.
            got = [_digest(queue.dequeue(timeout=WAIT_S)) for _ in range(count)]
        out.put((index, "ok", got))
    except BaseException as exc:
        out.put((index, type(exc).__name__, traceback.format_exc()))


def _expected(obj, *, chunk: bool) -> tuple:
    """The reader's digest of ``obj``; ``chunk``: an array this large is a view of the chunk."""
    if isinstance(obj, np.ndarray):
        digest = hashlib.sha1(obj.tobytes()).hexdigest()
        return (obj.shape, str(obj.dtype), digest, chunk and obj.nbytes >= INLINE_BELOW)
    if isinstance(obj, tuple):
        return tuple(_expected(x, chunk=chunk) for x in obj)
    return ("obj", repr(obj))


def _send(peers, run_id, messages, *, readers=1, paced=True, **sizes) -> list[list[tuple]]:
    """Send ``messages`` to ``readers`` spawned readers; return each one's digests."""
    with BroadcastQueue.create(run_id=run_id, num_readers=readers, **sizes) as queue:
        out = peers.queue()
        for i in range(readers):
            peers.start(_reader, queue.handle, i, len(messages), out)
        queue.wait_until_ready(WAIT_S)
        for obj in messages:
            if paced:
                queue.wait_read(WAIT_S)
            queue.enqueue(obj, timeout=WAIT_S)
        reports = peers.results(out, readers, timeout=WAIT_S * 2)
    for index, outcome, payload in reports.values():
        assert outcome == "ok", f"reader {index}: {payload}"
    return [reports[i][2] for i in range(readers)]


@pytest.mark.parametrize(
    ("messages", "sizes", "readers", "chunk"),
    [
        pytest.param(
            [_mask(4, 1), _mask(64, 2), {"step": 3}, (7, _mask(256, 4))],
            dict(chunk_bytes=8 << 20, num_chunks=3),
            1,
            True,
            id="stream-and-out-of-band",
        ),
        pytest.param(
            [_mask(256, 5), "small", _mask(64, 6)],
            dict(chunk_bytes=1 << 20, num_chunks=2),
            1,
            False,
            id="overflow-to-zmq",
        ),
        pytest.param(
            [_mask(64, 10 + i) for i in range(12)],
            dict(chunk_bytes=2 << 20, num_chunks=2),
            2,
            True,
            id="two-readers-six-laps",
        ),
    ],
)
def test_readers_get_what_was_sent(peers, run_id, messages, sizes, readers, chunk):
    got = _send(peers, run_id, messages, readers=readers, **sizes)
    want = [_expected(m, chunk=chunk) for m in messages]
    assert got == [want] * readers


def test_writer_blocks_on_a_full_ring_and_loses_nothing(peers, run_id):
    # Unpaced: with two chunks the writer waits for the reader every message.
    messages = [{"step": i, "ids": list(range(i % 7))} for i in range(200)]
    (got,) = _send(peers, run_id, messages, paced=False, chunk_bytes=4096, num_chunks=2)
    assert got == [_expected(m, chunk=True) for m in messages]


def test_waits_end_at_their_deadline(run_id):
    sizes = dict(num_readers=1, chunk_bytes=4096, num_chunks=1)
    with (
        BroadcastQueue.create(run_id=run_id, **sizes) as q,
        BroadcastQueue.attach(q.handle, 0) as reader,
    ):
        with pytest.raises(TimeoutError, match="no message"):
            reader.dequeue(timeout=0.05)
        q.enqueue("first")
        with pytest.raises(TimeoutError, match="no free chunk"):
            q.enqueue("second", timeout=0.05)
        assert reader.dequeue(timeout=1.0) == "first"
        q.enqueue("second", timeout=1.0)
        assert reader.dequeue(timeout=1.0) == "second"


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(num_readers=0), id="no-readers"),
        pytest.param(dict(num_readers=1, chunk_bytes=8), id="tiny-chunk"),
        pytest.param(dict(num_readers=1, num_chunks=0), id="no-chunks"),
    ],
)
def test_bad_sizes_are_refused(run_id, kwargs):
    with pytest.raises(ValueError, match="need num_readers"):
        BroadcastQueue.create(run_id=run_id, **kwargs)
