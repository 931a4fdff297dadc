"""The lean HTTP/1.1 connection of tensor streams (client/transports/http1.py): its parser
against answers written byte for byte by a loopback server (lengths, chunks, bodies that run
to the close, odd heads, cut answers), and the transport over it: errors from the server's
error body, a connection kept after an error, one the server closed while idle.

Large body reads run in Python and in the native loop (client/wire/_socketio.c); the
tests of those reads run on both (``body_reads``), and a real model's load is compared byte
for byte with both."""

from __future__ import annotations

import http.client
import importlib.util
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.native import c_compiler, printed_with_native_setting
from weightserve.client import Client
from weightserve.client.errors import TensorNotFound, TransportError, WeightserveError
from weightserve.client.receive.arrow_reader import ArrowChunkReader
from weightserve.client.transports.base import Connection, StreamParams
from weightserve.client.transports.http import HttpTransport
from weightserve.client.transports.http1 import BUFFER_BYTES, RCVLOWAT_BYTES, Http1Connection
from weightserve.client.wire import socket_loops
from weightserve.client.wire.routes import parse_url
from weightserve.service.serving.request import TensorRequest
from weightserve.service.serving.streams import plan_stream, stream_messages
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.transports.http.streaming import whole_body

NATIVE_MODULE = "weightserve.client.wire._socketio"
BUILT = importlib.util.find_spec(NATIVE_MODULE) is not None

# What a scripted connection does with each request: the bytes to answer, then whether to
# close the connection.
Script = list[tuple[bytes, bool]]


class ScriptedServer:
    """A loopback server answering each connection's requests from ``scripts`` (one per
    connection, in order of arrival) with exactly the bytes given."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = list(scripts)
        self.requests: list[bytes] = []
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.scripts:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            script = self.scripts.pop(0)
            threading.Thread(target=self._answer, args=(sock, script), daemon=True).start()

    def _answer(self, sock: socket.socket, script: Script) -> None:
        with sock:
            pending = b""
            for answer, close in script:
                while b"\r\n\r\n" not in pending:
                    data = sock.recv(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                self.requests.append(head)
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        while len(pending) < int(value):
                            pending += sock.recv(65536)
                        pending = pending[int(value) :]
                sock.sendall(answer)
                if close:
                    return

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(params=["python", "native"])
def body_reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Connections made in the test read large bodies in Python, or in the native loop
    (skipped where the extension was not built)."""
    if request.param == "native" and not BUILT:
        pytest.skip("the native reads are not built")
    monkeypatch.setattr(socket_loops, "NATIVE", request.param == "native")
    return request.param


@pytest.fixture
def scripted():
    made: list[ScriptedServer] = []

    def start(*scripts: Script) -> ScriptedServer:
        made.append(ScriptedServer(list(scripts)))
        return made[-1]

    yield start
    for server in made:
        server.close()


def _exchange(server: ScriptedServer, method: str = "GET") -> tuple[Http1Connection, object]:
    conn = Http1Connection.tcp("127.0.0.1", server.port, timeout=10)
    conn.send(f"{method} /x HTTP/1.1\r\nHost: here\r\n\r\n".encode())
    return conn, conn.response(method)


def _body(resp, piece: int = 7) -> bytes:
    out = bytearray()
    view = memoryview(bytearray(piece))
    while n := resp.readinto(view):
        out += view[:n]
    return bytes(out)


