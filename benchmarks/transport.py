"""Bitmask transport: one-way latency and bandwidth of our ring and its baselines.

For each shape (``[64, 4748]`` and ``[256, 4748]`` int32 by default; 4748 =
ceil(151936 / 32), the Qwen2.5 lm_head) it measures, with a sender (this
process) and a receiver in another process:

- ``shm_ring``: ``BitmaskChannel.publish`` (copy into the ring slot, one
  ``BitmaskReady`` over ipc) until ``BitmaskReceiver.receive`` returns the
  read-only view of the slot (no copy on the reader's side). Default
  ``TransportConfig`` (4 slots, 1 ms reader spin); it also carries the
  request ids and draft counts, which no baseline below does;
- ``shm_ring_inplace``: the same, but the rows are already in the slot
  (gramcoord's step loop builds the mask there: ``SessionMasks.bitmask``
  fills ``BitmaskChannel.acquire``'s view), so ``publish`` only announces
  them. This is the row held to the 2x target; the copy path above is what
  an engine that publishes its own array gets;
- ``vllm_shm_broadcast``: the target baseline, vLLM's own path from engine
  to TP workers, run from vLLM itself: ``MessageQueue.enqueue``
  (``vllm.distributed.device_communicators.shm_broadcast``) of the bare
  array (pickle protocol 5, the buffer out of band into a shared-memory
  chunk; 10 chunks of ``VLLM_MQ_MAX_CHUNK_BYTES_MB``, as vLLM's executor
  builds it; flags polled by the reader, a zmq ping) until ``dequeue``
  returns the array (vLLM 0.32 copies an out-of-band buffer out of the
  chunk). Needs vLLM (``.venv-vllm``); without it these rows are skipped,
  each saying so;
- ``pickled_zmq``: ``pickle.dumps`` of the array, in band, over a zmq ipc
  socket, then ``pickle.loads`` (what a plain pickling queue does);
- ``memcpy``: ``numpy.copyto`` in this process, the physical reference.

One-way latency is ``t_received - t_sent`` from ``time.perf_counter_ns``,
which is CLOCK_MONOTONIC on Linux and so comparable across processes of one
host. Before each timed send the sender waits, untimed, until the receiver
is idle again (the ring drained; for the others the receiver's zmq ack,
sent after its timestamp), so no sample includes queueing. Each method takes its
samples in ``--rounds`` rounds, the methods in turn within a round, so that
load changes on a shared machine hit all of them alike; every figure is the
median of the ``--iters`` samples pooled over the rounds, all taken in this
run. GB/s is bytes / median one-way time.

Run it with ``gramcoord bench transport`` (about 30 s on 2 idle cores);
``--iters N`` (default 200), ``--rounds N`` (3), ``--warmup N`` (20 per
round) and ``--rows 64,256`` adjust it.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.util
import os
import pickle
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

import msgspec
import numpy as np
import zmq

from gramcoord.benchmarks._contract import BenchRecord
from gramcoord.benchmarks._vllm_common import vllm_queue
from gramcoord.sync import BitmaskChannel, BitmaskReceiver, ChannelHandle, TransportConfig

WIDTH = 4748  # ceil(151936 / 32)
VOCAB = WIDTH * 32
CHILD_TIMEOUT_S = 300
METHODS = ("shm_ring", "shm_ring_inplace", "vllm_shm_broadcast", "pickled_zmq")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# What each baseline row asks of the ring (None: reported only).
TARGETS = {"vllm_shm_broadcast": 2.0, "pickled_zmq": 5.0}


def _mask(rows: int) -> np.ndarray:
    info = np.iinfo(np.int32)
    rng = np.random.default_rng(rows)
    return rng.integers(info.min, info.max, size=(rows, WIDTH), dtype=np.int32, endpoint=True)


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


# Receiver side (run as a child process) ---------------------------------


def _receive_ring(handle_b64: str, count: int) -> list[int]:
    handle = msgspec.msgpack.decode(base64.b64decode(handle_b64), type=ChannelHandle)
    stamps = []
    with BitmaskReceiver.connect(handle, "bench", vocab_size=VOCAB) as rx:
        for step in range(count):
            view, _, _ = rx.receive(step)
            stamps.append(time.perf_counter_ns())
            assert view.shape[1] == WIDTH
            rx.release(step)
    return stamps


def _receive(endpoint: str, count: int, get, ready=lambda: None) -> list[int]:
    """``get(sock)`` ``count`` times, each stamped, then acked on the PAIR socket
    ``endpoint``; a first ack says this receiver is there, then ``ready()`` runs."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(endpoint)
    sock.send(b"")
    ready()
    stamps = []
    for _ in range(count):
        array = get(sock)
        stamps.append(time.perf_counter_ns())
        assert array.shape[1] == WIDTH
        sock.send(b"")
    sock.close(linger=10_000)  # the last ack goes out before this process ends
    ctx.term()
    return stamps


