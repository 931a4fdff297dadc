"""Bulk tensor data over Arrow Flight, for gRPC URLs whose server offers it.

The server's gRPC service says in ``GetServerInfo`` on which port its Flight endpoint runs.
``DoGet`` with a serialized ``TensorRequest`` as the ticket returns the same rows as
``StreamTensors``, but Flight's C++ client receives them, so the only Python-level work per
chunk is reading its header and one copy of its bytes into the tensor's final buffer (with
the GIL released). grpcio instead copies every message 3-4 times under the GIL
(docs/performance.md has the figures).

The client asks for *lean* batches (the ``weightserve-flight-batches: lean-1`` call header):
each chunk is a record batch of one ``uint8`` column, ``data`` (the chunk's bytes, sent from
the server's mapping without a copy), with the rest of the row in the batch's
``app_metadata`` (``encode_chunk_header``; docs/protocol.md has the layout). One buffer per
message instead of 26 and no per-row Arrow arrays to build or read: that is what a minimal
zero-copy Flight server costs (bench/flight_minimal.py). A server that does not know the
header sends the full tensor schema, which the client reads too.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from weightserve.client.errors import ServerUnreachable, TransportError, WeightserveError
from weightserve.client.transports.base import wire_error_from_json
from weightserve.client.wire.flight_lean import (
    FORMAT_HEADER,
    LEAN_CHUNK_BYTES,
    LEAN_FORMAT,
    LEAN_SCHEMA,
    decode_chunk_header,
    encode_chunk_header,
)
from weightserve.client.wire.schema import FIELD_NAMES, ChunkHeader

__all__ = [  # the lean form's names, defined in client/wire/flight_lean.py, kept here too
    "FORMAT_HEADER",
    "LEAN_CHUNK_BYTES",
    "LEAN_FORMAT",
    "LEAN_SCHEMA",
    "FlightChunkReader",
    "FlightPool",
    "decode_chunk_header",
    "encode_chunk_header",
    "translate",
]

IDLE_CLIENTS = 8  # connected Flight clients kept per transport, like HTTP's kept-alive pool
CHANNEL_OPTIONS = [
    # Own TCP connection per client: parallel streams do not share one HTTP/2 connection.
    ("grpc.use_local_subchannel_pool", 1),
    # A fixed 4 MiB receive window per stream instead of BDP-probed growth: same speed, less
    # client memory per load (docs/performance.md).
    ("grpc.http2.lookahead_bytes", 4 << 20),
    ("grpc.http2.bdp_probe", 0),
]


def translate(e: flight.FlightError, url: str) -> WeightserveError:
    """Our exception for a Flight error: the server's own class when it named one."""
    try:
        detail = json.loads(e.extra_info or b"{}")
    except ValueError:
        detail = None
    found = wire_error_from_json(detail, older_class_key="error")
    if found is not None:
        return found.exception()
    message = str(e).split(". Detail:", 1)[0]
    if isinstance(e, flight.FlightUnavailableError) and "connect" in message.lower():
        return ServerUnreachable(f"cannot reach the Flight endpoint {url}: {message}")
    # Anything else is the stream breaking (reset, cancelled, internal): resumable.
    return TransportError(f"Flight stream from {url} broke: {type(e).__name__}: {message}")


