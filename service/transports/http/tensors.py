"""The HTTP routes of tensor data: a stream by names or prefix (GET query or POST body), one
tensor, the small-tensor lane's answer, and the deprecated forms without the ``-`` part.

Each is an Arrow IPC stream (``application/vnd.apache.arrow.stream``, docs/protocol.md),
planned before its first byte so errors are statuses, and sent by ``ArrowStreamResponse``.
"""

from __future__ import annotations

import threading
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from weightserve.client.errors import WeightserveError
from weightserve.client.wire.schema import ARROW_STREAM_MEDIA_TYPE, DEFAULT_CHUNK_BYTES
from weightserve.service.serving import request as requests
from weightserve.service.serving.lease import StreamLease
from weightserve.service.serving.request import TensorRequest
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.streams import PlannedTensor, stream_length, stream_messages
from weightserve.service.sources.model import Model
from weightserve.service.transports.http.common import (
    OPERATION_KEY,
    AccessCheck,
    error_response,
    off_loop,
)
from weightserve.service.transports.http.ops import model_info_response
from weightserve.service.transports.http.routes import Target, get_and_head, resolve_legacy
from weightserve.service.transports.http.streaming import (
    ArrowStreamResponse,
    KeptAnswer,
    whole_body,
)

# A stream request naming at most this many tensors is planned on the event loop when the
# catalog answers from memory (Catalog.answers_now); longer lists and prefixes are planned on
# a worker thread, as is any request whose model must be checked, loaded or hashed first.
INLINE_MAX_NAMES = 16

# The small-tensor lane's requests kept decoded, by (name, revision): a small tensor is asked
# for again and again (then decoded anew once this many are kept).
LANE_REQUESTS = 4096

# A one-tensor answer of at most this many bytes is kept whole for its revision
# (KeptAnswers), up to this many bytes of answers in all (then they are built anew).
KEPT_ANSWER_MAX_BYTES = 64 << 10
KEPT_ANSWERS_MAX_BYTES = 64 << 20

# Every route that answers with an Arrow stream. status_code is given because
# ArrowStreamResponse.__init__ has none for OpenAPI to read.
ARROW_ROUTE: dict[str, Any] = {
    "tags": ["tensors"],
    "response_class": ArrowStreamResponse,
    "status_code": 200,
    "responses": {200: {"content": {ARROW_STREAM_MEDIA_TYPE: {}}}},
}


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


async def stream_query(
    name: Annotated[list[str] | None, Query(description="tensor names (repeat)")] = None,
    prefix: Annotated[str | None, Query(description="every tensor whose name starts so")] = None,
    shard: Annotated[str | None, Query(description="'k/n': part k of n along axis")] = None,
    axis: int = 0,
    resume_tensor: str | None = None,
    resume_offset: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    revision: str | None = None,
) -> dict[str, Any]:
    """A stream route's query string, as the fields ``requests.from_http`` takes (async: a
    dependency that is a plain function would cost the route a thread hop)."""
    return {
        "names": name,
        "prefix": prefix,
        "shard": shard,
        "axis": axis,
        "resume_tensor": resume_tensor,
        "resume_offset": resume_offset,
        "chunk_bytes": chunk_bytes,
        "revision": revision,
    }


StreamQuery = Annotated[dict[str, Any], Depends(stream_query)]


async def tensor_query(
    shard: str | None = None, axis: int = 0, revision: str | None = None
) -> dict[str, Any]:
    """A one-tensor route's query string: a shard and the revision it pins."""
    return {"shard": shard, "axis": axis, "revision": revision}


TensorQuery = Annotated[dict[str, Any], Depends(tensor_query)]
TENSOR_FIELDS = ("shard", "axis", "revision")


