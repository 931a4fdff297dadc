"""The HTTP app's ASGI middleware: the call metrics (outermost), the request-body limit, and
the small-tensor lane, which answers one tensor's GET inside those two but before FastAPI."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from fastapi import FastAPI
from starlette.routing import Match

from weightserve.client.errors import ResourceExhausted
from weightserve.client.wire.routes import RESERVED_PART, UPLOADS_ROUTE
from weightserve.service.serving.state import ServiceState
from weightserve.service.transports.http.common import ERROR_KEY, OPERATION_KEY, error_response


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
        if scope["method"] == "PUT" and f"/{RESERVED_PART}/{UPLOADS_ROUTE}/" in scope["path"]:
            # A publish's files: streamed to disk, bounded by --max-upload-bytes there.
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
    # 413, not the 429 of a busy server: waiting does not make the body fit.
    refusal = ResourceExhausted(f"request body of {size}; the limit is {limit}")
    await error_response(scope, refusal, status=413)(scope, receive, send)


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

# ``revision=VALUE`` with nothing to decode (a commit, a branch name): the lane's commonest
# query, read without ``parse_qsl``.
_PLAIN_REVISION = re.compile(rb"revision=([A-Za-z0-9._~-]*)")

# The scope key under which the lane keeps the (model, tensor, revision) it answers.
LANE_TARGET_KEY = "weightserve.lane"


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
        plain = _PLAIN_REVISION.fullmatch(query)
        if plain is not None:
            return model, name, plain[1].decode("ascii") or None
        pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
        if len(pairs) != 1 or pairs[0][0] != "revision":
            return None  # shard, axis, anything else: the route validates it
        revision = pairs[0][1] or None
    return model, name, revision


class TensorLane:
    """One small tensor, the commonest small request, answered before FastAPI sees it: no
    routing or parameter validation, no FastAPI telemetry check, no Starlette error and
    body-limit middleware, a large part of such a request's server time (docs/performance.md,
    "Small requests"). The same stream as the route gives, counted by ``CallMetrics`` and
    bounded by ``BodyLimit`` as every request is; an unhandled error is uvicorn's 500, as
    Starlette's would be. ``LaneFirst`` hands it the requests it takes."""

    answered = 0  # requests this lane answered since start (tests check it engages)

    def __init__(self, state: ServiceState, answer: Callable[..., Awaitable[None]]) -> None:
        self.answer = answer
        self.app = CallMetrics(BodyLimit(self._answer, state), state)

    async def __call__(
        self, scope: Any, receive: Any, send: Any, target: tuple[str, str, str | None]
    ) -> None:
        TensorLane.answered += 1
        scope[LANE_TARGET_KEY] = target
        await self.app(scope, receive, send)

    async def _answer(self, scope: Any, receive: Any, send: Any) -> None:
        await self.answer(scope, receive, send, *scope[LANE_TARGET_KEY])


class LaneFirst(FastAPI):
    """FastAPI whose ``tensor_lane`` takes its requests (``tensor_lane_target``) before
    FastAPI's per-request work; every other request goes through FastAPI as before."""

    tensor_lane: TensorLane | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        lane = self.tensor_lane
        if lane is not None:
            target = tensor_lane_target(scope)
            if target is not None:
                scope["app"] = self  # as Starlette sets it: the stream writers' pool
                return await lane(scope, receive, send, target)
        await super().__call__(scope, receive, send)


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
