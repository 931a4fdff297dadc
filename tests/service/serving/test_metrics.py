"""Prometheus metrics on every transport, and the TensorRequest selection rules of gRPC/Flight.

Real servers on loopback: calls go over HTTP, gRPC (``flight=False``) and Arrow Flight with
the weightserve client or plain grpc / pyarrow clients, then ``/metrics`` is scraped over
HTTP and parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow.flight as flight
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import save_file

from weightserve.client._client import Client
from weightserve.client.errors import ModelNotFound
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2_grpc as pb_grpc
from weightserve.client.wire.routes import http_model_path
from weightserve.service.server import ServerConfig, WeightServer

TOKEN = "metrics-test-token-0123456789abcdef"
ARRAYS = {f"layer.{i}.w": np.full((32, 16), i, dtype=np.float32) for i in range(4)}
TOTAL_BYTES = sum(a.nbytes for a in ARRAYS.values())
# Far more than the socket buffers hold: a client that leaves mid-way leaves the server with
# most of the stream still to send.
BIG = {"w": np.zeros((64 << 20) // 4, dtype=np.float32)}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _root(path: Path) -> Path:
    (path / "m").mkdir(parents=True)
    save_file(ARRAYS, path / "m" / "model.safetensors")
    (path / "big").mkdir()
    save_file(BIG, path / "big" / "model.safetensors")
    return path


def _serve(root: Path, **config: Any) -> WeightServer:
    ports = {"http_port": 0, "grpc_port": 0, "flight_port": 0}
    return WeightServer(ServerConfig(str(root), rescan_seconds=0, **ports, **config)).start()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _root(tmp_path_factory.mktemp("metrics-root"))


@pytest.fixture(scope="module")
def srv(root: Path) -> Iterator[WeightServer]:
    server = _serve(root)
    try:
        yield server
    finally:
        server.stop(grace=1.0)


def scrape(server: WeightServer, headers: dict[str, str] | None = None) -> Samples:
    """Every sample of ``/metrics``, by (sample name, labels)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=headers or {})
        response = conn.getresponse()
        text = response.read().decode()
        assert response.status == 200, text
    finally:
        conn.close()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def requests(samples: Samples, transport: str, operation: str, code: str) -> float:
    return value(
        samples, "weightserve_requests_total", transport=transport, operation=operation, code=code
    )


def errors(samples: Samples, transport: str, operation: str, error: str) -> float:
    return value(
        samples, "weightserve_errors_total", transport=transport, operation=operation, error=error
    )


def latency_count(samples: Samples, transport: str, operation: str) -> float:
    return value(
        samples, "weightserve_request_seconds_count", transport=transport, operation=operation
    )


def eventually(server: WeightServer, check: Callable[[Samples], bool], what: str) -> Samples:
    """The first scrape that passes ``check``: a stream is counted when the server's side of
    it ends, a moment after the client has read its last byte."""
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(server)
        if check(samples):
            return samples
        if time.monotonic() > deadline:
            counts = {k: v for k, v in samples.items() if k[0].endswith("_total")}
            raise AssertionError(f"not within 10 s: {what}; counters: {counts}")
        time.sleep(0.05)


