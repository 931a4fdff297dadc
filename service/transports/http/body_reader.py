"""A large request body read straight from the connection's socket into a file (the publish
routes' uploads).

uvicorn hands a body over in the pieces asyncio reads: at most 256 KiB each, appended to a
buffer, copied again into each ASGI message, and a turn of the event loop apiece. A large
upload instead pauses uvicorn's reading of the connection, takes what it had buffered, and
reads the rest on a thread of its own: ``recv_into`` one large block, one ``write`` per
block, the GIL released in both (docs/performance.md, "Publishing and watching revisions").

Only where the bytes on the socket are exactly the body: uvicorn's httptools cycle on plain
HTTP/1.1 (TCP or a Unix socket) with a declared Content-Length. TLS, a chunked body and the
pure-Python h11 parser keep the ASGI messages. The connection is closed after the answer:
its parser never saw the bytes read here, so the next request cannot follow on it (an
uploading client uses a connection per part anyway).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
from collections.abc import Callable
from typing import Any

from weightserve.client.wire.digests import Hasher

# Bodies from this size on are read from the socket; smaller ones cost less through the
# event loop than through a thread.
RAW_BODY_MIN_BYTES = 1 << 20
# Bytes received before one write to the file: large enough that the system calls and the
# interpreter's turns per byte vanish, small enough to stay in the CPU's last-level cache.
READ_BLOCK = 4 << 20
WRITEV_PIECES = 512  # below every platform's IOV_MAX


def plain_socket(transport: Any) -> Any:
    """The socket under an asyncio ``transport`` where bytes can go to and from it directly:
    a stream socket with no TLS over it (whose keys stay in the process), not closing;
    else None."""
    sock = transport.get_extra_info("socket")
    if (
        sock is None
        or sock.type != socket.SOCK_STREAM
        or transport.get_extra_info("sslcontext") is not None
        or transport.get_extra_info("ssl_object") is not None
        or transport.is_closing()
    ):
        return None
    return sock


class SocketBodyReader:
    """The rest of one request body, read from a duplicate of the connection's socket."""

    def __init__(self, fd: int, remaining: int, timeout: float) -> None:
        # Our own descriptor: if asyncio closes its socket meanwhile (the server stopping),
        # this number cannot be reused under the reading thread.
        self.sock = socket.socket(fileno=os.dup(fd))
        self.remaining = remaining
        self.timeout_ms = int(timeout * 1000)
        self.poller = select.poll()
        self.poller.register(self.sock.fileno(), select.POLLIN)
        self.received = 0

    @classmethod
    def attach(
        cls, cycle: Any, declared: int | None, timeout: float
    ) -> tuple[SocketBodyReader, bytes] | None:
        """Take over the body of ``cycle`` (uvicorn's request-response cycle, from the ASGI
        scope): the reader of what is still to come, and the bytes uvicorn had already
        received; None where the socket cannot be read directly (see the module's
        docstring) or the body is whole already."""
        if declared is None or declared < RAW_BODY_MIN_BYTES:
            return None
        if not type(cycle).__module__.endswith(".httptools_impl"):
            return None
        transport = getattr(cycle, "transport", None)
        flow = getattr(cycle, "flow", None)
        buffered = getattr(cycle, "body", None)
        if transport is None or flow is None or not isinstance(buffered, bytearray):
            return None
        if not getattr(cycle, "more_body", False) or getattr(cycle, "chunked_encoding", None):
            return None
        if len(buffered) > declared:
            return None  # cannot happen with a Content-Length parser; never read past it
        sock = plain_socket(transport)
        if sock is None:
            return None
        if getattr(cycle, "waiting_for_100_continue", False):
            transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        # From here uvicorn reads nothing more of this connection (on the event loop's thread:
        # no data_received can run between the pause and taking its buffer).
        flow.pause_reading()
        already = bytes(buffered)
        cycle.body = bytearray()
        cycle.keep_alive = False  # closed after the answer: see the module's docstring
        return cls(sock.fileno(), declared - len(already), timeout), already

    def read_into(
        self, fd: int, on_bytes: Callable[[int], None], hasher: Hasher | None = None
    ) -> int:
        """Receive the rest of the body and write it to ``fd`` (and to ``hasher``, from the
        CPU's cache), calling ``on_bytes`` with the total received after each block; the
        bytes read. ``EOFError``: the client closed the
        connection first; ``TimeoutError``: nothing arrived for the timeout. On a thread."""
        block = bytearray(min(READ_BLOCK, max(self.remaining, 1)))
        view = memoryview(block)
        filled = 0
        try:
            while self.remaining:
                try:
                    n = self.sock.recv_into(
                        view[filled : filled + min(len(block) - filled, self.remaining)]
                    )
                except BlockingIOError:  # asyncio's socket is non-blocking, and so is its copy
                    if not self.poller.poll(self.timeout_ms):
                        raise TimeoutError from None
                    continue
                if n == 0:
                    raise EOFError("the client closed the connection in the middle of the body")
                filled += n
                self.remaining -= n
                self.received += n
                if filled == len(block) or not self.remaining:
                    write_all(fd, [view[:filled]], hasher)
                    filled = 0
                    on_bytes(self.received)
        finally:
            view.release()
        return self.received

    def abort(self) -> None:
        """End the connection under the reading thread: its ``poll`` wakes and the next
        read sees the end."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def write_all(
    fd: int, pieces: list[bytes] | list[memoryview], hasher: Hasher | None = None
) -> None:
    """Write every piece, in order, with as few system calls as the kernel allows; each also
    to ``hasher``."""
    views = [memoryview(p) for p in pieces]
    if hasher is not None:
        for view in views:
            hasher.update(view)
    while views:
        done = os.writev(fd, views[:WRITEV_PIECES])
        while views and done >= views[0].nbytes:
            done -= views[0].nbytes
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]
