"""uvicorn serving a state's HTTP app on a loopback port or a Unix socket, and the stream
bodies the ASGI path sends."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import threading
from collections.abc import Iterator

import uvicorn

from weightserve.service.config import SendfileMode
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.streams import (
    TensorRequest,
    plan_stream,
    stream_messages,
)
from weightserve.service.transports.http.app import WeightserveApp, create_app


@contextlib.contextmanager
def serving(
    state: ServiceState, protocol: str, uds: str | None = None, sendfile: SendfileMode = "on"
) -> Iterator[tuple[int, WeightserveApp]]:
    """uvicorn with ``protocol`` on a loopback port or on the Unix socket ``uds``: (port,
    the app, which counts the streams it wrote directly); ``sendfile`` as ``--sendfile``
    sets it (``on`` here, so that loopback peers exercise it)."""
    sock = None
    options: dict = {"uds": uds} if uds else {}
    if uds is None:
        # IPPROTO_TCP as the server's own listener declares it (asyncio sets TCP_NODELAY).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
    app = create_app(state, sendfile=sendfile)
    assert isinstance(app, WeightserveApp)
    config = uvicorn.Config(app, http=protocol, lifespan="off", log_level="warning", **options)
    server = uvicorn.Server(config)
    loop = asyncio.new_event_loop()
    sockets = [sock] if sock is not None else None
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(sockets),))
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            threading.Event().wait(0.01)
        yield (sock.getsockname()[1] if sock is not None else 0), app
    finally:
        server.should_exit = True
        thread.join(10)
        loop.close()


def expected_body(state: ServiceState, name: str, chunk_bytes: int) -> bytes:
    """The stream as the ASGI path sends it: every part of every message, in order."""
    model = state.catalog.get("m")
    request = TensorRequest(names=(name,), chunk_bytes=chunk_bytes)
    messages = stream_messages(model, plan_stream(model, request), chunk_bytes)
    return b"".join(bytes(part) for message in messages for part in message)


def fetch(conn: http.client.HTTPConnection, name: str, chunk_bytes: int) -> bytes:
    conn.request("GET", f"/v1/models/m/-/stream?name={name}&chunk_bytes={chunk_bytes}")
    response = conn.getresponse()
    body = response.read()
    assert response.status == 200, body[:300]
    assert len(body) == int(response.headers["content-length"])
    return body
