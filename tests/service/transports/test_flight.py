"""The Arrow Flight endpoint: bulk tensor data for gRPC clients.

A plain ``pyarrow.flight`` client reads a model with no weightserve code beyond the ticket
(a serialized ``TensorRequest``); the weightserve client finds the endpoint through
``GetServerInfo``, uses it for bulk data, falls back to ``StreamTensors`` when there is none
or it cannot be reached, and gets the same error classes as over HTTP and gRPC. Servers are
real, on loopback; bytes are compared with the reference readers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
from pathlib import Path

import grpc
import numpy as np
import pyarrow.flight as flight
import pytest
from safetensors.numpy import save_file

from weightserve.client._client import Client, FetchOptions
from weightserve.client.errors import (
    InvalidRequest,
    ModelNotFound,
    ModelUnavailable,
    ResourceExhausted,
    RevisionMismatch,
    ServerUnreachable,
    TensorNotFound,
)
from weightserve.client.transports.base import StreamParams
from weightserve.client.transports.flight import FlightPool, translate
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client.wire.schema import TENSOR_SCHEMA
from weightserve.service.server import ServerConfig, WeightServer


def flight_bytes(srv: WeightServer, transport: str, model: str) -> float:
    return srv.state.metrics.bytes_served.labels(transport, model)._value.get()


def ticket(**fields) -> flight.Ticket:
    return flight.Ticket(pb.TensorRequest(**fields).SerializeToString())


def eventually(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def test_server_info_advertises_the_flight_port(server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        info = channel.unary_unary(
            "/weightserve.v1.WeightService/GetServerInfo",
            request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.ServerInfo.FromString,
        )(pb.GetServerInfoRequest(), timeout=10)
    assert info.flight_port == server.flight_port > 0
    assert info.version


def test_plain_pyarrow_flight_client_reads_a_model(server, reference) -> None:
    """Any Flight client: DoGet, read_all, join each tensor's rows, compare bytes."""
    ref = reference("mixed")
    client = flight.connect(f"grpc://127.0.0.1:{server.flight_port}")
    try:
        reader = client.do_get(ticket(model="mixed", use_prefix=True, chunk_bytes=64))
        table = reader.read_all()
    finally:
        client.close()
    assert table.schema.equals(TENSOR_SCHEMA, check_metadata=True)
    rows = table.to_pylist()
    assert all(len(r["data"]) <= 64 for r in rows)  # chunked as asked
    tensors: dict[str, bytes] = {}
    for row in rows:
        assert row["offset"] == len(tensors.get(row["name"], b""))
        tensors[row["name"]] = tensors.get(row["name"], b"") + row["data"]
    assert set(tensors) == set(ref)
    for name, r in ref.items():
        assert tensors[name] == r.array.tobytes(), name
        row = next(x for x in rows if x["name"] == name)
        assert row["dtype"] == r.dtype and tuple(row["shape"]) == r.shape


def test_grpc_client_moves_bulk_data_over_flight(server, reference, model_id: str) -> None:
    ref = reference(model_id)
    before = flight_bytes(server, "flight", model_id), flight_bytes(server, "grpc", model_id)
    with Client(server.grpc_url, data_plane="flight") as client:
        got = client.model(model_id).fetch(prefix="")
        assert isinstance(client.transport._flight, FlightPool)  # type: ignore[attr-defined]
    for name, r in ref.items():
        assert got[name].tobytes() == r.array.tobytes(), name
    total = sum(r.array.nbytes for r in ref.values())
    eventually(lambda: flight_bytes(server, "flight", model_id) - before[0] == total, 5, "counted")
    assert flight_bytes(server, "grpc", model_id) == before[1]  # StreamTensors not used


def test_flight_off_uses_streamtensors(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    # Two tensors: one small tensor alone would take the unary GetTensor instead of a stream.
    arrays = {"w": np.arange(3000, dtype=np.float32).reshape(30, 100), "b": np.ones(7)}
    save_file(arrays, root / "m" / "model.safetensors")
    total = sum(a.nbytes for a in arrays.values())
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=None)
    with WeightServer(config) as srv, Client(srv.grpc_url, data_plane="flight") as client:
        assert srv.flight_port == 0
        got = client.model("m").fetch(prefix="")
        assert client.transport._flight is None  # type: ignore[attr-defined]
        eventually(lambda: flight_bytes(srv, "grpc", "m") == total, 5, "counted")
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[name], array)


