"""The HTTP transport: FastAPI routes over the shared catalog.

Metadata is JSON; tensor data is an Arrow IPC stream (``application/vnd.apache.arrow.stream``)
sent with an exact Content-Length (no chunked-encoding copy). On plain TCP under uvicorn the
body goes out through ``_SocketWriter``: ``writev`` from the mapped file, no user-space copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import mmap
import os
import select
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.routing import Match

from weightserve.client.errors import (
    InvalidRequest,
    ModelUnavailable,
    WeightserveError,
    status_for,
)
from weightserve.client.wire.schema import ARROW_STREAM_MEDIA_TYPE, DEFAULT_CHUNK_BYTES
from weightserve.service.serving import request as requests
from weightserve.service.serving import views as models_view
from weightserve.service.serving.auth import Access, authorize
from weightserve.service.serving.request import TensorRequest
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.streams import stream_length, stream_messages
from weightserve.service.serving.views import server_version
from weightserve.service.transports.http import browser as web_app
from weightserve.service.transports.http.docs import add_offline_docs
from weightserve.service.transports.http.routes import Target, get_and_head, resolve_legacy

log = logging.getLogger("weightserve.http")


class StreamBody(BaseModel):
    """A tensor request in a POST body (for name lists too long for a URL)."""

    names: list[str] | None = None
    prefix: str | None = None
    shard: str | None = Field(None, description="'k/n': part k of n along `axis`")
    axis: int = 0
    resume_tensor: str | None = None
    resume_offset: int = 0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    revision: str | None = None


# An ASGI stream gives the event loop a turn after this many tensor bytes (see below).
PAUSE_EVERY_BYTES = 8 << 20


class ArrowStreamResponse(Response):
    """Writes the stream's pieces as they come; stops early when the client goes away."""

    media_type = ARROW_STREAM_MEDIA_TYPE

    def __init__(
        self,
        state: ServiceState,
        model_id: str,
        messages: Iterator,
        length: int,
        headers: dict[str, str],
        release: Any,
        status_code: int = 200,
        media_type: str | None = None,
    ) -> None:
        # The files API sends a file's bytes (or a 206 range of them) the same way, as
        # messages ``(b"", data)``: the data part is what the bytes-served metric counts.
        super().__init__(
            content=None,
            status_code=status_code,
            headers={**headers, "content-length": str(length)},
            media_type=media_type or self.media_type,
        )
        self.state = state
        self.model_id = model_id
        self.messages = messages
        self.length = length
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.length < DIRECT_WRITE_MIN_BYTES:
            return await self._send_whole(scope, send)

        async def wait_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        gone = asyncio.ensure_future(wait_disconnect())
        sent = 0
        pause_at = PAUSE_EVERY_BYTES
        metrics = self.state.metrics
        idle = _IdleCut(self.state.limits.idle_timeout)
        writer: _SocketWriter | None = None
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            writer = await _SocketWriter.attach(scope, self.state.limits.idle_timeout)
            if writer is not None:
                idle.close()  # the writer enforces the idle timeout itself
                # Messages are taken (digests included) and written on a worker thread, a
                # batch per hop; between batches the loop runs and a client gone is noticed.
                while not gone.done():
                    written, finished = await asyncio.to_thread(writer.write_some, self.messages)
                    sent += written
                    if finished:
                        break
                else:
                    scope[ERROR_KEY] = "Cancelled"
                    return
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            for message in self.messages:
                if gone.done():
                    scope[ERROR_KEY] = "Cancelled"
                    break
                if len(message) > 1:
                    sent += len(message[1])  # tensor data bytes, not framing
                    if sent >= pause_at:
                        # uvicorn's send returns without yielding while the socket takes the
                        # bytes, and after a client resets until the loop runs connection_lost:
                        # without a pause, a client that left gets the rest of the stream
                        # read, hashed and written into the void, with the loop blocked.
                        pause_at = sent + PAUSE_EVERY_BYTES
                        await asyncio.sleep(0)
                for part in message:
                    if not part:
                        continue
                    if isinstance(part, memoryview) and isinstance(part.obj, mmap.mmap):
                        # Tensor bytes, read from the mapping when written. A send may wait
                        # (socket full) for as long as the client likes, so wait here with an
                        # empty write, then check the file still covers the bytes: reading a
                        # mapped page a truncation removed is SIGBUS, which kills the process.
                        await send({"type": "http.response.body", "body": b"", "more_body": True})
                        _ensure_still_mapped(part.obj)
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                    idle.progress()
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # Returning with the response incomplete makes uvicorn close the connection.
            self._cut_idle(scope, idle)
        except WeightserveError as e:  # e.g. a file truncated while being served
            scope[ERROR_KEY] = type(e).__name__
            log.warning("stream of model %s broke: %s", self.model_id, e)
        except (OSError, TimeoutError) as e:  # direct writes: the client left or stalled
            scope[ERROR_KEY] = "IdleTimeout" if isinstance(e, TimeoutError) else "Cancelled"
            log.warning(
                "stream of model %s to %s cut: %s",
                self.model_id,
                (scope.get("client") or ("?",))[0],
                e,
            )
        finally:
            if writer is not None:
                writer.close()
                app = scope.get("app")
                if isinstance(app, WeightserveApp):
                    app.direct_bytes += writer.written
            idle.close()
            gone.cancel()
            self.release()
            metrics.bytes_served.labels("http", self.model_id).inc(sent)

    def _cut_idle(self, scope: Any, idle: _IdleCut | None) -> None:
        """Inside ``except CancelledError``: re-raise unless the idle cut cancelled the
        stream, which ends as ``IdleTimeout``."""
        if idle is None or not idle.fired:
            raise  # noqa: PLE0704 - always called while handling the cancellation
        idle.uncancel()
        scope[ERROR_KEY] = "IdleTimeout"
        log.warning(
            "stream of model %s to %s cut: the client read nothing for %.1f s",
            self.model_id,
            (scope.get("client") or ("?",))[0],
            idle.timeout,
        )

    async def _send_whole(self, scope: Any, send: Any) -> None:
        """A small stream as one body after its headers, corked into one TCP segment where
        the connection allows: each segment costs the server ~0.1 ms of CPU on a kept-alive
        connection (profiled), more than the whole small request's framing and digests."""
        sent = 0
        idle: _IdleCut | None = None
        released = False
        try:
            body, data_bytes = bytearray(), 0
            for message in self.messages:  # an error here is answered with its own status
                for part in message:
                    if isinstance(part, memoryview) and isinstance(part.obj, mmap.mmap):
                        _ensure_still_mapped(part.obj)  # before reading it (SIGBUS)
                    body += part
                if len(message) > 1:
                    data_bytes += len(message[1])  # tensor data bytes, not framing
            # The bytes are copied: the files and the stream slot are free before the client
            # has them, so a slow reader holds neither.
            released = True
            self.release()
            idle = _IdleCut(self.state.limits.idle_timeout)  # a client that reads nothing
            with _corked(scope):
                start = {"type": "http.response.start", "status": self.status_code}
                await send({**start, "headers": self.raw_headers})
                await send({"type": "http.response.body", "body": bytes(body), "more_body": False})
            sent = data_bytes
        except asyncio.CancelledError:
            self._cut_idle(scope, idle)
        finally:
            if idle is not None:
                idle.close()
            if not released:
                self.release()
            self.state.metrics.bytes_served.labels("http", self.model_id).inc(sent)


