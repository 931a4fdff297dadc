"""The gRPC transport: metadata through the WeightService's unary calls; bulk tensor data
over the server's Arrow Flight endpoint when it has one, else StreamTensors; one small tensor
through the unary GetTensor."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

from weightserve.client import errors
from weightserve.client.receive.arrow_reader import ArrowChunkReader
from weightserve.client.transports import base
from weightserve.client.transports.malloc import steady_heap
from weightserve.client.wire.errors import RETRY_PUSHBACK_KEY, WireError, pushback_seconds
from weightserve.client.wire.routes import ServerAddress
from weightserve.client.wire.schema import MAX_GRPC_MESSAGE_BYTES, ChunkHeader

if TYPE_CHECKING:
    from weightserve.client.transports.flight import FlightPool

log = logging.getLogger("weightserve.client")

# gRPC loads of at least this many bytes keep glibc's heap steady (client/transports/malloc.py); below
# it, the mallopt and trim calls would cost more than the faults they save.
STEADY_HEAP_BYTES = 16 << 20
# A request for one tensor of at most this many bytes goes over gRPC's unary GetTensor: one
# call on the channel, where a Flight DoGet or a StreamTensors stream costs more per request
# (docs/performance.md, "Decisions and the figures behind them").
UNARY_TENSOR_BYTES = 1 << 20
# grpc core's words (UNAVAILABLE details) for a connection that was made and then refused:
# a failed TLS handshake, or a TLS server closing a plain-text connection.
_NOT_AN_OUTAGE = re.compile(r"handshake failed|Socket closed", re.IGNORECASE)


class GrpcTransport(base.RefusesControl, base.DataTransport):
    """The gRPC API: the data verbs, and of the control verbs the revisions listed and
    watched (ListRevisions, WatchRevisions); the others need HTTP (``RefusesControl``)."""

    control_verbs = frozenset({"list_revisions", "watch_revisions"})

    def __init__(self, address: ServerAddress, connection: base.Connection | None = None) -> None:
        import grpc

        from weightserve.client.wire.grpc_methods import ENCODED_RESPONSES, METHODS
        from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb

        self._grpc, self._pb = grpc, pb
        connection = connection or base.Connection()
        self.address = address
        self.token = connection.bearer
        self.timeout = connection.timeout
        target = (
            f"{address.host}:{address.port}"
            if ":" not in address.host
            else f"[{address.host}]:{address.port}"
        )
        self._target = target
        options = [
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
            # grpc's reconnect backoff grows to 120 s by default, so a channel to a server
            # that was down a while would stay in failure long after it came back; our own
            # retries (client/_retry.py) pace the attempts instead.
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        # Bulk data goes over the server's Arrow Flight endpoint when it offers one;
        # flight=False (or WEIGHTSERVE_FLIGHT=0) keeps every stream on grpcio StreamTensors.
        flight = connection.flight
        if flight is None:
            flight = os.environ.get("WEIGHTSERVE_FLIGHT", "1").lower() not in ("0", "off", "false")
        self.use_flight = flight
        self._flight: FlightPool | None | Literal[False] = False  # False: not asked yet
        self._flight_lock = threading.Lock()
        self._flight_tls: dict[str, bytes | None] = {}
        if address.tls:
            tls = connection.tls or base.TLSOptions()

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
        channel = self.channel

        def stub(name: str, payload: Callable[[bytes], Any] | None = None) -> Any:
            """The channel's callable for method ``name`` (client/wire/grpc_methods.py);
            ``payload`` reads an encoded response (ENCODED_RESPONSES) instead of its class."""
            method = METHODS[name]
            make = channel.unary_stream if method.server_streaming else channel.unary_unary
            deserialize = payload if name in ENCODED_RESPONSES else method.response.FromString
            return make(
                method.path,
                request_serializer=method.request.SerializeToString,
                response_deserializer=deserialize,
            )

        self._list = stub("ListModels")
        self._get = stub("GetModel")
        self._info = stub("GetServerInfo")
        self._stream = stub("StreamTensors", _arrow_data_payload)
        self._list_files = stub("ListFiles")
        self._read_file = stub("ReadFile", _arrow_data_payload)  # FileChunk: ArrowData's layout
        self._list_revisions = stub("ListRevisions")
        self._watch_revisions = stub("WatchRevisions")
        self._get_tensor = stub("GetTensor")
        self._unary_tensors = True  # False once the server says it has no GetTensor
        # (model, tensor) -> bytes, from model_info and too_large answers: a tensor known to
        # be large is streamed at once, without a GetTensor asked in vain first.
        self._sizes: dict[tuple[str, str], int] = {}

    def _metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def _translate(self, e: Any) -> errors.WeightserveError:
        grpc = self._grpc
        trailing = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
        found = WireError.from_grpc(e.details() or "", trailing)
        if found is not None:  # the server named its exception: raise the same class
            return found.exception()
        wrong_port = self._wrong_port(e)
        if wrong_port is not None:
            return wrong_port
        if e.code() == grpc.StatusCode.UNAVAILABLE and _NOT_AN_OUTAGE.search(e.details() or ""):
            # A TLS failure, or a TLS port spoken to in plain text: waiting will not fix it.
            return errors.TransportError(
                f"weightserve at {self.address.url} did not accept the connection: "
                f"{e.details()}; check the URL's scheme (grpcs:// for TLS), the CA and the "
                "client certificate"
            )
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return errors.ServerUnreachable(
                f"cannot reach weightserve at {self.address.url}: {e.details()}"
            )
        if e.code() in (
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.INTERNAL,
            grpc.StatusCode.UNKNOWN,
        ):
            return errors.TransportError(
                f"gRPC stream from {self.address.url} broke: {e.code().name}: {e.details()}"
            )
        # A status without our class (a proxy, another gRPC server): the class its code means.
        return WireError(
            _GRPC_CODE_CLASSES.get(e.code().name, "WeightserveError"),
            f"{self.address.url}: {e.code().name}: {e.details()}",
            pushback_seconds(trailing.get(RETRY_PUSHBACK_KEY)),
        ).exception()

    def _wrong_port(self, e: Any) -> errors.WrongTransport | None:
        """WrongTransport when the port speaks another protocol: HTTP/1.1 (grpc core says
        so when its HTTP/2 preface is answered by an HTTP/1 server), or Arrow Flight (it
        answers our methods UNIMPLEMENTED)."""
        code, details = e.code(), e.details() or ""
        url = self.address.url
        if code == self._grpc.StatusCode.UNAVAILABLE and "http1.x server" in details:
            http_url = ServerAddress("http", self.address.tls, self.address.host, self.address.port)
            return errors.WrongTransport(
                f"{url} is an HTTP port, not gRPC (it answered in HTTP/1.1): use "
                f"{http_url.url} (a model: {http_url.url}/v1/models/MODEL)"
            )
        if code == self._grpc.StatusCode.UNIMPLEMENTED and self._is_flight_port():
            return errors.WrongTransport(
                f"{url} is the server's Arrow Flight data port, not its gRPC API: use the "
                "gRPC port in grpc:// URLs (default 50051); gRPC clients find the Flight "
                "port by themselves"
            )
        return None

    def _is_flight_port(self) -> bool:
        """Whether this port serves Arrow Flight (asked only once our methods came back
        UNIMPLEMENTED): a Flight server answers DoGet of an empty ticket (with an error about
        the ticket), any other server does not know the method."""
        do_get = self.channel.unary_stream(
            "/arrow.flight.protocol.FlightService/DoGet",
            request_serializer=lambda _: b"",  # a Ticket with no bytes
            response_deserializer=bytes,
        )
        try:
            call = do_get(None, timeout=5, metadata=self._metadata())
            next(iter(call), None)
            call.cancel()
        except self._grpc.RpcError as probe:
            return probe.code() not in (
                self._grpc.StatusCode.UNIMPLEMENTED,
                self._grpc.StatusCode.UNAVAILABLE,
                self._grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        return True

    def _unary(self, method: Any, request: Any) -> Any:
        """One unary call with the client's token and timeout; errors as weightserve errors."""
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata())
        except self._grpc.RpcError as e:
            raise self._translate(e) from None

    def list_models(self) -> dict[str, Any]:
        resp = self._unary(self._list, self._pb.ListModelsRequest())
        return {
            "models": [
                {
                    "id": m.id,
                    "format": m.format,
                    "revision": m.revision,
                    "tensor_count": m.tensor_count,
                    "total_bytes": m.total_bytes,
                    "state": m.state or "local",
                    "commit": m.commit,
                    "cached_revision": m.cached_revision,
                }
                for m in resp.models
            ],
            "problems": [
                {"model": p.model, "file": p.file, "reason": p.reason} for p in resp.problems
            ],
        }

    def model_info(self, model: str) -> dict[str, Any]:
        m = self._unary(self._get, self._pb.GetModelRequest(model=model))
        self._sizes.update(((model, t.name), t.nbytes) for t in m.tensors)
        return {
            "id": m.id,
            "format": m.format,
            "revision": m.revision,
            "commit": m.commit,
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

    def _tensor_request(self, model: str, params: base.StreamParams) -> Any:
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

    def open_stream(self, model: str, params: base.StreamParams) -> base.ByteSource:
        """StreamTensors through grpcio: the Arrow IPC stream's bytes."""
        call = self._stream(self._tensor_request(model, params), metadata=self._metadata())
        return _GrpcSource(call, self)

    def _small_tensor(self, model: str, params: base.StreamParams) -> base.ChunkReader | None:
        """One small tensor through the unary GetTensor: a reader of its one chunk, or None
        when the request is not one small tensor (or the server lacks the call)."""
        names = params.names
        if (
            not self._unary_tensors
            or names is None
            or len(names) != 1
            or params.resume_offset
            or self._sizes.get((model, names[0]), 0) > UNARY_TENSOR_BYTES
        ):
            return None
        request = self._pb.GetTensorRequest(
            request=self._tensor_request(model, params), max_bytes=UNARY_TENSOR_BYTES
        )
        try:
            answer = self._get_tensor(request, timeout=self.timeout, metadata=self._metadata())
        except self._grpc.RpcError as e:
            if e.code() == self._grpc.StatusCode.UNIMPLEMENTED:  # an older server
                self._unary_tensors = False
                return None
            raise self._translate(e) from None
        if answer.too_large:
            self._sizes[(model, answer.name)] = answer.total_bytes
            return None
        return _TensorDataReader(answer)

    def open_chunks(self, model: str, params: base.StreamParams) -> base.ChunkReader:
        """One small tensor through GetTensor; else the stream over the server's Flight
        endpoint when it has one, else StreamTensors."""
        small = self._small_tensor(model, params)
        if small is not None:
            return small
        pool = self._flight_pool()
        if pool is not None:
            ticket = self._tensor_request(model, params).SerializeToString()
            try:
                return pool.open(ticket)
            except errors.ServerUnreachable as e:
                if not self._service_answers():
                    raise  # the whole server is down or restarting: the caller retries
                # The service answers but its Flight port does not, e.g. a Service that
                # exposes the gRPC port only: stay on StreamTensors from now on.
                log.warning("%s; using gRPC StreamTensors instead", e)
                with self._flight_lock:
                    self._flight = None
                pool.close()
        return ArrowChunkReader(self.open_stream(model, params))

    def list_revisions(self, model: str) -> list[dict[str, Any]]:
        """The model's revisions, as ``GET /v1/models/ID/-/revisions`` lists them."""
        listing = self._unary(self._list_revisions, self._pb.GetModelRequest(model=model))
        return [_revision_record(r) for r in listing.revisions]

    def watch_revisions(
        self, model: str, since: str | None, timeout: float | None, after: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """WatchRevisions' events as the HTTP watch's lines read: ``{"event": "hello",
        "main", "sequence"}``, ``{"event": "revision", "sequence", ...}`` (with
        ``"history_cut": true`` where the server's history no longer reached the point
        resumed from), ``{"event": "heartbeat"}``; ends at ``timeout`` seconds (None: when
        the server ends it). A server that numbers no changes sends no ``sequence``."""
        request = self._pb.WatchRequest(model=model, since=since or "", after=after)
        call = self._watch_revisions(request, timeout=timeout, metadata=self._metadata())
        try:
            for event in call:
                yield _watch_event(event)
        except self._grpc.RpcError as e:
            if e.code() == self._grpc.StatusCode.DEADLINE_EXCEEDED:
                return  # the watch's own time is up
            raise self._translate(e) from None
        finally:
            call.cancel()

    def list_files(self, model: str) -> dict[str, Any]:
        """``{id, revision, commit, files: [{name, size, etag}]}``: the model's repository."""
        listing = self._unary(self._list_files, self._pb.GetModelRequest(model=model))
        return {
            "id": listing.id,
            "revision": listing.revision,
            "commit": listing.commit,
            "files": [{"name": f.name, "size": f.size, "etag": f.etag} for f in listing.files],
        }

    def open_span(self, model: str, name: str, span: base.FileSpan) -> base.FileSource:
        """See ``DataTransport.open_file``; through ReadFile."""
        offset, length = span.offset, span.length
        request = self._pb.FileRequest(
            model=model, name=name, offset=offset, length=length or 0, revision=span.revision or ""
        )
        call = self._read_file(request, metadata=self._metadata())
        try:
            headers = dict(call.initial_metadata() or ())
        except self._grpc.RpcError as e:
            raise self._translate(e) from None
        if not headers:  # the call failed before the server sent its metadata
            try:
                next(iter(call), None)
            except self._grpc.RpcError as e:
                raise self._translate(e) from None
            raise errors.TransportError(f"{self.address.url}: ReadFile ended without an answer")
        source = _GrpcFileSource(call, self, length == 0)
        source.size = int(headers.get("x-file-size", 0))
        source.etag = headers.get("etag", "")
        source.revision = headers.get("x-weightserve-revision", "")
        source.offset = offset
        end = source.size if length is None else min(source.size, offset + length)
        source.length = max(0, end - offset)
        return source

    def receiving(self, nbytes: int) -> AbstractContextManager[None]:
        """Around a load of ``nbytes``: large ones keep glibc's heap steady, since gRPC
        receives every message into fresh malloc'd buffers (client/transports/malloc.py)."""
        return steady_heap() if nbytes >= STEADY_HEAP_BYTES else contextlib.nullcontext()

    def _server_info(self, timeout: float) -> Any:
        return self._info(
            self._pb.GetServerInfoRequest(), timeout=timeout, metadata=self._metadata()
        )

    def server_info(self) -> dict[str, Any]:
        """The server's data planes (GetServerInfo), as HTTP's ``/v1/server`` spells them;
        {} from a server without the call."""
        try:
            info = self._server_info(self.timeout)
        except self._grpc.RpcError as e:
            if e.code() == self._grpc.StatusCode.UNIMPLEMENTED:
                return {}
            raise self._translate(e) from None
        return {
            "version": info.version,
            "instance": info.instance,
            "http_port": info.http_port,
            "flight_port": info.flight_port,
            "uds": info.uds or None,
        }

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
                from weightserve.client.transports.flight import FlightPool

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


class _TensorDataReader:
    """A GetTensor answer as a ChunkReader: one chunk, the whole tensor."""

    def __init__(self, answer: Any) -> None:
        self._answer: Any = answer

    def read_schema(self) -> None:
        return None

    def next_chunk(self, destination: Callable[[ChunkHeader], memoryview]) -> ChunkHeader | None:
        a, self._answer = self._answer, None
        if a is None:
            return None
        header = ChunkHeader(
            a.name,
            a.dtype,
            tuple(a.shape),
            tuple(a.logical_shape),
            a.encoding or None,
            0,
            a.total_bytes,
            a.digest,
            len(a.data),
        )
        view = memoryview(destination(header)).cast("B")
        view[:] = a.data
        return header

    def close(self) -> None:
        self._answer = None


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
    from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb

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


class _GrpcFileSource(_GrpcSource):
    """A file's bytes from ReadFile, with what its initial metadata says about the file."""

    size = 0
    etag = ""
    revision = ""
    offset = 0
    length = 0

    def __init__(self, call: Any, transport: GrpcTransport, empty: bool) -> None:
        super().__init__(call, transport)
        self.empty = empty
        if empty:  # length 0 asked for the metadata alone; "0" on the wire means "to the end"
            call.cancel()

    def readinto(self, view: memoryview) -> int:
        return 0 if self.empty else super().readinto(view)


def _watch_event(event: Any) -> dict[str, Any]:
    """A RevisionEvent as the HTTP watch's line: a field the message leaves unset (sequence
    0, no history cut) is left out, as the HTTP watch leaves it out."""
    found: dict[str, Any] = {"event": event.event}
    if event.event == "hello":
        found["main"] = event.main
    elif event.event == "revision":
        found.update(_revision_record(event.revision))
        if event.history_cut:
            found["history_cut"] = True
    if event.sequence:
        found["sequence"] = event.sequence
    return found


def _revision_record(revision: Any) -> dict[str, Any]:
    """A Revision message as the HTTP routes' JSON record."""
    return {
        "commit": revision.commit,
        "parent": revision.parent or None,
        "created": revision.created,
        "bytes": revision.bytes,
        "message": revision.message,
        "metadata": json.loads(revision.metadata_json or "{}"),
    }