def _child_main(argv: list[str]) -> None:
    role, *rest = argv
    if role == "ring":
        stamps = _receive_ring(rest[0], int(rest[1]))
    elif role == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        queue = MessageQueue.create_from_handle(pickle.loads(base64.b64decode(rest[2])), 0)

        def get(_sock) -> np.ndarray:
            return queue.dequeue(timeout=CHILD_TIMEOUT_S)

        stamps = _receive(rest[0], int(rest[1]), get, queue.wait_until_ready)
    else:
        stamps = _receive(rest[0], int(rest[1]), lambda sock: pickle.loads(sock.recv()))
    sys.stdout.write(msgspec.json.encode(stamps).decode() + "\n")


# Sender side --------------------------------------------------------------


def _spawn(*args: object) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, __file__, *map(str, args)], stdout=subprocess.PIPE, env=env
    )


def _stamps(proc: subprocess.Popen[bytes]) -> list[int]:
    out, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark receiver {proc.args[2:4]} failed with {proc.returncode}")
    return msgspec.json.decode(out.splitlines()[-1], type=list[int])


def _one_way_ms(sent: list[int], received: list[int], warmup: int) -> list[float]:
    """One-way samples in ms, the first ``warmup`` left out."""
    return [(r - s) / 1e6 for s, r in list(zip(sent, received))[warmup:]]


def _shm_ring(array: np.ndarray, iters: int, warmup: int, *, inplace: bool = False) -> list[float]:
    count = iters + warmup
    config = TransportConfig(kind="shm", timeout_s=60.0)
    with BitmaskChannel(
        readers=["bench"],
        vocab_size=VOCAB,
        max_rows=array.shape[0],
        config=config,
        run_id=f"bench{secrets.token_hex(3)}",
    ) as channel:
        handle = base64.b64encode(msgspec.msgpack.encode(channel.handle)).decode()
        proc = _spawn("ring", handle, count)
        channel.accept()
        order = [f"req-{i}" for i in range(array.shape[0])]
        drafts = [0] * array.shape[0]
        sent = []
        for step in range(count):
            channel.drain()  # untimed: the reader is idle again
            rows = array
            if inplace:
                # Untimed: gramcoord's builder fills the mask into the slot
                # (SessionMasks.bitmask); this copy stands in for that fill.
                rows = channel.acquire(array.shape[0])
                rows[:] = array
            sent.append(time.perf_counter_ns())
            channel.publish(step, rows, order, drafts)
        return _one_way_ms(sent, _stamps(proc), warmup)


@contextlib.contextmanager
def _acked():
    """A bound PAIR socket for the receiver's acks, and its endpoint."""
    tmp = tempfile.mkdtemp(prefix="gramcoord-bench-")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    try:
        sock.bind(f"ipc://{tmp}/s")
        yield sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        sock.close(linger=0)
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)


def _ack(sock) -> None:
    if not sock.poll(CHILD_TIMEOUT_S * 1000):
        raise TimeoutError("the benchmark receiver did not answer in time")
    sock.recv()


def _sends(sock, proc, send, count: int, warmup: int) -> list[float]:
    """``send()`` ``count`` times, each after the receiver's ack of the one before
    (untimed: it is idle again); the one-way samples."""
    sent = []
    for i in range(count):
        if i:
            _ack(sock)
        sent.append(time.perf_counter_ns())
        send()
    _ack(sock)
    return _one_way_ms(sent, _stamps(proc), warmup)


def _vllm(array: np.ndarray, iters: int, warmup: int) -> list[float]:
    with _acked() as (sock, endpoint), vllm_queue(1) as queue:
        handle = base64.b64encode(pickle.dumps(queue.export_handle())).decode()
        proc = _spawn("vllm", endpoint, iters + warmup, handle)
        _ack(sock)  # attached: its subscription is on the way
        queue.wait_until_ready()
        return _sends(sock, proc, partial(queue.enqueue, array), iters + warmup, warmup)