@contextlib.contextmanager
def _corked(scope: Any) -> Iterator[None]:
    """TCP_CORK on uvicorn's TCP connection inside: what is written goes out as full
    segments, the rest when it ends (Linux). Elsewhere nothing happens."""
    cycle = scope.get(CYCLE_KEY)
    transport = getattr(cycle, "transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    cork = getattr(socket, "TCP_CORK", None)
    if sock is None or cork is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        yield
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, cork, 1)
    except OSError:  # the connection is gone: nothing to cork
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, cork, 0)


# Bodies this long go out through _SocketWriter where it can engage; shorter ones (a small
# tensor) cost less through the event loop's own write than through a worker thread.
DIRECT_WRITE_MIN_BYTES = 1 << 20
# ASGI scope key: uvicorn's request-response cycle of a plain HTTP/1.1 connection, set by
# the outermost layer (WeightserveApp.__call__) before Starlette wraps ``send``.
CYCLE_KEY = "weightserve.uvicorn_cycle"


def _uvicorn_cycle_types() -> tuple[type, ...]:
    """uvicorn's HTTP/1.1 request-response cycles (httptools and h11), those installed."""
    found = []
    for module in ("httptools_impl", "h11_impl"):
        try:
            imported = importlib.import_module(f"uvicorn.protocols.http.{module}")
        except ImportError:  # httptools not installed, or no uvicorn at all
            continue
        found.append(imported.RequestResponseCycle)
    return tuple(found)


