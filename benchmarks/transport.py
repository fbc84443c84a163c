"""Bitmask transport: one-way latency and bandwidth of five ways to ship a mask.

For each shape (``[64, 4748]`` and ``[256, 4748]`` int32 by default; 4748 =
ceil(151936 / 32), the Qwen2.5 lm_head) it measures, with a sender (this
process, or gloo rank 0) and a receiver in another process:

- ``shm_ring``: ``BitmaskChannel.publish`` (copy into the ring slot, one
  ``BitmaskReady`` over ipc) until ``BitmaskReceiver.receive`` returns the
  read-only view of the slot (no copy on the reader's side);
- ``pickled_zmq``: ``pickle.dumps`` of the array over a zmq ipc socket, then
  ``pickle.loads`` (the anchor: what pickling broadcast queues do);
- ``raw_zmq_ipc`` / ``raw_zmq_tcp``: the array's bytes as one zmq frame
  (``copy=False``), viewed with ``numpy.frombuffer``; tcp on 127.0.0.1 is
  the cross-node fallback path;
- ``gloo_broadcast``: ``torch.distributed.broadcast`` over gloo, 2 ranks on
  127.0.0.1;
- ``memcpy``: ``numpy.copyto`` in this process, the physical reference.

One-way latency is ``t_received - t_sent`` from ``time.perf_counter_ns``,
which is CLOCK_MONOTONIC on Linux and so comparable across processes of one
host. Before each timed send the sender waits, untimed, until the receiver
is idle again (the ring drained, a zmq ack, a gloo barrier), so no sample
includes queueing. Every figure is the median of ``--iters`` samples taken
in this run; GB/s is bytes / median one-way time.

Run it with ``gramcoord bench transport`` or
``python -c "from launch.bench import run_bench; ..."``; ``--iters N`` and
``--rows 64,256`` adjust it.
"""

from __future__ import annotations

import argparse
import base64
import os
import pickle
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # when run as a script (the receiver side)
    sys.path.insert(0, str(ROOT))

from gramcoord.launch.bench import BenchRecord, median_ms  # noqa: E402
from gramcoord.sync import BitmaskChannel, BitmaskReceiver, ChannelHandle, TransportConfig  # noqa: E402

WIDTH = 4748  # ceil(151936 / 32)
VOCAB = WIDTH * 32
CHILD_TIMEOUT_S = 300
METHODS = ("shm_ring", "pickled_zmq", "raw_zmq_ipc", "raw_zmq_tcp", "gloo_broadcast")


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


def _receive_zmq(endpoint: str, count: int, pickled: bool) -> list[int]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(endpoint)
    stamps = []
    for _ in range(count):
        if pickled:
            array = pickle.loads(sock.recv())
        else:
            frame = sock.recv(copy=False)
            array = np.frombuffer(frame.buffer, dtype=np.int32).reshape(-1, WIDTH)
        stamps.append(time.perf_counter_ns())
        assert array.shape[1] == WIDTH
        sock.send(b"")
    sock.close(linger=0)
    ctx.term()
    return stamps


