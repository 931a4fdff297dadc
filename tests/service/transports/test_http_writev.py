"""HTTP stream bodies go out straight to the socket (``_SocketWriter``: tensor bytes with
sendfile from the file, framing with writev) on uvicorn's plain HTTP/1.1 connections,
httptools and h11, TCP and a Unix socket alike, and the bytes are those the ASGI path sends.
Small bodies keep the ASGI path (no thread hop). Every test runs with the writer's loops in
Python and in the native extension (client/wire/socket_loops.py)."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.http_streams import expected_body, fetch, serving
from weightserve.client.errors import ModelUnavailable
from weightserve.client.wire import socket_loops
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.streams import (
    FileMessage,
    TensorRequest,
    plan_stream,
    stream_messages,
)
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.transports.http import streaming as http_streaming

BIG = "big.weight"  # 3 MiB: more than DIRECT_WRITE_MIN_BYTES, and several 1 MiB chunks
BIG_BYTES = 768 * 1024 * 4
SMALL = "small.norm"


@pytest.fixture(autouse=True, params=["python", "native"])
def write_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Writers made during the test write in Python, or in the native loops (skipped where
    the extension was not built)."""
    if request.param == "native" and socket_loops._socketio is None:
        pytest.skip("the native loops are not built")
    monkeypatch.setattr(socket_loops, "NATIVE", request.param == "native")
    return request.param


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> ServiceState:
    root = tmp_path_factory.mktemp("writev-root")
    (root / "m").mkdir()
    rng = np.random.default_rng(7)
    save_file(
        {
            BIG: rng.standard_normal((768, 1024), dtype=np.float32),
            SMALL: rng.standard_normal(64, dtype=np.float32),
        },
        str(root / "m" / "model.safetensors"),
    )
    return ServiceState(Catalog(root))


def written_by(state: ServiceState, how: str) -> float:
    """``weightserve_http_direct_bytes_total{how}`` as /metrics has it."""
    value = state.metrics.registry.get_sample_value(
        "weightserve_http_direct_bytes_total", {"how": how}
    )
    return value or 0.0


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_large_bodies_are_written_directly_and_match(state, protocol) -> None:
    chunk = 1 << 20
    with serving(state, protocol) as (port, app):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        first = fetch(conn, BIG, chunk)
        assert app.direct_streams == 1
        assert first == expected_body(state, BIG, chunk)
        # The same connection afterwards: uvicorn's Content-Length accounting was kept, so
        # the response ended cleanly and the connection serves the next request.
        assert fetch(conn, BIG, chunk) == first
        assert app.direct_streams == 2
        conn.close()
        # Counted when the stream's handler ends, a moment after the client has its bytes.
        deadline = time.monotonic() + 10
        while app.direct_bytes < 2 * len(first) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.direct_bytes == 2 * len(first)
        # The tensor's bytes went from the file with sendfile (--sendfile on: a loopback
        # peer too), the framing around them not.
        assert app.sendfile_bytes == 2 * BIG_BYTES


@pytest.mark.parametrize("mode", ["off", "auto"])
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_copies_write_the_same_bytes_from_the_mapping(state, transport, mode, tmp_path) -> None:
    # --sendfile off, and auto for a peer on this host (loopback, a Unix socket): the direct
    # writer still takes the body, but copies the tensor bytes from the file's mapping; what
    # the client gets is byte for byte the same.
    uds = str(tmp_path / "ws.sock") if transport == "unix" else None
    chunk = (1 << 20) + 4  # padded chunks too
    before = {how: written_by(state, how) for how in ("sendfile", "write")}
    with serving(state, "httptools", uds=uds, sendfile=mode) as (port, app):
        conn = _UnixConnection(uds) if uds else http.client.HTTPConnection("127.0.0.1", port)
        body = fetch(conn, BIG, chunk)
        conn.close()
        assert body == expected_body(state, BIG, chunk)
        assert app.direct_streams == 1
        deadline = time.monotonic() + 10
        while app.direct_bytes < len(body) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.direct_bytes == len(body)
        assert app.sendfile_bytes == 0
    # /metrics says the same: every byte written, none with sendfile.
    assert written_by(state, "write") - before["write"] == len(body)
    assert written_by(state, "sendfile") == before["sendfile"]


