"""The HTTP transport over TCP, TLS or the server's Unix socket, with small kept-alive pools:
tensor streams on plain sockets through the lean ``Http1Connection`` (client/transports/http1.py),
everything else (and TLS) through http.client; both ``readinto`` straight from the socket.
It carries every control verb too (publishing, watches, holds, deltas). http.client's and the
socket's errors become weightserve errors here and nowhere else: before an answer in
``HttpTransport._exchange_failed``, once one is under way in ``map_http_errors``."""

from __future__ import annotations

import contextlib

# socket.getaddrinfo encodes every str host with the idna codec, whose module (and
# unicodedata) would otherwise be imported inside a process's first request.
import encodings.idna  # noqa: F401
import http.client
import json
import socket
import ssl
import threading
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Literal, TypeVar
from urllib.parse import urlencode

from weightserve.client.errors import (
    ResourceExhausted,
    ServerUnreachable,
    TransportError,
    WeightserveError,
    WrongTransport,
)
from weightserve.client.receive.arrow_reader import ArrowChunkReader
from weightserve.client.transports.base import (
    ByteSource,
    ChunkReader,
    Connection,
    DataTransport,
    FileSource,
    FileSpan,
    LineStream,
    StreamParams,
    TLSOptions,
)
from weightserve.client.transports.http1 import Http1Connection, Http1Response
from weightserve.client.transports.http_control import HttpControl
from weightserve.client.wire.errors import WireError, retry_after_seconds
from weightserve.client.wire.routes import (
    ServerAddress,
    http_model_path,
)
from weightserve.client.wire.schema import BULK_CHUNK_BYTES

IDLE_CONNECTIONS = 8  # kept-alive HTTP connections per transport (and as many lean ones)
ACCEPT = "application/json, application/vnd.apache.arrow.stream"
NDJSON = "application/x-ndjson"
PREBUILT_REQUESTS = 4096  # one-tensor GETs kept built per transport (then built anew)
FOREIGN_ERRORS = (OSError, http.client.HTTPException)
Conn = TypeVar("Conn", http.client.HTTPConnection, Http1Connection)
Answer = TypeVar("Answer", http.client.HTTPResponse, Http1Response)


class map_http_errors:  # noqa: N801 (used as a context manager, named for what it does)
    """``with map_http_errors(kind, what):`` the one translation of http.client's and the
    socket's errors met once an exchange is under way (an answer's body, an upload, a line
    stream) into ``kind`` naming ``what``: ``TransportError`` for a tensor stream (resumed
    from its last chunk), ``ServerUnreachable`` for answers asked again whole. ``cleanup``
    (closing the connection) runs first. A class rather than a generator: it wraps every
    ``readinto`` of a stream."""

    __slots__ = ("cleanup", "kind", "what")

    def __init__(
        self,
        kind: type[WeightserveError],
        what: str,
        cleanup: Callable[[], None] | None = None,
    ) -> None:
        self.kind, self.what, self.cleanup = kind, what, cleanup

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        e: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if e is None or not isinstance(e, FOREIGN_ERRORS):
            return False
        if self.cleanup is not None:
            self.cleanup()
        raise self.kind(f"{self.what}: {e!r}") from e