def http_get(server: WeightServer, path: str, headers: dict[str, str] | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def flight_ticket(**fields: Any) -> flight.Ticket:
    return flight.Ticket(pb.TensorRequest(**fields).SerializeToString())


def flight_error_class(server: WeightServer, ticket: flight.Ticket) -> str:
    """The error class a plain pyarrow Flight client is told (``extra_info``)."""
    client = flight.connect(f"grpc://127.0.0.1:{server.flight_port}")
    try:
        with pytest.raises(flight.FlightError) as info:
            client.do_get(ticket).read_all()
    finally:
        client.close()
    return json.loads(info.value.extra_info)["type"]


def test_metadata_calls_and_streams_are_counted_on_every_transport(srv: WeightServer) -> None:
    before = scrape(srv)
    with Client(srv.http_url, retry_seconds=0) as client:
        client.list_models()
        client.model("m").fetch(prefix="")
        with pytest.raises(ModelNotFound):
            client.model_info("no/such-model")
    with Client(srv.grpc_url, flight=False, retry_seconds=0) as client:
        client.list_models()
        client.model("m").fetch(prefix="")
        with pytest.raises(ModelNotFound):
            client.model_info("no/such-model")
    with Client(srv.grpc_url, retry_seconds=0, data_plane="flight") as client:
        client.model("m").fetch(prefix="")
    assert flight_error_class(srv, flight_ticket(model="no/such-model", use_prefix=True)) == (
        "ModelNotFound"
    )
    assert http_get(srv, "/no/such/route") == 404
    assert http_get(srv, "/healthz") == 200
    assert http_get(srv, "/openapi.json") == 200

    def all_counted(s: Samples) -> bool:
        return all(
            requests(s, t, "stream", ok) - requests(before, t, "stream", ok) >= 1
            for t, ok in (("http", "200"), ("grpc", "OK"), ("flight", "OK"))
        )

    after = eventually(srv, all_counted, "a finished stream on each transport")

    def grew(f: Callable[..., float], *labels: str) -> float:
        return f(after, *labels) - f(before, *labels)

    for transport, ok, not_found in (("http", "200", "404"), ("grpc", "OK", "NOT_FOUND")):
        assert grew(requests, transport, "list_models", ok) >= 1, transport
        assert grew(requests, transport, "model_info", ok) >= 1, transport
        assert grew(requests, transport, "model_info", not_found) == 1, transport
        assert grew(errors, transport, "model_info", "ModelNotFound") == 1, transport
        assert grew(latency_count, transport, "model_info") >= 1, transport
        assert grew(latency_count, transport, "stream") >= 1, transport
    # The Flight client asked the gRPC service where the endpoint is.
    assert grew(requests, "grpc", "server_info", "OK") >= 1
    # Flight errors are counted under the error table's code, not Flight's coarser status.
    assert grew(requests, "flight", "stream", "NOT_FOUND") == 1
    assert grew(errors, "flight", "stream", "ModelNotFound") == 1
    assert grew(latency_count, "flight", "stream") >= 1
    # Probes and the API's own description have operations of their own.
    assert grew(requests, "http", "health", "200") == 1
    assert grew(requests, "http", "docs", "200") == 1
    # A path no route serves is counted too, under a fixed label (never the path itself).
    assert grew(requests, "http", "other", "404") == 1
    assert grew(errors, "http", "other", "HTTP404") == 1
    # Failures are counted, not timed: the latency histogram holds answers that succeeded.
    assert grew(latency_count, "http", "other") == 0


def test_bytes_served_are_counted_per_transport(srv: WeightServer) -> None:
    def bytes_served(s: Samples, transport: str) -> float:
        return value(s, "weightserve_bytes_served_total", transport=transport, model="m")

    before = scrape(srv)
    for url, use_flight in ((srv.http_url, None), (srv.grpc_url, False), (srv.grpc_url, True)):
        with Client(url, flight=use_flight, retry_seconds=0) as client:
            got = client.model("m").fetch(prefix="layer.")
        assert all(np.array_equal(got[name], ARRAYS[name]) for name in ARRAYS)
    eventually(
        srv,
        lambda s: all(
            bytes_served(s, t) - bytes_served(before, t) == TOTAL_BYTES
            for t in ("http", "grpc", "flight")
        ),
        f"{TOTAL_BYTES} bytes counted on each transport",
    )


def test_refusals_before_the_router_and_cut_streams_are_counted(srv: WeightServer) -> None:
    before = scrape(srv)
    # A body over the limit is refused by its Content-Length before any route runs.
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=10)
    try:
        conn.putrequest("POST", http_model_path("m", "stream"))
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(1 << 30))
        conn.endheaders()
        assert conn.getresponse().status == 413
    finally:
        conn.close()
    # A gRPC client that cancels after the first message.
    with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
        call = pb_grpc.WeightServiceStub(channel).StreamTensors(
            pb.TensorRequest(model="big", use_prefix=True, chunk_bytes=1 << 16), timeout=30
        )
        next(call)
        call.cancel()
    # An HTTP client that reads a little and hangs up.
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=10)
    conn.request("GET", http_model_path("big", "stream") + "?prefix=")
    response = conn.getresponse()
    assert response.status == 200
    response.read(1 << 16)
    conn.close()

    def grew(s: Samples, f: Callable[..., float], *labels: str) -> float:
        return f(s, *labels) - f(before, *labels)

    def both_cut(s: Samples) -> bool:
        return all(grew(s, errors, t, "stream", "Cancelled") == 1 for t in ("grpc", "http"))

    after = eventually(srv, both_cut, "a cut stream counted on gRPC and HTTP")
    assert grew(after, requests, "http", "stream", "413") == 1
    assert grew(after, errors, "http", "stream", "ResourceExhausted") == 1
    assert grew(after, requests, "grpc", "stream", "CANCELLED") == 1
    # The HTTP client was told 200 before the cut: that stays its code.
    assert grew(after, requests, "http", "stream", "200") == 1
    # The server noticed the client had left: it did not send the rest into the void.
    sent = value(after, "weightserve_bytes_served_total", transport="http", model="big")
    assert sent < BIG["w"].nbytes / 2


