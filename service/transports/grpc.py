"""The gRPC transport: the same catalog and streams as HTTP, plus health and reflection.

StreamTensors sends the Arrow IPC stream as ArrowData messages, one per IPC message. Its
responses are encoded by hand (field 1, length-delimited) so each chunk is copied once, into
the message, instead of twice through a protobuf object.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any
from urllib.parse import unquote

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from weightserve.client.errors import InvalidRequest, ResourceExhausted, WeightserveError
from weightserve.client.wire.errors import WireError
from weightserve.client.wire.grpc_methods import ENCODED_RESPONSES, METHODS, SERVICE_NAME
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client.wire.schema import MAX_GRPC_MESSAGE_BYTES
from weightserve.service.serving import files
from weightserve.service.serving import views as models_view
from weightserve.service.serving.arrow_writer import END_OF_STREAM
from weightserve.service.serving.auth import Access, authorize
from weightserve.service.serving.feed import (
    DRAIN_CHECK_SECONDS,
    HEARTBEAT_SECONDS,
    OVERRUN_REASON,
    watch_start,
)
from weightserve.service.serving.lease import StreamLease
from weightserve.service.serving.request import from_proto
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.streams import plan_stream, stream_chunks, stream_messages
from weightserve.service.serving.views import server_version
from weightserve.service.sources.base import RevisionLog
from weightserve.service.sources.revisions.announcements import HISTORY_CUT
from weightserve.service.transports.listener import (
    StartupError,
    check_port_free,
    claim_socket_path,
    remove_socket_file,
    url_host,
)

# GetTensor: the largest tensor it sends when the request names no limit, and in any case.
GET_TENSOR_DEFAULT_BYTES = 1 << 20
# WatchRevisions calls served at once: each holds a worker thread of the pool (sized for them).
GRPC_WATCHES = 64
GET_TENSOR_MAX_BYTES = 4 << 20

log = logging.getLogger("weightserve.grpc")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_arrow_data(parts: tuple | list) -> bytes:
    """ArrowData{data = concatenation of parts}, in protobuf wire format, one copy."""
    size = sum(len(p) for p in parts)
    return b"".join([b"\x0a", _varint(size), *parts])


def _abort(context: grpc.ServicerContext, exc: WeightserveError) -> None:
    """Ends the call with the error's wire form: its status code and message, its class
    (and retry hint) in trailing metadata."""
    error = WireError.from_exception(exc)
    context.set_trailing_metadata(error.grpc_trailers())
    context.abort(getattr(grpc.StatusCode, error.grpc_code()), error.message)


def _revision(record: dict[str, Any]) -> pb.Revision:
    return pb.Revision(
        commit=record["commit"],
        parent=record.get("parent") or "",
        created=float(record.get("created") or 0.0),
        bytes=int(record.get("bytes") or 0),
        message=record.get("message") or "",
        metadata_json=json.dumps(record.get("metadata") or {}),
    )


def _revision_event(record: dict[str, Any]) -> pb.RevisionEvent:
    """A change of main as the HTTP watch's ``revision`` line carries it."""
    return pb.RevisionEvent(
        event="revision",
        revision=_revision(record),
        sequence=int(record.get("sequence") or 0),
        history_cut=bool(record.get(HISTORY_CUT)),
    )


