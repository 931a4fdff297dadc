"""The HTTP routes around the data: liveness and readiness probes, Prometheus metrics, the
server's data planes, the model list and one model's info."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from weightserve.service.serving import views as models_view
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.views import server_version
from weightserve.service.transports.http.common import AccessCheck, off_loop
from weightserve.service.transports.http.routes import get_and_head

# A model's info is rendered on the event loop up to this many tensors when the catalog
# answers from memory (Catalog.answers_now); larger indexes go to a worker thread.
INLINE_MAX_TENSORS = 1024


def add_operations_routes(app: FastAPI, state: ServiceState, access: AccessCheck) -> None:
    """Probes, metrics, server info and the model list."""
    catalog = state.catalog

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
        ports = state.lifecycle.ports()
        return {
            "version": server_version(),
            "instance": state.instance,
            "http_port": ports.http,
            "grpc_port": ports.grpc,
            "flight_port": ports.flight,
            "uds": state.lifecycle.uds,
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


def model_info_response(
    state: ServiceState, access: AccessCheck, model_id: str, request: Request
) -> Response:
    """One model's info, with its revision as ETag (304 for a matching ``If-None-Match``).
    Over a node cache an uncached model is described from its headers, not filled; where its
    revision is not known before a fill (object storage), it is "" and there is no ETag."""
    m = state.readable_metadata(access(request), model_id)
    etag = f'"{m.revision}"'
    headers = {"etag": etag, "cache-control": "no-cache"} if m.revision else {}
    if m.revision and request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return JSONResponse(models_view.model_info(m), headers=headers)


def add_model_info_route(app: FastAPI, state: ServiceState, access: AccessCheck) -> None:
    """``/v1/models/{model}``: any path, so it goes after every route below a model."""
    catalog = state.catalog

    @get_and_head(app, "/v1/models/{model:path}", tags=["models"])
    async def get_model(model: str, request: Request) -> Response:
        """Format, revision, metadata and the tensor index (in MAX's items() order)."""
        known = catalog.models.get(model)
        inline = (
            known is not None
            and len(known.tensors) <= INLINE_MAX_TENSORS
            and catalog.answers_now(model)
        )
        return await off_loop(lambda: model_info_response(state, access, model, request), inline)
