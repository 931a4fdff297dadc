"""The one seam between the client and the wire: HTTP or gRPC.

A transport answers three questions — which models, what is in one, and "open a tensor
stream" — the last as a ``readinto``-able source of Arrow IPC stream bytes, so the receiver
can read tensor data straight into its final buffers. Foreign errors (socket, http.client,
grpc) are translated here, at this one boundary, into weightserve errors.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

from weightserve.client._arrow_reader import ArrowChunkReader
from weightserve.client._malloc import steady_heap
from weightserve.client._schema import ChunkHeader
from weightserve.client._url import ServerAddress
from weightserve.client.errors import (
    ServerUnreachable,
    TransportError,
    WeightserveError,
    error_from_wire,
)

if TYPE_CHECKING:
    from weightserve.client._flight import FlightPool

log = logging.getLogger("weightserve.client")

DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0  # longest silence tolerated inside a stream
IDLE_CONNECTIONS = 8  # kept-alive HTTP connections per transport
# gRPC loads of at least this many bytes keep glibc's heap steady (client/_malloc.py); below
# it, the mallopt and trim calls would cost more than the faults they save.
STEADY_HEAP_BYTES = 16 << 20
MAX_GRPC_MESSAGE = (64 << 20) + (1 << 20)


@dataclass(frozen=True)
class StreamParams:
    """A tensor request as the client sends it (mirrors the server's TensorRequest)."""

    names: tuple[str, ...] | None = None
    prefix: str | None = None
    shard: tuple[int, int] | None = None  # (index, count)
    axis: int = 0
    resume_tensor: str | None = None
    resume_offset: int = 0
    chunk_bytes: int | None = None
    revision: str | None = None


class ByteSource(Protocol):
    def readinto(self, view: memoryview) -> int: ...
    def close(self) -> None: ...


class ChunkReader(Protocol):
    """One tensor stream, chunk by chunk (``ArrowChunkReader``, ``FlightChunkReader``)."""

    def read_schema(self) -> Any: ...
    def next_chunk(
        self, destination: Callable[[ChunkHeader], memoryview]
    ) -> ChunkHeader | None: ...
    def close(self) -> None: ...


class Transport(Protocol):
    address: ServerAddress

    def list_models(self) -> dict[str, Any]: ...
    def model_info(self, model: str) -> dict[str, Any]: ...
    def open_stream(self, model: str, params: StreamParams) -> ByteSource: ...
    def open_chunks(self, model: str, params: StreamParams) -> ChunkReader: ...
    def receiving(self, nbytes: int) -> AbstractContextManager[None]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class TLSOptions:
    ca_file: str | None = None  # trust this CA (PEM) instead of the system store
    cert_file: str | None = None  # client certificate, for mutual TLS
    key_file: str | None = None


def _token(token: str | None) -> str | None:
    return token if token is not None else os.environ.get("WEIGHTSERVE_TOKEN") or None


class HttpTransport:
    """Plain http.client: its responses ``readinto`` straight from the socket."""

    def __init__(
        self,
        address: ServerAddress,
        token: str | None = None,
        tls: TLSOptions | None = None,
        timeout: float = DEFAULT_READ_TIMEOUT,
    ) -> None:
        self.address = address
        self.token = _token(token)
        self.timeout = timeout
        self._ssl: ssl.SSLContext | None = None
        # Connections kept alive between requests: a small request then costs no TCP (and
        # no TLS) handshake. Taken by one request at a time; closed on any error.
        self._idle: list[http.client.HTTPConnection] = []
        self._pool_lock = threading.Lock()
        if address.tls:
            tls = tls or TLSOptions()
            self._ssl = ssl.create_default_context(cafile=tls.ca_file)
            if tls.cert_file:
                self._ssl.load_cert_chain(tls.cert_file, tls.key_file)

    def _connect(self) -> http.client.HTTPConnection:
        if self._ssl is not None:
            return http.client.HTTPSConnection(
                self.address.host, self.address.port, timeout=self.timeout, context=self._ssl
            )
        return http.client.HTTPConnection(
            self.address.host, self.address.port, timeout=self.timeout
        )

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        """A kept-alive connection if one is idle (True), else a new one (False)."""
        with self._pool_lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def release(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        """Keep the connection for the next request if its response was read to the end."""
        if resp.isclosed() and not resp.will_close:
            with self._pool_lock:
                if len(self._idle) < IDLE_CONNECTIONS:
                    self._idle.append(conn)
                    return
        conn.close()

    def _request(
        self, method: str, path: str, body: dict | None = None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        headers = {"accept": "application/json, application/vnd.apache.arrow.stream"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        while True:
            conn, reused = self._take()
            try:
                if conn.sock is None:
                    conn.connect()
                    # http.client sends headers and body in two writes; without NODELAY the
                    # body waits for the server's delayed ACK (40 ms) on a kept-alive connection.
                    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # type: ignore[attr-defined]
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                conn.close()
                if reused:
                    continue  # the server closed an idle kept-alive connection: use a new one
                raise ServerUnreachable(
                    f"cannot reach weightserve at {self.address.url}: {e}"
                ) from e
            except (ConnectionRefusedError, TimeoutError, OSError) as e:
                conn.close()
                raise ServerUnreachable(
                    f"cannot reach weightserve at {self.address.url}: {e}"
                ) from e
            except http.client.HTTPException as e:
                conn.close()
                raise TransportError(f"{self.address.url}: broken HTTP exchange: {e}") from e
        if resp.status != 200:
            raw = resp.read()
            conn.close()
            raise _http_error(resp.status, raw, f"{method} {self.address.url}{path}")
        return conn, resp

    def _json(self, path: str) -> dict[str, Any]:
        conn, resp = self._request("GET", path)
        try:
            result = json.loads(resp.read())
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise TransportError(f"{self.address.url}{path}: {e}") from e
        self.release(conn, resp)
        return result

    def list_models(self) -> dict[str, Any]:
        return self._json("/v1/models")

    def model_info(self, model: str) -> dict[str, Any]:
        return self._json(f"/v1/models/{quote(model, safe='/')}")

    def open_stream(self, model: str, params: StreamParams) -> ByteSource:
        body: dict[str, Any] = {
            "names": list(params.names) if params.names is not None else None,
            "prefix": params.prefix,
            "axis": params.axis,
            "resume_tensor": params.resume_tensor,
            "resume_offset": params.resume_offset,
            "revision": params.revision,
        }
        if params.shard:
            body["shard"] = f"{params.shard[0]}/{params.shard[1]}"
        if params.chunk_bytes:
            body["chunk_bytes"] = params.chunk_bytes
        conn, resp = self._request("POST", f"/v1/models/{quote(model, safe='/')}/stream", body)
        return _HttpSource(self, conn, resp)

    def open_chunks(self, model: str, params: StreamParams) -> ChunkReader:
        return ArrowChunkReader(self.open_stream(model, params))

    def receiving(self, nbytes: int) -> AbstractContextManager[None]:
        """Around a load of ``nbytes``: nothing to prepare, data lands in place."""
        return contextlib.nullcontext()

    def close(self) -> None:
        with self._pool_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _HttpSource:
    def __init__(
        self,
        transport: HttpTransport,
        conn: http.client.HTTPConnection,
        resp: http.client.HTTPResponse,
    ) -> None:
        self.transport, self.conn, self.resp = transport, conn, resp
        self.where = transport.address.url
        self.closed = False

    def readinto(self, view: memoryview) -> int:
        try:
            return self.resp.readinto(view)
        except (OSError, http.client.HTTPException) as e:
            raise TransportError(f"stream from {self.where} broke: {e!r}") from e

    def close(self) -> None:
        if self.closed:  # a second close must not pool the connection twice
            return
        self.closed = True
        # Read to its end (the receiver stops at the end marker, the last byte): keep the
        # connection; cut short: close it, the rest of the body is not worth reading.
        if self.resp.isclosed():
            self.transport.release(self.conn, self.resp)
        else:
            self.resp.close()
            self.conn.close()


def _http_error(status: int, raw: bytes, what: str) -> WeightserveError:
    try:
        err = json.loads(raw)["error"]
        return error_from_wire(err["type"], err["message"])
    except (ValueError, KeyError, TypeError):
        text = raw[:200].decode(errors="replace")
        if status >= 500:
            return TransportError(f"{what}: HTTP {status}: {text}")
        return WeightserveError(f"{what}: HTTP {status}: {text}")


class GrpcTransport:
    def __init__(
        self,
        address: ServerAddress,
        token: str | None = None,
        tls: TLSOptions | None = None,
        timeout: float = DEFAULT_READ_TIMEOUT,
        flight: bool | None = None,
    ) -> None:
        import grpc

        from weightserve.client._proto.weightserve.v1 import weightserve_pb2 as pb

        self._grpc, self._pb = grpc, pb
        self.address = address
        self.token = _token(token)
        self.timeout = timeout
        target = (
            f"{address.host}:{address.port}"
            if ":" not in address.host
            else f"[{address.host}]:{address.port}"
        )
        self._target = target
        options = [("grpc.max_receive_message_length", MAX_GRPC_MESSAGE)]
        # Bulk data goes over the server's Arrow Flight endpoint when it offers one;
        # flight=False (or WEIGHTSERVE_FLIGHT=0) keeps every stream on grpcio StreamTensors.
        if flight is None:
            flight = os.environ.get("WEIGHTSERVE_FLIGHT", "1").lower() not in ("0", "off", "false")
        self.use_flight = flight
        self._flight: FlightPool | None | bool = False  # False: not asked yet
        self._flight_lock = threading.Lock()
        self._flight_tls: dict[str, bytes | None] = {}
        if address.tls:
            tls = tls or TLSOptions()

            def read(path: str | None) -> bytes | None:
                if path is None:
                    return None
                with open(path, "rb") as f:
                    return f.read()

            ca, key, cert = read(tls.ca_file), read(tls.key_file), read(tls.cert_file)
            creds = grpc.ssl_channel_credentials(ca, key, cert)
            self._flight_tls = {"ca": ca, "cert": cert, "key": key}
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        service = "/weightserve.v1.WeightService/"
        self._list = self.channel.unary_unary(
            service + "ListModels",
            request_serializer=pb.ListModelsRequest.SerializeToString,
            response_deserializer=pb.ListModelsResponse.FromString,
        )
        self._get = self.channel.unary_unary(
            service + "GetModel",
            request_serializer=pb.GetModelRequest.SerializeToString,
            response_deserializer=pb.ModelInfo.FromString,
        )
        self._info = self.channel.unary_unary(
            service + "GetServerInfo",
            request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.ServerInfo.FromString,
        )
        self._stream = self.channel.unary_stream(
            service + "StreamTensors",
            request_serializer=pb.TensorRequest.SerializeToString,
            response_deserializer=_arrow_data_payload,
        )

    def _metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def _translate(self, e: Any) -> WeightserveError:
        grpc = self._grpc
        trailing = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
        kind = trailing.get("weightserve-error")
        if kind:
            return error_from_wire(kind, e.details())
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return ServerUnreachable(
                f"cannot reach weightserve at {self.address.url}: {e.details()}"
            )
        if e.code() in (
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.INTERNAL,
            grpc.StatusCode.UNKNOWN,
        ):
            return TransportError(
                f"gRPC stream from {self.address.url} broke: {e.code().name}: {e.details()}"
            )
        return error_from_wire(
            _GRPC_CODE_CLASSES.get(e.code().name, "WeightserveError"),
            f"{self.address.url}: {e.code().name}: {e.details()}",
        )

    def list_models(self) -> dict[str, Any]:
        try:
            resp = self._list(
                self._pb.ListModelsRequest(), timeout=self.timeout, metadata=self._metadata()
            )
        except self._grpc.RpcError as e:
            raise self._translate(e) from None
        return {
            "models": [
                {
                    "id": m.id,
                    "format": m.format,
                    "revision": m.revision,
                    "tensor_count": m.tensor_count,
                    "total_bytes": m.total_bytes,
                }
                for m in resp.models
            ],
            "problems": [
                {"model": p.model, "file": p.file, "reason": p.reason} for p in resp.problems
            ],
        }

    def model_info(self, model: str) -> dict[str, Any]:
        try:
            m = self._get(
                self._pb.GetModelRequest(model=model),
                timeout=self.timeout,
                metadata=self._metadata(),
            )
        except self._grpc.RpcError as e:
            raise self._translate(e) from None
        return {
            "id": m.id,
            "format": m.format,
            "revision": m.revision,
            "alignment": m.alignment,
            "metadata": json.loads(m.metadata_json or "{}"),
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "logical_shape": list(t.logical_shape),
                    "encoding": t.encoding or None,
                    "nbytes": t.nbytes,
                }
                for t in m.tensors
            ],
        }

    def _tensor_request(self, model: str, params: StreamParams) -> Any:
        return self._pb.TensorRequest(
            model=model,
            names=list(params.names or ()),
            prefix=params.prefix or "",
            use_prefix=params.names is None,
            shard_index=params.shard[0] if params.shard else 0,
            shard_count=params.shard[1] if params.shard else 0,
            shard_axis=params.axis,
            resume_tensor=params.resume_tensor or "",
            resume_offset=params.resume_offset,
            chunk_bytes=params.chunk_bytes or 0,
            revision=params.revision or "",
        )

    def open_stream(self, model: str, params: StreamParams) -> ByteSource:
        """StreamTensors through grpcio: the Arrow IPC stream's bytes."""
        call = self._stream(self._tensor_request(model, params), metadata=self._metadata())
        return _GrpcSource(call, self)

    def open_chunks(self, model: str, params: StreamParams) -> ChunkReader:
        """The stream over the server's Flight endpoint when it has one, else StreamTensors."""
        pool = self._flight_pool()
        if pool is not None:
            ticket = self._tensor_request(model, params).SerializeToString()
            try:
                return pool.open(ticket)
            except ServerUnreachable as e:
                if not self._service_answers():
                    raise  # the whole server is down or restarting: the caller retries
                # The service answers but its Flight port does not, e.g. a Service that
                # exposes the gRPC port only: stay on StreamTensors from now on.
                log.warning("%s; using gRPC StreamTensors instead", e)
                with self._flight_lock:
                    self._flight = None
                pool.close()
        return ArrowChunkReader(self.open_stream(model, params))

    def receiving(self, nbytes: int) -> AbstractContextManager[None]:
        """Around a load of ``nbytes``: large ones keep glibc's heap steady, since gRPC
        receives every message into fresh malloc'd buffers (client/_malloc.py)."""
        return steady_heap() if nbytes >= STEADY_HEAP_BYTES else contextlib.nullcontext()

    def _server_info(self, timeout: float) -> Any:
        return self._info(
            self._pb.GetServerInfoRequest(), timeout=timeout, metadata=self._metadata()
        )

    def _service_answers(self) -> bool:
        try:
            self._server_info(timeout=5)
        except self._grpc.RpcError:
            return False
        return True

    def _flight_pool(self) -> FlightPool | None:
        """The Flight endpoint the server advertises (asked once), unless turned off."""
        with self._flight_lock:
            if self._flight is not False:
                return self._flight
            if not self.use_flight:
                self._flight = None
                return None
            try:
                info = self._server_info(self.timeout)
            except self._grpc.RpcError as e:
                if e.code() != self._grpc.StatusCode.UNIMPLEMENTED:
                    raise self._translate(e) from None  # not answered: ask again next time
                self._flight = None  # an older server without GetServerInfo
                return None
            self._flight = None
            if info.flight_port:
                from weightserve.client._flight import FlightPool

                scheme = "grpc+tls" if self.address.tls else "grpc+tcp"
                host = self._target.rsplit(":", 1)[0]
                self._flight = FlightPool(
                    f"{scheme}://{host}:{info.flight_port}", token=self.token, **self._flight_tls
                )
            return self._flight

    def close(self) -> None:
        with self._flight_lock:
            pool, self._flight = self._flight, False
        if pool is not None and not isinstance(pool, bool):
            pool.close()
        self.channel.close()


_GRPC_CODE_CLASSES = {
    "NOT_FOUND": "NotFound",
    "INVALID_ARGUMENT": "InvalidRequest",
    "UNAUTHENTICATED": "Unauthenticated",
    "PERMISSION_DENIED": "PermissionDenied",
    "RESOURCE_EXHAUSTED": "ResourceExhausted",
    "DATA_LOSS": "DataCorruption",
}


def _arrow_data_payload(message: bytes) -> memoryview:
    """ArrowData.data without a protobuf object: skip the tag and length varint (no copy)."""
    view = memoryview(message)
    if not view or view[0] != 0x0A:
        return view[:0] if not view else _arrow_data_slow(message)
    i, shift, size = 1, 0, 0
    while True:
        byte = view[i]
        size |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            break
        shift += 7
    if i + size != len(view):
        return _arrow_data_slow(message)
    return view[i:]


def _arrow_data_slow(message: bytes) -> memoryview:
    from weightserve.client._proto.weightserve.v1 import weightserve_pb2 as pb

    return memoryview(pb.ArrowData.FromString(message).data)


class _GrpcSource:
    """readinto over the gRPC message stream (one copy: message -> destination)."""

    def __init__(self, call: Any, transport: GrpcTransport) -> None:
        self.call = call
        self.transport = transport
        self._messages: Iterator[memoryview] = iter(call)
        self._current = memoryview(b"")

    def readinto(self, view: memoryview) -> int:
        while not self._current:
            try:
                self._current = next(self._messages)
            except StopIteration:
                return 0
            except self.transport._grpc.RpcError as e:
                raise self.transport._translate(e) from None
        n = min(len(view), len(self._current))
        view[:n] = self._current[:n]
        self._current = self._current[n:]
        return n

    def close(self) -> None:
        self.call.cancel()


def make_transport(
    address: ServerAddress,
    token: str | None = None,
    tls: TLSOptions | None = None,
    timeout: float = DEFAULT_READ_TIMEOUT,
    flight: bool | None = None,
) -> Transport:
    if address.transport == "http":
        return HttpTransport(address, token=token, tls=tls, timeout=timeout)
    return GrpcTransport(address, token=token, tls=tls, timeout=timeout, flight=flight)