def test_chunk_padding_goes_out_in_front_of_the_next_framing(state) -> None:
    # Chunks of 1 MiB + 4 bytes: each but the last is padded to 8 bytes by a suffix, which
    # the direct writer holds back and sends in front of the next chunk's framing.
    chunk = (1 << 20) + 4
    with serving(state, "httptools") as (port, app):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        assert fetch(conn, BIG, chunk) == expected_body(state, BIG, chunk)
        conn.close()
        assert app.direct_streams == 1


def test_small_bodies_keep_the_asgi_path(state) -> None:
    with serving(state, "httptools") as (port, app):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = fetch(conn, SMALL, 1 << 20)
        assert len(body) < http_streaming.DIRECT_WRITE_MIN_BYTES
        assert app.direct_streams == 0
        assert body == expected_body(state, SMALL, 1 << 20)
        conn.close()


def server_end(client: socket.socket) -> socket.socket:
    """This process's end of ``client``'s TCP connection (uvicorn serves in a thread here):
    a duplicate of the socket whose peer is ``client``'s own address."""
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            candidate = socket.socket(fileno=os.dup(int(fd)))
            if candidate.type == socket.SOCK_STREAM and candidate.family == socket.AF_INET:
                with contextlib.suppress(OSError):
                    if candidate.getpeername() == client.getsockname():
                        return candidate
            candidate.close()
    raise AssertionError("the server's end of the connection is not in this process")


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_same_host_peer_that_gets_copies_gets_a_bounded_send_buffer(state, mode) -> None:
    # auto copies for a loopback peer, and bounds the connection's send buffer so that the
    # copies stay in the caches; with sendfile (on) autotuning keeps it.
    with serving(state, "httptools", sendfile=mode) as (port, app):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = fetch(conn, BIG, 1 << 20)
        assert body == expected_body(state, BIG, 1 << 20)
        assert app.direct_streams == 1
        assert conn.sock is not None
        with server_end(conn.sock) as end:
            send_buffer = end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        conn.close()
    bounded = 2 * http_streaming.SAME_HOST_SEND_BUFFER  # the kernel doubles what is set
    assert (send_buffer == bounded) is (mode == "auto"), send_buffer


def test_a_unix_socket_gets_direct_writes(state, tmp_path: Path) -> None:
    path = str(tmp_path / "ws.sock")
    with serving(state, "httptools", uds=path) as (_, app):
        conn = _UnixConnection(path)
        body = fetch(conn, BIG, 1 << 20)
        assert app.direct_streams == 1
        assert body == expected_body(state, BIG, 1 << 20)
        conn.close()
        deadline = time.monotonic() + 10
        while app.sendfile_bytes < BIG_BYTES and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.sendfile_bytes == BIG_BYTES


def test_the_catalog_says_when_it_answers_from_memory(tmp_path: Path) -> None:
    # What decides whether a small HTTP request is answered on the event loop.
    (tmp_path / "m").mkdir()
    save_file({"w": np.zeros(4, np.float32)}, str(tmp_path / "m" / "model.safetensors"))
    catalog = Catalog(tmp_path, recheck_seconds=3600)
    model = catalog.models["m"]
    assert not catalog.answers_now("nope")
    if not model.revision_known:
        assert not catalog.answers_now("m") and not catalog.answers_now()
        model.revision  # noqa: B018 - computed now, as the first request would
    assert catalog.answers_now("m") and catalog.answers_now()
    model.checked_at = float("-inf")  # its files are due for a check: a worker thread's job
    assert not catalog.answers_now("m")