def test_content_length_chunked_and_to_the_close(scripted) -> None:
    server = scripted(
        [
            (b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\nX-A: 1\r\n\r\nhello world", False),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
                False,
            ),
            (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", True),
        ]
    )
    conn = Http1Connection.tcp("127.0.0.1", server.port, timeout=10)
    for want, closes in (
        (b"hello world", False),
        (b"hello world", False),
        (b"until the end", True),
    ):
        assert conn.idle
        conn.send(b"GET /x HTTP/1.1\r\nHost: here\r\n\r\n")
        resp = conn.response()
        assert resp.status == 200 and resp.reason == "OK"
        assert _body(resp, piece=4) == want
        assert resp.isclosed() and resp.will_close is closes
        assert resp.readinto(memoryview(bytearray(4))) == 0
    assert server.connections == 1
    assert resp.getheader("connection") == "close"


def test_odd_heads(scripted) -> None:
    server = scripted(
        [
            (
                b"HTTP/1.1 100 Continue\r\n\r\n"
                b"HTTP/1.1 200 Fine Thanks\r\nContent-Length: 2\r\nX-Many: a\r\nx-many: b\r\n"
                b"X-Folded: one\r\n  two\r\n\r\nok",
                False,
            ),
            (b"HTTP/1.1 204 No Content\r\n\r\n", False),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", False),  # a HEAD's answer
            (b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nold", True),
        ]
    )
    conn, resp = _exchange(server)
    assert (resp.status, resp.reason) == (200, "Fine Thanks")
    assert resp.getheader("X-MANY") == "a, b" and resp.getheader("x-folded") == "one two"
    assert resp.read() == b"ok" and conn.idle
    conn.send(b"GET /x HTTP/1.1\r\n\r\n")
    resp = conn.response()
    assert resp.status == 204 and resp.isclosed() and resp.read() == b""
    conn.send(b"HEAD /x HTTP/1.1\r\n\r\n")
    resp = conn.response("HEAD")
    assert resp.getheader("content-length") == "9" and resp.read() == b""
    conn.send(b"GET /x HTTP/1.1\r\n\r\n")
    resp = conn.response()
    assert resp.version == 10 and resp.will_close and resp.read() == b"old"
    conn.close()


def test_a_body_larger_than_the_buffer_lands_in_place(scripted, body_reads) -> None:
    payload = np.random.default_rng(1).integers(0, 256, 3 * BUFFER_BYTES + 5, np.uint8).tobytes()
    server = scripted(
        [(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload, True)]
    )
    conn, resp = _exchange(server)
    into = bytearray(len(payload) + 10)
    view, got = memoryview(into), 0
    while n := resp.readinto(view[got:]):
        got += n
    assert got == len(payload) and bytes(into[:got]) == payload
    conn.close()


@pytest.mark.parametrize(
    "answer, error",
    [
        (b"", http.client.RemoteDisconnected),
        (b"HTTP/1.1 200 OK\r\nContent-Le", http.client.BadStatusLine),  # cut in its head
        (
            b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x05\x00\x00\x40\x00",
            http.client.BadStatusLine,
        ),
        (b"HTTP/1.1 2000 OK\r\n\r\n", http.client.BadStatusLine),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", http.client.HTTPException),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", http.client.HTTPException),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", http.client.HTTPException),
    ],
)
def test_answers_that_are_not_http_1(scripted, answer: bytes, error: type[Exception]) -> None:
    server = scripted([(answer, True)])
    conn = Http1Connection.tcp("127.0.0.1", server.port, timeout=10)
    conn.send(b"GET /x HTTP/1.1\r\n\r\n")
    with pytest.raises(error) as raised:
        conn.response()
    if answer.startswith(b"\x00"):  # what tells an HTTP/2 server (a gRPC port) apart
        assert raised.value.line.encode("latin-1")[:9] == answer[:9]  # type: ignore[attr-defined]
    conn.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\na\r\nshort",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        # Past the size the native loop takes (RCVLOWAT_MIN_READ): cut after some bytes came.
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (1 << 20, bytes(300 << 10)),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s"
        % (1 << 20, bytes(300 << 10)),
    ],
    ids=["length", "chunk", "chunk-size", "large-length", "large-chunk"],
)
def test_a_body_cut_short_fails(scripted, body_reads, answer: bytes) -> None:
    server = scripted([(answer, True)])
    conn, resp = _exchange(server)
    with pytest.raises(http.client.IncompleteRead):
        _body(resp, piece=1 << 20)
    assert not conn.idle  # closed: never pooled again
    conn.close()


def _transport(server: ScriptedServer) -> HttpTransport:
    address, _ = parse_url(f"http://127.0.0.1:{server.port}")
    return HttpTransport(address, Connection(token="secret", timeout=10))


def _read_all(transport: HttpTransport, name: str = "w") -> bytes:
    source = transport.open_stream("m", StreamParams(names=[name], revision="r1"))
    out = bytearray()
    view = memoryview(bytearray(64))
    while n := source.readinto(view):
        out += view[:n]
    source.close()
    return bytes(out)


