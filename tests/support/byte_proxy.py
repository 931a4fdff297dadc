"""A loopback TCP proxy that counts the bytes its upstream sends, to show what a read costs the
origin (e.g. "the second read of a cached model costs no origin bytes"), and the HTTP requests
it is asked (e.g. "a rescan lists the bucket once, with no HEAD per object"). Same shape as
CuttingProxy in tests/support/faults.py, without the cut; SlowProxy paces or holds it.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

# A request's head: its request line, then headers up to the blank line.
_REQUEST_HEAD = re.compile(rb"([A-Z]+) (\S+) HTTP/1\.[01]\r\n.*?\r\n\r\n", re.DOTALL)


class ByteCountingProxy:
    """Passes every connection to ``127.0.0.1:upstream_port``; ``bytes_from_upstream`` and
    ``connections`` count what went through, ``requests`` the HTTP requests by
    ``"METHOD TARGET"`` (requests without bodies, as reads are). ``reset()`` starts the counts
    again."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.bytes_from_upstream = 0
        self.bytes_to_upstream = 0
        self.connections = 0
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._start(self._accept)

    def __enter__(self) -> ByteCountingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        with self._lock:
            self.bytes_from_upstream = self.bytes_to_upstream = self.connections = 0
            self.requests.clear()

    def _start(self, target: Callable, *args: object) -> None:
        threading.Thread(target=target, args=args, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:  # upstream down: the client sees the connection closed
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._socks += [client, upstream]
            self._start(self._pump, client, upstream, False)
            self._start(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, from_upstream: bool) -> None:
        pending = b""  # the start of a request head not yet whole
        with contextlib.suppress(OSError):
            while data := src.recv(256 << 10):
                with self._lock:
                    if from_upstream:
                        self.bytes_from_upstream += len(data)
                    else:
                        self.bytes_to_upstream += len(data)
                        pending += data
                        end = 0
                        for head in _REQUEST_HEAD.finditer(pending):
                            self.requests[f"{head[1].decode()} {head[2].decode()}"] += 1
                            end = head.end()
                        pending = pending[end:]
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()


class SlowProxy(ByteCountingProxy):
    """A counting proxy that passes the upstream's bytes at ``rate`` bytes/s at most, and
    none at all (the connection open and silent) once ``stall_after`` bytes have passed."""

    def __init__(self, upstream_port: int, rate: float | None = None) -> None:
        self.rate = rate
        self.stall_after: int | None = None
        self._closed = threading.Event()
        super().__init__(upstream_port)

    def _pump(self, src: socket.socket, dst: socket.socket, from_upstream: bool) -> None:
        super()._pump(_SlowSocket(self, src) if from_upstream else src, dst, from_upstream)

    def close(self) -> None:
        self._closed.set()
        super().close()


class _SlowSocket:
    """The upstream side of a SlowProxy connection: its ``recv`` is paced or held."""

    def __init__(self, proxy: SlowProxy, sock: socket.socket) -> None:
        self.proxy, self.sock = proxy, sock

    def recv(self, size: int) -> bytes:
        stall_after = self.proxy.stall_after
        if stall_after is not None and self.proxy.bytes_from_upstream >= stall_after:
            self.proxy._closed.wait()
            return b""
        data = self.sock.recv(min(size, 64 << 10))
        if self.proxy.rate:
            time.sleep(len(data) / self.proxy.rate)
        return data

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)
