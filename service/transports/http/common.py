"""What every HTTP route module shares: the scope keys the call metrics read, the error
answer, the caller's access and the choice between the event loop and the threadpool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from weightserve.client.errors import WeightserveError
from weightserve.client.wire.errors import WireError
from weightserve.service.serving.auth import Access, authorize
from weightserve.service.serving.state import ServiceState

# ASGI scope keys the routes set for CallMetrics: the error class a request ended with, and
# the operation when its route alone does not say (a stream reached through a route of its own).
ERROR_KEY = "weightserve.error"
OPERATION_KEY = "weightserve.operation"

# Who is asking: the request's bearer token checked against the server's tokens.
AccessCheck = Callable[[Request], Access]


def access_check(state: ServiceState) -> AccessCheck:
    def access(request: Request) -> Access:
        return authorize(state.tokens, request.headers.get("authorization"))

    return access


def error_response(
    scope: Any,
    exc: WeightserveError,
    headers: dict[str, str] | None = None,
    status: int | None = None,
) -> JSONResponse:
    """One of our errors as the API answers it (its wire form: the status its class has
    unless ``status`` says, Retry-After on a temporary refusal), noted in ``scope`` for
    CallMetrics."""
    error = WireError.from_exception(exc)
    scope[ERROR_KEY] = error.type
    return JSONResponse(
        error.http_body(),
        status_code=status or error.http_status(),
        headers={**(headers or {}), **error.http_headers()} or None,
    )


async def off_loop(answer: Callable[[], Response], inline: bool) -> Response:
    """``answer()`` on the event loop when ``inline`` (it cannot block), else on the
    threadpool: the small routes are ``async def``, answered without the thread hop a sync
    route takes, and what may block (a model to check, load or hash first, a long plan) goes
    to a worker thread."""
    return answer() if inline else await run_in_threadpool(answer)