_CYCLE_TYPES = _uvicorn_cycle_types()


class _SocketWriter:
    """Writes stream messages straight to the connection's socket with ``writev``.

    asyncio (before 3.12) copies whatever a socket doesn't take at once into its own buffer,
    which was most of the HTTP server's time; here the kernel copies tensor bytes from the
    mapping to the socket and nothing else does. The writes run on a worker thread (the GIL
    is released in writev and poll), so several streams proceed in parallel. A page that a
    truncation removed makes the kernel fail the write (EFAULT) instead of raising SIGBUS.

    Only for uvicorn's plain HTTP/1.1 connections (TCP or a Unix socket), found through the
    cycle ``WeightserveApp`` puts in the scope: the server's Content-Length accounting is
    adjusted here (httptools counts down ``expected_content_length``, h11 its writer's
    length). TLS, other servers and anything unrecognised use ASGI sends.
    """

    def __init__(self, account: Callable[[int], None], fd: int, idle_timeout: float) -> None:
        self.account = account
        self.written = 0  # body bytes, framing included
        # Our own descriptor: if asyncio closes its socket (client gone), this number can't
        # be reused by another connection while a write is still in flight.
        self.fd = os.dup(fd)
        self.idle_ms = int(idle_timeout * 1000)

    @classmethod
    async def attach(cls, scope: Any, idle_timeout: float) -> _SocketWriter | None:
        cycle = scope.get(CYCLE_KEY)
        transport = getattr(cycle, "transport", None)
        account = _content_length_account(cycle)
        if transport is None or account is None:
            return None
        sock = transport.get_extra_info("socket")
        if (
            sock is None
            or sock.type != socket.SOCK_STREAM
            or transport.get_extra_info("sslcontext") is not None
            or transport.get_extra_info("ssl_object") is not None
            or transport.is_closing()
        ):
            return None
        # The status line and headers must be on the wire before the body.
        while transport.get_write_buffer_size():
            await asyncio.sleep(0.001)
            if transport.is_closing():
                return None
        app = scope.get("app")
        if isinstance(app, WeightserveApp):
            app.direct_streams += 1
        return cls(account, sock.fileno(), idle_timeout)

    def write_some(self, messages: Iterator[tuple]) -> tuple[int, bool]:
        """Take and write messages until ``PAUSE_EVERY_BYTES`` tensor bytes went out or the
        stream ended: (tensor bytes written, whether the stream ended)."""
        written = 0
        for message in messages:
            data = message[1] if len(message) > 1 else None
            if isinstance(data, memoryview) and isinstance(data.obj, mmap.mmap):
                _ensure_still_mapped(data.obj)
            self.write_all(message)
            if data is not None:
                written += len(data)
                if written >= PAUSE_EVERY_BYTES:
                    return written, False
        return written, True

    def write_all(self, parts: tuple) -> None:
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        total = sum(len(v) for v in views)
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)
        while views:
            try:
                n = os.writev(self.fd, views)
            except BlockingIOError:
                if not poller.poll(self.idle_ms):
                    raise TimeoutError(
                        f"the client read nothing for {self.idle_ms / 1000:.1f} s"
                    ) from None
                continue
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]
        self.account(total)
        self.written += total

    def close(self) -> None:
        os.close(self.fd)


def _content_length_account(cycle: Any) -> Callable[[int], None] | None:
    """What tells uvicorn's cycle that ``n`` body bytes went out behind its back, so its
    Content-Length check at the end of the response holds; None for anything else."""
    if not _CYCLE_TYPES or not isinstance(cycle, _CYCLE_TYPES):
        return None
    if hasattr(cycle, "expected_content_length"):  # httptools
        if getattr(cycle, "chunked_encoding", None):
            return None

        def count_down(n: int) -> None:
            cycle.expected_content_length -= n

        return count_down
    writer: Any = getattr(getattr(cycle, "conn", None), "_writer", None)  # h11's body writer
    if type(writer).__name__ != "ContentLengthWriter" or not isinstance(
        getattr(writer, "_length", None), int
    ):
        return None

    def h11_count_down(n: int) -> None:
        writer._length -= n

    return h11_count_down