def _gloo_rank(rank: int, port: int, rows: int, count: int) -> list[int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = (
        torch.from_numpy(_mask(rows))
        if rank == 0
        else torch.empty((rows, WIDTH), dtype=torch.int32)
    )
    stamps = []
    for _ in range(count):
        dist.barrier()
        if rank == 0:
            stamps.append(time.perf_counter_ns())
        dist.broadcast(tensor, src=0)
        if rank == 1:
            stamps.append(time.perf_counter_ns())
    dist.destroy_process_group()
    return stamps


def _child_main(argv: list[str]) -> None:
    role, *rest = argv
    if role == "ring":
        stamps = _receive_ring(rest[0], int(rest[1]))
    elif role in ("pickled", "raw"):
        stamps = _receive_zmq(rest[0], int(rest[1]), pickled=role == "pickled")
    else:
        stamps = _gloo_rank(int(rest[0]), int(rest[1]), int(rest[2]), int(rest[3]))
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


def _one_way_ms(sent: list[int], received: list[int], warmup: int) -> float:
    pairs = list(zip(sent, received))[warmup:]
    return statistics.median((r - s) / 1e6 for s, r in pairs)


def _shm_ring(array: np.ndarray, iters: int, warmup: int) -> float:
    count = iters + warmup
    config = TransportConfig(kind="shm", num_slots=2, timeout_s=60.0)
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
            sent.append(time.perf_counter_ns())
            channel.publish(step, array, order, drafts)
        return _one_way_ms(sent, _stamps(proc), warmup)


def _zmq(array: np.ndarray, iters: int, warmup: int, *, pickled: bool, tcp: bool) -> float:
    import zmq

    count = iters + warmup
    tmp = tempfile.mkdtemp(prefix="gramcoord-bench-")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    try:
        sock.bind("tcp://127.0.0.1:*" if tcp else f"ipc://{tmp}/s")
        proc = _spawn(
            "pickled" if pickled else "raw", sock.getsockopt_string(zmq.LAST_ENDPOINT), count
        )
        sent = []
        for i in range(count):
            if i:
                sock.recv()  # untimed: the receiver's ack
            sent.append(time.perf_counter_ns())
            if pickled:
                sock.send(pickle.dumps(array, protocol=pickle.HIGHEST_PROTOCOL))
            else:
                sock.send(array, copy=False)
        sock.recv()
        return _one_way_ms(sent, _stamps(proc), warmup)
    finally:
        sock.close(linger=0)
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)


def _gloo(array: np.ndarray, iters: int, warmup: int) -> float:
    count = iters + warmup
    with socket.socket() as probe:  # gloo needs the port up front
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [_spawn("gloo", rank, port, array.shape[0], count) for rank in (0, 1)]
    sent, received = (_stamps(p) for p in ranks)
    return _one_way_ms(sent, received, warmup)


def _measure(method: str, array: np.ndarray, iters: int, warmup: int) -> float:
    if method == "shm_ring":
        return _shm_ring(array, iters, warmup)
    if method == "gloo_broadcast":
        return _gloo(array, iters, warmup)
    return _zmq(array, iters, warmup, pickled=method == "pickled_zmq", tcp=method == "raw_zmq_tcp")


def run(args: list[str]) -> list[BenchRecord]:
    """Measure every method for every shape; return the comparison records."""
    parser = argparse.ArgumentParser(prog="gramcoord bench transport")
    parser.add_argument("--iters", type=int, default=200, help="timed samples per method")
    parser.add_argument("--warmup", type=int, default=20, help="untimed samples first")
    parser.add_argument("--rows", default="64,256", help="comma-separated row counts")
    opts = parser.parse_args(args)
    records = []
    for rows in (int(r) for r in opts.rows.split(",")):
        array = _mask(rows)
        shape = f"[{rows}x{WIDTH}]"
        dst = np.empty_like(array)
        memcpy = median_ms(partial(np.copyto, dst, array), repeat=opts.iters, warmup=opts.warmup)
        ms = {m: _measure(m, array, opts.iters, opts.warmup) for m in METHODS}
        gb = {m: _gbps(array.nbytes, t) for m, t in {**ms, "memcpy": memcpy}.items()}
        records.append(
            BenchRecord.compare(
                f"shm_ring{shape}",
                "pickled_zmq",
                ms["shm_ring"],
                ms["pickled_zmq"],
                target=5.0,
                note=f"one-way; shm {gb['shm_ring']:.2f} GB/s, pickled {gb['pickled_zmq']:.2f} GB/s",
            )
        )
        records.append(
            BenchRecord.compare(
                f"shm_ring_bandwidth{shape}",
                "memcpy",
                ms["shm_ring"],
                memcpy,
                target=0.5,
                note=(
                    f"ratio = memcpy ms / shm ms = shm GB/s / memcpy GB/s; >=0.5 means shm "
                    f"within 2x of memcpy; shm {gb['shm_ring']:.2f} GB/s, "
                    f"memcpy {gb['memcpy']:.2f} GB/s"
                ),
            )
        )
        for method in METHODS[1:]:
            records.append(
                BenchRecord.compare(
                    f"{method}{shape}",
                    "memcpy",
                    ms[method],
                    memcpy,
                    note=f"one-way; {gb[method]:.2f} GB/s (ratio = fraction of memcpy bandwidth)",
                )
            )
    return records


if __name__ == "__main__":
    _child_main(sys.argv[1:])