def test_a_kept_connection_the_server_closed_is_replaced(scripted) -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    server = scripted([(ok, True)], [(ok, False), (ok, False)])
    transport = _transport(server)
    assert _read_all(transport) == b"hello"
    assert len(transport._lean_idle) == 1  # kept: the server said nothing of closing it
    assert _read_all(transport) == b"hello"  # its first request fails on it: sent again
    assert _read_all(transport) == b"hello"
    assert server.connections == 2
    # One request line, written whole, with the caller's token and the pinned revision.
    assert server.requests[0].startswith(b"GET /v1/models/m/-/tensors/w?revision=r1 HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer secret" in server.requests[0]
    transport.close()


def test_error_answers_keep_the_connection(scripted) -> None:
    error = (
        b'{"error": {"type": "TensorNotFound", "message": "no tensor \'w\'", "retryable": false}}'
    )
    server = scripted(
        [
            (
                b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error),
                False,
            ),
            (b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 9\r\n\r\nupstream!", False),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
        ]
    )
    transport = _transport(server)
    with pytest.raises(TensorNotFound, match="no tensor"):
        _read_all(transport)
    with pytest.raises(TransportError, match="HTTP 502: upstream!"):  # a proxy's answer
        _read_all(transport)
    assert _read_all(transport) == b"ok"
    assert server.connections == 1
    transport.close()


def test_a_server_that_never_answers_is_unreachable(scripted) -> None:
    server = scripted([(b"", True)])
    transport = _transport(server)
    with pytest.raises(WeightserveError, match="closed the connection without answering"):
        _read_all(transport)
    transport.close()


def _counting(transport: HttpTransport, monkeypatch) -> Callable[[], int]:
    made = [0]
    original = transport._lean_connect

    def counting():
        made[0] += 1
        return original()

    monkeypatch.setattr(transport, "_lean_connect", counting)
    return lambda: made[0]


def test_the_servers_errors_over_the_lean_connection(server, reference, monkeypatch) -> None:
    with Client(server.http_url) as client:
        transport = client.transport
        assert isinstance(transport, HttpTransport)
        made = _counting(transport, monkeypatch)
        model = client.model("mixed")
        revision = model.info.revision
        client.planes()  # as a fetch does first: the planes' request is back in the pool
        with pytest.raises(TensorNotFound):  # the server's answer, not the client's index
            transport.open_stream("mixed", StreamParams(names=["no.such"], revision=revision))
        got = model.fetch(["float32"])["float32"]
        assert got.tobytes() == reference("mixed")["float32"].array.tobytes()
        assert made() == 1  # the error's connection served the next request


def test_a_small_body_is_taken_whole_from_the_buffer(scripted) -> None:
    body = bytes(range(256)) * 40  # more than one segment may carry
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    big = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (BUFFER_BYTES + 1)
    server = scripted(
        [(ok, False), (ok, False), (chunked, False), (big + bytes(BUFFER_BYTES + 1), False)]
    )
    conn = Http1Connection.tcp("127.0.0.1", server.port, timeout=10)
    heads = []
    for _ in range(2):
        conn.send(b"GET /x HTTP/1.1\r\nHost: here\r\n\r\n")
        resp = conn.response()
        whole = resp.buffered_body()
        assert whole is not None and bytes(whole) == body
        assert resp.isclosed() and conn.idle  # read to its end: fit for the next request
        assert resp.readinto(memoryview(bytearray(4))) == 0
        heads.append(resp.headers)
    # The same head parsed once, each answer with headers of its own.
    assert heads[0] == heads[1] and heads[0] is not heads[1]
    assert len(conn._heads) == 1
    for want in (b"hello", bytes(BUFFER_BYTES + 1)):  # no length, or too long: read as before
        conn.send(b"GET /x HTTP/1.1\r\nHost: here\r\n\r\n")
        resp = conn.response()
        assert resp.buffered_body() is None
        assert _body(resp, piece=1 << 16) == want
    conn.close()


def test_a_small_stream_cut_short_fails_from_memory(scripted) -> None:
    # A whole Arrow stream but its end marker, behind a Content-Length that promises it.
    stream = _stream_bytes()
    cut = stream[:-8]
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(cut), cut)
    server = scripted([(answer, False)])
    transport = _transport(server)
    reader = ArrowChunkReader(transport.open_stream("m", StreamParams(names=["w"])))
    header = reader.next_chunk(lambda h: memoryview(bytearray(h.nbytes)))
    assert header is not None and header.name == "w"
    assert reader._memory is not None  # the answer was taken whole: this is the memory path
    with pytest.raises(TransportError, match="before its end marker"):
        reader.next_chunk(lambda h: memoryview(bytearray(h.nbytes)))
    reader.close()
    transport.close()


