"""The gRPC method table (client/wire/grpc_methods.py) is the generated stubs' own: every
method the proto declares, with its path, streaming kind and messages, as the generated
``WeightServiceStub`` registers them on a channel, and a server built from it serves them."""

from __future__ import annotations

from typing import Any

from weightserve.client.wire.grpc_methods import ENCODED_RESPONSES, METHODS, SERVICE_NAME
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2_grpc as pb_grpc
from weightserve.service.transports.grpc import WeightService


class RecordingChannel:
    """Records what a generated stub asks a channel for (no connection is made)."""

    def __init__(self) -> None:
        self.methods: dict[str, tuple[str, Any, Any]] = {}

    def _record(self, kind: str) -> Any:
        def register(path: str, request_serializer: Any, response_deserializer: Any,
                     **_: Any) -> None:  # fmt: skip
            self.methods[path] = (kind, request_serializer, response_deserializer)

        return register

    def __getattr__(self, kind: str) -> Any:
        return self._record(kind)


def test_the_table_is_the_generated_stubs() -> None:
    channel = RecordingChannel()
    pb_grpc.WeightServiceStub(channel)
    assert SERVICE_NAME == "weightserve.v1.WeightService"
    assert {m.path for m in METHODS.values()} == set(channel.methods)
    for method in METHODS.values():
        kind, serialize, deserialize = channel.methods[method.path]
        assert kind == ("unary_stream" if method.server_streaming else "unary_unary")
        assert serialize == method.request.SerializeToString
        assert deserialize == method.response.FromString
    assert set(METHODS) >= ENCODED_RESPONSES


def test_the_server_implements_every_method() -> None:
    assert all(callable(getattr(WeightService, name, None)) for name in METHODS)
