"""The gRPC API through the generated stubs: the three RPCs, error codes with their trailing
metadata, the standard health service, server reflection, and bounded messages."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pyarrow as pa
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.support import fixtures_safetensors
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2_grpc as pb_grpc
from weightserve.client.wire.schema import DEFAULT_CHUNK_BYTES

MIB = 1 << 20
SERVICE = "weightserve.v1.WeightService"


@pytest.fixture(scope="module")
def channel(server) -> Iterator[grpc.Channel]:
    # The default 4 MiB receive limit is below the 8 MiB default chunk.
    options = [("grpc.max_receive_message_length", 80 * MIB)]
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=options) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.WeightServiceStub:
    return pb_grpc.WeightServiceStub(channel)


def stream(stub, **request) -> list[bytes]:
    return [m.data for m in stub.StreamTensors(pb.TensorRequest(**request), timeout=60)]


def rows(messages: list[bytes]) -> list[dict]:
    return pa.ipc.open_stream(b"".join(messages)).read_all().to_pylist()


def joined(table_rows: list[dict]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for r in table_rows:
        out[r["name"]] = out.get(r["name"], b"") + r["data"]
    return out


def expect_error(call, code: grpc.StatusCode, kind: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if not isinstance(result, pb.ModelInfo | pb.ListModelsResponse):
            list(result)  # a streaming call fails when iterated
    err = info.value
    assert err.code() == code, err.details()
    assert dict(err.trailing_metadata())["weightserve-error"] == kind
    return err.details()


# --------------------------------------------------------------------------- metadata RPCs


def test_list_models(stub, model_root, reference) -> None:
    resp = stub.ListModels(pb.ListModelsRequest(), timeout=10)
    models = {m.id: m for m in resp.models}
    assert set(models) == set(model_root.models)
    for model_id, (fmt, _) in model_root.models.items():
        ref = reference(model_id)
        m = models[model_id]
        assert m.format == fmt
        assert re.fullmatch(r"[0-9a-f]{16}", m.revision)
        assert m.tensor_count == len(ref)
        assert m.total_bytes == sum(r.array.nbytes for r in ref.values())
    assert len(resp.problems) == 1
    p = resp.problems[0]
    assert p.model == "broken"
    named = Path(model_root.path.resolve(), p.file).resolve()
    assert named == model_root.broken["broken"].resolve()
    assert "tensor data lies outside the file" in p.reason


def test_get_model(stub, reference) -> None:
    m = stub.GetModel(pb.GetModelRequest(model="mixed"), timeout=10)
    assert (m.id, m.format, m.alignment) == ("mixed", "safetensors", 1)
    assert json.loads(m.metadata_json) == fixtures_safetensors.MIXED_METADATA
    ref = reference("mixed")
    assert [t.name for t in m.tensors] == list(ref)
    for t in m.tensors:
        r = ref[t.name]
        assert (t.dtype, tuple(t.shape), tuple(t.logical_shape), t.encoding, t.nbytes) == (
            r.dtype,
            r.shape,
            r.logical_shape,
            "",
            r.array.nbytes,
        )

    g = stub.GetModel(pb.GetModelRequest(model="tiny.gguf"), timeout=10)
    assert g.alignment == 32
    assert json.loads(g.metadata_json)["general.name"] == "weightserve mixed fixture"
    q4 = next(t for t in g.tensors if t.name == "blk.0.ffn_down.weight")
    assert (q4.dtype, q4.encoding, list(q4.shape), list(q4.logical_shape)) == (
        "uint8",
        "Q4_0",
        [64, 18],
        [64, 32],
    )
    s = stub.GetModel(pb.GetModelRequest(model="org/sharded"), timeout=10)
    assert s.id == "org/sharded" and len(s.tensors) == len(reference("org/sharded"))


# --------------------------------------------------------------------------- StreamTensors


def test_stream_by_names_prefix_and_shard(stub, reference) -> None:
    ref = reference("mixed")
    got = joined(rows(stream(stub, model="mixed", names=["int64", "bfloat16", "empty.float32"])))
    assert list(got) == ["int64", "bfloat16", "empty.float32"]
    assert got == {n: ref[n].array.tobytes() for n in got}

    got = joined(rows(stream(stub, model="mixed", use_prefix=True, prefix="scalar.")))
    assert got == {n: r.array.tobytes() for n, r in ref.items() if n.startswith("scalar.")}
    got = joined(rows(stream(stub, model="mixed", use_prefix=True, prefix="")))
    assert list(got) == list(ref)

    parts = rows(
        stream(stub, model="mixed", names=["float32"], shard_index=1, shard_count=2, shard_axis=1)
    )
    assert [(r["shape"], r["logical_shape"]) for r in parts] == [([3, 2], [3, 2])]
    assert parts[0]["data"] == ref["float32"].array[:, 3:5].tobytes()  # 5 -> 3, 2


def test_stream_resume(stub, reference) -> None:
    ref = reference("mixed")
    revision = stub.GetModel(pb.GetModelRequest(model="mixed"), timeout=10).revision
    got = rows(
        stream(
            stub,
            model="mixed",
            names=["float32", "uint64", "int8"],
            resume_tensor="uint64",
            resume_offset=150,
            chunk_bytes=32,
            revision=revision,
        )
    )
    u64 = [r for r in got if r["name"] == "uint64"]
    assert [r["offset"] for r in u64] == [150, 182]  # 192 bytes in all
    assert b"".join(r["data"] for r in u64) == ref["uint64"].array.tobytes()[150:]
    assert [r["name"] for r in got if r["name"] != "uint64"] == ["int8"]


def _ipc_messages(data: bytes) -> int:
    """How many whole Arrow IPC messages ``data`` holds (fails on a partial one)."""
    reader = pa.BufferReader(data)
    count = 0
    while reader.tell() < len(data):
        if data[reader.tell() :] == b"\xff\xff\xff\xff\x00\x00\x00\x00":
            return count + 1  # end of stream
        msg = pa.ipc.read_message(reader)
        assert msg is not None
        count += 1
    return count


@pytest.mark.parametrize("chunk_bytes", [0, 1 * MIB])
def test_messages_bounded_and_whole(stub, model_root, reference, chunk_bytes: int) -> None:
    model = "minilm" if "minilm" not in model_root.skipped else "tiny.gguf"
    limit = chunk_bytes or DEFAULT_CHUNK_BYTES  # 0: the server default
    messages = stream(stub, model=model, use_prefix=True, prefix="", chunk_bytes=chunk_bytes)
    sizes = [len(m) for m in messages]
    assert max(sizes) < limit + MIB
    if model == "minilm":  # its 47 MB embedding table is cut into full-size chunks
        assert max(sizes) > limit
    for m in messages:
        assert _ipc_messages(m) >= 1  # each ArrowData holds whole IPC messages
    ref = reference(model)
    got = joined(rows(messages))
    assert list(got) == list(ref)
    assert all(got[n] == r.array.tobytes() for n, r in ref.items())


def test_chunk_bytes_over_the_cap(stub) -> None:
    details = expect_error(
        lambda: stub.StreamTensors(
            pb.TensorRequest(model="mixed", names=["float32"], chunk_bytes=(64 * MIB) + 1)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "InvalidRequest",
    )
    assert "chunk_bytes" in details


# --------------------------------------------------------------------------- errors


def test_error_codes(stub) -> None:
    details = expect_error(
        lambda: stub.GetModel(pb.GetModelRequest(model="nope")),
        grpc.StatusCode.NOT_FOUND,
        "ModelNotFound",
    )
    assert "'nope'" in details
    details = expect_error(
        lambda: stub.StreamTensors(pb.TensorRequest(model="mixd", use_prefix=True)),
        grpc.StatusCode.NOT_FOUND,
        "ModelNotFound",
    )
    assert details.endswith("Did you mean 'mixed'?")
    details = expect_error(
        lambda: stub.StreamTensors(pb.TensorRequest(model="mixed", names=["bfloat61"])),
        grpc.StatusCode.NOT_FOUND,
        "TensorNotFound",
    )
    assert details == "No weight named 'bfloat61' in model 'mixed'. Did you mean 'bfloat16'?"
    for bad in (
        pb.TensorRequest(model="mixed", names=["float32"], shard_index=3, shard_count=3),
        pb.TensorRequest(model="mixed", names=["float32"], shard_index=-1, shard_count=2),
        pb.TensorRequest(
            model="mixed", names=["float32"], shard_index=0, shard_count=2, shard_axis=-1
        ),
        pb.TensorRequest(model="mixed", names=["float32"], resume_tensor="int8"),
        pb.TensorRequest(
            model="mixed", names=["float32"], resume_tensor="float32", resume_offset=61
        ),
        pb.TensorRequest(model="../x", use_prefix=True),
        pb.TensorRequest(model="/etc/passwd", use_prefix=True),
    ):
        expect_error(
            lambda bad=bad: stub.StreamTensors(bad),
            grpc.StatusCode.INVALID_ARGUMENT,
            "InvalidRequest",
        )
    expect_error(
        lambda: stub.GetModel(pb.GetModelRequest(model="org/../../x")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "InvalidRequest",
    )
    details = expect_error(
        lambda: stub.StreamTensors(
            pb.TensorRequest(model="mixed", names=["float32"], revision="0123456789abcdef")
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "RevisionMismatch",
    )
    assert "0123456789abcdef" in details
    expect_error(
        lambda: stub.GetModel(pb.GetModelRequest(model="broken")),
        grpc.StatusCode.UNAVAILABLE,
        "ModelUnavailable",
    )


# --------------------------------------------------------------------------- health, reflection


def test_health_serving(channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_service(channel) -> None:
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {SERVICE, "grpc.health.v1.Health"} <= services
    pool = DescriptorPool(db)
    service = pool.FindServiceByName(SERVICE)
    assert {m.name for m in service.methods} == {
        "ListModels",
        "GetModel",
        "StreamTensors",
        "GetTensor",
        "GetServerInfo",
        "ListFiles",
        "ReadFile",
        "ListRevisions",
        "WatchRevisions",
    }
    method = service.FindMethodByName("StreamTensors")
    assert method.input_type.full_name == "weightserve.v1.TensorRequest"
    assert method.output_type.full_name == "weightserve.v1.ArrowData"
    assert method.server_streaming and not method.client_streaming
    remote = pool.FindMessageTypeByName("weightserve.v1.TensorRequest")
    local = pb.TensorRequest.DESCRIPTOR
    assert [(f.name, f.number, f.type) for f in remote.fields] == [
        (f.name, f.number, f.type) for f in local.fields
    ]