def _ensure_still_mapped(mapping: mmap.mmap) -> None:
    """ModelUnavailable if the file behind ``mapping`` shrank since it was mapped (one fstat):
    see ``MappedFile.ensure_unchanged``."""
    if mapping.size() < len(mapping):
        raise ModelUnavailable(
            "a file of this model was truncated while being served; the model reloads on its "
            "next request"
        )


class _IdleCut:
    """Cancels the current task once no write has completed for ``timeout`` seconds.

    A client that stops reading blocks ``send`` (uvicorn waits for the socket to drain), which
    would hold the stream's slot forever. One timer per stream, re-armed lazily, costs nothing
    per write (``asyncio.wait_for`` would cost a task per write).
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.last = self.loop.time()
        self.fired = False
        self._handle = self.loop.call_later(timeout, self._check)

    def progress(self) -> None:
        self.last = self.loop.time()

    def _check(self) -> None:
        waited = self.loop.time() - self.last
        if waited >= self.timeout:
            self.fired = True
            if self.task is not None:
                self.task.cancel()
        else:
            self._handle = self.loop.call_later(self.timeout - waited, self._check)

    def uncancel(self) -> None:
        uncancel = getattr(self.task, "uncancel", None)  # Python 3.11+
        if uncancel is not None:
            uncancel()

    def close(self) -> None:
        self._handle.cancel()


class BodyLimit:
    """Refuses request bodies over ``limits.max_request_bytes`` with 413 before the app reads
    them: by Content-Length, or for a chunked body (no Content-Length) by counting the bytes
    as they arrive, so leaving out the length does not get around the limit."""

    def __init__(self, app: Any, state: ServiceState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.state.limits.max_request_bytes
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > limit:
                return await _too_large(scope, receive, send, f"{int(length)} bytes", limit)
            return await self.app(scope, receive, send)
        if b"transfer-encoding" not in headers:
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            body += message.get("body", b"")
            if len(body) > limit:
                return await _too_large(scope, receive, send, f"more than {limit} bytes", limit)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)


async def _too_large(scope: Any, receive: Any, send: Any, size: str, limit: int) -> None:
    scope[ERROR_KEY] = "ResourceExhausted"
    response = JSONResponse(
        {"error": {"type": "ResourceExhausted",
                   "message": f"request body of {size}; the limit is {limit}"}},
        status_code=413,
    )  # fmt: skip
    await response(scope, receive, send)


# ASGI scope keys the app sets for CallMetrics: the error class a request ended with, and the
# operation when its route alone does not say (a stream reached through a route of its own).
ERROR_KEY = "weightserve.error"
OPERATION_KEY = "weightserve.operation"


def route_operation(path: str) -> str:
    """The ``operation`` label of a route template: a fixed set, never a model id."""
    if path == "/v1/models":
        return "list_models"
    if "/-/files/" in path or "/resolve/" in path:  # a file's bytes, Hub routes included
        return "file"
    if path.startswith("/v1/models/"):
        return "stream" if path.endswith("/stream") or "/tensors/" in path else "model_info"
    if path.startswith("/api/"):  # the Hub-compatible model info and file listings
        return "model_info"
    fixed = {
        "/healthz": "health",
        "/readyz": "ready",
        "/metrics": "metrics",
        "/v1/server": "server_info",
    }
    if path in fixed:
        return fixed[path]
    if path.startswith(("/docs", "/redoc", "/openapi")):
        return "docs"
    return "other"


TENSOR_ROUTE_PART = "/-/tensors/"


def tensor_lane_target(scope: Any) -> tuple[str, str, str | None] | None:
    """(model, tensor name, revision) of a plain ``GET /v1/models/ID/-/tensors/NAME`` (at
    most a ``revision`` query), which ``TensorLane`` answers; None for anything else."""
    if scope["type"] != "http" or scope["method"] != "GET" or scope.get("root_path"):
        return None
    path: str = scope["path"]
    if not path.startswith("/v1/models/"):
        return None
    # Model ids have no path part "-", so the first "/-/tensors/" ends the id.
    model, found, name = path[len("/v1/models/") :].partition(TENSOR_ROUTE_PART)
    if not found or not model or not name:
        return None
    revision = None
    query: bytes = scope.get("query_string", b"")
    if query:
        pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
        if len(pairs) != 1 or pairs[0][0] != "revision":
            return None  # shard, axis, anything else: the route validates it
        revision = pairs[0][1] or None
    return model, name, revision


class TensorLane:
    """One small tensor, the commonest small request, answered without FastAPI's routing and
    parameter validation (two fifths of such a request's server time, profiled): the same
    ``start_stream`` as the route, inside the metrics and body-limit middleware. Anything
    but a plain GET of one tensor goes on to the routes."""

    answered = 0  # requests this lane answered since start (tests check it engages)

    def __init__(self, app: Any, answer: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.answer = answer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        target = tensor_lane_target(scope)
        if target is None:
            return await self.app(scope, receive, send)
        TensorLane.answered += 1
        await self.answer(scope, receive, send, *target)


class CallMetrics:
    """Counts every HTTP request as it ends (``Metrics.http``): by operation and status, its
    latency when it succeeded, its error class when not.

    The outermost middleware, so requests that BodyLimit refuses, unknown paths and unhandled
    errors are counted too. The operation comes from the matched route's template, once per
    route; a stream cut after its 200 counts as a failure with the class that cut it.
    """

    def __init__(self, app: Any, state: ServiceState) -> None:
        self.app = app
        self.calls = state.metrics.http
        self._by_route: dict[int, str] = {}  # id(route) -> operation; routes are unhashable

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 0
        path, root_path = scope["path"], scope.get("root_path", "")  # a Mount changes them

        async def send_noting_status(message: Any) -> None:
            nonlocal status
            if not status and message["type"] == "http.response.start":  # once per request
                status = message["status"]
            await send(message)

        error: str | None = "Internal"  # unless the app returns
        try:
            await self.app(scope, receive, send_noting_status)
            error = scope.get(ERROR_KEY)
        except asyncio.CancelledError:
            error = "Cancelled"
            raise
        finally:
            if not status:  # nothing answered: the client left, or Starlette answers 500
                status, error = (500, error) if error == "Internal" else (499, "Cancelled")
            operation = scope.get(OPERATION_KEY) or self._operation(scope, path, root_path)
            if error is None and status < 400:
                self.calls.succeeded(operation, str(status), time.perf_counter() - started)
            else:
                self.calls.failed(operation, str(status), error or f"HTTP{status}")

    def _operation(self, scope: Any, path: str, root_path: str) -> str:
        route = scope.get("route")
        if route is None:
            # FastAPI records only its own routes: this is a mount (the docs' assets), a
            # plain route (/openapi.json), a request refused before routing (413) or one no
            # route serves (404). Match it as it arrived.
            arrived = {**scope, "path": path, "root_path": root_path}
            return route_operation(_route_path(arrived))
        operation = self._by_route.get(id(route))
        if operation is None:
            operation = route_operation(getattr(route, "path", ""))
            self._by_route[id(route)] = operation
        return operation


def _route_path(scope: Any) -> str:
    """The template of the route a request that never reached the router would take."""
    app = scope.get("app")
    partial = ""
    for route in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return str(getattr(route, "path", ""))
        if match is Match.PARTIAL and not partial:  # the path matches, the method not
            partial = str(getattr(route, "path", ""))
    return partial


# Every route that answers with an Arrow stream. status_code is given because
# ArrowStreamResponse.__init__ has none for OpenAPI to read.
ARROW_ROUTE: dict[str, Any] = {
    "tags": ["tensors"],
    "response_class": ArrowStreamResponse,
    "status_code": 200,
    "responses": {200: {"content": {ARROW_STREAM_MEDIA_TYPE: {}}}},
}


class WeightserveApp(FastAPI):
    """The FastAPI app, and the outermost ASGI layer uvicorn calls: before Starlette wraps
    ``send`` it notes the server's own request-response cycle in the scope (``CYCLE_KEY``),
    where a stream's ``_SocketWriter`` finds it."""

    # Streams and body bytes written with _SocketWriter (tests check that the path engages).
    direct_streams = 0
    direct_bytes = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("http_version") == "1.1":
            cycle = getattr(send, "__self__", None)
            if _CYCLE_TYPES and isinstance(cycle, _CYCLE_TYPES):
                scope[CYCLE_KEY] = cycle
        await super().__call__(scope, receive, send)


# A stream request naming at most this many tensors is planned on the event loop when the
# catalog answers from memory (Catalog.answers_now); longer lists and prefixes are planned on
# a worker thread, as is any request whose model must be checked, loaded or hashed first.
INLINE_MAX_NAMES = 16
# The same for a model's info: its tensor index rendered as JSON on the loop up to this size.
INLINE_MAX_TENSORS = 1024


def create_app(state: ServiceState) -> FastAPI:
    app = WeightserveApp(
        title="weightserve",
        description="Model weights as Apache Arrow streams. Tensor data: Arrow IPC stream, "
        "one row per chunk of a tensor (see docs/protocol.md). Every GET route answers "
        "HEAD too. Model ids never have a path part `-`: routes below a model start with "
        "it (`/v1/models/{model}/-/stream`), so no model id or tensor name collides with one.",
        version="1",
        docs_url=None,  # add_offline_docs: the pages' assets come from this server, no CDN
        redoc_url=None,
    )
    catalog = state.catalog
    add_offline_docs(app)

    def access(request: Request) -> Access:
        return authorize(state.tokens, request.headers.get("authorization"))

    async def tensor_lane(
        scope: Any, receive: Any, send: Any, model: str, name: str, revision: str | None
    ) -> None:
        http = Request(scope, receive)
        try:
            request = TensorRequest(names=(name,), revision=revision)
            response = await stream_response(http, model, request)
        except WeightserveError as e:
            response = await weightserve_error(http, e)
        await response(scope, receive, send)

    app.add_middleware(TensorLane, answer=tensor_lane)  # innermost of the three
    app.add_middleware(BodyLimit, state=state)
    app.add_middleware(CallMetrics, state=state)  # added last: outermost, sees every answer

    @app.exception_handler(WeightserveError)
    async def weightserve_error(request: Request, exc: WeightserveError) -> JSONResponse:
        status, _ = status_for(exc)
        request.scope[ERROR_KEY] = type(exc).__name__  # for CallMetrics
        headers = None
        if exc.retry_after is not None:  # a temporary refusal (stream limit, draining)
            # Retry-After counts whole seconds; never 0, which would invite a busy loop.
            headers = {"retry-after": str(max(1, math.ceil(exc.retry_after)))}
        return JSONResponse(
            {"error": {"type": type(exc).__name__, "message": str(exc)}},
            status_code=status,
            headers=headers,
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default answer echoes the input, and fails with a 500 on what it cannot
        # encode (a NaN in the JSON body); say what is wrong in our error format instead.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
            for e in exc.errors()
        )
        return await weightserve_error(request, InvalidRequest(f"invalid request: {problems}"))

    # The small routes are `async def`: answered on the event loop, without the thread hop a
    # sync route takes. What may block (a model to check, load or hash first, a long plan)
    # goes to the threadpool (`off_loop`).
    async def off_loop(answer: Callable[[], Response], inline: bool) -> Response:
        return answer() if inline else await run_in_threadpool(answer)

    @get_and_head(app, "/healthz", tags=["operations"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @get_and_head(app, "/v1/server", tags=["operations"])
    async def server_info() -> dict[str, Any]:
        """This server's data planes, for a client choosing the fastest one: its HTTP, gRPC
        and Arrow Flight ports (0: none), the same-node socket (``uds``; its handoff socket is
        that path + ``.handoff``), and an instance id to tell whether a socket found on the
        node is this server's."""
        return {
            "version": server_version(),
            "instance": state.instance,
            "http_port": state.http_port,
            "grpc_port": state.grpc_port,
            "flight_port": state.flight_port,
            "uds": state.uds,
        }

    @get_and_head(app, "/readyz", tags=["operations"])
    async def readyz() -> JSONResponse:
        """Readiness: the catalog is loaded, the content revisions of the models found at
        start are known (a never-seen large model is hashed once first), and the server
        accepts new streams."""
        ready = not state.draining and not state.warming
        status = "draining" if state.draining else "warming" if state.warming else "ready"
        body = {
            "status": status,
            "models": len(catalog.models),
            "refused": len(catalog.problems),
            "revisions_pending": catalog.pending_revisions,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @get_and_head(app, "/metrics", tags=["operations"])
    def metrics(request: Request) -> Response:
        """Prometheus metrics (needs a token when the server protects metrics)."""
        if state.protect_metrics:
            access(request)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @get_and_head(app, "/v1/models", tags=["models"])
    async def list_models(request: Request) -> Response:
        """Every model served, and those refused with the file and rule they broke."""

        def answer() -> Response:
            return JSONResponse(models_view.model_list(catalog, access(request).may_read))

        return await off_loop(answer, catalog.answers_now())

    def start_stream(http: Request, model_id: str, request: TensorRequest) -> Response:
        http.scope[OPERATION_KEY] = "stream"  # whichever route led here
        caller = access(http)
        model = state.readable_model(caller, model_id)
        client = caller.client_key(http.client.host if http.client else "")
        planned, slot = state.begin_stream(model, request, "http", client)
        length = stream_length(planned, request.chunk_bytes)
        headers = {
            "etag": f'"{model.revision}"',
            "x-weightserve-revision": model.revision,
            "x-weightserve-tensors": str(len(planned)),
        }
        if http.method == "HEAD":
            # The status and headers a GET gets (a slot was taken so a full server answers
            # 429 here too), no body, and the slot is free again at once. Not an
            # ArrowStreamResponse: its direct socket writes would bypass uvicorn's HEAD rule.
            slot.__exit__(None, None, None)
            headers["content-length"] = str(length)
            return Response(headers=headers, media_type=ARROW_STREAM_MEDIA_TYPE)
        tensors = state.metrics.tensors_served.labels("http", model.id)
        messages = stream_messages(model, planned, request.chunk_bytes, tensors.inc)
        return ArrowStreamResponse(
            state,
            model.id,
            messages,
            length,
            headers,
            lambda: slot.__exit__(None, None, None),
        )

    async def stream_response(http: Request, model_id: str, request: TensorRequest) -> Response:
        """A stream, planned on the loop when it names few tensors and the catalog answers
        from memory (``inline_stream``), else on the threadpool."""
        return await off_loop(
            lambda: start_stream(http, model_id, request), inline_stream(model_id, request)
        )

    def inline_stream(model_id: str, request: TensorRequest) -> bool:
        return (
            request.names is not None
            and len(request.names) <= INLINE_MAX_NAMES
            and catalog.answers_now(model_id)
        )

    @get_and_head(app, "/v1/models/{model:model_id}/-/stream", **ARROW_ROUTE)
    async def stream_get(
        http: Request,
        model: str,
        name: Annotated[list[str] | None, Query(description="tensor names (repeat)")] = None,
        prefix: Annotated[
            str | None, Query(description="every tensor whose name starts so")
        ] = None,
        shard: Annotated[str | None, Query(description="'k/n': part k of n along axis")] = None,
        axis: int = 0,
        resume_tensor: str | None = None,
        resume_offset: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        revision: str | None = None,
    ) -> Response:
        """Tensor data as an Arrow IPC stream: by name list or by prefix."""
        request = requests.from_http(
            name, prefix, shard, axis, resume_tensor, resume_offset, chunk_bytes, revision
        )
        return await stream_response(http, model, request)

    @app.post("/v1/models/{model:model_id}/-/stream", **ARROW_ROUTE)
    async def stream_post(
        http: Request, model: str, body: Annotated[StreamBody, Body()]
    ) -> Response:
        """The same stream, with the request in a JSON body (long name lists)."""
        request = requests.from_http(**body.model_dump())
        return await stream_response(http, model, request)

    @get_and_head(app, "/v1/models/{model:model_id}/-/tensors/{name:path}", **ARROW_ROUTE)
    async def one_tensor(
        http: Request,
        model: str,
        name: str,
        shard: str | None = None,
        axis: int = 0,
        revision: str | None = None,
    ) -> Response:
        """One tensor as an Arrow IPC stream (the name may hold `/`; percent-encode `%`, `?`,
        `#` and spaces)."""
        request = requests.from_http([name], shard=shard, axis=axis, revision=revision)
        return await stream_response(http, model, request)

    web_app.add_browser_routes(app, state, access)  # the page at / and its stats route
    # Imported here: these modules build on ArrowStreamResponse above.
    from weightserve.service.transports.http import files as http_files

    http_files.add_file_routes(app, state, access)

    # The layout before the reserved `-` part, registered after the routes above and before
    # the model's own route. A path ending in /stream or holding /tensors/ may be a model id
    # (`edge/stream`) or hold a tensor name, so the catalog says which reading names a model
    # the caller may read; with none, the route's own reading gives the usual error. These
    # deprecated routes stay on the threadpool.
    def legacy(http: Request, path: str, fallback: Target, **stream_query: Any) -> Response:
        caller = access(http)

        def known(model_id: str) -> bool:
            return caller.may_read(model_id) and (
                model_id in catalog.models or model_id in catalog.problems
            )

        target = resolve_legacy(path, known) or fallback
        if target.kind == "model":
            return model_info(target.model, http)
        if target.kind == "tensor":
            # The tensor's own route takes only these (from either old form).
            request = requests.from_http(
                [target.tensor or ""],
                shard=stream_query.get("shard"),
                axis=stream_query.get("axis", 0),
                revision=stream_query.get("revision"),
            )
            return start_stream(http, target.model, request)
        return start_stream(http, target.model, requests.from_http(**stream_query))

    @get_and_head(app, "/v1/models/{model:path}/stream", deprecated=True, **ARROW_ROUTE)
    def legacy_stream_get(
        http: Request,
        model: str,
        name: Annotated[list[str] | None, Query()] = None,
        prefix: str | None = None,
        shard: str | None = None,
        axis: int = 0,
        resume_tensor: str | None = None,
        resume_offset: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        revision: str | None = None,
    ) -> Response:
        """Use `/v1/models/{model}/-/stream`: this form is answered only where the path names
        one model (`/v1/models/edge/stream` is model `edge/stream` when that exists)."""
        return legacy(
            http,
            f"{model}/stream",
            Target("stream", model),
            names=name,
            prefix=prefix,
            shard=shard,
            axis=axis,
            resume_tensor=resume_tensor,
            resume_offset=resume_offset,
            chunk_bytes=chunk_bytes,
            revision=revision,
        )

    # Any path, as for the model's route below: a malformed id gets its named error, not 405.
    @app.post("/v1/models/{model:path}/stream", deprecated=True, **ARROW_ROUTE)
    async def legacy_stream_post(
        http: Request, model: str, body: Annotated[StreamBody, Body()]
    ) -> Response:
        """Use `POST /v1/models/{model}/-/stream` (the same request)."""
        return await stream_post(http, model, body)

    @get_and_head(
        app, "/v1/models/{model:path}/tensors/{name:path}", deprecated=True, **ARROW_ROUTE
    )
    def legacy_tensor(
        http: Request,
        model: str,
        name: str,
        shard: str | None = None,
        axis: int = 0,
        revision: str | None = None,
    ) -> Response:
        """Use `/v1/models/{model}/-/tensors/{name}`: this form is answered only where the
        path names one model and tensor."""
        return legacy(
            http,
            f"{model}/tensors/{name}",
            Target("tensor", model, name),
            shard=shard,
            axis=axis,
            revision=revision,
        )

    @get_and_head(app, "/v1/models/{model:path}", tags=["models"])
    async def get_model(model: str, request: Request) -> Response:
        """Format, revision, metadata and the tensor index (in MAX's items() order)."""
        known = catalog.models.get(model)
        inline = (
            known is not None
            and len(known.tensors) <= INLINE_MAX_TENSORS
            and catalog.answers_now(model)
        )
        return await off_loop(lambda: model_info(model, request), inline)

    def model_info(model: str, request: Request) -> Response:
        m = state.readable_model(access(request), model)
        etag = f'"{m.revision}"'
        headers = {"etag": etag, "cache-control": "no-cache"}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return JSONResponse(models_view.model_info(m), headers=headers)

    # Last: the Hub's layout (/api/models/..., /{repo}/resolve/...) takes only what no route
    # above answers.
    from weightserve.service.transports.http import hub as hub_routes

    hub_routes.add_hub_routes(app, state, access)
    return app
