"""A lean HTTP/1.1 client connection for the data routes on plain sockets (TCP or a Unix
socket): a request written in one send, the answer's head parsed from one preallocated
buffer, its body read by Content-Length, chunks or to the close, straight into the caller's
memory once the buffered bytes are out. http.client's per-response objects and email header
parser were most of a small request's client time (docs/performance.md, "Small requests").

Failures raise http.client's exceptions (``RemoteDisconnected``, ``BadStatusLine``,
``IncompleteRead``, ``LineTooLong``...), so callers handle both connections alike.

A large body read runs in one native call where the extension was built
(client/wire/socket_loops.py): the GIL is let go once per read instead of at every
receive and poll, and the bytes after the read land in the connection's buffer in the same
receive. Without it, or with ``WEIGHTSERVE_NATIVE=0``, the same reads run in Python.
"""

from __future__ import annotations

import contextlib
import http.client
import select
import socket

from weightserve.client.wire import socket_loops
from weightserve.client.wire.socket_loops import _socketio

BUFFER_BYTES = 64 << 10  # holds any head we accept, and a small answer whole
MAX_HEAD_BYTES = BUFFER_BYTES
MAX_HEADERS = 100  # http.client's limit too
_NO_BODY_STATUSES = frozenset({204, 304})
KEPT_HEADS = 64  # answer heads kept parsed per connection (then parsed anew)
KEPT_HEAD_MAX_BYTES = 2048  # heads kept parsed are at most this long (a usual head: ~300)
# A large body read over TCP waits (SO_RCVLOWAT) until this many bytes are queued, instead
# of waking for every segment batch: a 1 GiB load made ~4,000 receives with a poll and a
# thread wake-up each, ~700 with this (docs/performance.md, "HTTP, whole model").
RCVLOWAT_BYTES = 1 << 20
# Below this, a read's remaining bytes are taken as they come (the framing between chunks).
RCVLOWAT_MIN_READ = 128 << 10
# How long a read waits for its low-water mark before it takes what has come: far above a
# megabyte's time on any link the mark is for. Bytes queued but short of the mark by then (a
# slow sender, or a kernel that cannot grow the receive buffer to the mark, Linux < 4.18)
# turn the mark off for the connection; the read timeout keeps meaning "no bytes for that
# long" either way.
RCVLOWAT_PATIENCE_MS = 250