def _stream_bytes() -> bytes:
    """One small tensor's Arrow stream as a server sends it."""
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "m").mkdir()
        save_file({"w": np.arange(64, dtype=np.float32)}, str(Path(root) / "m" / "x.safetensors"))
        model = Catalog(Path(root)).get("m")
        request = TensorRequest(names=("w",))
        body, _ = whole_body(stream_messages(model, plan_stream(model, request), 1 << 20))
    return body


class TricklingServer:
    """Answers one request with ``head``, then ``body`` in ``piece``-byte writes a little
    apart (each its own segments), then holds the connection open without a byte more
    until the test is done: what the end of one answer looks like on a kept-alive
    connection."""

    def __init__(self, head: bytes, body: bytes, piece: int, pause: float = 0.0005) -> None:
        self.done = threading.Event()
        self.pause = pause
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, args=(head, body, piece), daemon=True).start()

    def _serve(self, head: bytes, body: bytes, piece: int) -> None:
        sock, _ = self.listener.accept()
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            request = b""
            while b"\r\n\r\n" not in request:
                data = sock.recv(65536)
                if not data:  # the client left without asking
                    return
                request += data
            sock.sendall(head)
            for at in range(0, len(body), piece):
                sock.sendall(body[at : at + piece])
                self.done.wait(self.pause)
            self.done.wait(30)

    def close(self) -> None:
        self.done.set()
        self.listener.close()


def _timed_reads(resp, into: memoryview) -> tuple[int, int, float]:
    """(bytes, readinto calls, seconds) reading until ``into`` is full or the body ends."""
    got = calls = 0
    start = time.monotonic()
    while got < len(into):
        n = resp.readinto(into[got:])
        calls += 1
        if not n:
            break
        got += n
    return got, calls, time.monotonic() - start


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_large_body_read_wakes_per_megabyte_and_never_waits_past_its_end(
    framing, body_reads
) -> None:
    """A body trickling in 16 KiB writes: a large read waits (SO_RCVLOWAT) for a megabyte
    at a time instead of waking for each write, and its last bytes, with nothing sent
    after them on the open connection, are read at once, not after the idle timeout."""
    body = np.random.default_rng(2).integers(0, 256, 3 * RCVLOWAT_BYTES // 2, np.uint8).tobytes()
    if framing == "length":
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
        wire = body
    else:
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        wire = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    server = TricklingServer(head, wire, 16 << 10)
    conn = Http1Connection.tcp("127.0.0.1", server.port, timeout=5)
    try:
        conn.send(b"GET /x HTTP/1.1\r\nHost: here\r\n\r\n")
        resp = conn.response()
        into = memoryview(bytearray(len(body)))
        got, calls, seconds = _timed_reads(resp, into)
        assert got == len(body) and bytes(into) == body
        assert seconds < 2.5  # the body's end was not waited past (the timeout is 5 s)
        # 96 writes; without the low-water mark each woke a read (60-97 measured).
        assert calls <= 12, calls
        if framing == "chunked":
            assert resp.readinto(memoryview(bytearray(8))) == 0 and resp.isclosed()
    finally:
        conn.close()
        server.close()


def test_a_sender_slower_than_the_mark_is_read_as_it_comes(body_reads) -> None:
    """A body flowing at ~1 MiB/s, under a megabyte per the mark's patience: the first read
    takes what came after the patience and the connection stops using the mark; the read
    timeout still means "no bytes for that long" (one timeout, not two, when the server then
    sends nothing more)."""
    body = bytes(range(256)) * (6 << 10)  # 1.5 MiB
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(body) + 1)  # 1 owed
    server = TricklingServer(head, body, 32 << 10, pause=0.03)
    conn = Http1Connection.tcp("127.0.0.1", server.port, timeout=1.0)
    try:
        conn.send(b"GET /x HTTP/1.1\r\nHost: here\r\n\r\n")
        resp = conn.response()
        into = memoryview(bytearray(len(body) + 1))
        got = 0
        while got < len(body):
            n = resp.readinto(into[got:])
            assert n, "the body ended early"
            got += n
        assert bytes(into[:got]) == body
        assert conn._lowat is None  # short of the mark within the patience: off for this link
        start = time.monotonic()
        with pytest.raises(TimeoutError):  # the last byte never comes
            resp.readinto(into[got:])
        assert time.monotonic() - start < 1.9
    finally:
        conn.close()
        server.close()


