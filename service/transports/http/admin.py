"""The operator's HTTP routes for a node cache: warm a model without a load, evict it, re-verify
it against the origin, and read its state (docs/protocol.md, "Operator routes").

They need ``admin=PATTERN`` in the token file when the server has one (401 without a token,
403 without the grant); without a token file they answer only callers on this node
(``Access.check_admin``). A server that serves a local directory has no cache to act on.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from weightserve.client.errors import InvalidRequest
from weightserve.service.serving.state import ServiceState
from weightserve.service.sources.base import CacheControls
from weightserve.service.sources.cache.room import EvictionRefused
from weightserve.service.transports.http.common import (
    OPERATION_KEY,
    AccessCheck,
    error_response,
    off_loop,
)
from weightserve.service.transports.http.routes import get_and_head

ADMIN_PREFIX = "/v1/admin/cache"
ADMIN_OPERATION = "admin"  # the metrics operation of every route here


def _on_this_node(http: Request) -> bool:
    """Whether the caller is on this node: loopback TCP, or the Unix socket (no address)."""
    host = http.client.host if http.client else ""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_admin_routes(app: FastAPI, state: ServiceState, access: AccessCheck) -> None:
    """Routes below ``/v1/admin/cache/{model}``; actions after the reserved ``-`` part, as
    below ``/v1/models/{model}``, so no model id collides with one."""

    def controls(http: Request, model: str) -> CacheControls:
        http.scope[OPERATION_KEY] = ADMIN_OPERATION
        access(http).check_admin(model, on_this_node=_on_this_node(http))
        found = state.served.cache_controls
        if found is None:
            raise InvalidRequest(
                f"this server serves {state.catalog.description}, a local directory: there is "
                "no node cache to prefetch into, evict from or verify"
            )
        return found

    def answer(body: dict[str, Any], status: int = 200) -> Response:
        return JSONResponse(body, status_code=status)

    @get_and_head(app, f"{ADMIN_PREFIX}/{{model:model_id}}", tags=["admin"])
    async def cache_state(http: Request, model: str) -> Response:
        """The model's state in this node's cache: `cached`, `filling` (with `bytes_done` of
        `bytes_total`) or `remote`; `error` says why the last fill failed."""
        return await off_loop(lambda: answer(controls(http, model).cache_state(model)), False)

    @app.post(f"{ADMIN_PREFIX}/{{model:model_id}}/-/prefetch", tags=["admin"], status_code=202)
    async def prefetch(http: Request, model: str) -> Response:
        """Start copying the model into this node's cache without a load (202, its state);
        the fill every request joins. Poll `GET /v1/admin/cache/{model}` for its progress."""
        return await off_loop(lambda: answer(controls(http, model).prefetch(model), 202), False)

    @app.delete(f"{ADMIN_PREFIX}/{{model:model_id}}", tags=["admin"])
    async def evict(http: Request, model: str) -> Response:
        """Remove the model from this node's cache now. Refused (409) while a stream reads it,
        while it is being filled, or when it is pinned (`--pin`)."""

        def evicted() -> Response:
            try:
                return answer(controls(http, model).evict(model))
            except EvictionRefused as e:  # in use or pinned: a conflict, not a busy server
                return error_response(http.scope, e, status=409)

        return await off_loop(evicted, False)

    @app.post(f"{ADMIN_PREFIX}/{{model:model_id}}/-/verify", tags=["admin"])
    async def verify(http: Request, model: str) -> Response:
        """Re-check each cached file against the origin (size, and content where the origin's
        version is a content digest); a model that fails is evicted, so the next request
        fills it again."""
        return await off_loop(lambda: answer(controls(http, model).verify(model)), False)