def test_auth_failures_are_counted_on_every_transport(root: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    server = _serve(root, token_file=str(tokens))
    try:
        assert http_get(server, "/v1/models") == 401
        assert http_get(server, "/v1/models/m", {"authorization": "Bearer wrong"}) == 401
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pb_grpc.WeightServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.ListModels(pb.ListModelsRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ticket = flight_ticket(model="m", use_prefix=True)
        assert flight_error_class(server, ticket) == "Unauthenticated"
        samples = scrape(server)
    finally:
        server.stop(grace=1.0)
    assert requests(samples, "http", "list_models", "401") == 1
    assert requests(samples, "http", "model_info", "401") == 1
    assert requests(samples, "grpc", "list_models", "UNAUTHENTICATED") == 1
    assert requests(samples, "flight", "stream", "UNAUTHENTICATED") == 1
    for transport, operation in (
        ("http", "list_models"),
        ("http", "model_info"),
        ("grpc", "list_models"),
        ("flight", "stream"),
    ):
        assert errors(samples, transport, operation, "Unauthenticated") == 1, transport


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"prefix": "layer."}, "use_prefix to true"),
        ({"prefix": "layer.", "names": ["layer.0.w"]}, "send one or the other"),
        ({"names": ["layer.0.w"], "use_prefix": True}, "send one or the other"),
    ],
)
def test_a_request_whose_selection_would_drop_a_field_is_refused(
    srv: WeightServer, fields: dict[str, Any], words: str
) -> None:
    """A prefix without ``use_prefix`` once streamed nothing, silently; now it is
    INVALID_ARGUMENT on gRPC and InvalidRequest (whose code that is) on Flight, saying what
    to change. Names together with a prefix would drop one of them: refused too, as on
    every transport."""
    before = scrape(srv)
    with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
        call = pb_grpc.WeightServiceStub(channel).StreamTensors(
            pb.TensorRequest(model="m", **fields), timeout=10
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()
    assert flight_error_class(srv, flight_ticket(model="m", **fields)) == "InvalidRequest"
    after = scrape(srv)
    for transport in ("grpc", "flight"):
        for f, label in ((requests, "INVALID_ARGUMENT"), (errors, "InvalidRequest")):
            grown = f(after, transport, "stream", label) - f(before, transport, "stream", label)
            assert grown == 1, (transport, label)


def test_a_prefix_with_use_prefix_still_streams(srv: WeightServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
        call = pb_grpc.WeightServiceStub(channel).StreamTensors(
            pb.TensorRequest(model="m", prefix="layer.1", use_prefix=True), timeout=10
        )
        assert b"".join(m.data for m in call)
    client = flight.connect(f"grpc://127.0.0.1:{srv.flight_port}")
    try:
        table = client.do_get(flight_ticket(model="m", prefix="layer.1", use_prefix=True))
        assert set(table.read_all().column("name").to_pylist()) == {"layer.1.w"}
    finally:
        client.close()