def _pickled_zmq(array: np.ndarray, iters: int, warmup: int) -> list[float]:
    with _acked() as (sock, endpoint):
        proc = _spawn("pickled", endpoint, iters + warmup)
        _ack(sock)  # attached

        def send() -> None:
            sock.send(pickle.dumps(array, protocol=pickle.HIGHEST_PROTOCOL))

        return _sends(sock, proc, send, iters + warmup, warmup)


def _memcpy(array: np.ndarray, dst: np.ndarray, iters: int, warmup: int) -> list[float]:
    """``numpy.copyto`` in this process: the physical reference, in ms per copy."""
    for _ in range(warmup):
        np.copyto(dst, array)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        np.copyto(dst, array)
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def _measure(method: str, array: np.ndarray, iters: int, warmup: int) -> list[float]:
    if method == "shm_ring":
        return _shm_ring(array, iters, warmup)
    if method == "shm_ring_inplace":
        return _shm_ring(array, iters, warmup, inplace=True)
    if method == "vllm_shm_broadcast":
        return _vllm(array, iters, warmup)
    return _pickled_zmq(array, iters, warmup)


def run(args: list[str]) -> list[BenchRecord]:
    """Measure every method for every shape; return the comparison records."""
    parser = argparse.ArgumentParser(prog="gramcoord bench transport")
    parser.add_argument("--iters", type=int, default=200, help="timed samples per method")
    parser.add_argument("--warmup", type=int, default=20, help="untimed samples per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per shape")
    parser.add_argument("--rows", default="64,256", help="comma-separated row counts")
    opts = parser.parse_args(args)
    if min(opts.iters, opts.rounds) < 1 or opts.warmup < 0:
        parser.error("--iters and --rounds must be >= 1, --warmup >= 0")
    per_round = -(-opts.iters // opts.rounds)
    methods = [m for m in METHODS if HAS_VLLM or m != "vllm_shm_broadcast"]
    records = []
    for rows in (int(r) for r in opts.rows.split(",")):
        array = _mask(rows)
        shape = f"[{rows}x{WIDTH}]"
        dst = np.empty_like(array)
        # Every method takes its samples in each of several rounds, in turn,
        # so a load change on the shared machine hits all of them alike.
        samples: dict[str, list[float]] = {m: [] for m in ("memcpy", *methods)}
        for _ in range(opts.rounds):
            samples["memcpy"] += _memcpy(array, dst, per_round, opts.warmup)
            for m in methods:
                samples[m] += _measure(m, array, per_round, opts.warmup)
        ms = {m: statistics.median(v) for m, v in samples.items()}
        gb = {m: _gbps(array.nbytes, t) for m, t in ms.items()}
        ours = ms["shm_ring"]
        # (record, baseline, ours' method, target, note)
        pairs = [
            (
                "shm_ring_inplace",
                "vllm_shm_broadcast",
                "shm_ring_inplace",
                TARGETS["vllm_shm_broadcast"],
                "gramcoord's own path: the mask was filled into the ring slot, publish "
                "only announces it; vLLM must pickle and copy the finished mask",
            )
        ]
        for method in METHODS[2:]:
            name = "shm_ring" if method == "vllm_shm_broadcast" else f"shm_ring_vs_{method}"
            note = f"one-way, publish copies the rows in; shm {gb['shm_ring']:.2f} GB/s"
            if method in gb:
                note += f", {method} {gb[method]:.2f} GB/s"
            # The copy path's target against vLLM is the in-place row's.
            target = None if method == "vllm_shm_broadcast" else TARGETS.get(method)
            pairs.append((name, method, "shm_ring", target, note))
        for name, base, mine, target, note in pairs:
            if base not in ms:
                records.append(BenchRecord.needs_vllm(name + shape, base, "transport", target))
                continue
            records.append(
                BenchRecord.compare(name + shape, base, ms[mine], ms[base], target, note)
            )
        records.append(
            BenchRecord.compare(
                f"shm_ring_bandwidth{shape}",
                "memcpy",
                ours,
                ms["memcpy"],
                target=0.5,
                note=(
                    f"ratio = memcpy ms / shm ms = shm GB/s / memcpy GB/s; >=0.5 means shm "
                    f"within 2x of memcpy; shm {gb['shm_ring']:.2f} GB/s, "
                    f"memcpy {gb['memcpy']:.2f} GB/s"
                ),
            )
        )
    return records


if __name__ == "__main__":
    _child_main(sys.argv[1:])