def test_grpc_url_takes_bulk_data_over_the_advertised_http_port(server, reference) -> None:
    """A grpc:// client asks the server for its data planes and streams tensor bytes over
    HTTP (closest to the TCP limit); metadata stays on gRPC."""
    ref = reference("mixed")
    before = {t: flight_bytes(server, t, "mixed") for t in ("http", "flight", "grpc")}
    with Client(server.grpc_url) as client:
        assert client.planes().streams.address.transport == "http"
        assert client.planes().streams.address.port == server.http_port
        got = client.model("mixed").fetch(prefix="")
    assert {n: a.tobytes() for n, a in got.items()} == {
        n: r.array.tobytes() for n, r in ref.items()
    }
    total = sum(r.array.nbytes for r in ref.values())
    eventually(lambda: flight_bytes(server, "http", "mixed") - before["http"] == total, 5, "http")
    assert flight_bytes(server, "flight", "mixed") == before["flight"]
    assert flight_bytes(server, "grpc", "mixed") == before["grpc"]


def test_grpc_url_stays_on_grpc_when_http_is_not_reachable(tmp_path: Path) -> None:
    """The advertised HTTP port answers nothing from here (not published): Flight it is."""
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    # Two tensors: one small tensor alone would take the unary GetTensor, not a stream.
    arrays = {"w": np.arange(100, dtype=np.int32), "b": np.zeros(3, dtype=np.int32)}
    save_file(arrays, root / "m" / "model.safetensors")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0)
    with WeightServer(config) as srv, Client(srv.grpc_url, timeout=10) as client:
        bound = srv.state.lifecycle.ports
        srv.state.lifecycle.ports = lambda: dataclasses.replace(bound(), http=closed)
        assert client.planes().streams is client.transport
        assert client.model("m").fetch(prefix="")["w"].tolist() == list(range(100))
        assert isinstance(client.transport._flight, FlightPool)  # type: ignore[attr-defined]


def test_client_with_flight_off_never_uses_it(server, reference) -> None:
    ref = reference("mixed")
    before = flight_bytes(server, "flight", "mixed")
    with Client(server.grpc_url, flight=False) as client:
        got = client.model("mixed").fetch(prefix="")
    assert flight_bytes(server, "flight", "mixed") == before
    assert {n: a.tobytes() for n, a in got.items()} == {
        n: r.array.tobytes() for n, r in ref.items()
    }


