"""The gRPC transport: the same catalog and streams as HTTP, plus health and reflection.

StreamTensors sends the Arrow IPC stream as ArrowData messages, one per IPC message. Its
responses are encoded by hand (field 1, length-delimited) so each chunk is copied once, into
the message, instead of twice through a protobuf object.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any
from urllib.parse import unquote

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from weightserve.client._proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client._schema import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES
from weightserve.client.errors import WeightserveError, status_for
from weightserve.service import models_view
from weightserve.service.auth import Access, authorize
from weightserve.service.state import ServiceState
from weightserve.service.streaming import (
    Shard,
    TensorRequest,
    stream_messages,
)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightService"].full_name
ERROR_METADATA_KEY = "weightserve-error"
# A chunk message plus its framing; the client and server both allow this much per message.
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)

log = logging.getLogger("weightserve.grpc")


def server_version() -> str:
    try:
        return importlib.metadata.version("weightserve")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


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
    _, code = status_for(exc)
    context.set_trailing_metadata(((ERROR_METADATA_KEY, type(exc).__name__),))
    context.abort(getattr(grpc.StatusCode, code), str(exc))


def request_from_proto(msg: pb.TensorRequest) -> TensorRequest:
    shard = None
    if msg.shard_count > 1:
        shard = Shard(msg.shard_index, msg.shard_count, msg.shard_axis)
    return TensorRequest(
        names=tuple(msg.names) if not msg.use_prefix else None,
        prefix=msg.prefix if msg.use_prefix else None,
        shard=shard,
        resume_tensor=msg.resume_tensor or None,
        resume_offset=msg.resume_offset,
        chunk_bytes=msg.chunk_bytes or DEFAULT_CHUNK_BYTES,
        revision=msg.revision or None,
    )


def peer_host(peer: str) -> str:
    """The client's address from a gRPC peer string, without its port, spelled as HTTP spells
    it, so one client's streams count against one per-client limit on every transport:
    'ipv4:127.0.0.1:5000' -> '127.0.0.1', 'ipv6:%5B::1%5D:5000' -> '::1'."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return unquote(rest).rsplit(":", 1)[0].strip("[]")
    return peer


class _IdleCutter:
    """Cancels streams whose client has taken no message for ``timeout`` seconds.

    While a client reads nothing, HTTP/2 flow control blocks the handler inside grpc, holding
    a worker thread and a stream slot; HTTP cuts such streams after the same
    ``Limits.idle_timeout``. One watcher thread per server, running only while streams are open.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[grpc.ServicerContext, list[float]]] = {}
        self._running = False

    def watch(self, context: grpc.ServicerContext) -> list[float]:
        """A one-item list holding the time of the stream's last progress; keep it current."""
        stamp = [time.monotonic()]
        with self._lock:
            self._streams[id(stamp)] = (context, stamp)
            if not self._running:
                self._running = True
                watcher = threading.Thread(target=self._run, name="weightserve-idle", daemon=True)
                watcher.start()
        return stamp

    def forget(self, stamp: list[float]) -> None:
        with self._lock:
            self._streams.pop(id(stamp), None)

    def _run(self) -> None:
        period = min(1.0, self.timeout / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                if not self._streams:
                    self._running = False
                    return
                stale = [c for c, s in self._streams.values() if now - s[0] > self.timeout]
            for context in stale:
                log.warning(
                    "gRPC stream to %s cut: the client read nothing for %.1f s",
                    context.peer(),
                    self.timeout,
                )
                context.cancel()


class WeightService:
    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.idle = _IdleCutter(state.limits.idle_timeout)

    def _access(self, context: grpc.ServicerContext) -> Access:
        metadata = dict(context.invocation_metadata())
        return authorize(self.state.tokens, metadata.get("authorization"))

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> Any:
        try:
            access = self._access(context)
        except WeightserveError as e:
            _abort(context, e)
        listing = models_view.model_list(self.state.catalog, access.may_read)
        return pb.ListModelsResponse(
            models=[pb.ModelSummary(**m) for m in listing["models"]],
            problems=[pb.ModelProblem(**p) for p in listing["problems"]],
        )

    def GetModel(self, request: pb.GetModelRequest, context: grpc.ServicerContext) -> Any:
        try:
            model = self.state.readable_model(self._access(context), request.model)
        except WeightserveError as e:
            _abort(context, e)
        info = models_view.model_info(model)
        return pb.ModelInfo(
            id=info["id"],
            format=info["format"],
            revision=info["revision"],
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

    def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.ServicerContext) -> Any:
        return pb.ServerInfo(version=server_version(), flight_port=self.state.flight_port)

    def StreamTensors(
        self, request: pb.TensorRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        state = self.state
        try:
            model = state.readable_model(self._access(context), request.model)
            tensor_request = request_from_proto(request)
            planned, slot = state.begin_stream(
                model, tensor_request, "grpc", peer_host(context.peer())
            )
        except WeightserveError as e:
            _abort(context, e)
        started = time.perf_counter()
        sent = 0
        progress = self.idle.watch(context)
        try:
            tensors = state.metrics.tensors_served.labels("grpc", model.id)
            chunk_bytes = tensor_request.chunk_bytes
            for parts in stream_messages(model, planned, chunk_bytes, tensors.inc):
                if not context.is_active():
                    return
                message = encode_arrow_data(parts)
                if len(parts) > 1:
                    sent += len(parts[1])  # tensor data bytes, not framing
                progress[0] = time.monotonic()
                yield message  # returns once grpc has sent it: the client is reading
                progress[0] = time.monotonic()
        except WeightserveError as e:  # e.g. a file truncated while being served
            log.warning("gRPC stream of model %s broke: %s", model.id, e)
            _abort(context, e)
        finally:
            self.idle.forget(progress)
            slot.__exit__(None, None, None)
            state.metrics.bytes_served.labels("grpc", model.id).inc(sent)
            state.metrics.latency.labels("grpc", "stream").observe(time.perf_counter() - started)


def create_grpc_server(
    state: ServiceState,
    address: str,
    max_workers: int | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int]:
    """A started-ready (not started) grpc.Server bound to address; returns (server, port)."""
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", 4 << 20),
        ("grpc.so_reuseport", 0),
    ]
    workers = max_workers or state.limits.max_streams + 8
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=options)
    service = WeightService(state)
    handlers = {
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels,
            request_deserializer=pb.ListModelsRequest.FromString,
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
        "GetModel": grpc.unary_unary_rpc_method_handler(
            service.GetModel,
            request_deserializer=pb.GetModelRequest.FromString,
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            service.GetServerInfo,
            request_deserializer=pb.GetServerInfoRequest.FromString,
            response_serializer=pb.ServerInfo.SerializeToString,
        ),
        "StreamTensors": grpc.unary_stream_rpc_method_handler(
            service.StreamTensors,
            request_deserializer=pb.TensorRequest.FromString,
            response_serializer=lambda b: b,  # already encoded ArrowData
        ),
    }
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