def test_a_server_silent_mid_body_times_out_once(body_reads) -> None:
    """A server that owes a large body and sends none of it: the read gives up after the
    mark's patience and one read timeout, not two; the mark stays in use (nothing came)."""
    server = TricklingServer(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (2 << 20), b"", 1)
    conn = Http1Connection.tcp("127.0.0.1", server.port, timeout=1.0)
    try:
        conn.send(b"GET /x HTTP/1.1\r\nHost: here\r\n\r\n")
        resp = conn.response()
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            resp.readinto(memoryview(bytearray(2 << 20)))
        elapsed = time.monotonic() - start
        assert 0.9 < elapsed < 1.9, elapsed
        assert conn._lowat == 1
    finally:
        conn.close()
        server.close()


def test_a_body_without_a_length_is_read_as_it_comes(body_reads) -> None:
    """A body that runs to the close owes no byte count: a large read takes what has
    come while the server pauses with the connection open."""
    head = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"
    server = TricklingServer(head, bytes(200 << 10), 100 << 10)
    conn = Http1Connection.tcp("127.0.0.1", server.port, timeout=5)
    try:
        conn.send(b"GET /x HTTP/1.1\r\nHost: here\r\n\r\n")
        resp = conn.response()
        into = memoryview(bytearray(4 * RCVLOWAT_BYTES))
        got = 0
        start = time.monotonic()
        while got < 200 << 10:
            n = resp.readinto(into[got:])
            assert n, "the body ended early"
            got += n
        assert got == 200 << 10 and time.monotonic() - start < 2.5
    finally:
        conn.close()
        server.close()


def test_large_reads_keep_what_follows_them_in_the_buffer(scripted, body_reads) -> None:
    """Reads of a body's parts, each owed in full (as a stream's chunks are): every byte
    lands once and in order; the native loop takes the bytes past a part into the
    connection's buffer in the same receive, and the next read starts from there."""
    payload = np.random.default_rng(3).integers(0, 256, 3 << 20, np.uint8).tobytes()
    server = scripted(
        [(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload, True)]
    )
    conn, resp = _exchange(server)
    into = memoryview(bytearray(len(payload)))
    part = 700 << 10  # above RCVLOWAT_MIN_READ, so the native loop takes each part
    got = followed = 0
    while got < len(payload):
        got += resp.readinto(into[got : got + part])
        followed += conn._end > conn._start  # bytes past the part already buffered
    assert bytes(into) == payload and resp.isclosed()
    if body_reads == "native":
        assert followed, "no part's receive took the bytes after it"
    conn.close()


def test_a_real_models_load_is_the_same_through_both_reads(
    server, reference, model_root, body_reads
) -> None:
    """MiniLM's whole load (two streams of 8 MiB chunks, the framing between them) against
    the safetensors reader's bytes."""
    if "minilm" in model_root.skipped:
        pytest.skip(model_root.skipped["minilm"])
    with Client(server.http_url) as client:
        got = client.model("minilm").fetch()
    expected = reference("minilm")
    assert list(got) == list(expected)
    for name, ref in expected.items():
        assert got[name].dtype == ref.array.dtype and got[name].shape == ref.array.shape, name
        assert got[name].tobytes() == ref.array.tobytes(), name


def test_the_native_reads_are_built_where_a_c_compiler_exists() -> None:
    compiler = c_compiler()
    if compiler is None:
        pytest.skip("no C compiler: the install leaves the extension out and Python reads")
    assert BUILT, (
        f"{compiler} exists but {NATIVE_MODULE} is not built: pip install -e . builds it "
        "(its errors show with pip install -v)"
    )


@pytest.mark.parametrize("setting", [None, "0"])
def test_weightserve_native_picks_the_loops_at_import(setting: str | None) -> None:
    code = "from weightserve.client.wire import socket_loops; print(socket_loops.NATIVE)"
    assert printed_with_native_setting(code, setting) == str(BUILT and setting != "0")