def test_unreachable_flight_endpoint_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A deployment that exposes the gRPC port but not the Flight port still loads."""
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    arrays = {"w": np.arange(1000, dtype=np.int64), "b": np.ones(3)}  # two: a stream
    save_file(arrays, root / "m" / "model.safetensors")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    # What GetServerInfo advertises: a Flight port nobody listens on.
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=0, flight_public_port=closed
    )
    with (
        WeightServer(config) as srv,
        Client(srv.grpc_url, timeout=10, data_plane="flight") as client,
    ):
        with caplog.at_level(logging.WARNING, logger="weightserve.client"):
            got = client.model("m").fetch(prefix="")
        np.testing.assert_array_equal(got["w"], arrays["w"])
        assert "using gRPC StreamTensors instead" in caplog.text
        # counted when the server's handler returns, which may be just after the client is done
        total = sum(a.nbytes for a in arrays.values())
        eventually(lambda: flight_bytes(srv, "grpc", "m") == total, 5, "counted")


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"model": "nope", "use_prefix": True}, ModelNotFound, "nope"),
        ({"model": "mixed", "names": ["float32", "missing"]}, TensorNotFound, "missing"),
        (
            {"model": "mixed", "use_prefix": True, "revision": "0" * 16},
            RevisionMismatch,
            "revision",
        ),
        ({"model": "mixed", "use_prefix": True, "chunk_bytes": -1}, InvalidRequest, "chunk"),
        ({"model": "../outside", "use_prefix": True}, InvalidRequest, "invalid model id"),
        ({"model": "/etc/passwd", "use_prefix": True}, InvalidRequest, "invalid model id"),
    ],
)
def test_flight_errors_are_the_same_classes(server, fields, error, match) -> None:
    """Through the client: the class the other transports raise. Raw: extra_info names it."""
    with Client(server.grpc_url) as client:
        pool = client.transport._flight_pool()  # type: ignore[attr-defined]
        with pytest.raises(error, match=match):
            reader = pool.open(pb.TensorRequest(**fields).SerializeToString())
            reader.read_schema()
            reader.next_chunk(lambda h: memoryview(bytearray(h.nbytes)))
    raw = flight.connect(f"grpc://127.0.0.1:{server.flight_port}")
    try:
        with pytest.raises(flight.FlightError) as info:
            raw.do_get(ticket(**fields)).read_all()
    finally:
        raw.close()
    assert json.loads(info.value.extra_info)["type"] == error.__name__


def test_a_ticket_that_is_not_a_request_is_refused(server) -> None:
    raw = flight.connect(f"grpc://127.0.0.1:{server.flight_port}")
    try:
        with pytest.raises(flight.FlightError) as info:
            raw.do_get(flight.Ticket(b"\xff\xff not protobuf")).read_all()
    finally:
        raw.close()
    assert json.loads(info.value.extra_info)["type"] == "InvalidRequest"


def _big_root(tmp_path: Path) -> Path:
    """A model "big" of eight 4 MiB tensors: 32 streamed MiB, enough to stall a reader."""
    root = tmp_path / "root"
    (root / "big").mkdir(parents=True)
    rng = np.random.default_rng(5)
    save_file(
        {f"t{i}": rng.integers(0, 255, 4 << 20, dtype=np.uint8) for i in range(8)},
        root / "big" / "model.safetensors",
    )
    return root


def test_abandoned_flight_streams_release_their_slots(tmp_path: Path) -> None:
    root = _big_root(tmp_path)
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0)
    with WeightServer(config) as srv, Client(srv.grpc_url, timeout=10) as client:
        transport = client.transport
        params = StreamParams(prefix="", chunk_bytes=1 << 20)
        # Read one chunk of 32, then give up.
        reader = transport.open_chunks("big", params)
        reader.read_schema()
        assert reader.next_chunk(lambda h: memoryview(bytearray(h.nbytes))) is not None
        eventually(lambda: srv.state.open_streams == 1, 5, "the stream holds a slot")
        reader.close()
        eventually(lambda: srv.state.open_streams == 0, 5, "the slot is released on cancel")
        # Open and close without reading anything.
        transport.open_chunks("big", params).close()
        eventually(lambda: srv.state.open_streams == 0, 5, "the unread stream's slot")
        # A stream read to its end hands its connection back for the next one.
        reader = transport.open_chunks("big", params)
        reader.read_schema()
        while reader.next_chunk(lambda h: memoryview(bytearray(h.nbytes))) is not None:
            pass
        reader.close()
        assert len(transport._flight._idle) == 1  # type: ignore[attr-defined]
        eventually(lambda: srv.state.open_streams == 0, 5, "slot released at the end")


def test_every_transport_counts_tensors_and_bytes_served(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    arrays = {f"t{i}": np.full((64, 10), i, dtype=np.float32) for i in range(5)}
    save_file(arrays, root / "m" / "model.safetensors")
    total = sum(a.nbytes for a in arrays.values())
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0)
    with WeightServer(config) as srv:
        metrics = srv.state.metrics
        for url, flight_on, label in (
            (srv.http_url, None, "http"),
            (srv.grpc_url, True, "flight"),
            (srv.grpc_url, False, "grpc"),
        ):
            with Client(url, flight=flight_on) as client:
                client.model("m").fetch(prefix="", shard=None)
                # Two names: one small tensor alone goes through gRPC's unary GetTensor.
                client.model("m").fetch(["t1", "t2"])

            def counted(label: str = label) -> bool:
                tensors = metrics.tensors_served.labels(label, "m")._value.get()
                again = arrays["t1"].nbytes + arrays["t2"].nbytes
                return tensors == 7 and flight_bytes(srv, label, "m") == total + again

            eventually(counted, 5, f"{label} counters")


def test_a_server_that_is_down_is_not_taken_for_a_missing_flight_port(tmp_path: Path) -> None:
    """While the whole server is unreachable the client keeps its Flight endpoint (a restart
    will bring both back); only a reachable service with an unreachable Flight port makes it
    fall back to StreamTensors."""
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    save_file({"w": np.arange(10, dtype=np.int64)}, root / "m" / "model.safetensors")
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0)
    srv = WeightServer(config).start()
    client = Client(srv.grpc_url, timeout=5)
    transport = client.transport
    try:
        pool = transport._flight_pool()  # type: ignore[attr-defined]
        assert isinstance(pool, FlightPool)
        srv.stop(grace=0)
        with pytest.raises(ServerUnreachable):
            transport.open_chunks("m", StreamParams(prefix=""))
        assert transport._flight is pool  # type: ignore[attr-defined]
    finally:
        client.close()


def test_an_error_the_caller_sees_still_cancels_the_stream(tmp_path: Path) -> None:
    """Not only retried breaks: any exception out of a load closes its stream (a Flight
    stream left open would hold its server slot, with no idle cut to free it)."""

    class Stop(Exception):
        pass

    def stop_after_first_chunk(n: int) -> None:
        raise Stop

    config = ServerConfig(str(_big_root(tmp_path)), http_port=0, grpc_port=0, flight_port=0)
    with WeightServer(config) as srv:
        for url in (srv.grpc_url, srv.http_url):
            with Client(url, timeout=10) as client:
                model = client.model("big", FetchOptions(parallel=1, chunk_bytes=1 << 20))
                with pytest.raises(Stop):
                    model.fetch(prefix="", on_bytes=stop_after_first_chunk)
                eventually(lambda: srv.state.open_streams == 0, 5, f"{url}: slot released")


def test_streams_past_the_grace_period_are_cut_at_shutdown(tmp_path: Path) -> None:
    config = ServerConfig(
        str(_big_root(tmp_path)), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0
    )
    srv = WeightServer(config).start()
    client = Client(srv.grpc_url, timeout=10)
    try:
        reader = client.transport.open_chunks("big", StreamParams(prefix="", chunk_bytes=1 << 20))
        reader.read_schema()
        assert reader.next_chunk(lambda h: memoryview(bytearray(h.nbytes))) is not None
        eventually(lambda: srv.state.open_streams == 1, 5, "the stream holds a slot")
        started = time.monotonic()
        srv.stop(grace=0.5)  # the client reads nothing more: not drained in time
        assert time.monotonic() - started < 8
        with pytest.raises(ModelUnavailable, match="shutting down"):
            while reader.next_chunk(lambda h: memoryview(bytearray(h.nbytes))) is not None:
                pass
        assert srv.state.open_streams == 0
    finally:
        client.close()


def test_public_flight_port_is_what_clients_are_told(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=0, flight_public_port=31052
    )
    with WeightServer(config) as srv, grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as ch:
        info = ch.unary_unary(
            "/weightserve.v1.WeightService/GetServerInfo",
            request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.ServerInfo.FromString,
        )(pb.GetServerInfoRequest(), timeout=10)
        assert info.flight_port == 31052 and srv.flight_port not in (0, 31052)


def test_a_failed_start_leaves_nothing_listening(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=port)
        srv = WeightServer(config)
        with pytest.raises(RuntimeError, match="Flight endpoint could not listen"):
            srv.start()
    assert srv.http_port
    with socket.socket() as probe:  # the HTTP listener was closed again
        eventually(lambda: probe.connect_ex(("127.0.0.1", srv.http_port)) != 0, 5, "closed")


@pytest.mark.parametrize(
    "detail",
    [
        {"type": "ResourceExhausted", "message": "4 streams open", "retry_after": 1.5},
        # A server from before the one error shape named the class under "error".
        {"error": "ResourceExhausted", "message": "4 streams open", "retry_after": 1.5},
    ],
)
def test_extra_info_names_the_servers_class(detail: dict) -> None:
    raised = flight.FlightUnavailableError("busy", extra_info=json.dumps(detail).encode())
    error = translate(raised, "grpc+tcp://127.0.0.1:1")
    assert type(error) is ResourceExhausted
    assert str(error) == "4 streams open" and error.retry_after == 1.5
