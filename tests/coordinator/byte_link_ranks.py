"""Rank bodies for the spawned ByteLink test (importable by spawned children).

Only the runtime and the link are imported: no grammar machinery, so a
spawned rank starts in well under a second.
"""

from __future__ import annotations

import hashlib

from gramcoord.coordinator.byte_link import ByteLink
from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.runtime import Runtime


def messages() -> list[bytes]:
    """What rank 0 sends, in order: edge sizes, trailing zeros, 1 MB."""
    big = bytes((i * 7919 + 13) % 256 for i in range(1 << 20))
    return [b"", b"x", b"1234567", b"12345678", b"123456789", b"ab\0\0\0", big, b"end"]


def reply(data: bytes) -> bytes:
    return data[::-1] + b"!"


def digest(data: bytes) -> str:
    return f"{len(data)}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"


def link_body(rank, world):
    """Ping-pong every message, then a burst one way, then a gather on rank 0."""
    layout = ParallelLayout(dp=world, pp=1, tp=1, requests="replicated")
    runtime = Runtime.attach(layout, distributed=DistributedConfig(step_timeout_s=30))
    link = ByteLink(runtime)
    got: list[str] = []
    with runtime:
        for step, msg in enumerate(messages()):
            if rank == 0:
                link.send(1, msg, operation="ping", step=step)
                got.append(digest(link.recv(1, operation="pong", step=step)))
            else:
                data = link.recv(0, operation="ping", step=step)
                got.append(digest(data))
                link.send(0, reply(data), operation="pong", step=step)
        # Three sends in a row from rank 1; rank 0 posts its receives in order.
        burst = [b"b0", b"", b"b2" * 1000]
        if rank == 1:
            for i, data in enumerate(burst):
                link.send(0, data, operation="burst", step=100 + i)
        else:
            got += [digest(link.recv(1, operation="burst", step=100 + i)) for i in range(3)]
        gathered = link.gather(0, f"report of rank {rank}".encode(), (0, 1), step=200)
        runtime.drain()
    return dict(
        got=got,
        gathered=gathered,
        sent=link.bytes_sent,
        received=link.bytes_received,
    )