class FlightPool:
    """Connected ``FlightClient``s for one endpoint, one per concurrent stream."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        ca: bytes | None = None,
        cert: bytes | None = None,
        key: bytes | None = None,
    ) -> None:
        self.url = url
        self._tls: dict[str, Any] = {}
        if ca is not None:
            self._tls["tls_root_certs"] = ca
        if cert is not None and key is not None:
            self._tls.update(cert_chain=cert, private_key=key)
        headers = [(FORMAT_HEADER.encode(), LEAN_FORMAT.encode())]
        if token:
            headers.append((b"authorization", f"Bearer {token}".encode()))
        self.options = flight.FlightCallOptions(headers=headers)
        self._idle: list[flight.FlightClient] = []
        self._lock = threading.Lock()

    def take(self) -> flight.FlightClient:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return flight.FlightClient(self.url, generic_options=CHANNEL_OPTIONS, **self._tls)

    def give(self, client: flight.FlightClient) -> None:
        with self._lock:
            if len(self._idle) < IDLE_CLIENTS:
                self._idle.append(client)
                return
        client.close()

    def open(self, ticket: bytes) -> FlightChunkReader:
        client = self.take()
        try:
            reader = client.do_get(flight.Ticket(ticket), self.options)
        except flight.FlightError as e:
            client.close()
            raise translate(e, self.url) from None
        except pa.ArrowException as e:  # e.g. an IPC error before any status arrived
            client.close()
            raise TransportError(f"Flight stream from {self.url} failed: {e}") from None
        return FlightChunkReader(reader, self, client)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()


class FlightChunkReader:
    """``ArrowChunkReader``'s interface over a Flight ``DoGet`` stream."""

    def __init__(self, reader: flight.FlightStreamReader, pool: FlightPool, client: Any) -> None:
        self._reader = reader
        self._pool = pool
        self._client: Any = client
        self._done = False
        self._lean = False  # set by read_schema: lean batches, or TENSOR_SCHEMA rows

    def read_schema(self) -> pa.Schema:
        try:
            schema = self._reader.schema
        except flight.FlightError as e:
            raise translate(e, self._pool.url) from None
        if schema.equals(LEAN_SCHEMA, check_metadata=True):
            self._lean = True
        elif tuple(schema.names) != FIELD_NAMES:
            raise TransportError(f"not a tensor stream: Flight schema fields {schema.names}")
        return schema

    def next_chunk(self, destination: Callable[[ChunkHeader], memoryview]) -> ChunkHeader | None:
        while not self._done:
            try:
                chunk = self._reader.read_chunk()
            except StopIteration:
                self._done = True
                return None
            except flight.FlightError as e:
                raise translate(e, self._pool.url) from None
            except pa.ArrowException as e:  # a malformed message, not a Flight status
                raise TransportError(f"Flight stream from {self._pool.url}: {e}") from None
            batch = chunk.data
            if self._lean:
                meta = chunk.app_metadata
                if batch is None or meta is None:
                    raise TransportError("a lean Flight batch without data or metadata")
                return self._place_lean(batch.column(0), meta, destination)
            if batch.num_rows == 1:
                return self._place(batch, destination)
            if batch.num_rows:
                raise TransportError(f"a record batch of {batch.num_rows} rows (need 1 per batch)")
        return None

    def _place_lean(
        self, data: pa.Array, meta: pa.Buffer, destination: Callable[[ChunkHeader], memoryview]
    ) -> ChunkHeader:
        header = decode_chunk_header(meta, len(data))
        values = data.buffers()[1]
        source = (
            np.frombuffer(values, np.uint8, header.nbytes, data.offset) if header.nbytes else None
        )
        _copy(destination, header, source)
        return header

    def _place(
        self, batch: pa.RecordBatch, destination: Callable[[ChunkHeader], memoryview]
    ) -> ChunkHeader:
        columns = batch.columns
        data = columns[8]
        _, offsets, values = data.buffers()
        start, end = struct.unpack_from("<ii", offsets, 4 * data.offset)
        header = ChunkHeader(
            columns[0][0].as_py(),
            columns[1][0].as_py(),
            tuple(columns[2][0].as_py()),
            tuple(columns[3][0].as_py()),
            columns[4][0].as_py(),
            columns[5][0].as_py(),
            columns[6][0].as_py(),
            columns[7][0].as_py(),
            end - start,
        )
        source = np.frombuffer(values, np.uint8, header.nbytes, start) if header.nbytes else None
        _copy(destination, header, source)
        return header

    def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        if self._done:
            self._pool.give(client)  # the stream ended cleanly: the connection is reusable
        else:
            self._reader.cancel()
            client.close()


def _copy(
    destination: Callable[[ChunkHeader], memoryview], header: ChunkHeader, source: Any
) -> None:
    """The chunk's bytes (``source``, None when empty) into the buffer the caller gives."""
    view = memoryview(destination(header))
    if view.readonly or view.nbytes != header.nbytes:
        raise ValueError(f"destination for {header!r} must be writable and {header.nbytes} bytes")
    if source is not None:
        # np.copyto releases the GIL for large copies; the other stream keeps running.
        np.copyto(np.frombuffer(view.cast("B") if view.format != "B" else view, np.uint8), source)
