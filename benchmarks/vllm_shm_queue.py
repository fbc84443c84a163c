"""vLLM's shared-memory broadcast queue, rebuilt here as a benchmark baseline.

vLLM cannot be installed on these machines, so ``benchmarks/transport.py``
measures this stand-in for the path vLLM's multiprocess executor uses to
send every RPC, the grammar bitmask included, from the engine to its TP
workers: ``MessageQueue`` in
``vllm/distributed/device_communicators/shm_broadcast.py``. It is written
from reading that file, not copied, and keeps everything that costs time on
the way:

- one segment of ``num_chunks`` chunks of ``chunk_bytes``, then one metadata
  line per chunk: a written flag and one read flag per reader (one byte
  each). The writer may reuse a chunk once every reader set its flag;
- the writer pickles with protocol 5 and a ``buffer_callback`` that keeps
  buffers under 1 MiB in the stream and sends larger ones (a bitmask of 64
  rows or more) out of band; the chunk holds an overflow byte, a 2-byte
  buffer count and each buffer behind its 4-byte big-endian length;
- a message that does not fit its chunk is marked as overflow in the chunk
  and sent as zmq multipart frames (``copy=False``) on an XPUB socket;
- after each write the writer pings a PUB socket; a reader spins on its
  chunk's flags with ``os.sched_yield`` for up to 1 s after its last read and
  only then sleeps on that socket (CONFLATE SUB) until the ping;
- a lock taken and dropped as a memory fence around every flag access;
- the reader unpickles with ``buffers=`` slices of the chunk, so a numpy
  array comes back as a view of shared memory with no copy, valid until the
  writer laps the ring.

Defaults are the ones vLLM's executor uses: ``VLLM_MQ_MAX_CHUNK_BYTES_MB``
= 16 MiB per chunk and 10 chunks, so masks up to 16 MiB (about 880 rows of
Qwen2.5's 4748 words) never overflow. Left out, because they cost nothing
per message: the warning logs, the reader's in-process cancel socket, remote
(tcp) readers, and torch's tensor reducer (masks are numpy here, as in
vLLM's ``GrammarOutput``).

One addition for the benchmark, not in vLLM: :meth:`BroadcastQueue.wait_read`
lets the writer wait, untimed, until every reader is idle.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
import time
from typing import Any

import msgspec
import zmq

from gramcoord.sync.janitor import PREFIX, janitor
from gramcoord.sync.segment import Segment, segment_name

__all__ = ["CHUNK_BYTES", "INLINE_BELOW", "NUM_CHUNKS", "BroadcastQueue", "QueueHandle"]

# vLLM's executor: VLLM_MQ_MAX_CHUNK_BYTES_MB (16) MiB chunks, 10 of them.
CHUNK_BYTES = 16 * 1024 * 1024
NUM_CHUNKS = 10
# Pickle buffers smaller than this stay in the pickle stream.
INLINE_BELOW = 1024 * 1024
# Seconds a reader busy-polls after its last read before it sleeps on zmq.
BUSY_LOOP_S = 1.0
# The header: overflow byte, then a 2-byte buffer count.
_HEAD = 3
_LEN = 4

_fence_lock = threading.Lock()


def _fence() -> None:
    # vLLM's memory barrier: a lock round trip orders the flag accesses.
    with _fence_lock:
        pass


class QueueHandle(msgspec.Struct, frozen=True, kw_only=True):
    """What a reader needs to attach; msgspec-encodable."""

    # Shared-memory segment name.
    segment: str
    # Readers the writer waits for.
    num_readers: int
    # Bytes per chunk; a message this large or larger overflows to zmq.
    chunk_bytes: int
    # Chunks in the ring.
    num_chunks: int
    # XPUB endpoint: readiness handshake and overflowing messages.
    overflow_endpoint: str
    # PUB endpoint: the writer's ping after each message.
    notify_endpoint: str


class BroadcastQueue:
    """One writer, ``num_readers`` local readers; build with :meth:`create` / :meth:`attach`."""

    def __init__(
        self,
        handle: QueueHandle,
        segment: Segment,
        *,
        reader: int | None,
        ctx: zmq.Context,
        data: zmq.Socket,
        notify: zmq.Socket,
        ipc_dir: str | None = None,
    ) -> None:
        self.handle = handle
        self._segment = segment
        self._reader = reader
        self._ctx, self._data, self._notify = ctx, data, notify
        self._dir = ipc_dir
        self._idx = 0
        self._last_read = time.monotonic()
        buf = memoryview(segment.buf)
        meta_at = handle.chunk_bytes * handle.num_chunks
        line = 1 + handle.num_readers
        self._chunks = [
            buf[i * handle.chunk_bytes : (i + 1) * handle.chunk_bytes]
            for i in range(handle.num_chunks)
        ]
        self._meta = [
            buf[meta_at + i * line : meta_at + (i + 1) * line] for i in range(handle.num_chunks)
        ]
        self._views = [buf, *self._chunks, *self._meta]

    @classmethod
    def create(
        cls,
        *,
        run_id: str,
        num_readers: int,
        chunk_bytes: int = CHUNK_BYTES,
        num_chunks: int = NUM_CHUNKS,
    ) -> BroadcastQueue:
        """The writer's queue; it owns the segment and the ipc directory."""
        if num_readers < 1 or chunk_bytes < 16 or num_chunks < 1:
            raise ValueError(
                f"need num_readers >= 1, chunk_bytes >= 16, num_chunks >= 1; got "
                f"{num_readers}, {chunk_bytes}, {num_chunks}"
            )
        size = (chunk_bytes + 1 + num_readers) * num_chunks
        segment = Segment.create(segment_name(run_id, "vllmq"), size)
        path = tempfile.mkdtemp(prefix=f"{PREFIX}-{run_id}-", dir="/tmp")
        janitor().own("dir", path)
        handle = QueueHandle(
            segment=segment.name,
            num_readers=num_readers,
            chunk_bytes=chunk_bytes,
            num_chunks=num_chunks,
            overflow_endpoint=f"ipc://{path}/data",
            notify_endpoint=f"ipc://{path}/notify",
        )
        ctx = zmq.Context()
        data, notify = ctx.socket(zmq.XPUB), ctx.socket(zmq.PUB)
        queue = cls(handle, segment, reader=None, ctx=ctx, data=data, notify=notify, ipc_dir=path)
        try:
            data.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per reader
            data.bind(handle.overflow_endpoint)
            notify.setsockopt(zmq.SNDHWM, 1)  # pings beyond one are dropped
            notify.bind(handle.notify_endpoint)
        except BaseException:
            queue.close()
            raise
        return queue

    @classmethod
    def attach(cls, handle: QueueHandle, reader: int) -> BroadcastQueue:
        """Reader ``reader`` (0-based) of the queue ``handle`` describes."""
        if not 0 <= reader < handle.num_readers:
            raise ValueError(f"reader must be in [0, {handle.num_readers}), got {reader}")
        segment = Segment.attach(handle.segment)
        ctx = zmq.Context()
        data, notify = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
        queue = cls(handle, segment, reader=reader, ctx=ctx, data=data, notify=notify)
        try:
            data.setsockopt_string(zmq.SUBSCRIBE, "")
            data.connect(handle.overflow_endpoint)
            notify.setsockopt(zmq.CONFLATE, 1)  # only the newest ping matters
            notify.setsockopt_string(zmq.SUBSCRIBE, "")
            notify.connect(handle.notify_endpoint)
        except BaseException:
            queue.close()
            raise
        return queue

    def wait_until_ready(self, timeout: float) -> None:
        """Collective: the writer waits for every reader's subscription, then says READY."""
        ms = int(timeout * 1000)
        if self._reader is None:
            for _ in range(self.handle.num_readers):
                if not self._data.poll(ms):
                    raise TimeoutError("a reader did not subscribe in time")
                self._data.recv()
            self._data.send(b"READY")
        else:
            if not self._data.poll(ms):
                raise TimeoutError("the writer did not say READY in time")
            if self._data.recv() != b"READY":
                raise RuntimeError("unexpected first message on the queue")
            self._last_read = time.monotonic()

    # Writer ------------------------------------------------------------

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Pickle ``obj`` (large buffers out of band) into the next chunk, or overflow."""
        buffers: list[Any] = [b""]
        size = _HEAD + _LEN

        def out_of_band(pb: pickle.PickleBuffer) -> bool:
            nonlocal size
            raw = pb.raw()
            if len(raw) < INLINE_BELOW:
                return True  # stays in the stream
            buffers.append(raw)
            size += _LEN + len(raw)
            return False

        buffers[0] = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
        if size + len(buffers[0]) >= self.handle.chunk_bytes:
            chunk, meta = self._acquire_write(timeout)
            chunk[0] = 1
            self._publish(meta)
            self._data.send_multipart(buffers, copy=False)
        else:
            chunk, meta = self._acquire_write(timeout)
            chunk[0] = 0
            chunk[1:_HEAD] = len(buffers).to_bytes(2, "big")
            at = _HEAD
            for b in buffers:
                n = len(b)
                chunk[at : at + _LEN] = n.to_bytes(_LEN, "big")
                chunk[at + _LEN : at + _LEN + n] = b
                at += _LEN + n
            self._publish(meta)
        self._notify.send(b"\x00")

    def wait_read(self, timeout: float) -> None:
        """Benchmark helper (not vLLM's): wait until every reader read every message."""
        meta = self._meta[(self._idx - 1) % self.handle.num_chunks]
        deadline = time.monotonic() + timeout
        while True:
            _fence()
            if not meta[0] or sum(meta[1:]) == self.handle.num_readers:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("readers did not read the last message in time")
            os.sched_yield()

    def _acquire_write(self, timeout: float | None) -> tuple[memoryview, memoryview]:
        meta = self._meta[self._idx]
        start = time.monotonic()
        while True:
            _fence()
            if not meta[0] or sum(meta[1:]) == self.handle.num_readers:
                break
            os.sched_yield()
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError("no free chunk: a reader is behind")
        meta[0] = 0  # not written: readers keep off while it is filled
        return self._chunks[self._idx], meta

    def _publish(self, meta: memoryview) -> None:
        # Clear the read flags before setting the written flag, so that no
        # reader sees "written and already read" in between.
        for i in range(1, len(meta)):
            meta[i] = 0
        _fence()
        meta[0] = 1
        _fence()
        self._idx = (self._idx + 1) % self.handle.num_chunks

    # Reader ------------------------------------------------------------

    def dequeue(self, timeout: float | None = None) -> Any:
        """The next message; numpy arrays in it are views of the chunk (no copy)."""
        assert self._reader is not None, "only readers dequeue"
        meta = self._meta[self._idx]
        flag = 1 + self._reader
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            _fence()
            if meta[0] and not meta[flag]:
                break
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TimeoutError("no message in time")
            if now <= self._last_read + BUSY_LOOP_S:
                os.sched_yield()
            elif self._notify.poll(self._poll_ms(deadline)):
                self._notify.recv(zmq.NOBLOCK, copy=False)
        chunk = self._chunks[self._idx]
        try:
            overflow = chunk[0] == 1
            if not overflow:
                count = int.from_bytes(chunk[1:_HEAD], "big")
                parts, at = [], _HEAD
                for _ in range(count):
                    n = int.from_bytes(chunk[at : at + _LEN], "big")
                    parts.append(chunk[at + _LEN : at + _LEN + n])
                    at += _LEN + n
                obj = pickle.loads(parts[0], buffers=parts[1:])
        finally:
            meta[flag] = 1
            _fence()
            self._idx = (self._idx + 1) % self.handle.num_chunks
            self._last_read = time.monotonic()
        if overflow:
            if not self._data.poll(self._poll_ms(deadline)):
                raise TimeoutError("overflow message did not arrive in time")
            first, *rest = self._data.recv_multipart(copy=False)
            obj = pickle.loads(first, buffers=rest)
        return obj

    @staticmethod
    def _poll_ms(deadline: float | None) -> int | None:
        if deadline is None:
            return None
        return max(0, int((deadline - time.monotonic()) * 1000))

    # Both --------------------------------------------------------------

    def close(self) -> None:
        """Close the sockets and the mapping; the writer also removes segment and directory."""
        for sock in (self._data, self._notify):
            sock.close(linger=0)
        self._ctx.term()
        for view in self._views:
            view.release()
        self._segment.close()
        if self._segment.owner:
            self._segment.unlink()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            janitor().disown("dir", self._dir)
            self._dir = None

    def __enter__(self) -> BroadcastQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
