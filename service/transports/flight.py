"""Arrow Flight endpoint for bulk tensor data: the StreamTensors stream, moved by C++.

grpcio hands every message through Python: the server copies each chunk into a message and
the client copies it several times more, under the GIL (docs/performance.md). Flight (Arrow's
gRPC service, ``pyarrow.flight``) sends record batches whose buffers are views of the mmap,
and its client assembles them without Python. The gRPC service stays the control plane
(models, index, health, reflection) and advertises this endpoint in ``GetServerInfo``.

``DoGet`` takes a serialized ``weightserve.v1.TensorRequest`` as its ticket and streams one
record batch per chunk in the schema of client/wire/schema.py, so any Flight client (pyarrow,
Arrow Java, arrow-rs) can read weights with no weightserve code. A client that sends the
``weightserve-flight-batches: lean-1`` header (the weightserve client does) gets *lean*
batches instead: one zero-copy ``uint8`` column per chunk, the rest of the row in the batch's
``app_metadata`` (client/transports/flight.py), in 4 MiB chunks unless the request names a size. That is
one body buffer per message and no per-row arrays to build in Python (bench/flight_minimal.py
measures the floor). Auth, limits, draining, errors and metrics are those of the other
transports. An error carries ``extra_info``, JSON
``{"type": class name, "message": text}`` (plus ``"retry_after": seconds`` on a temporary
refusal; client/wire/errors.py), which the weightserve client turns back into the same
exception as on HTTP and gRPC.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.flight as flight

from weightserve.client.errors import (
    ModelUnavailable,
    WeightserveError,
)
from weightserve.client.wire.errors import WireError
from weightserve.client.wire.flight_lean import (
    FORMAT_HEADER,
    LEAN_CHUNK_BYTES,
    LEAN_FORMAT,
    LEAN_SCHEMA,
    encode_chunk_header,
)
from weightserve.client.wire.schema import DEFAULT_CHUNK_BYTES, TENSOR_SCHEMA, ChunkHeader
from weightserve.service.serving.auth import authorize
from weightserve.service.serving.lease import StreamLease
from weightserve.service.serving.request import from_proto, from_ticket
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.streams import stream_chunks
from weightserve.service.transports.grpc import peer_host
from weightserve.service.transports.listener import StartupError, check_port_free, url_host

log = logging.getLogger("weightserve.flight")

_SHAPE_TYPE = TENSOR_SCHEMA.field("shape").type

_FLIGHT_ERRORS = {
    "UNAUTHENTICATED": flight.FlightUnauthenticatedError,
    "PERMISSION_DENIED": flight.FlightUnauthorizedError,
    "UNAVAILABLE": flight.FlightUnavailableError,
}


def flight_error(exc: WeightserveError) -> flight.FlightError:
    """The Flight error for one of ours: the Flight class of its gRPC code, and its wire form
    (class, message, retry hint) as JSON in ``extra_info`` for the client."""
    error = WireError.from_exception(exc)
    detail = json.dumps(error.to_json()).encode()
    flight_class = _FLIGHT_ERRORS.get(error.grpc_code(), flight.FlightServerError)
    return flight_class(error.message, extra_info=detail)


def chunk_batch(header: ChunkHeader, data: memoryview) -> pa.RecordBatch:
    """One row of the tensor schema; ``data`` is wrapped, not copied."""
    offsets = pa.py_buffer(struct.pack("<ii", 0, len(data)))
    values = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, pa.py_buffer(data)])
    return pa.RecordBatch.from_arrays(
        [
            pa.array([header.name], pa.utf8()),
            pa.array([header.dtype], pa.utf8()),
            pa.array([header.shape], _SHAPE_TYPE),
            pa.array([header.logical_shape], _SHAPE_TYPE),
            pa.array([header.encoding], pa.utf8()),
            pa.array([header.offset], pa.int64()),
            pa.array([header.total_bytes], pa.int64()),
            pa.array([header.digest], pa.uint64()),
            values,
        ],
        schema=TENSOR_SCHEMA,
    )


def lean_batch(header: ChunkHeader, data: memoryview) -> tuple[pa.RecordBatch, bytes]:
    """One chunk as a lean batch: ``data`` wrapped (not copied), the header as app_metadata."""
    column = pa.Array.from_buffers(pa.uint8(), len(data), [None, pa.py_buffer(data)])
    return pa.RecordBatch.from_arrays([column], schema=LEAN_SCHEMA), encode_chunk_header(header)


class _Authorization(flight.ServerMiddleware):
    def __init__(self, header: str | None, lean: bool = False) -> None:
        self.header = header
        self.lean = lean  # the client asked for lean batches


class _AuthorizationFactory(flight.ServerMiddlewareFactory):
    """Keeps the call's ``authorization`` header for ``do_get`` (checked there, per model),
    and whether it asked for lean batches."""

    def start_call(self, info: flight.CallInfo, headers: dict) -> _Authorization:
        values = headers.get("authorization") or [None]
        lean = LEAN_FORMAT in (headers.get(FORMAT_HEADER) or ())
        return _Authorization(values[0], lean)


class _Batches:
    """The record batches of one stream, holding its lease until the stream is done.

    A class rather than a generator: Flight may drop a stream before asking for its first
    batch (the client went away), and an unstarted generator never runs its ``finally``.
    """

    def __init__(
        self,
        service: FlightService,
        lease: StreamLease,
        chunks: Iterator[tuple[ChunkHeader, memoryview]],
        context: flight.ServerCallContext,
        lean: bool = False,
    ) -> None:
        self.service, self.lease, self.chunks = service, lease, chunks
        self.batch = lean_batch if lean else chunk_batch
        self.context = context
        self.open = True

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> pa.RecordBatch | tuple[pa.RecordBatch, bytes]:
        if not self.open or self.context.is_cancelled():
            self.close()
            raise StopIteration
        if self.service.closing:  # shutting down and past the grace period: cut the stream
            hint = self.service.state.limits.retry_after
            error = ModelUnavailable("the server is shutting down; retry", retry_after=hint)
            self.close(error)
            raise flight_error(error)
        try:
            header, data = next(self.chunks)
        except StopIteration:
            self.lease.finished()
            self.close()
            raise
        except WeightserveError as e:  # e.g. a file truncated while being served
            log.warning("Flight stream of model %s broke: %s", self.lease.model_id, e)
            self.close(e)
            raise flight_error(e) from None
        except Exception as e:
            self.close(e)
            raise
        self.lease.progress(len(data))
        return self.batch(header, data)

    def close(self, error: BaseException | None = None) -> None:
        """Ends the stream: its lease is released and the call counted, once. With no error
        and unfinished, the client went away (or Flight dropped the stream) before the end."""
        self.open = False
        self.lease.close(error)

    def __del__(self) -> None:
        self.close()


class FlightService(flight.FlightServerBase):
    def __init__(self, state: ServiceState, location: str, **tls: object) -> None:
        super().__init__(location, middleware={"auth": _AuthorizationFactory()}, **tls)
        self.state = state
        self.closing = False  # set by WeightServer.stop once the grace period is over

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> object:
        state = self.state
        try:
            with StreamLease(state, "flight") as lease:
                message = from_ticket(ticket.ticket)
                call = context.get_middleware("auth")
                access = authorize(state.tokens, call.header)
                chunk_bytes = LEAN_CHUNK_BYTES if call.lean else DEFAULT_CHUNK_BYTES
                request = from_proto(message, chunk_bytes)
                model = state.readable_model(access, message.model, request.revision)
                planned = lease.plan(model, request, access.client_key(peer_host(context.peer())))
                tensors = state.metrics.child(state.metrics.tensors_served, "flight", model.id)
                chunks = stream_chunks(model, planned, request.chunk_bytes, tensors.inc)
                batches = _Batches(self, lease.handed_over(), chunks, context, call.lean)
        except WeightserveError as e:
            # Counted (by the lease) under the error table's code, not Flight's coarser status.
            raise flight_error(e) from None
        return flight.GeneratorStream(LEAN_SCHEMA if call.lean else TENSOR_SCHEMA, batches)


class FlightListener:
    """The Flight endpoint as a ``Listener`` on ``host:port``; ``public_port`` is what
    GetServerInfo advertises when clients reach it through another port (None: the bound
    one)."""

    name = "Arrow Flight"

    def __init__(
        self,
        state: ServiceState,
        host: str,
        port: int,
        public_port: int | None = None,
        **tls: object,
    ) -> None:
        self.state, self.host, self.public_port, self.tls = state, host, public_port, tls
        self.bind_port = port
        self.port = 0  # the port bound, once started
        self.service: FlightService | None = None

    def start(self) -> None:
        check_port_free("Arrow Flight", "flight_port", self.host, self.bind_port)
        scheme = "grpc+tls" if self.tls else "grpc+tcp"
        location = f"{scheme}://{url_host(self.host)}:{self.bind_port}"
        try:
            # pyarrow.flight serves on its own threads once constructed.
            self.service = FlightService(self.state, location, **self.tls)
        except pa.ArrowException as e:  # pyarrow says only "Server did not start properly"
            raise StartupError(
                "flight_port",
                f"the Arrow Flight endpoint could not listen on {location} (the port taken "
                f"since it was checked?): {e}",
            ) from e
        self.port = self.service.port

    @property
    def advertised_port(self) -> int:
        """The port clients are told to dial: ``public_port`` where given; 0 until bound."""
        return (self.public_port or self.port) if self.port else 0

    def drain(self) -> None:
        """Nothing to announce: GetServerInfo and /readyz say so from the shared state."""

    def stop(self, force: bool, wait: float) -> None:
        if self.service is None:
            return
        # shutdown() waits for open calls: streams still open after the grace period end at
        # their next batch (pyarrow cannot cancel a call from the server side).
        self.service.closing = True
        closer = threading.Thread(target=self.service.shutdown, daemon=True)
        closer.start()
        closer.join(timeout=wait)
