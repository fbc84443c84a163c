"""Multi-process transport tests: a writer and spawned readers, with deadlines.

Every test bounds its waits (the peers fixture, the transport timeouts), and
the peers and run_id fixtures kill every child and remove every segment even
when an assertion fails.
"""

from __future__ import annotations

import os
import signal
import time

import msgspec
import numpy as np
import pytest

from gramcoord.sync import (
    BitmaskChannel,
    BitmaskFrame,
    BitmaskReady,
    Hello,
    PeerGone,
    Release,
    TransportConfig,
    TransportTimeout,
    Welcome,
)
from tests.load import scaled
from tests.sync.transport_peers import (
    MAX_ROWS,
    VOCAB,
    expected_digests,
    ipc_dirs,
    mask_for,
    reader_main,
    shm_names,
    wait_until,
    writer_main,
)

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(120)]


def channel(names, run_id, **config) -> BitmaskChannel:
    settings = {"num_slots": 2, "timeout_s": 30.0, "handshake_timeout_s": 60.0, **config}
    return BitmaskChannel(
        readers=names,
        vocab_size=VOCAB,
        max_rows=MAX_ROWS,
        config=TransportConfig(**settings),
        run_id=run_id,
    )


@pytest.mark.parametrize(
    ("names", "remote", "kind", "steps"),
    [
        pytest.param(["tp1"], (), "auto", 1000, id="1-reader-shm"),
        pytest.param(["tp1", "tp2", "tp3"], (), "auto", 1000, id="3-readers-shm"),
        pytest.param(["tp1"], (), "tcp", 1000, id="tcp-loopback"),
        pytest.param(["tp1", "tp2", "far"], ("far",), "auto", 300, id="auto-shm-and-remote"),
    ],
)
def test_readers_get_bit_identical_rows(peers, run_id, names, remote, kind, steps):
    # Two slots keep the ring tight, so slots are reused constantly; each
    # reader digests every view twice, before and after a random pause just
    # before releasing it, so an early overwrite would change a digest.
    with channel(names, run_id, kind=kind) as ch:
        if kind == "tcp":
            assert ch.handle.tcp_endpoint.startswith("tcp://127.0.0.1:")
        out = peers.queue()
        for i, name in enumerate(names):
            host = f"{name}-node" if name in remote else None
            peers.start(
                reader_main, ch.handle, name, list(range(steps)), out, hostname=host, recheck_seed=i
            )
        modes = ch.accept()
        for step in range(steps):
            ch.publish(step, *mask_for(step))
        ch.drain()
        results = peers.results(out, len(names))
        for proc in peers.started:
            proc.join(30)
            assert proc.exitcode == 0
        # Readers attach and close; only the creator unlinks.
        assert shm_names(run_id) == [ch.handle.ring.name]
    assert shm_names(run_id) == []
    want = expected_digests(range(steps))
    for name in names:
        _, outcome, got, dropped, mode = results[name]
        assert outcome == "ok", results[name]
        assert got == want, f"{name} got different bytes"
        assert dropped == 0
        assert mode == modes[name] == ("tcp" if kind == "tcp" or name in remote else "shm")


def test_slow_reader_times_out_the_writer_naming_it(peers, run_id):
    with channel(["fast", "slow"], run_id, timeout_s=1.0) as ch:
        out, stop = peers.queue(), peers.event()
        peers.start(reader_main, ch.handle, "fast", [0, 1, 2], out)
        peers.start(reader_main, ch.handle, "slow", [0, 1], out, hold_after=1, stop=stop)
        ch.accept()
        ch.publish(0, *mask_for(0))
        ch.publish(1, *mask_for(1))
        assert peers.results(out, 1)["slow"][1] == "holding"  # slow holds step 0
        wait_until(lambda: ch.ring.released()["fast"] == 1, 30, "fast to release step 1")
        with pytest.raises(TransportTimeout) as info:
            ch.publish(2, *mask_for(2))  # needs slot 0, which slow still holds
        stop.set()
    assert info.value.peers == ("slow",)
    assert "'slow'" in str(info.value) and "'fast'" not in str(info.value)


