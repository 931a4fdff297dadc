"""The HTTP transport's app: FastAPI over the shared catalog, with its middleware, error
answers and route groups (operations, tensors, files, the browser, Hub-compatible routes).

Metadata is JSON; tensor data is an Arrow IPC stream (``application/vnd.apache.arrow.stream``,
streaming.py). Route modules register their routes in the order below: a later route takes
only what no earlier one answers.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from weightserve.client.errors import InvalidRequest, WeightserveError
from weightserve.service.config import SendfileMode
from weightserve.service.serving.state import ServiceState
from weightserve.service.transports.http.admin import add_admin_routes
from weightserve.service.transports.http.browser import add_browser_routes
from weightserve.service.transports.http.common import access_check, error_response
from weightserve.service.transports.http.docs import add_offline_docs
from weightserve.service.transports.http.files import add_file_routes
from weightserve.service.transports.http.hub import add_hub_routes
from weightserve.service.transports.http.middleware import (
    BodyLimit,
    CallMetrics,
    LaneFirst,
    TensorLane,
)
from weightserve.service.transports.http.ops import add_model_info_route, add_operations_routes
from weightserve.service.transports.http.publish import add_publish_routes
from weightserve.service.transports.http.streaming import WeightserveApp
from weightserve.service.transports.http.swarm import add_swarm_routes
from weightserve.service.transports.http.tensors import (
    TensorStreams,
    add_legacy_routes,
    add_tensor_routes,
)


class _App(WeightserveApp, LaneFirst):
    """WeightserveApp, which uvicorn calls first (it notes the request's cycle), then the
    small-tensor lane (``LaneFirst``), then FastAPI."""


def create_app(state: ServiceState, sendfile: SendfileMode = "auto") -> FastAPI:
    app = _App(
        title="weightserve",
        description="Model weights as Apache Arrow streams. Tensor data: Arrow IPC stream, "
        "one row per chunk of a tensor (see docs/protocol.md). Every GET route answers "
        "HEAD too. Model ids never have a path part `-`: routes below a model start with "
        "it (`/v1/models/{model}/-/stream`), so no model id or tensor name collides with one.",
        version="1",
        docs_url=None,  # add_offline_docs: the pages' assets come from this server, no CDN
        redoc_url=None,
    )
    app.sendfile = sendfile
    access = access_check(state)
    streams = TensorStreams(state, access)

    # The lane answers one tensor's GET before FastAPI, inside metrics and body limit of its
    # own; FastAPI's middleware does the same for every other request.
    app.tensor_lane = TensorLane(state, streams.lane)
    app.add_middleware(BodyLimit, state=state)
    app.add_middleware(CallMetrics, state=state)  # added last: outermost, sees every answer

    @app.exception_handler(WeightserveError)
    async def weightserve_error(request: Request, exc: WeightserveError) -> JSONResponse:
        return error_response(request.scope, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default answer echoes the input, and fails with a 500 on what it cannot
        # encode (a NaN in the JSON body); say what is wrong in our error format instead.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
            for e in exc.errors()
        )
        return error_response(request.scope, InvalidRequest(f"invalid request: {problems}"))

    add_offline_docs(app)
    add_operations_routes(app, state, access)
    add_tensor_routes(app, streams)
    add_browser_routes(app, state, access)  # the page at / and its stats route
    add_file_routes(app, state, access)
    add_admin_routes(app, state, access)
    add_publish_routes(app, state, access)
    add_swarm_routes(app, state, access)
    add_legacy_routes(app, streams)
    add_model_info_route(app, state, access)  # any path below /v1/models/: after those above
    # Last: the Hub's layout (/api/models/..., /{repo}/resolve/...) takes only what no route
    # above answers.
    add_hub_routes(app, state, access)
    return app