class Http1Connection:
    """One kept-alive HTTP/1.1 connection: ``send`` a request, ``response`` reads its answer
    (one at a time: the previous answer's body must be read, or the connection closed)."""

    __slots__ = (
        "sock", "native", "_buf", "_view", "_start", "_end", "_heads", "_lowat", "_poller",
    )  # fmt: skip

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock
        # The socket's SO_RCVLOWAT; None where it is not used (not TCP, no poll).
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
        self._lowat: int | None = 1 if tcp and hasattr(select, "poll") else None
        self._poller: select.poll | None = None
        # Large body reads in one native call (the module's docstring).
        self.native = socket_loops.NATIVE
        self._buf = bytearray(BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unread received bytes: _buf[_start:_end]
        # Recent heads and what they parsed to: small tensors asked again get the same heads
        # (their Date changes once a second), which are not parsed again.
        self._heads: dict[bytes, tuple[int, int, str, dict[str, str]]] = {}

    @classmethod
    def tcp(cls, host: str, port: int, timeout: float) -> Http1Connection:
        sock = socket.create_connection((host, port), timeout=timeout)
        # A request is one write, but a small answer must not wait for a delayed ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock)

    @classmethod
    def unix(cls, path: str, timeout: float) -> Http1Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        return cls(sock)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    @property
    def idle(self) -> bool:
        """Open, with nothing received beyond the last answer: fit for the next request."""
        return self.sock is not None and self._start == self._end

    def send(self, request: bytes | bytearray) -> None:
        if self.sock is None:
            raise http.client.NotConnected("the connection is closed")
        self._start = self._end = 0
        self.sock.sendall(request)

    def response(self, method: str = "GET") -> Http1Response:
        """The answer to the request just sent (informational 1xx answers skipped)."""
        while True:
            status, version, reason, headers = self._read_head()
            if status >= 200 or status == 101:
                return Http1Response(self, method, status, version, reason, headers)

    # -- receiving ----------------------------------------------------------------------

    def _set_lowat(self, sock: socket.socket, lowat: int) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat
        except OSError:  # a kernel or sandbox without it: wake for any bytes, as before
            with contextlib.suppress(OSError):  # fails too where the option is unknown
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            self._lowat = None

    def _receive(self) -> int:
        """Receive more into the buffer after what it holds; 0 when the peer closed."""
        if self.sock is None:
            raise http.client.NotConnected("the connection is closed")
        if self._lowat is not None and self._lowat > 1:  # a head or framing: any bytes do
            self._set_lowat(self.sock, 1)
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # full: move what is unread to the front
            kept = self._end - self._start
            if kept == len(self._buf):
                raise http.client.LineTooLong(f"a line or head over {len(self._buf)} bytes")
            self._buf[:kept] = self._buf[self._start : self._end]
            self._start, self._end = 0, kept
        n = self.sock.recv_into(self._view[self._end :])
        self._end += n
        return n

    def _read_head(self) -> tuple[int, int, str, dict[str, str]]:
        buf = self._buf
        while True:
            end = buf.find(b"\r\n\r\n", self._start, self._end)
            if end >= 0:
                break
            have = self._end - self._start
            if have >= 5 and buf[self._start : self._start + 5] != b"HTTP/":
                # Not HTTP/1.x at all (e.g. an HTTP/2 server's first frame): say so now.
                raise http.client.BadStatusLine(
                    bytes(buf[self._start : self._end]).decode("latin-1")
                )
            if have >= MAX_HEAD_BYTES:
                raise http.client.LineTooLong(f"an answer head over {MAX_HEAD_BYTES} bytes")
            if not self._receive():
                if self._end == self._start:
                    raise http.client.RemoteDisconnected(
                        "Remote end closed connection without response"
                    )
                raise http.client.BadStatusLine(
                    bytes(buf[self._start : self._end]).decode("latin-1")
                )
        raw = bytes(buf[self._start : end])
        self._start = end + 4
        parsed = self._heads.get(raw)
        if parsed is None:
            parsed = self._parse_head(raw)
            if len(raw) <= KEPT_HEAD_MAX_BYTES:  # a usual head; a huge one is parsed each time
                if len(self._heads) >= KEPT_HEADS:
                    self._heads.clear()
                self._heads[raw] = parsed
        status, version, reason, headers = parsed
        return status, version, reason, dict(headers)

    @staticmethod
    def _parse_head(raw: bytes) -> tuple[int, int, str, dict[str, str]]:
        head = raw.decode("latin-1")
        lines = head.split("\r\n")
        status_line = lines[0]
        version_text, _, rest = status_line.partition(" ")
        code, _, reason = rest.partition(" ")
        if version_text not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
            raise http.client.BadStatusLine(status_line)
        if len(lines) > MAX_HEADERS + 1:
            raise http.client.HTTPException(f"got more than {MAX_HEADERS} headers")
        headers: dict[str, str] = {}
        last = ""
        for line in lines[1:]:
            if line[:1] in (" ", "\t"):  # obsolete folding: continues the previous value
                if not last:
                    raise http.client.HTTPException(f"a header line without a name: {line!r}")
                headers[last] += " " + line.strip()
                continue
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise http.client.HTTPException(f"malformed header line: {line!r}")
            last = name.lower()
            value = value.strip()
            headers[last] = f"{headers[last]}, {value}" if last in headers else value
        return int(code), 11 if version_text == "HTTP/1.1" else 10, reason.strip(), headers

    def _readinto(self, view: memoryview, owed: bool = False) -> int:
        """Up to ``len(view)`` body bytes: buffered ones first, else one receive straight
        into ``view``; 0 when the peer closed. ``owed``: the peer sends at least
        ``len(view)`` more bytes unasked (the rest of a body of known length), so a large
        read may wait for a good part of them (``RCVLOWAT_BYTES``) before waking."""
        buffered = self._end - self._start
        if buffered:
            n = min(buffered, len(view))
            view[:n] = self._view[self._start : self._start + n]
            self._start += n
            return n
        sock = self.sock
        if sock is None:
            raise http.client.NotConnected("the connection is closed")
        lowat = self._lowat
        if owed and self.native and len(view) >= RCVLOWAT_MIN_READ:
            return self._receive_owed(sock, view)
        if lowat is None:
            return sock.recv_into(view)
        # Never wait for more than the peer owes: a poll would sit out the timeout.
        size = len(view) if owed else 1
        if size >= RCVLOWAT_BYTES:
            if lowat != RCVLOWAT_BYTES:
                self._set_lowat(sock, RCVLOWAT_BYTES)
        elif lowat > size:
            self._set_lowat(sock, size if size >= RCVLOWAT_MIN_READ else 1)
        if self._lowat and self._lowat > 1 and not self._readable(sock, RCVLOWAT_PATIENCE_MS):
            self._set_lowat(sock, 1)  # this read takes what comes, as before
            if self._readable(sock, 0):  # bytes came, short of the mark: not for this link
                self._lowat = None
        return sock.recv_into(view)

    def _receive_owed(self, sock: socket.socket, view: memoryview) -> int:
        """All of ``view`` (owed by the peer, the connection's buffer empty) in one native
        call; what arrives past it in the same receive is kept in the buffer. Fewer bytes
        only where the peer closed."""
        assert _socketio is not None
        timeout = sock.gettimeout()
        lowat = self._lowat
        self._start = self._end = 0
        n, spilled, mark, current = _socketio.recv_into_all(
            sock.fileno(),
            view,
            self._view,
            -1 if timeout is None else int(timeout * 1000),
            0 if lowat is None else RCVLOWAT_BYTES,
            lowat or 1,
            RCVLOWAT_PATIENCE_MS,
        )
        self._end = spilled
        if lowat is not None:
            self._lowat = current if mark else None  # 0: the mark is not for this link
        return n

    def _readable(self, sock: socket.socket, timeout_ms: int) -> bool:
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(sock, select.POLLIN)
        return bool(poller.poll(timeout_ms))

    def _readline(self) -> bytes:
        """One line (without its CRLF) of a chunked body's framing."""
        while True:
            at = self._buf.find(b"\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._buf[self._start : at])
                self._start = at + 1
                return line.rstrip(b"\r")
            if not self._receive():
                raise http.client.IncompleteRead(b"")


class Http1Response:
    """An answer's status and headers, and its body through ``readinto`` / ``read``.

    The parts of ``http.client.HTTPResponse`` the transport uses: ``status``, ``reason``,
    ``getheader``, ``will_close``, ``isclosed`` (the body was read to its end), ``close``."""

    __slots__ = (
        "conn", "status", "version", "reason", "headers", "will_close", "_left", "_chunked",
        "_chunk_left", "_to_close", "_done",
    )  # fmt: skip

    def __init__(
        self,
        conn: Http1Connection,
        method: str,
        status: int,
        version: int,
        reason: str,
        headers: dict[str, str],
    ) -> None:
        self.conn: Http1Connection | None = conn
        self.status, self.version, self.reason, self.headers = status, version, reason, headers
        connection = headers.get("connection")
        tokens = {t.strip().lower() for t in connection.split(",")} if connection else ()
        self.will_close = "close" in tokens or (version == 10 and "keep-alive" not in tokens)
        self._left = 0  # Content-Length bytes still to read
        self._chunked = False
        self._chunk_left = 0  # bytes left of the current chunk; -1 before its size line
        self._to_close = False  # the body runs until the server closes
        codings = headers.get("transfer-encoding", "")
        if method == "HEAD" or status in _NO_BODY_STATUSES or 100 <= status < 200:
            self._done = True
        elif codings:
            if codings.rsplit(",", 1)[-1].strip().lower() != "chunked":
                raise http.client.HTTPException(f"unsupported transfer coding {codings!r}")
            self._chunked, self._chunk_left, self._done = True, -1, False
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise http.client.HTTPException(f"bad Content-Length {length!r}")
            self._left = int(length)
            self._done = self._left == 0
        else:
            self._to_close, self.will_close, self._done = True, True, False

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)

    def isclosed(self) -> bool:
        return self._done

    def close(self) -> None:
        """Leave the rest of the body unread: the connection cannot serve another request."""
        if not self._done:
            self._done = True
            self.will_close = True
            if self.conn is not None:
                self.conn.close()

    def buffered_body(self) -> memoryview | None:
        """The whole body, received into the connection's buffer where its Content-Length
        says it fits (a small answer usually came whole with its head), to be parsed from
        memory with no more receives; the answer is then read to its end. The view is valid
        until the connection's next request. None where it does not fit, has no length, or
        the server closed before its end (``readinto`` then says so)."""
        conn = self.conn
        if self._done or self._chunked or self._to_close or conn is None:
            return None
        if self._left > len(conn._buf):
            return None
        while conn._end - conn._start < self._left:
            if not conn._receive():
                return None
        start = conn._start
        conn._start += self._left
        self._left, self._done = 0, True
        return conn._view[start : conn._start]

    def readinto(self, view: memoryview | bytearray) -> int:
        """Body bytes into ``view``: fewer than asked for whenever the socket has fewer
        ready; 0 only at the body's end."""
        if self._done:
            return 0
        conn = self.conn
        assert conn is not None
        if not isinstance(view, memoryview):
            view = memoryview(view)
        if self._chunked:
            try:
                return self._read_chunked(conn, view)
            except http.client.HTTPException:
                self._done, self.will_close = True, True  # lost its framing: unusable
                conn.close()
                raise
        if self._to_close:
            n = conn._readinto(view)
            if not n:
                self._done = True
                conn.close()
            return n
        if len(view) > self._left:
            view = view[: self._left]
        n = conn._readinto(view, owed=True)
        if not n:
            left, self._left, self._done = self._left, 0, True
            conn.close()
            raise http.client.IncompleteRead(b"", left)
        self._left -= n
        if not self._left:
            self._done = True
        return n

    def _read_chunked(self, conn: Http1Connection, view: memoryview) -> int:
        if self._chunk_left <= 0:
            if self._chunk_left == 0 and conn._readline():  # the CRLF after a chunk's data
                raise http.client.HTTPException("a chunk's data overran its size")
            size_text = conn._readline().split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise http.client.IncompleteRead(b"") from None
            if size < 0:
                raise http.client.HTTPException(f"negative chunk size {size_text!r}")
            if size == 0:
                while conn._readline():  # trailers, up to the empty line
                    pass
                self._done = True
                return 0
            self._chunk_left = size
        n = conn._readinto(
            view[: self._chunk_left] if len(view) > self._chunk_left else view, owed=True
        )
        if not n:
            self._done = True
            conn.close()
            raise http.client.IncompleteRead(b"", self._chunk_left)
        self._chunk_left -= n
        return n

    def read(self) -> bytes:
        """The rest of the body."""
        out = bytearray()
        scratch = bytearray(BUFFER_BYTES)
        view = memoryview(scratch)
        while n := self.readinto(view):
            out += view[:n]
        return bytes(out)
