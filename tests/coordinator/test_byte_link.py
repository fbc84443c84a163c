"""ByteLink: byte messages over a runtime's point-to-point calls.

Most cases run over an in-memory fake comm (one queue per direction and tag;
a receive buffer at least as long as the message, whose prefix it fills, as
gloo does); one spawned 2-rank test runs over a real gloo ``Runtime``.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque

import numpy as np
import pytest

from gramcoord.coordinator.byte_link import INLINE_BYTES, TAG_HEADER, TAG_PAYLOAD, ByteLink
from tests.coordinator import byte_link_ranks
from tests.procs import run_ranks


class Wires:
    """The in-memory network: (src, dst, tag) -> queue of int64 arrays."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int, int], deque[np.ndarray]] = defaultdict(deque)
        self.log: list[tuple[str, int, int, int, str, int]] = []

    def comm(self, rank: int, world: int = 2) -> FakeComm:
        return FakeComm(self, rank, world)


class FakeComm:
    def __init__(self, wires: Wires, rank: int, world: int) -> None:
        self.wires = wires
        self.rank = rank
        self.world = world

    def members(self, group: str) -> tuple[int, ...]:
        return tuple(range(self.world))

    def send(self, group, dst, payload, *, tag, operation, step) -> None:
        assert group == "world" and dst != self.rank
        assert payload.dtype == np.int64 and payload.ndim == 1
        self.wires.log.append(("send", self.rank, dst, tag, operation, step))
        # Runtime.send copies, so the caller may reuse its array at once.
        self.wires.queues[(self.rank, dst, tag)].append(np.array(payload, copy=True))

    def recv(self, group, src, out, *, tag, operation, step) -> None:
        assert group == "world" and out.dtype == np.int64
        self.wires.log.append(("recv", src, self.rank, tag, operation, step))
        queue = self.wires.queues[(src, self.rank, tag)]
        assert queue, f"rank {self.rank} receives from {src} (tag {tag}) but nothing was sent"
        data = queue.popleft()
        assert data.size <= out.size, "gloo needs a receive buffer at least as long"
        out[: data.size] = data


def _payload(size: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    data = bytearray(rng.randbytes(size))
    if size >= 2:
        data[-2:] = b"\0\0"  # trailing zeros must survive the padding
    return bytes(data)


@pytest.fixture
def pair():
    wires = Wires()
    return wires, ByteLink(wires.comm(0)), ByteLink(wires.comm(1))


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, INLINE_BYTES, INLINE_BYTES + 1, 1 << 20])
def test_round_trip(pair, size):
    wires, a, b = pair
    data = _payload(size, seed=size)
    a.send(1, data, operation="ping", step=3)
    got = b.recv(0, operation="ping", step=3)
    assert got == data and isinstance(got, bytes)
    assert a.bytes_sent == b.bytes_received == size
    sends = [e for e in wires.log if e[0] == "send"]
    assert sends[0] == ("send", 0, 1, TAG_HEADER, "ping", 3)
    if size > INLINE_BYTES:
        assert sends[1][3] == TAG_PAYLOAD and len(sends) == 2
    else:
        assert len(sends) == 1  # the payload rides in the header's transfer
    assert not any(wires.queues.values())  # every transfer was consumed
    # The reply goes the other way on the same link.
    b.send(0, data[::-1], operation="pong", step=3)
    assert a.recv(1, operation="pong", step=3) == data[::-1]


def test_payload_is_whole_words(pair):
    wires, a, _ = pair
    a.send(1, b"123456789", operation="x", step=0)
    (message,) = wires.queues[(0, 1, TAG_HEADER)]
    assert message[0] == 9 and message.shape == (3,)  # length + two words
    a.send(1, b"x" * (INLINE_BYTES + 9), operation="x", step=0)
    (words,) = wires.queues[(0, 1, TAG_PAYLOAD)]
    assert wires.queues[(0, 1, TAG_HEADER)][1].tolist() == [INLINE_BYTES + 9]
    assert words.shape == (INLINE_BYTES // 8 + 2,)


def test_messages_keep_their_order_and_boundaries(pair):
    _, a, b = pair
    sent = [_payload(n, seed=n) for n in (5, 0, 16, 1, 0, 33)]
    for i, data in enumerate(sent):
        a.send(1, data, operation="burst", step=i)
    assert [b.recv(0, operation="burst", step=i) for i in range(len(sent))] == sent
    assert a.bytes_sent == sum(map(len, sent))


def test_negative_length_is_refused():
    wires = Wires()
    wires.queues[(0, 1, TAG_HEADER)].append(np.array([-5], dtype=np.int64))
    with pytest.raises(ValueError, match="negative"):
        ByteLink(wires.comm(1)).recv(0, operation="x", step=0)


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_gather_returns_messages_in_rank_order(order):
    wires = Wires()
    links = [ByteLink(wires.comm(r, world=3)) for r in range(3)]
    root = 1
    data = {r: f"rank {r} says {'x' * r}".encode() for r in range(3)}
    for r in (0, 2):  # the fake never blocks, so the senders may go first
        assert links[r].gather(root, data[r], order, step=7) == []
    got = links[root].gather(root, data[root], order, step=7)
    assert got == [data[r] for r in order]
    assert not any(wires.queues.values())
    assert {e[4] for e in wires.log} == {"gather reports"}


def test_gather_with_root_alone():
    wires = Wires()
    link = ByteLink(wires.comm(0, world=1))
    assert link.gather(0, b"mine", (0,), step=0) == [b"mine"]
    assert wires.log == []


@pytest.mark.spawn
@pytest.mark.timeout(120)
def test_two_ranks_over_gloo():
    r0, r1 = (r.value for r in run_ranks(byte_link_ranks.link_body, 2, timeout=100))
    msgs = byte_link_ranks.messages()
    burst = [b"b0", b"", b"b2" * 1000]
    assert r1["got"] == [byte_link_ranks.digest(m) for m in msgs]
    assert r0["got"] == [byte_link_ranks.digest(byte_link_ranks.reply(m)) for m in msgs] + [
        byte_link_ranks.digest(m) for m in burst
    ]
    assert r0["gathered"] == [b"report of rank 0", b"report of rank 1"]
    assert r1["gathered"] == []
    total = sum(map(len, msgs))
    replies = total + len(msgs)
    assert (r0["sent"], r0["received"]) == (total, replies + sum(map(len, burst)) + 16)
    assert r1["sent"] == replies + sum(map(len, burst)) + len(b"report of rank 1")
    assert r1["received"] == total