@pytest.mark.parametrize(
    ("kind", "host", "timeout", "error"),
    [
        # Local readers: the writer sees the dead pid long before the timeout.
        pytest.param("auto", None, 5.0, PeerGone, id="shm"),
        pytest.param("tcp", None, 5.0, PeerGone, id="tcp"),
        # A reader on "another host": no pid to check, so the deadline (or
        # zmq noticing the dropped connection) is what ends the wait.
        pytest.param("auto", "far-node", 2.0, (PeerGone, TransportTimeout), id="remote"),
    ],
)
def test_killed_reader_fails_the_writer_within_the_timeout(
    peers, run_id, kind, host, timeout, error
):
    with channel(["victim"], run_id, kind=kind, timeout_s=timeout) as ch:
        out = peers.queue()
        steps = list(range(100))
        victim = peers.start(
            reader_main, ch.handle, "victim", steps, out, hostname=host, die_after=3
        )
        ch.accept()
        with pytest.raises(error) as info:
            for step in steps:
                start = time.monotonic()
                ch.publish(step, *mask_for(step))
        waited = time.monotonic() - start
        victim.join(10)
    assert victim.exitcode == -signal.SIGKILL
    assert info.value.peers == ("victim",) and "'victim'" in str(info.value)
    assert waited < timeout + 5, (
        "the writer hung past its timeout"
    )  # a hang bound, not a speed claim


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_writer_fails_readers_and_leaves_no_segment(peers, run_id, how):
    config = TransportConfig(num_slots=2, timeout_s=30.0)
    writer_out, reader_out, go = peers.queue(), peers.queue(), peers.event()
    writer = peers.start(
        writer_main, ["tp1", "far"], run_id, writer_out, go, steps=5, config=config
    )
    handle = writer_out.get(timeout=scaled(60))[2]
    for name, host in (("tp1", None), ("far", "far-node")):
        peers.start(reader_main, handle, name, list(range(10)), reader_out, hostname=host)
    assert writer_out.get(timeout=scaled(60))[1] == "published"
    assert shm_names(run_id) == [handle.ring.name]
    assert os.stat(f"/dev/shm/{handle.ring.name}").st_mode & 0o777 == 0o600
    os.kill(writer.pid, how)
    reports = peers.results(reader_out, 2)
    writer.join(10)
    assert writer.exitcode == -how
    for name in ("tp1", "far"):
        # WriterLost, not TransportTimeout: the readers noticed, well within 30 s.
        assert reports[name][1] == "WriterLost", reports[name]
        assert "after 5 steps" in reports[name][2]
    wait_until(lambda: not shm_names(run_id) and not ipc_dirs(run_id), 15, "the reaper")


def _garbage(
    rng: np.random.Generator, step: int, slot_rows: dict[int, tuple[int, int]]
) -> list[bytes]:
    """One control message that a correct reader must drop (never raise on)."""
    enc = msgspec.msgpack.Encoder()
    far = int(rng.integers(10**6, 10**9))
    templates = [
        enc.encode(BitmaskReady(far, 0, 1, ("x",), (0,))),
        enc.encode(BitmaskFrame(far, 1, 32, ("x",), (0,))),
        enc.encode(Welcome(1, VOCAB, 0, "shm")),
        enc.encode(Release("tp1", far)),
        enc.encode(Hello(1, VOCAB, "tp1", "h", 1)),
    ]
    kind = int(rng.integers(0, 8))
    if kind == 0:
        return [rng.bytes(int(rng.integers(0, 65)))]
    if kind == 1:
        t = templates[int(rng.integers(len(templates)))]
        return [t[: int(rng.integers(0, len(t)))]]
    if kind == 2:
        t = bytearray(templates[int(rng.integers(len(templates)))])
        for _ in range(int(rng.integers(1, 4))):
            t[int(rng.integers(len(t)))] ^= 1 << int(rng.integers(8))
        return [bytes(t)]
    if kind == 3:
        value = [str(rng.bytes(3)), int(rng.integers(-5, 5)), [1.5, None], {"k": "v"}]
        return [enc.encode(value[: int(rng.integers(1, 5))])]
    if kind == 4:
        return [rng.bytes(int(rng.integers(0, 16))) for _ in range(int(rng.integers(2, 4)))]
    if kind == 5 and step > 0:
        # A replay of the previous step: well-formed, but stale.
        slot, rows = slot_rows[step - 1]
        return [enc.encode(BitmaskReady(step - 1, slot, rows, (), ()))]
    if kind == 6:
        # The coming step in the right slot with the wrong row count.
        return [enc.encode(BitmaskReady(step, step % 2, MAX_ROWS + 1, (), ()))]
    return [templates[0], b"extra part"]


def _send_with_backpressure(ch, frames, deadline_s: float = 30.0) -> None:
    """Send fuzz, waiting while the reader's queue is full.

    A reader that takes its steps from the ring may drain its socket later
    than the writer fills it (on 2 busy cores its zmq thread can lag), and
    the control socket then refuses more (``TransportTimeout``); a real
    writer sends one message per step, the fuzzer fifty.
    """
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            ch.control.send_frames("tp1", frames)
            return
        except TransportTimeout:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def test_reader_survives_ten_thousand_fuzzed_frames(peers, run_id):
    steps, per_step = 200, 50
    rng = np.random.default_rng(1234)
    with channel(["tp1"], run_id) as ch:
        out = peers.queue()
        peers.start(reader_main, ch.handle, "tp1", list(range(steps)), out, until_closed=True)
        ch.accept()
        slot_rows = {}
        for step in range(steps):
            for _ in range(per_step):
                _send_with_backpressure(ch, _garbage(rng, step, slot_rows))
            array, order, drafts = mask_for(step)
            slot_rows[step] = (ch.publish(step, array, order, drafts), array.shape[0])
        ch.drain()
        ch.close()  # Shutdown comes after every fuzzed frame
        report = peers.results(out, 1)["tp1"]
    assert report[1] == "ok", report
    assert report[2] == expected_digests(range(steps))
    assert report[3] == steps * per_step  # every fuzzed frame was counted and dropped
