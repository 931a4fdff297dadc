"""The HTTP app served by uvicorn, on a TCP port or on the same-node Unix socket: one
``Listener`` (service/transports/listener.py) each, on a thread and event loop of its own."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from typing import Any

import uvicorn

from weightserve.service.transports.listener import (
    StartupError,
    claim_socket_path,
    listen_error,
    remove_socket_file,
)


class UvicornListener:
    """``app`` on one socket. ``start`` binds (``port``: the TCP port bound, 0 on a Unix
    socket or before start) and returns once uvicorn serves; ``stop`` lets open connections finish their
    answer unless forced."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        uds: str | None = None,
        uds_mode: int = 0o666,
        idle_timeout: float = 60.0,
        grace_seconds: float = 30.0,
        **tls: Any,
    ) -> None:
        self.name = f"HTTP on {uds}" if uds else "HTTP"
        self.app, self.host, self.uds, self.uds_mode = app, host, uds, uds_mode
        self.bind_port = port
        self.port = 0  # the TCP port bound, once started
        self.idle_timeout = idle_timeout
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                # No logging setup of uvicorn's own: its records go through the process's
                # handlers, JSON lines under `weightserve serve` (service/logs.py).
                log_config=None,
                lifespan="off",
                access_log=False,
                timeout_graceful_shutdown=int(grace_seconds),
                **tls,
            )
        )
        self._thread: threading.Thread | None = None
        self._socket_file: str | None = None  # the Unix socket this listener created

    def _bind_tcp(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP given explicitly: asyncio sets TCP_NODELAY only on sockets that say so,
        # and without it small responses on kept-alive connections wait for the client's
        # delayed ACK (Nagle; docs/performance.md).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux; accepted connections inherit it
            # A client that stops reading is cut by the stream's idle timeout, but closing the
            # connection waits for its unsent data; this lets the kernel drop it instead.
            idle_ms = int(self.idle_timeout * 1000)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, idle_ms)
        try:
            sock.bind((self.host, self.bind_port))
        except OSError as e:
            sock.close()
            raise listen_error("HTTP", "http_port", self.host, self.bind_port, e) from None
        self.port = sock.getsockname()[1]
        return sock

    def _bind_unix(self, path: str) -> socket.socket:
        claim_socket_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, self.uds_mode)
        except OSError as e:
            sock.close()
            raise StartupError("uds", f"cannot listen on {path}: {e.strerror or e}") from None
        self._socket_file = path
        return sock

    def start(self) -> None:
        sock = self._bind_unix(self.uds) if self.uds else self._bind_tcp()
        server = self.server

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(server.serve(sockets=[sock]))
            finally:
                loop.close()

        self._thread = threading.Thread(target=serve, name="weightserve-http", daemon=True)
        self._thread.start()
        while not server.started and self._thread.is_alive():
            self._thread.join(0.01)
        if not server.started:
            where = self.uds or f"{self.host}:{self.port}"
            raise StartupError(
                "uds" if self.uds else "http_port", f"HTTP failed to start on {where}"
            )

    def drain(self) -> None:
        """Nothing to announce: /readyz says so from the shared state."""

    def stop(self, force: bool, wait: float) -> None:
        self.server.should_exit = True
        if force:
            abort_streams = getattr(self.app, "abort_streams", None)
            if abort_streams is not None:  # streams on writer threads outlive uvicorn's loop
                abort_streams()
            self.server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=wait)
        if self._socket_file is not None:
            remove_socket_file(self._socket_file)
