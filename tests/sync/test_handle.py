"""join: the reader's half of the handshake refuses what it can before connecting."""

from __future__ import annotations

import pytest

from gramcoord.sync import ChannelHandle, HandshakeError
from gramcoord.sync.handle import join
from gramcoord.sync.ring_layout import describe

RING = describe(name="n", run_id="r", readers=("tp1",), max_rows=4, width=3, num_slots=2)


def _handle(kind: str) -> ChannelHandle:
    return ChannelHandle(
        version=1,
        run_id="r",
        kind=kind,
        hostname="writer-host",
        pid=1,
        vocab_size=96,
        ipc_endpoint="ipc:///nonexistent/ctl",
        tcp_endpoint=None if kind == "shm" else "tcp://127.0.0.1:1",
        ring=RING,
        timeout_s=1.0,
        handshake_timeout_s=1.0,
        spin_us=0,
    )


@pytest.mark.parametrize(
    ("kind", "name", "hostname", "error", "match"),
    [
        pytest.param("auto", "bad name", None, ValueError, "must match", id="invalid-name"),
        pytest.param("auto", "tp2", None, HandshakeError, "not one of", id="unknown-reader"),
        pytest.param("shm", "tp1", "elsewhere", HandshakeError, "cannot reach", id="shm-remote"),
    ],
)
def test_join_refuses_before_connecting(kind, name, hostname, error, match):
    with pytest.raises(error, match=match):
        join(_handle(kind), name, vocab_size=96, hostname=hostname)