def test_a_file_truncated_under_sendfile_cuts_the_stream(tmp_path: Path) -> None:
    # Truncated after its chunk was taken (digest checked) but before it is sent, with no
    # read lease to hold the truncation back: sendfile ends short, the writer says the
    # model is unavailable, and the process never reads a removed page (no SIGBUS).
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "model.safetensors"
    save_file({BIG: np.ones((768, 1024), np.float32)}, str(path))
    model = ServiceState(Catalog(tmp_path)).catalog.get("m")
    messages = stream_messages(model, plan_stream(model, TensorRequest(names=(BIG,))), 1 << 20)
    schema, first = next(messages), next(messages)
    assert isinstance(first, FileMessage)
    os.truncate(path, first.file_offset + 1000)
    sender, receiver = socket.socketpair()
    sender.setblocking(False)
    writer = http_streaming._SocketWriter(lambda n: None, sender.fileno(), idle_timeout=5)
    try:
        with pytest.raises(ModelUnavailable, match="truncated"):
            writer.write_some(iter([schema, first]))
        assert writer.sent_from_files == 1000
    finally:
        writer.close()
        sender.close()
        receiver.close()


def test_file_ranges_go_out_with_sendfile(state) -> None:
    path = state.catalog.root / "m" / "model.safetensors"
    whole = path.read_bytes()
    with serving(state, "httptools") as (port, app):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        start, stop = 1000, 1000 + (2 << 20) + 7  # an odd length, across file chunks
        conn.request(
            "GET",
            "/v1/models/m/-/files/model.safetensors",
            headers={"range": f"bytes={start}-{stop - 1}"},
        )
        response = conn.getresponse()
        assert response.status == 206
        assert response.read() == whole[start:stop]
        conn.request("GET", "/v1/models/m/-/files/model.safetensors")
        response = conn.getresponse()
        assert response.status == 200
        assert response.read() == whole
        conn.close()
        expected = (stop - start) + len(whole)
        deadline = time.monotonic() + 10
        while app.sendfile_bytes < expected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.direct_streams == 2
        assert app.sendfile_bytes == expected


def _big_stream(root: Path) -> Iterator[tuple]:
    """The messages of one 3 MiB tensor's stream, in 4 MiB chunks (one chunk)."""
    (root / "m").mkdir()
    save_file({BIG: np.ones((768, 1024), np.float32)}, str(root / "m" / "model.safetensors"))
    model = ServiceState(Catalog(root)).catalog.get("m")
    return stream_messages(model, plan_stream(model, TensorRequest(names=(BIG,))), 4 << 20)


@pytest.mark.parametrize("sendfile", [True, False])
def test_a_client_that_stops_reading_is_cut_after_the_idle_timeout(
    tmp_path: Path, sendfile: bool
) -> None:
    # A socket that is never read fills: the writer waits for room, at most the idle
    # timeout, and says so; the bytes that went are counted either way.
    messages = _big_stream(tmp_path)
    sender, receiver = socket.socketpair()
    sender.setblocking(False)
    writer = http_streaming._SocketWriter(lambda n: None, sender.fileno(), idle_timeout=0.3)
    writer.use_sendfile = sendfile
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="read nothing for 0.3 s"):
            writer.write_some(messages)
        assert 0.25 < time.monotonic() - start < 5
        assert 0 < writer.written < BIG_BYTES
        # Past the framing, what went is the tensor's bytes, by sendfile or by the copy.
        assert (writer.sent_from_files > 0) is sendfile
    finally:
        writer.close()
        sender.close()
        receiver.close()


@pytest.mark.parametrize("sendfile", [True, False])
def test_a_client_gone_fails_the_write(tmp_path: Path, sendfile: bool) -> None:
    messages = _big_stream(tmp_path)
    sender, receiver = socket.socketpair()
    sender.setblocking(False)
    receiver.close()
    writer = http_streaming._SocketWriter(lambda n: None, sender.fileno(), idle_timeout=5)
    writer.use_sendfile = sendfile
    try:
        with pytest.raises(BrokenPipeError):
            writer.write_some(messages)
    finally:
        writer.close()
        sender.close()