def peer_host(peer: str) -> str:
    """The client's address from a gRPC peer string, without its port, spelled as HTTP spells
    it, so one client's streams count against one per-client limit on every transport:
    'ipv4:127.0.0.1:5000' -> '127.0.0.1', 'ipv6:%5B::1%5D:5000' -> '::1'."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return unquote(rest).rsplit(":", 1)[0].strip("[]")
    return peer


def _unary_call(operation: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A unary handler counted under ``operation`` whatever its outcome; the WeightserveError
    it raises becomes the gRPC status the error table gives it."""

    def decorate(answer: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(answer)
        def handler(service: WeightService, request: Any, context: grpc.ServicerContext) -> Any:
            calls = service.state.metrics.grpc
            started = time.perf_counter()
            try:
                response = answer(service, request, context)
            except Exception as e:
                calls.ended(operation, started, e, finished=False)
                if isinstance(e, WeightserveError):
                    _abort(context, e)
                raise  # grpc answers UNKNOWN
            calls.ended(operation, started)
            return response

        return handler

    return decorate


def _cancel_when_idle(context: grpc.ServicerContext, timeout: float) -> Callable[[], None]:
    """The idle cut of one call: while a client reads nothing, HTTP/2 flow control blocks
    the handler inside grpc, holding a worker thread and a stream slot. Only this stream is
    reset, not the connection."""

    def cut() -> None:
        log.warning(
            "gRPC stream to %s cut: the client read nothing for %.1f s", context.peer(), timeout
        )
        context.cancel()

    return cut


class WeightService:
    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self._watches = 0  # WatchRevisions calls open, each holding a worker thread
        self._watch_lock = threading.Lock()

    def _access(self, context: grpc.ServicerContext) -> Access:
        metadata = dict(context.invocation_metadata())
        return authorize(self.state.tokens, metadata.get("authorization"))

    @_unary_call("list_models")
    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> Any:
        listing = models_view.model_list(self.state.catalog, self._access(context).may_read)
        return pb.ListModelsResponse(
            models=[pb.ModelSummary(**m) for m in listing["models"]],
            problems=[pb.ModelProblem(**p) for p in listing["problems"]],
        )

    @_unary_call("model_info")
    def GetModel(self, request: pb.GetModelRequest, context: grpc.ServicerContext) -> Any:
        # Metadata: a node cache describes an uncached model from its headers, no fill.
        model = self.state.readable_metadata(self._access(context), request.model)
        info = models_view.model_info(model)
        return pb.ModelInfo(
            id=info["id"],
            format=info["format"],
            revision=info["revision"],
            commit=info["commit"],
            alignment=info["alignment"],
            metadata_json=json.dumps(info["metadata"]),
            tensors=[
                pb.TensorInfo(
                    name=t["name"],
                    dtype=t["dtype"],
                    shape=t["shape"],
                    logical_shape=t["logical_shape"],
                    encoding=t["encoding"] or "",
                    nbytes=t["nbytes"],
                )
                for t in info["tensors"]
            ],
        )

    @_unary_call("server_info")
    def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.ServicerContext) -> Any:
        state = self.state
        ports = state.lifecycle.ports()
        return pb.ServerInfo(
            version=server_version(),
            flight_port=ports.flight,
            instance=state.instance,
            http_port=ports.http,
            uds=state.lifecycle.uds or "",
        )

    @_unary_call("stream")
    def GetTensor(self, request: pb.GetTensorRequest, context: grpc.ServicerContext) -> Any:
        """One small tensor in one answer: the access, plan, stream slot and metrics of a
        one-tensor stream, without a stream's per-message cost."""
        state = self.state
        access = self._access(context)
        asked = from_proto(request.request)
        model = state.readable_model(access, request.request.model, asked.revision)
        if asked.names is None or len(asked.names) != 1:
            raise InvalidRequest(
                "GetTensor sends one tensor: give exactly one name (use_prefix false); "
                "use StreamTensors for several"
            )
        wanted = request.max_bytes if request.max_bytes > 0 else GET_TENSOR_DEFAULT_BYTES
        limit = min(wanted, GET_TENSOR_MAX_BYTES)
        one = dataclasses.replace(asked, resume_tensor=None, resume_offset=0, chunk_bytes=limit)
        (planned,) = plan_stream(model, one, state.limits.max_names)
        if planned.nbytes > limit:
            return pb.TensorData(
                name=planned.entry.name, total_bytes=planned.nbytes, too_large=True
            )
        client = access.client_key(peer_host(context.peer()))
        # Counted by _unary_call; the lease holds the slot and files, and counts the bytes.
        with StreamLease(state, "grpc", counted=False) as lease:
            lease.admit(model, {planned.entry.file}, client)
            tensors = state.metrics.child(state.metrics.tensors_served, "grpc", model.id)
            ((header, data),) = stream_chunks(model, [planned], one.chunk_bytes, tensors.inc)
            lease.progress(header.nbytes)
            return pb.TensorData(
                name=header.name,
                dtype=header.dtype,
                shape=header.shape,
                logical_shape=header.logical_shape,
                encoding=header.encoding or "",
                total_bytes=header.total_bytes,
                digest=header.digest,
                data=bytes(data),
            )

    @_unary_call("model_info")
    def ListRevisions(self, request: pb.GetModelRequest, context: grpc.ServicerContext) -> Any:
        listed = self.state.revisions(self._access(context), request.model)
        return pb.RevisionList(model=request.model, revisions=[_revision(r) for r in listed])

    def WatchRevisions(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Any:
        """As ``GET /v1/models/ID/-/watch``: hello, the changes after ``since`` / ``after``,
        then each new one; a handler thread per watch, so their number is bounded (GRPC_WATCHES)."""
        state = self.state
        try:
            access = self._access(context)
            access.check(request.model)
            log = state.revision_log
            if log is None:
                raise InvalidRequest("this server announces no revisions")
            with self._watch_lock:
                if self._watches >= GRPC_WATCHES:
                    raise ResourceExhausted(
                        f"this server already serves {GRPC_WATCHES} gRPC watches; watch over "
                        "HTTP (GET /v1/models/ID/-/watch), which holds no thread per watcher"
                    )
                self._watches += 1
        except WeightserveError as e:
            _abort(context, e)
            return  # abort raised; for the type checker
        try:
            yield from self._watch(log, request, context)
        except WeightserveError as e:
            _abort(context, e)
        finally:
            with self._watch_lock:
                self._watches -= 1

    def _watch(
        self, log: RevisionLog, request: pb.WatchRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RevisionEvent]:
        state = self.state
        log.revisions(request.model)  # an unknown model: NOT_FOUND before any event
        after = request.after if request.HasField("after") else None
        with state.feed.subscribe_blocking(request.model) as announced:
            start = watch_start(log, request.model, request.since or None, after)
            sent = start.sent  # later changes are announced, each once
            hello = start.hello
            yield pb.RevisionEvent(event="hello", main=hello["main"], sequence=hello["sequence"])
            for record in start.backlog:
                yield _revision_event(record)
            quiet = 0.0
            while context.is_active() and not state.draining:
                try:
                    announcement = announced.get(timeout=DRAIN_CHECK_SECONDS)
                except queue.Empty:
                    quiet += DRAIN_CHECK_SECONDS
                    if quiet >= HEARTBEAT_SECONDS:
                        quiet = 0.0
                        yield pb.RevisionEvent(event="heartbeat")
                    continue
                if announcement is None:  # fell too far behind: what it missed comes on reconnect
                    raise ResourceExhausted(OVERRUN_REASON)
                if announcement.sequence > sent:  # every change of main, rollbacks too
                    sent = announcement.sequence
                    yield _revision_event(announcement.record)

    @_unary_call("model_info")
    def ListFiles(self, request: pb.GetModelRequest, context: grpc.ServicerContext) -> Any:
        # As the HTTP listing: no fill where the origin lists every ETag (files.listed_model).
        model = files.listed_model(self.state, self._access(context), request.model)
        listing = files.file_list(model)
        return pb.FileList(
            id=listing["id"],
            revision=listing["revision"],
            commit=listing["commit"],
            files=[pb.FileInfo(**f) for f in listing["files"]],
        )

    def ReadFile(self, request: pb.FileRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """A file's bytes as FileChunk messages; the same slot, idle cut and metrics as
        StreamTensors (operation ``file``)."""
        state = self.state
        try:
            with StreamLease(state, "grpc", "file") as lease:
                access = self._access(context)
                # A side file of a node cache's uncached model is fetched alone, no fill.
                model = files.file_model(
                    state, access, request.model, request.name, request.revision
                )
                files.check_revision(model, request.revision)
                file = files.repo_file(model, request.name)
                byte_range = files.file_range(model, file, request.offset, request.length or None)
                etag = model.file_digest(file.path)
                files.pin_file(model, file)
                lease.admit(model, {file.path}, access.client_key(peer_host(context.peer())))
                lease.watch_idle(_cancel_when_idle(context, state.limits.idle_timeout))
                metadata = (
                    ("etag", etag),
                    ("x-file-size", str(file.size)),
                    ("x-weightserve-revision", model.revision),
                )
                try:
                    context.send_initial_metadata(metadata)
                except grpc.RpcError:
                    if context.is_active():
                        raise
                    return  # the client cancelled already: counted as such
                for chunk in files.file_chunks(model, file, byte_range):
                    if not context.is_active():
                        return
                    lease.progress(len(chunk))
                    yield encode_arrow_data((chunk,))  # FileChunk has ArrowData's layout
                    lease.progress()
                lease.finished()
        except WeightserveError as e:
            if lease.model_id is not None:  # e.g. a file truncated while being served
                log.warning("gRPC file %s of model %s broke: %s", request.name, lease.model_id, e)
            _abort(context, e)

    def StreamTensors(
        self, request: pb.TensorRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        state = self.state
        try:
            with StreamLease(state, "grpc") as lease:
                access = self._access(context)
                tensor_request = from_proto(request)
                model = state.readable_model(access, request.model, tensor_request.revision)
                client = access.client_key(peer_host(context.peer()))
                planned = lease.plan(model, tensor_request, client)
                lease.watch_idle(_cancel_when_idle(context, state.limits.idle_timeout))
                tensors = state.metrics.child(state.metrics.tensors_served, "grpc", model.id)
                chunk_bytes = tensor_request.chunk_bytes
                for parts in stream_messages(model, planned, chunk_bytes, tensors.inc):
                    if not context.is_active():
                        return
                    if len(parts) > 1:
                        lease.progress(len(parts[1]))  # tensor data bytes, not framing
                    elif parts[0] is END_OF_STREAM:
                        # Complete once the end marker is handed over: a client that has read
                        # it may cancel before grpc asks this generator for more.
                        lease.finished()
                    yield encode_arrow_data(parts)  # returns once grpc has sent it
                    lease.progress()
        except WeightserveError as e:
            if lease.model_id is not None:  # e.g. a file truncated while being served
                log.warning("gRPC stream of model %s broke: %s", lease.model_id, e)
            _abort(context, e)


def create_grpc_server(
    state: ServiceState,
    address: str,
    max_workers: int | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int]:
    """A started-ready (not started) grpc.Server bound to address; returns (server, port)."""
    options = [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", 4 << 20),
        ("grpc.so_reuseport", 0),
    ]
    workers = max_workers or state.limits.max_streams + 8 + GRPC_WATCHES
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=options)
    service = WeightService(state)
    handlers = {}
    for name, method in METHODS.items():  # the proto's methods (client/wire/grpc_methods.py)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[name] = make(
            getattr(service, name),
            request_deserializer=method.request.FromString,
            # ArrowData and FileChunk messages come encoded once, around the mapping's views.
            response_serializer=_encoded
            if name in ENCODED_RESPONSES
            else method.response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = (
        server.add_secure_port(address, credentials)
        if credentials
        else server.add_insecure_port(address)
    )
    server.health_servicer = health_servicer  # type: ignore[attr-defined]
    return server, port


class GrpcListener:
    """The gRPC server as a ``Listener``: on ``host:port`` (with TLS when ``credentials``)
    and, plain, on the same-node socket ``uds`` (gRPC's ``unix:`` target) when given.
    Its health service follows readiness (``set_serving``) and says NOT_SERVING on drain."""

    name = "gRPC"

    def __init__(
        self,
        state: ServiceState,
        host: str,
        port: int,
        credentials: grpc.ServerCredentials | None = None,
        uds: str | None = None,
        uds_mode: int = 0o666,
    ) -> None:
        self.state, self.host, self.credentials = state, host, credentials
        self.bind_port = port
        self.port = 0  # the port bound, once started
        self.uds, self.uds_mode = uds, uds_mode
        self.server: grpc.Server | None = None
        self._socket_file: str | None = None  # the Unix socket this listener created

    def start(self) -> None:
        check_port_free("gRPC", "grpc_port", self.host, self.bind_port)
        address = f"{url_host(self.host)}:{self.bind_port}"
        try:
            self.server, self.port = create_grpc_server(
                self.state, address, credentials=self.credentials
            )
        except RuntimeError as e:  # grpc: "Failed to bind to address ..."
            raise StartupError(
                "grpc_port", f"the gRPC endpoint could not listen on {address}: {e}"
            ) from e
        if self.uds:
            claim_socket_path(self.uds)
            if not self.server.add_insecure_port(f"unix:{self.uds}"):
                raise StartupError("uds", f"the gRPC endpoint could not listen on {self.uds}")
            self._socket_file = self.uds
        self.server.start()
        if self.uds:  # grpc-core creates its socket with the process umask
            os.chmod(self.uds, self.uds_mode)

    def set_serving(self, serving: bool) -> None:
        """gRPC health follows /readyz (probes may use either)."""
        if self.server is None:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            self.server.health_servicer.set(name, status)  # type: ignore[attr-defined]

    def drain(self) -> None:
        if self.server is not None:
            self.server.health_servicer.enter_graceful_shutdown()  # type: ignore[attr-defined]

    def stop(self, force: bool, wait: float) -> None:
        # After the grace period (or at once when forced), nothing open is waited for.
        if self.server is not None:
            self.server.stop(0).wait(wait)
        if self._socket_file is not None:
            remove_socket_file(self._socket_file)


def _encoded(message: bytes) -> bytes:
    return message
