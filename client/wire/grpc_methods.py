"""The gRPC method table of ``weightserve.v1.WeightService``, derived once from the generated
stubs' service descriptor (client/wire/proto, generated from protos/): each method's path,
request and response classes and whether it streams. The client's channel stubs and the
server's handlers are both built from it, so neither can name a method, a message or a
streaming kind the proto does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import message_factory

from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb

_SERVICE: Any = pb.DESCRIPTOR.services_by_name["WeightService"]
SERVICE_NAME: str = _SERVICE.full_name
# Responses the server encodes once, around views of its mapping (ArrowData, FileChunk), and
# the client reads as their payload without building the message.
ENCODED_RESPONSES = frozenset({"StreamTensors", "ReadFile"})


@dataclass(frozen=True)
class GrpcMethod:
    """One method of the service, as the proto declares it."""

    name: str
    path: str  # "/weightserve.v1.WeightService/NAME", what a channel calls
    request: Any  # the generated message classes
    response: Any
    server_streaming: bool


def _methods(service: Any) -> dict[str, GrpcMethod]:
    found = {}
    for method in service.methods:
        if method.client_streaming:  # none is: a new one needs its kind of handler here
            raise TypeError(f"{method.full_name} streams requests: not supported")
        found[method.name] = GrpcMethod(
            method.name,
            f"/{service.full_name}/{method.name}",
            message_factory.GetMessageClass(method.input_type),
            message_factory.GetMessageClass(method.output_type),
            bool(method.server_streaming),
        )
    return found


METHODS: dict[str, GrpcMethod] = _methods(_SERVICE)
