"""gRPC's unary GetTensor: one small tensor in one answer, with the stream's header fields,
digest, errors, auth and admission; the client uses it for a request of one small tensor and
streams a large one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import xxhash

from weightserve.client import Client
from weightserve.client.transports.grpc import GrpcTransport
from weightserve.client.wire.errors import ERROR_METADATA_KEY
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2_grpc as pb_grpc

MODEL = "org/sharded"
NAME = "model.layers.0.attn.weight"  # 8 x 8 float32


@pytest.fixture(scope="module")
def stub(server) -> Iterator[pb_grpc.WeightServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield pb_grpc.WeightServiceStub(channel)


def get(stub, names: list[str], max_bytes: int = 0, **fields) -> pb.TensorData:
    request = pb.TensorRequest(model=MODEL, names=names, **fields)
    return stub.GetTensor(pb.GetTensorRequest(request=request, max_bytes=max_bytes), timeout=30)


def error_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    trailing = dict(info.value.trailing_metadata() or ())
    return info.value.code(), trailing.get(ERROR_METADATA_KEY, "")


def test_one_tensor_with_header_and_digest(stub, reference) -> None:
    ref = reference(MODEL)[NAME]
    answer = get(stub, [NAME])
    assert not answer.too_large
    assert (answer.name, answer.dtype) == (NAME, ref.dtype)
    assert tuple(answer.shape) == ref.shape
    assert tuple(answer.logical_shape) == ref.logical_shape
    assert answer.data == ref.array.tobytes()
    assert answer.total_bytes == len(answer.data)
    assert answer.digest == xxhash.xxh3_64_intdigest(answer.data)


def test_a_shard_is_its_slice(stub, reference) -> None:
    ref = reference(MODEL)[NAME]
    answer = get(stub, [NAME], shard_index=1, shard_count=4, shard_axis=0)
    assert tuple(answer.shape) == (2, 8)
    assert answer.data == ref.array[2:4].tobytes()


def test_over_max_bytes_sends_no_data(stub) -> None:
    answer = get(stub, [NAME], max_bytes=100)
    assert answer.too_large and answer.total_bytes == 256 and answer.data == b""


def test_errors_are_statuses_with_their_class(stub) -> None:
    assert error_of(lambda: get(stub, ["nope"])) == (grpc.StatusCode.NOT_FOUND, "TensorNotFound")
    two = [NAME, "model.embed.weight"]
    assert error_of(lambda: get(stub, two)) == (grpc.StatusCode.INVALID_ARGUMENT, "InvalidRequest")
    stale = "0" * 16
    assert error_of(lambda: get(stub, [NAME], revision=stale)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "RevisionMismatch",
    )


def test_the_client_fetches_one_small_tensor_with_it(server, reference, monkeypatch) -> None:
    # data_plane="flight": tensor data over the gRPC port's side (the default would take the
    # HTTP port the server advertises).
    refs = reference(MODEL)
    with Client(server.grpc_url, data_plane="flight") as client:
        transport = client.transport
        assert isinstance(transport, GrpcTransport)
        calls: list[pb.GetTensorRequest] = []
        original = transport._get_tensor

        def counting(request, **kwargs):
            calls.append(request)
            return original(request, **kwargs)

        monkeypatch.setattr(transport, "_get_tensor", counting)
        model = client.model(MODEL)
        got = model.fetch([NAME])[NAME]
        assert len(calls) == 1
        assert np.array_equal(got.view(np.uint8).ravel(), refs[NAME].array.view(np.uint8).ravel())
        # Several tensors are one stream, not unary calls.
        both = model.fetch([NAME, "model.embed.weight"])
        assert len(calls) == 1 and set(both) == {NAME, "model.embed.weight"}


def test_a_tensor_the_server_calls_too_large_is_streamed(server, reference, monkeypatch) -> None:
    # The client's limit lowered below the tensor: the server answers too_large, the client
    # streams it and remembers its size, so the next request goes to the stream at once.
    import weightserve.client.transports.grpc as transport_module

    monkeypatch.setattr(transport_module, "UNARY_TENSOR_BYTES", 100)
    refs = reference(MODEL)
    with Client(server.grpc_url, data_plane="flight") as client:
        transport = client.transport
        calls: list[pb.GetTensorRequest] = []
        original = transport._get_tensor

        def counting(request, **kwargs):
            calls.append(request)
            return original(request, **kwargs)

        monkeypatch.setattr(transport, "_get_tensor", counting)
        transport._sizes.clear()  # as for a client that never asked for the model's index
        model = client.model(MODEL)
        transport._sizes.clear()
        for _ in range(2):
            got = model.fetch([NAME])[NAME]
            assert np.array_equal(
                got.view(np.uint8).ravel(), refs[NAME].array.view(np.uint8).ravel()
            )
        assert len(calls) == 1


def test_tokens_and_grants_apply(model_root, tmp_path: Path) -> None:
    from weightserve.service.server import ServerConfig, WeightServer

    tokens = tmp_path / "tokens"
    tokens.write_text("all-models\nonly-mixed mixed\n")
    config = ServerConfig(
        str(model_root.path), http_port=0, grpc_port=0, flight_port=None, token_file=str(tokens)
    )
    srv = WeightServer(config).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
            stub = pb_grpc.WeightServiceStub(channel)
            request = pb.GetTensorRequest(request=pb.TensorRequest(model=MODEL, names=[NAME]))

            def call(token: str | None):
                metadata = [("authorization", f"Bearer {token}")] if token else []
                return stub.GetTensor(request, timeout=30, metadata=metadata)

            assert error_of(lambda: call(None))[0] == grpc.StatusCode.UNAUTHENTICATED
            assert error_of(lambda: call("only-mixed"))[0] == grpc.StatusCode.PERMISSION_DENIED
            assert call("all-models").name == NAME
    finally:
        srv.stop(grace=1.0)
