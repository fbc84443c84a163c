"""Control plane: endpoints, dropping bad frames, peers that leave."""

from __future__ import annotations

import os
import re
import stat

import msgspec
import pytest
import zmq

from gramcoord.sync import Bye, Hello, PeerGone, Release, Shutdown, WriterLost
from gramcoord.sync.control import ControlClient, ControlServer


@pytest.fixture
def server(run_id):
    srv = ControlServer(run_id=run_id)
    yield srv
    srv.close()


@pytest.fixture
def client(server):
    cli = ControlClient(server.ipc_endpoint, name="tp1")
    yield cli
    cli.close()


def test_ipc_endpoint_lives_in_a_private_directory_removed_at_close(run_id):
    srv = ControlServer(run_id=run_id)
    path = srv.ipc_dir
    assert srv.ipc_endpoint == f"ipc://{path}/ctl"
    assert run_id in os.path.basename(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    srv.close()
    assert not os.path.exists(path)


def test_tcp_endpoint_is_loopback_on_an_os_chosen_port(run_id):
    first, second = ControlServer(run_id=run_id), ControlServer(run_id=run_id)
    shm_only = ControlServer(run_id=run_id, tcp=False)
    try:
        ports = []
        for srv in (first, second):
            match = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", srv.tcp_endpoint)
            assert match, srv.tcp_endpoint
            ports.append(int(match.group(1)))
        assert ports[0] != ports[1] and min(ports) > 0
        assert shm_only.tcp_endpoint is None
    finally:
        for srv in (first, second, shm_only):
            srv.close()


def test_server_receives_over_tcp_too(server):
    cli = ControlClient(server.tcp_endpoint, name="far")
    cli.send(Release("far", 3))
    assert server.recv(10) == ("far", Release("far", 3))
    cli.close()


def _raw_dealer(endpoint: str, name: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, name)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


ENC = msgspec.msgpack.Encoder()
BAD_FROM_READER = [
    pytest.param([b""], id="empty"),
    pytest.param([b"\xc1"], id="never-used-msgpack-byte"),
    pytest.param([ENC.encode(["release", "tp1"])], id="short-array"),
    pytest.param([ENC.encode(["release", "tp1", -1])], id="negative-step"),
    pytest.param([ENC.encode(["ready", 1, 0, 1, [], []])], id="writer-only-message"),
    pytest.param([ENC.encode(Release("tp2", 1))], id="spoofed-reader-name"),
    pytest.param([ENC.encode(Release("tp1", 1)), b"x"], id="extra-part"),
    pytest.param([ENC.encode({"reader": "tp1"})], id="map-not-array"),
]


@pytest.mark.parametrize("frames", BAD_FROM_READER)
def test_server_drops_bad_frames_and_keeps_going(server, frames):
    sock = _raw_dealer(server.ipc_endpoint, b"tp1")
    sock.send_multipart(frames)
    sock.send(ENC.encode(Release("tp1", 7)))
    assert server.recv(10) == ("tp1", Release("tp1", 7))
    assert server.dropped == 1
    sock.close()


BAD_FROM_WRITER = [
    pytest.param([b"\x00" * 9], id="zeros"),
    pytest.param([ENC.encode(["shutdown"])], id="missing-field"),
    pytest.param([ENC.encode(["frame", 1, 1, 32, [], []])], id="frame-without-data"),
    pytest.param([ENC.encode(Shutdown("x")), b"data"], id="data-after-shutdown"),
    pytest.param([ENC.encode(Hello(1, 1, "tp1", "h", 1))], id="reader-only-message"),
    pytest.param([ENC.encode(["ready", 1, 0, 1, ["id"], [-1]])], id="negative-draft"),
]


@pytest.mark.parametrize("frames", BAD_FROM_WRITER)
def test_client_drops_bad_frames_and_keeps_going(server, client, frames):
    client.send(Release("tp1", 0))
    assert server.recv(10) is not None  # connected: the writer knows tp1
    server.send_frames("tp1", frames)
    server.send("tp1", server.encode(Shutdown("done")))
    assert client.recv(10) == (Shutdown("done"), None)
    assert client.dropped == 1


def test_send_to_an_unknown_reader_is_peer_gone(server):
    with pytest.raises(PeerGone) as info:
        server.send("nobody", server.encode(Shutdown("x")))
    assert info.value.peers == ("nobody",)


def test_client_reports_writer_lost_after_reading_what_was_sent(server, client):
    client.send(Bye(1, 1, "tp1", "hi"))
    assert server.recv(10)[0] == "tp1"
    server.send("tp1", server.encode(Shutdown("last words")))
    server.close()
    assert client.recv(10) == (Shutdown("last words"), None)
    with pytest.raises(WriterLost):
        for _ in range(100):
            client.recv(0.1)
