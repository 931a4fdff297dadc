"""One tensor request on every transport: the same rules, the same refusals.

A request names tensors or gives a prefix, never both; HTTP (query string and JSON body),
gRPC, Arrow Flight and the same-node handoff refuse both alike, with ``InvalidRequest`` and a
message saying to send one or the other.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import grpc
import pyarrow.flight as flight
import pytest

from tests.support.model_root import ModelRoot
from weightserve.client.wire.errors import ERROR_METADATA_KEY
from weightserve.client.wire.handoff import encode_frame, read_frame
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2_grpc as pb_grpc
from weightserve.service.server import ServerConfig, WeightServer

BOTH = "send one or the other"
NAMES = ["float32", "int8"]


def http_error(request: urllib.request.Request | str) -> tuple[int, dict]:
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    return info.value.code, json.loads(info.value.read())["error"]


def test_http_query_with_names_and_prefix_is_refused(server) -> None:
    query = urllib.parse.urlencode([("name", n) for n in NAMES] + [("prefix", "float")])
    status, error = http_error(f"{server.http_url}/v1/models/mixed/-/stream?{query}")
    assert status == 400
    assert error["type"] == "InvalidRequest" and BOTH in error["message"]


def test_http_body_with_names_and_prefix_is_refused(server) -> None:
    request = urllib.request.Request(
        f"{server.http_url}/v1/models/mixed/-/stream",
        data=json.dumps({"names": NAMES, "prefix": "float"}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    status, error = http_error(request)
    assert status == 400
    assert error["type"] == "InvalidRequest" and BOTH in error["message"]


def test_http_names_or_prefix_alone_are_served(server) -> None:
    for query in ("name=float32&name=int8", "prefix=float"):
        url = f"{server.http_url}/v1/models/mixed/-/stream?{query}"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200 and response.read()


@pytest.mark.parametrize("use_prefix", [False, True])
def test_grpc_stream_with_names_and_prefix_is_refused(server, use_prefix: bool) -> None:
    request = pb.TensorRequest(model="mixed", names=NAMES, prefix="float", use_prefix=use_prefix)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.StreamTensors(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata())[ERROR_METADATA_KEY] == "InvalidRequest"
    assert BOTH in info.value.details()


def test_flight_ticket_with_names_and_prefix_is_refused(server) -> None:
    request = pb.TensorRequest(model="mixed", names=NAMES, prefix="float", use_prefix=True)
    client = flight.connect(f"grpc://127.0.0.1:{server.flight_port}")
    try:
        with pytest.raises(flight.FlightError) as info:
            client.do_get(flight.Ticket(request.SerializeToString())).read_all()
    finally:
        client.close()
    detail = json.loads(info.value.extra_info)
    assert detail["type"] == "InvalidRequest" and BOTH in detail["message"]


@pytest.fixture(scope="module")
def uds_server(model_root: ModelRoot) -> Iterator[WeightServer]:
    directory = tempfile.mkdtemp(prefix="ws-")  # a Unix socket path is short: not tmp_path
    config = ServerConfig(
        str(model_root.path), http_port=0, grpc_port=0, flight_port=None,
        uds=f"{directory}/ws.sock", rescan_seconds=0, watch=False,
    )  # fmt: skip
    with WeightServer(config) as srv:
        yield srv
    shutil.rmtree(directory, ignore_errors=True)


def test_handoff_with_names_and_prefix_is_refused(uds_server: WeightServer) -> None:
    assert uds_server.config.uds
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(uds_server.config.uds + ".handoff")
        sock.sendall(encode_frame({"op": "open", "model": "mixed", "names": NAMES, "prefix": ""}))
        answer = read_frame(sock)
    assert answer is not None
    error = answer["error"]
    assert error["type"] == "InvalidRequest" and BOTH in error["message"]