class HttpTransport(HttpControl, DataTransport):
    """http.client, and ``Http1Connection`` for tensor streams on plain sockets: responses
    ``readinto`` straight from the socket. Carries the data and the control verbs
    (``HttpControl``)."""

    # Chunks land in their tensors' buffers, so a larger one costs no memory, and a quarter of
    # the per-chunk work (framing, digest call, bookkeeping) of 2 MiB's: a whole-model fetch
    # went from 0.85 to 1.05 of the verifying raw reader (docs/performance.md, "Round 4").
    bulk_chunk_bytes: int | None = BULK_CHUNK_BYTES

    def __init__(self, address: ServerAddress, connection: Connection | None = None) -> None:
        connection = connection or Connection()
        self.address = address
        self.token = connection.bearer
        self.timeout = connection.timeout
        self._ssl: ssl.SSLContext | None = None
        # Connections kept alive between requests: a small request then costs no TCP (and
        # no TLS) handshake. Taken by one request at a time; closed on any error.
        self._idle: list[http.client.HTTPConnection] = []
        self._lean_idle: list[Http1Connection] = []  # the same for tensor streams
        self._pool_lock = threading.Lock()
        # Dropped without close() (``RemoteWeights(url).torch_state_dict()``), the transport
        # still closes its kept-alive connections: a socket left to be collected warns.
        weakref.finalize(self, _close_idle, self._idle, self._lean_idle)
        host = "localhost" if address.socket_path is not None else address.host
        host = f"[{host}]" if ":" in host else host
        # Every lean request's headers after its request line, encoded once.
        fixed = f"Host: {host}:{address.port}\r\n" if address.port else f"Host: {host}\r\n"
        fixed += f"Accept: {ACCEPT}\r\nAccept-Encoding: identity\r\n"
        if self.token:
            fixed += f"Authorization: Bearer {self.token}\r\n"
        self._lean_headers = fixed.encode("latin-1")
        self._tensor_gets: dict[tuple[str, str, str | None], tuple[str, bytes]] = {}
        if address.tls:
            tls = connection.tls or TLSOptions()
            self._ssl = ssl.create_default_context(cafile=tls.ca_file)
            if tls.cert_file:
                self._ssl.load_cert_chain(tls.cert_file, tls.key_file)

    def _connect(self) -> http.client.HTTPConnection:
        if self.address.socket_path is not None:
            return _UnixHTTPConnection(self.address.socket_path, self.timeout)
        if self._ssl is not None:
            return http.client.HTTPSConnection(
                self.address.host, self.address.port, timeout=self.timeout, context=self._ssl
            )
        return http.client.HTTPConnection(
            self.address.host, self.address.port, timeout=self.timeout
        )

    def _lean_connect(self) -> Http1Connection:
        if self.address.socket_path is not None:
            return Http1Connection.unix(self.address.socket_path, self.timeout)
        return Http1Connection.tcp(self.address.host, self.address.port, self.timeout)

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        """A kept-alive connection if one is idle (True), else a new one (False)."""
        with self._pool_lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _lean_take(self) -> tuple[Http1Connection, bool]:
        """``_take`` for tensor streams: a kept-alive lean connection, else a new one."""
        with self._pool_lock:
            if self._lean_idle:
                return self._lean_idle.pop(), True
        return self._lean_connect(), False

    def _exchange(
        self, take: Callable[[], tuple[Conn, bool]], send: Callable[[Conn], Answer]
    ) -> tuple[Conn, Answer]:
        """``send`` on a connection from ``take``, sent again on a new one where a kept-alive
        connection turns out closed (``_exchange_failed`` says which failures those are)."""
        while True:
            conn, reused = None, False
            try:
                conn, reused = take()
                return conn, send(conn)
            except FOREIGN_ERRORS as e:
                if conn is not None:
                    conn.close()
                self._exchange_failed(e, reused)

    def release(
        self,
        conn: http.client.HTTPConnection | Http1Connection,
        resp: http.client.HTTPResponse | Http1Response,
    ) -> None:
        """Keep the connection for the next request if its response was read to the end."""
        if resp.isclosed() and not resp.will_close:
            if isinstance(conn, Http1Connection):
                if conn.idle:  # nothing came after the answer
                    with self._pool_lock:
                        if len(self._lean_idle) < IDLE_CONNECTIONS:
                            self._lean_idle.append(conn)
                            return
            else:
                with self._pool_lock:
                    if len(self._idle) < IDLE_CONNECTIONS:
                        self._idle.append(conn)
                        return
        conn.close()

    def _lean_head(self, method: str, path: str) -> bytes:
        """A lean request's line and headers, less the blank line that ends them."""
        return f"{method} {path} HTTP/1.1\r\n".encode("ascii") + self._lean_headers

    def _tensor_get(self, model: str, name: str, revision: str | None) -> tuple[str, bytes]:
        """(path, whole request) of one tensor's GET, built once per tensor and revision:
        a small request is asked again and again."""
        key = (model, name, revision)
        known = self._tensor_gets.get(key)
        if known is None:
            path = http_model_path(model, "tensors", name)
            if revision:
                path += "?" + urlencode({"revision": revision})
            if len(self._tensor_gets) >= PREBUILT_REQUESTS:
                self._tensor_gets.clear()
            known = self._tensor_gets[key] = (path, self._lean_head("GET", path) + b"\r\n")
        return known

    def _lean_request(
        self, method: str, path: str, request: bytes, ok: tuple[int, ...] = (200,)
    ) -> tuple[Http1Connection, Http1Response]:
        """``_request`` for a tensor stream on a plain socket: ``request`` (whole) written in
        one send on an ``Http1Connection`` from its own kept-alive pool."""

        def send(conn: Http1Connection) -> Http1Response:
            conn.send(request)
            return conn.response(method)

        conn, resp = self._exchange(self._lean_take, send)
        self._refuse_unless(ok, method, path, conn, resp)
        return conn, resp

    def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        extra_headers: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        headers = {"accept": ACCEPT}
        headers.update(extra_headers or {})
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"

        def send(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
            if conn.sock is None:
                conn.connect()
                if conn.sock.family != socket.AF_UNIX:  # type: ignore[attr-defined]
                    # http.client sends headers and body in two writes; without NODELAY the
                    # body waits for the server's delayed ACK (40 ms) when kept alive.
                    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # type: ignore[attr-defined]
            conn.request(method, path, body=data, headers=headers)
            return conn.getresponse()

        conn, resp = self._exchange(self._take, send)
        self._refuse_unless(ok, method, path, conn, resp)
        return conn, resp

    def _refuse_unless(
        self,
        ok: tuple[int, ...],
        method: str,
        path: str,
        conn: http.client.HTTPConnection | Http1Connection,
        resp: http.client.HTTPResponse | Http1Response,
    ) -> None:
        """Raise the error an answer with a status outside ``ok`` says."""
        if resp.status in ok:
            return
        try:
            raw = resp.read()
        except FOREIGN_ERRORS:
            raw = b""  # cut short: the status says enough
        # Read to its end, an error answer leaves the connection fit for the next request.
        self.release(conn, resp)
        raise self._answer_error(method, path, resp, raw)

    def _answer_error(
        self,
        method: str,
        path: str,
        resp: http.client.HTTPResponse | Http1Response,
        raw: bytes,
    ) -> WeightserveError:
        what = f"{method} {self.address.url}{path}"
        return _http_error(resp.status, raw, what, resp.getheader("retry-after"))

    def _exchange_failed(self, e: OSError | http.client.HTTPException, reused: bool) -> None:
        """What a request that got no answer (its connection closed) means: returns when it
        is worth sending again on a new connection, else raises the error it is."""
        if isinstance(e, ssl.SSLError):  # an OSError, but no outage: waiting will not fix it
            raise TransportError(
                f"TLS with weightserve at {self.address.url} failed: {e}; check the CA it "
                "is verified with (TLSOptions.ca_file) and the client certificate"
            ) from e
        if isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
            if reused:
                return  # the server closed an idle kept-alive connection: use a new one
            if (
                isinstance(e, http.client.RemoteDisconnected)
                and self._ssl is None
                and self.address.socket_path is None
                and _speaks_tls(self.address.host, self.address.port, self.timeout)
            ):
                # Not an outage: a TLS port spoken to in plain text closes without an
                # answer every time.
                raise TransportError(
                    f"weightserve at {self.address.url} closed the connection without "
                    "answering and its port speaks TLS: use https://"
                ) from e
            if (
                isinstance(e, http.client.RemoteDisconnected)
                and self._ssl is not None
                and self._refuses_this_client()
            ):
                raise TransportError(
                    f"weightserve at {self.address.url} completed TLS and closed the "
                    "connection without answering, again: does it require a client "
                    "certificate it accepts (TLSOptions.cert_file)?"
                ) from e
            # A server killed or restarting while the request waited: retried.
            raise ServerUnreachable(
                f"weightserve at {self.address.url} closed the connection without "
                f"answering (stopped or restarting?): {e!r}"
            ) from e
        if isinstance(e, OSError):
            raise ServerUnreachable(f"cannot reach weightserve at {self.address.url}: {e}") from e
        raise _broken_exchange(self.address, e) from e

    def _refuses_this_client(self) -> bool:
        """Whether a second TLS connection, made as this transport makes them, is closed
        unanswered too (a refused client certificate does that after the handshake), where a
        restarting server refuses the connection or answers."""
        assert self._ssl is not None
        probe = (
            f"HEAD /v1/server HTTP/1.1\r\nHost: {self.address.host}\r\nConnection: close\r\n\r\n"
        )
        try:
            with (
                socket.create_connection(
                    (self.address.host, self.address.port), timeout=min(self.timeout, 5.0)
                ) as raw,
                self._ssl.wrap_socket(raw, server_hostname=self.address.host) as sock,
            ):
                sock.sendall(probe.encode())
                return not sock.recv(5)
        except ssl.SSLError:
            return True  # refused in TLS (an alert): the same client would be again
        except OSError:
            return False  # refused, reset or silent: down, or restarting

    def _json(self, path: str, missing: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON at ``path``; with ``missing`` given, that instead of a 404's error."""
        ok = (200,) if missing is None else (200, 404)
        status, body = self._answer("GET", path, ok)
        return body if status == 200 else dict(missing or {})

    def request_json(
        self, method: str, path: str, ok: tuple[int, ...] = (200,), body: dict | None = None
    ) -> dict[str, Any]:
        """The JSON answer of any route (the operator's admin routes, publishing); another
        status raises the server's error as its class."""
        return self._answer(method, path, ok, body)[1]

    def _lines(self, path: str) -> LineStream:
        conn, resp = self._request("GET", path, extra_headers={"accept": NDJSON})
        return _HttpLines(conn, resp, f"{self.address.url}{path}")

    def upload_to(
        self,
        path: str,
        chunks: Iterable[bytes | memoryview],
        length: int,
        on_bytes: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """PUT ``length`` bytes from ``chunks`` (streamed: never held whole) on a connection
        of its own; the server's JSON answer, or its error as its class."""
        conn = self._connect()
        url = f"PUT {self.address.url}{path}"
        with map_http_errors(ServerUnreachable, f"{url}: the upload was cut off", conn.close):
            conn.putrequest("PUT", path)
            conn.putheader("content-type", "application/octet-stream")
            conn.putheader("content-length", str(length))
            conn.putheader("accept", "application/json")
            if self.token:
                conn.putheader("authorization", f"Bearer {self.token}")
            conn.endheaders()
            try:
                for chunk in chunks:
                    conn.send(chunk)
                    if on_bytes is not None:
                        on_bytes(len(chunk))
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before the end (too large, not allowed): its answer says why
            resp = conn.getresponse()
            raw = resp.read()
        conn.close()
        if resp.status != 200:
            raise _http_error(resp.status, raw, url, resp.getheader("retry-after"))
        return json.loads(raw)

    def _answer(
        self, method: str, path: str, ok: tuple[int, ...], body: dict | None = None
    ) -> tuple[int, Any]:
        conn, resp = self._request(method, path, body=body, ok=ok)
        # The server went away mid-answer: retried like one that cannot be reached.
        what = f"{self.address.url}{path}: answer cut short"
        with map_http_errors(ServerUnreachable, what, conn.close):
            raw = resp.read()
        self.release(conn, resp)
        return resp.status, json.loads(raw) if raw else None

    def list_models(self) -> dict[str, Any]:
        return self._json("/v1/models")

    def server_info(self) -> dict[str, Any]:
        """The server's data planes (``GET /v1/server``); {} from a server without it.

        Asked on the tensor streams' pool where there is one (not over TLS): a model being
        opened chooses its data planes beside its index read (client/transports/planes.py),
        and the load's first stream then goes on this request's connection."""
        path = "/v1/server"
        if self._ssl is not None:
            return self._json(path, missing={})
        request = self._lean_head("GET", path) + b"\r\n"
        conn, resp = self._lean_request("GET", path, request, ok=(200, 404))
        what = f"{self.address.url}{path}: answer cut short"
        with map_http_errors(ServerUnreachable, what, conn.close):
            raw = resp.read()
        self.release(conn, resp)
        return json.loads(raw) if resp.status == 200 and raw else {}

    def model_info(self, model: str) -> dict[str, Any]:
        return self._json(http_model_path(model))

    def open_stream(self, model: str, params: StreamParams) -> ByteSource:
        if (
            params.names is not None
            and len(params.names) == 1
            and params.shard is None
            and params.resume_tensor is None
            and params.chunk_bytes is None
        ):
            # One whole tensor: its own GET route, which the server answers on its fastest
            # path (TensorLane, service/transports/http/middleware.py); a stream request is a
            # JSON POST.
            if self._ssl is None:
                path, request = self._tensor_get(model, params.names[0], params.revision)
                return _HttpSource(self, *self._lean_request("GET", path, request))
            path = http_model_path(model, "tensors", params.names[0])
            if params.revision:
                path += "?" + urlencode({"revision": params.revision})
            conn, resp = self._request("GET", path)
            return _HttpSource(self, conn, resp)
        body: dict[str, Any] = {
            "names": list(params.names) if params.names is not None else None,
            "prefix": params.prefix,
            "axis": params.axis,
            "resume_tensor": params.resume_tensor,
            "resume_offset": params.resume_offset,
            "revision": params.revision,
        }
        if params.shard:
            body["shard"] = f"{params.shard[0]}/{params.shard[1]}"
        if params.chunk_bytes:
            body["chunk_bytes"] = params.chunk_bytes
        path = http_model_path(model, "stream")
        if self._ssl is None:
            data = json.dumps(body).encode()
            request = b"%scontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
                self._lean_head("POST", path),
                len(data),
                data,
            )
            return _HttpSource(self, *self._lean_request("POST", path, request))
        conn, resp = self._request("POST", path, body)
        return _HttpSource(self, conn, resp)

    def open_chunks(self, model: str, params: StreamParams) -> ChunkReader:
        return ArrowChunkReader(self.open_stream(model, params))

    def list_files(self, model: str) -> dict[str, Any]:
        """``{id, revision, commit, files: [{name, size, etag}]}``: the model's repository."""
        return self._json(http_model_path(model, "files"))

    def join_swarm(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        """A node cache's join of a revision's swarm (docs/protocol.md, "Peer fills")."""
        _, answer = self._answer("POST", http_model_path(model, "swarm"), ok=(200,), body=body)
        return answer

    def open_span(self, model: str, name: str, span: FileSpan) -> FileSource:
        """See ``DataTransport.open_file``; through an HTTP Range request."""
        offset, length = span.offset, span.length
        path = http_model_path(model, "files", name)
        if span.revision:
            path += "?" + urlencode({"revision": span.revision})
        headers = {}
        if offset or length is not None:
            last = "" if length is None else str(offset + length - 1)
            headers["range"] = f"bytes={offset}-{last}"
        if length == 0:  # no Range says "no bytes": ask for the headers alone
            conn, resp = self._request("HEAD", path, ok=(200,))
            resp.read()
            self.release(conn, resp)
            return _HttpFileSource(self, conn, resp, offset, 0, empty=True)
        conn, resp = self._request("GET", path, extra_headers=headers, ok=(200, 206, 416))
        if resp.status == 416:
            # Asking from the very end of a file is a finished download, not an error.
            raw = resp.read()
            conn.close()
            size = (resp.getheader("content-range") or "").rpartition("/")[2]
            if size.isdigit() and int(size) == offset:
                return _HttpFileSource(self, conn, resp, offset, 0, empty=True)
            raise _http_error(resp.status, raw, f"GET {self.address.url}{path}")
        if resp.status == 200 and offset:
            # The server ignored the range (it may: RFC 9110); never hand out wrong bytes.
            resp.close()
            conn.close()
            raise TransportError(
                f"GET {self.address.url}{path}: asked for bytes from {offset}, the server "
                "answered with the whole file"
            )
        return _HttpFileSource(self, conn, resp, offset, int(resp.getheader("content-length", 0)))

    def receiving(self, nbytes: int) -> AbstractContextManager[None]:
        """Around a load of ``nbytes``: nothing to prepare, data lands in place."""
        return contextlib.nullcontext()

    def close(self) -> None:
        with self._pool_lock:
            idle, lean = self._idle[:], self._lean_idle[:]
            self._idle.clear()  # the same lists the finalizer holds
            self._lean_idle.clear()
        _close_idle(idle, lean)


def _close_idle(*pools: list[http.client.HTTPConnection] | list[Http1Connection]) -> None:
    for pool in pools:
        for conn in pool:
            conn.close()


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a Unix socket (a server's ``--uds``): same requests, no TCP."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _HttpSource:
    def __init__(
        self,
        transport: HttpTransport,
        conn: http.client.HTTPConnection | Http1Connection,
        resp: http.client.HTTPResponse | Http1Response,
    ) -> None:
        self.transport, self.conn, self.resp = transport, conn, resp
        self.closed = False
        self._errors = map_http_errors(TransportError, f"stream from {transport.address.url} broke")

    def readinto(self, view: memoryview) -> int:
        with self._errors:
            return self.resp.readinto(view)

    def whole(self) -> memoryview | None:
        """The whole body in memory where it is small (``Http1Response.buffered_body``),
        valid until this source is closed; None: read it with ``readinto``."""
        if not isinstance(self.resp, Http1Response):
            return None
        with self._errors:
            return self.resp.buffered_body()

    def close(self) -> None:
        if self.closed:  # a second close must not pool the connection twice
            return
        self.closed = True
        # Read to its end (the receiver stops at the end marker, the last byte): keep the
        # connection; cut short: close it, the rest of the body is not worth reading.
        if self.resp.isclosed():
            self.transport.release(self.conn, self.resp)
        else:
            self.resp.close()
            self.conn.close()


class _HttpLines:
    """A ``LineStream`` over one http.client answer on a connection of its own."""

    def __init__(
        self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, url: str
    ) -> None:
        self._conn, self._resp = conn, resp
        self._errors = map_http_errors(ServerUnreachable, f"{url}: the answer was cut off")

    def header(self, name: str) -> str:
        return self._resp.getheader(name) or ""

    def readline(self, limit: int = -1, /, *, silence: float | None = None) -> bytes:
        with self._errors:
            if silence is not None and self._conn.sock is not None:
                self._conn.sock.settimeout(silence)
            return self._resp.readline(limit)

    def read(self, n: int = -1, /) -> bytes:
        with self._errors:
            return self._resp.read(n if n >= 0 else None)

    def close(self) -> None:
        # The response's file object holds the socket too: closing only the connection
        # leaves it to the collector, which warns.
        self._resp.close()
        self._conn.close()

    def interrupt(self) -> None:
        # Not close(): the reading thread still uses the connection. A shutdown wakes its
        # blocked receive, which closing the descriptor does not.
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _HttpFileSource(_HttpSource):
    """A file's bytes from a 200 or 206 answer, with what its headers say about the file."""

    def __init__(
        self,
        transport: HttpTransport,
        conn: http.client.HTTPConnection,
        resp: http.client.HTTPResponse,
        offset: int,
        length: int,
        empty: bool = False,
    ) -> None:
        super().__init__(transport, conn, resp)
        self.offset, self.length, self.empty = offset, length, empty
        self.closed = empty  # the answer was read already (and its connection released)
        self.etag = (resp.getheader("etag") or "").removeprefix("W/").strip('"')
        self.revision = resp.getheader("x-weightserve-revision") or ""
        total = (resp.getheader("content-range") or "").rpartition("/")[2]
        if total.isdigit():
            self.size = int(total)
        elif resp.status == 200 and resp.getheader("content-length", "").isdigit():
            self.size = int(resp.getheader("content-length", "0"))
        else:
            self.size = offset

    def readinto(self, view: memoryview) -> int:
        return 0 if self.empty else super().readinto(view)


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` answers a TLS ClientHello with a TLS record (a handshake or an
    alert): what tells a TLS port spoken to in plain text from a server that died mid-request
    or restarts (which refuses, resets or closes, or answers in HTTP)."""
    probe = ssl.create_default_context()
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE  # only whether it speaks TLS, not whom
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    hello = probe.wrap_bio(incoming, outgoing, server_hostname=host)
    with contextlib.suppress(ssl.SSLWantReadError):
        hello.do_handshake()
    try:
        with socket.create_connection((host, port), timeout=min(timeout, 5.0)) as sock:
            sock.sendall(outgoing.read())
            head = sock.recv(2)
    except OSError:
        return False
    # A TLS record opens with its type (22 handshake, 21 alert) and major version 3.
    return len(head) == 2 and head[0] in (21, 22) and head[1] == 3


def _broken_exchange(address: ServerAddress, e: http.client.HTTPException) -> WeightserveError:
    """What a reply that is not HTTP/1.x means: WrongTransport when it is the first frame of
    an HTTP/2 server (a SETTINGS frame, type 4, on stream 0), which is what a gRPC or Arrow
    Flight port answers; TransportError otherwise."""
    line = getattr(e, "line", "")  # http.client.BadStatusLine: the reply's first line, latin-1
    head = line[:9].encode("latin-1", errors="replace") if isinstance(line, str) else b""
    if len(head) == 9 and head[3] == 0x04 and head[5:] == b"\0\0\0\0":
        grpc_url = ServerAddress("grpc", address.tls, address.host, address.port).url
        return WrongTransport(
            f"{address.url} answered in HTTP/2 only: this is a gRPC port; use {grpc_url} "
            f"(a model: {grpc_url}/MODEL), or the server's HTTP port for http:// URLs"
        )
    return TransportError(f"{address.url}: broken HTTP exchange: {e}")


def _http_error(
    status: int, raw: bytes, what: str, retry_after: str | None = None
) -> WeightserveError:
    """The server's error (the same class it raised), or for an answer that is not ours (a
    proxy's page) an error named by its status."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    found = WireError.from_http(body, retry_after)
    if found is not None:
        return found.exception()
    hint = retry_after_seconds(retry_after)
    text = raw[:200].decode(errors="replace")
    if status == 429 and hint is not None:  # a proxy's rate limit: temporary
        return ResourceExhausted(f"{what}: HTTP 429: {text}", retry_after=hint)
    if status >= 500:
        return TransportError(f"{what}: HTTP {status}: {text}")
    return WeightserveError(f"{what}: HTTP {status}: {text}")