class KeptAnswers:
    """Small one-tensor answers kept whole: the headers (encoded), the body (schema, framing
    with its digest, the bytes, end of stream), its data bytes and the tensors it counts. All
    are fixed by the model's revision, so a small tensor asked again costs neither a plan of
    messages nor a copy out of the mapping; its request is still authorized, pinned, admitted
    and its files checked (``StreamLease.plan``) as any stream's."""

    served = 0  # answers sent from kept bytes since start (tests check it engages)

    def __init__(self) -> None:
        self._answers: dict[tuple, tuple[list[tuple[bytes, bytes]], bytes, int, int]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(model: Model, request: TensorRequest) -> tuple | None:
        """The answer's key, or None where it is not kept (a shard, a resume, a model whose
        revision is not hashed yet: that waits for the plan, after admission)."""
        if (
            not model.revision_known
            or request.names is None
            or len(request.names) != 1
            or request.shard is not None
            or request.resume_tensor is not None
        ):
            return None
        return model.id, model.revision, request.names[0], request.chunk_bytes

    def get(self, key: tuple | None) -> tuple[list[tuple[bytes, bytes]], bytes, int, int] | None:
        """(raw headers, body, data bytes, tensors counted) kept for ``key``, or None."""
        kept = self._answers.get(key) if key is not None else None
        if kept is not None:
            KeptAnswers.served += 1
        return kept

    def build(
        self,
        key: tuple,
        model: Model,
        planned: list[PlannedTensor],
        chunk_bytes: int,
        headers: dict[str, str],
    ) -> tuple[list[tuple[bytes, bytes]], bytes, int, int]:
        """The answer of ``key`` from the files (the lease holding them), kept from now on."""
        tensors = 0

        def count() -> None:
            nonlocal tensors
            tensors += 1

        body, data_bytes = whole_body(stream_messages(model, planned, chunk_bytes, count))
        # Bytes copied after their digest was checked: kept only if no write landed between.
        for p in planned:
            model.mapped(p.entry.file).ensure_unchanged()
        # Encoded once here, as Starlette would per request (with length and type).
        raw_headers = Response(
            body, headers=headers, media_type=ARROW_STREAM_MEDIA_TYPE
        ).raw_headers
        kept = raw_headers, body, data_bytes, tensors
        size = _kept_size(kept)
        with self._lock:
            if key in self._answers:  # built twice at once: the first one stays
                return self._answers[key]
            if self._bytes + size > KEPT_ANSWERS_MAX_BYTES:
                self._answers.clear()
                self._bytes = 0
            self._answers[key] = kept
            self._bytes += size
        return kept


def _kept_size(kept: tuple[list[tuple[bytes, bytes]], bytes, int, int]) -> int:
    """What a kept answer holds in memory, about: its body, its headers, and a little for the
    entry itself."""
    raw_headers, body = kept[0], kept[1]
    return len(body) + sum(len(k) + len(v) + 64 for k, v in raw_headers) + 256


class TensorStreams:
    """Starts a tensor stream for whichever route (or the lane) asked for one."""

    def __init__(self, state: ServiceState, access: AccessCheck) -> None:
        self.state = state
        self.access = access
        # Per request this was a request's validation.
        self._lane_requests: dict[tuple[str, str | None], TensorRequest] = {}
        self._kept = KeptAnswers()

    def start(self, http: Request, model_id: str, request: TensorRequest) -> Response:
        state = self.state
        http.scope[OPERATION_KEY] = "stream"  # whichever route led here
        caller = self.access(http)
        model = state.readable_model(caller, model_id, request.revision)
        client = caller.client_key(http.client.host if http.client else "")
        # CallMetrics counts the request; the lease its slot, files and bytes.
        key = self._kept.key(model, request) if http.method != "HEAD" else None
        kept = self._kept.get(key)
        with StreamLease(state, "http", counted=False) as lease:
            # A kept answer reads no file: none is held (its files are checked all the same).
            planned = lease.plan(model, request, client, reads_files=kept is None)
            length = stream_length(planned, request.chunk_bytes)
            headers = {
                "etag": f'"{model.revision}"',
                "x-weightserve-revision": model.revision,
                "x-weightserve-tensors": str(len(planned)),
            }
            if http.method == "HEAD":
                # The status and headers a GET gets (a slot was taken so a full server
                # answers 429 here too), no body, and the slot is free again at once. Not an
                # ArrowStreamResponse: its direct socket writes would bypass uvicorn's HEAD
                # rule.
                headers["content-length"] = str(length)
                return Response(headers=headers, media_type=ARROW_STREAM_MEDIA_TYPE)
            tensors = state.metrics.child(state.metrics.tensors_served, "http", model.id)
            if kept is None and key is not None and length <= KEPT_ANSWER_MAX_BYTES:
                kept = self._kept.build(key, model, planned, request.chunk_bytes, headers)
            if kept is not None:
                raw_headers, body, data_bytes, count = kept
                if count:
                    tensors.inc(count)
                return KeptAnswer(lease.handed_over(), raw_headers, body, data_bytes)
            messages = stream_messages(model, planned, request.chunk_bytes, tensors.inc)
            return ArrowStreamResponse(lease.handed_over(), messages, length, headers)

    async def respond(self, http: Request, model_id: str, request: TensorRequest) -> Response:
        """A stream, planned on the loop when it names few tensors and the catalog answers
        from memory, else on the threadpool."""
        inline = (
            request.names is not None
            and len(request.names) <= INLINE_MAX_NAMES
            and self.state.catalog.answers_now(model_id)
        )
        return await off_loop(lambda: self.start(http, model_id, request), inline)

    async def lane(
        self, scope: Any, receive: Any, send: Any, model: str, name: str, revision: str | None
    ) -> None:
        """The small-tensor lane's answer (``TensorLane``): one tensor, as its route gives it."""
        http = Request(scope, receive)
        try:
            request = self._lane_requests.get((name, revision))
            if request is None:
                request = requests.from_http([name], revision=revision)
                if len(self._lane_requests) >= LANE_REQUESTS:
                    self._lane_requests.clear()
                self._lane_requests[name, revision] = request
            response = await self.respond(http, model, request)
        except WeightserveError as e:
            response = error_response(scope, e)
        await response(scope, receive, send)


def add_tensor_routes(app: FastAPI, streams: TensorStreams) -> None:
    """The stream routes and the one-tensor route below a model's ``-`` part."""

    @get_and_head(app, "/v1/models/{model:model_id}/-/stream", **ARROW_ROUTE)
    async def stream_get(http: Request, model: str, query: StreamQuery) -> Response:
        """Tensor data as an Arrow IPC stream: by name list or by prefix."""
        return await streams.respond(http, model, requests.from_http(**query))

    @app.post("/v1/models/{model:model_id}/-/stream", **ARROW_ROUTE)
    async def stream_post(
        http: Request, model: str, body: Annotated[StreamBody, Body()]
    ) -> Response:
        """The same stream, with the request in a JSON body (long name lists)."""
        return await streams.respond(http, model, requests.from_http(**body.model_dump()))

    @get_and_head(app, "/v1/models/{model:model_id}/-/tensors/{name:path}", **ARROW_ROUTE)
    async def one_tensor(http: Request, model: str, name: str, query: TensorQuery) -> Response:
        """One tensor as an Arrow IPC stream (the name may hold `/`; percent-encode `%`, `?`,
        `#` and spaces)."""
        return await streams.respond(http, model, requests.from_http([name], **query))


def add_legacy_routes(app: FastAPI, streams: TensorStreams) -> None:
    """The layout before the reserved `-` part, registered after the routes below a model and
    before the model's own route. A path ending in /stream or holding /tensors/ may be a model
    id (`edge/stream`) or hold a tensor name, so the catalog says which reading names a model
    the caller may read; with none, the route's own reading gives the usual error. These
    deprecated routes stay on the threadpool."""
    state, access = streams.state, streams.access
    catalog = state.catalog

    def legacy(http: Request, path: str, fallback: Target, query: dict[str, Any]) -> Response:
        caller = access(http)

        def known(model_id: str) -> bool:
            return caller.may_read(model_id) and (
                model_id in catalog.models or model_id in catalog.problems
            )

        target = resolve_legacy(path, known) or fallback
        if target.kind == "model":
            return model_info_response(state, access, target.model, http)
        if target.kind == "tensor":
            # The tensor's own route takes only these (from either old form).
            tensor_fields = {k: v for k, v in query.items() if k in TENSOR_FIELDS}
            request = requests.from_http([target.tensor or ""], **tensor_fields)
            return streams.start(http, target.model, request)
        return streams.start(http, target.model, requests.from_http(**query))

    @get_and_head(app, "/v1/models/{model:path}/stream", deprecated=True, **ARROW_ROUTE)
    def legacy_stream_get(http: Request, model: str, query: StreamQuery) -> Response:
        """Use `/v1/models/{model}/-/stream`: this form is answered only where the path names
        one model (`/v1/models/edge/stream` is model `edge/stream` when that exists)."""
        return legacy(http, f"{model}/stream", Target("stream", model), query)

    # Any path, as for the model's route: a malformed id gets its named error, not 405.
    @app.post("/v1/models/{model:path}/stream", deprecated=True, **ARROW_ROUTE)
    async def legacy_stream_post(
        http: Request, model: str, body: Annotated[StreamBody, Body()]
    ) -> Response:
        """Use `POST /v1/models/{model}/-/stream` (the same request)."""
        return await streams.respond(http, model, requests.from_http(**body.model_dump()))

    @get_and_head(
        app, "/v1/models/{model:path}/tensors/{name:path}", deprecated=True, **ARROW_ROUTE
    )
    def legacy_tensor(http: Request, model: str, name: str, query: TensorQuery) -> Response:
        """Use `/v1/models/{model}/-/tensors/{name}`: this form is answered only where the
        path names one model and tensor."""
        return legacy(http, f"{model}/tensors/{name}", Target("tensor", model, name), query)
