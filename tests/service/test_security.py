"""Security: bearer tokens and per-model grants, TLS and mTLS, confinement to the model root,
and the limits that keep one client from exhausting the server.

Every test runs real servers on loopback ports chosen by the OS, over a model root written
here. Certificates (a test CA, a server and a client certificate, and a second "rogue" CA)
are made at test time in a temporary directory with the ``openssl`` command line tool; no key
is ever stored in the repository. Raw HTTP requests go through ``http.client`` with the path
exactly as written, so traversal attempts reach the server unnormalised.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pyarrow.flight as flight
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import security
from tests.support.security import (
    BIG_TENSOR_BYTES,
    BIG_TENSORS,
    FULL_TOKEN,
    SECRET,
    TEAM_A_TOKEN,
    Certs,
    Root,
    serving,
    write_tokens,
)
from weightserve.client._client import Client
from weightserve.client.errors import (
    InvalidRequest,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TransportError,
    Unauthenticated,
    WeightserveError,
)
from weightserve.client.transports.base import TLSOptions
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.serving.state import Limits

# The fixtures this module shares with others.
root, certs = security.root, security.certs
tls_server, mtls_server = security.tls_server, security.mtls_server

STREAM = "/weightserve.v1.WeightService/StreamTensors"


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTSERVE_TOKEN", raising=False)


# ----------------------------------------------------------------------------- the model root


def raw(
    srv: WeightServer,
    method: str,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    body: object = None,
    source: tuple[str, int] | None = None,
) -> tuple[int, bytes]:
    """One HTTP request with the path exactly as given; (status, whole body)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=20, source_address=source)
    try:
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        hdrs = dict(headers or {})
        if isinstance(body, (dict, list)):
            hdrs["content-type"] = "application/json"
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def error_type(body: bytes) -> str:
    return json.loads(body)["error"]["type"]


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def assert_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
        assert got[name].tobytes() == arr.tobytes(), name


def eventually(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``check`` until it holds; returns the seconds it took, fails after ``timeout``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - start


# ----------------------------------------------------------------------------- authentication


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    write_tokens(path, f"# tokens for tests\n{FULL_TOKEN}\n{TEAM_A_TOKEN}  team-a/*\n")
    return path


@pytest.fixture(scope="module")
def auth_server(root: Root, token_file: Path) -> Iterator[WeightServer]:
    with serving(root, token_file=str(token_file)) as srv:
        yield srv


URLS = ("http", "grpc")


def url(srv: WeightServer, transport: str) -> str:
    return srv.http_url if transport == "http" else srv.grpc_url


def flight_bytes(srv: WeightServer, model: str) -> float:
    """Tensor bytes the server sent over its Flight endpoint for ``model``."""
    return srv.state.metrics.bytes_served.labels("flight", model)._value.get()


def test_http_no_token_or_wrong_token_is_401(auth_server: WeightServer) -> None:
    for headers in ({}, bearer("wrong-token"), {"authorization": FULL_TOKEN}, bearer("")):
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("GET", "/v1/models/team-a/x", None),
            ("POST", "/v1/models/team-a/x/stream", {"prefix": ""}),
            ("GET", "/v1/models/team-a/x/stream?prefix=", None),
            ("GET", "/v1/models/team-a/x/tensors/w", None),
            ("GET", "/v1/models/team-a/x/-/tensors/w", None),  # the small-tensor lane
        ):
            status, data = raw(auth_server, method, path, headers=headers, body=body)
            assert status == 401, (headers, path)
            assert error_type(data) == "Unauthenticated"


@pytest.mark.parametrize("transport", URLS)
@pytest.mark.parametrize("token", [None, "wrong-token", FULL_TOKEN + "x", FULL_TOKEN[:-1]])
def test_client_without_valid_token_is_unauthenticated(
    auth_server: WeightServer, transport: str, token: str | None
) -> None:
    with Client(url(auth_server, transport), token=token, timeout=10) as client:
        with pytest.raises(Unauthenticated):
            client.list_models()
        with pytest.raises(Unauthenticated):
            client.model("team-a/x")


def test_grpc_stream_without_token_is_unauthenticated(auth_server: WeightServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{auth_server.grpc_port}") as channel:
        call = channel.unary_stream(STREAM, request_serializer=pb.TensorRequest.SerializeToString)
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as info:
                list(call(pb.TensorRequest(model="team-a/x", use_prefix=True), metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_flight_stream_needs_the_same_token_and_grant(auth_server: WeightServer) -> None:
    """The Flight endpoint checks tokens and per-model grants as StreamTensors does."""
    request = pb.TensorRequest(model="team-a/x", use_prefix=True).SerializeToString()
    client = flight.connect(f"grpc://127.0.0.1:{auth_server.flight_port}")

    def error_of(headers: list) -> str:
        with pytest.raises(flight.FlightError) as info:
            options = flight.FlightCallOptions(headers=headers)
            client.do_get(flight.Ticket(request), options).read_all()
        return json.loads(info.value.extra_info)["type"]

    try:
        assert error_of([]) == "Unauthenticated"
        assert error_of([(b"authorization", b"Bearer nope")]) == "Unauthenticated"
        other = pb.TensorRequest(model="team-b/z", use_prefix=True).SerializeToString()
        team_a = [(b"authorization", f"Bearer {TEAM_A_TOKEN}".encode())]
        options = flight.FlightCallOptions(headers=team_a)
        with pytest.raises(flight.FlightUnauthorizedError) as info:
            client.do_get(flight.Ticket(other), options).read_all()
        assert json.loads(info.value.extra_info)["type"] == "PermissionDenied"
        table = client.do_get(flight.Ticket(request), options).read_all()
        assert set(table.column("name").to_pylist()) == {"b", "w"}
    finally:
        client.close()


@pytest.mark.parametrize("transport", URLS)
def test_good_token_reads_everything(auth_server: WeightServer, root: Root, transport: str) -> None:
    with Client(url(auth_server, transport), token=FULL_TOKEN, timeout=10) as client:
        models, _ = client.list_models()
        assert {m.id for m in models} == set(root.arrays)
        for model_id in ("team-a/x", "team-b/z", "shared/base"):
            assert_arrays(client.model(model_id).fetch(prefix=""), root.arrays[model_id])


def test_token_from_environment(
    auth_server: WeightServer, root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTSERVE_TOKEN", FULL_TOKEN)
    for transport in URLS:
        with Client(url(auth_server, transport), timeout=10) as client:
            assert_arrays(client.model("team-b/z").fetch(prefix=""), root.arrays["team-b/z"])


@pytest.mark.parametrize("transport", URLS)
def test_per_model_grant(auth_server: WeightServer, root: Root, transport: str) -> None:
    with Client(url(auth_server, transport), token=TEAM_A_TOKEN, timeout=10) as client:
        models, problems = client.list_models()
        assert sorted(m.id for m in models) == ["team-a/x", "team-a/y"]
        assert problems == []  # refused models outside the grant are not listed either
        assert_arrays(client.model("team-a/x").fetch(prefix=""), root.arrays["team-a/x"])
        assert_arrays(client.model("team-a/y").fetch(["w"]), {"w": root.arrays["team-a/y"]["w"]})
        # Outside the grant: refused whether the model exists or not (no existence oracle).
        for model_id in ("team-b/z", "shared/base", "big", "team-b/does-not-exist", "team-a"):
            with pytest.raises(PermissionDenied):
                client.model(model_id)


def test_per_model_grant_http_statuses(auth_server: WeightServer) -> None:
    headers = bearer(TEAM_A_TOKEN)
    assert raw(auth_server, "GET", "/v1/models/team-a/x", headers=headers)[0] == 200
    for path, method, body in (
        ("/v1/models/team-b/z", "GET", None),
        ("/v1/models/team-b/z/stream", "POST", {"names": ["w"]}),
        ("/v1/models/team-b/z/stream?name=w", "GET", None),
        ("/v1/models/team-b/z/tensors/w", "GET", None),
        ("/v1/models/team-b/z/-/tensors/w", "GET", None),  # the small-tensor lane
        ("/v1/models/nope/nothing", "GET", None),
    ):
        status, data = raw(auth_server, method, path, headers=headers, body=body)
        assert status == 403, path
        assert error_type(data) == "PermissionDenied"


def test_per_model_grant_grpc_codes(auth_server: WeightServer) -> None:
    metadata = tuple(bearer(TEAM_A_TOKEN).items())
    with grpc.insecure_channel(f"127.0.0.1:{auth_server.grpc_port}") as channel:
        get = channel.unary_unary(
            "/weightserve.v1.WeightService/GetModel",
            request_serializer=pb.GetModelRequest.SerializeToString,
            response_deserializer=pb.ModelInfo.FromString,
        )
        assert get(pb.GetModelRequest(model="team-a/y"), metadata=metadata).id == "team-a/y"
        with pytest.raises(grpc.RpcError) as info:
            get(pb.GetModelRequest(model="team-b/z"), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        call = channel.unary_stream(STREAM, request_serializer=pb.TensorRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as info:
            list(call(pb.TensorRequest(model="shared/base", names=["w"]), metadata=metadata))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_token_file_reloads_without_restart(root: Root, tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    write_tokens(path, "old-token\n")
    with serving(root, token_file=str(path)) as srv:
        assert raw(srv, "GET", "/v1/models", headers=bearer("old-token"))[0] == 200
        assert raw(srv, "GET", "/v1/models", headers=bearer("new-token"))[0] == 401
        with Client(srv.grpc_url, token="old-token", timeout=10) as c:
            c.list_models()

        write_tokens(path, "new-token  team-a/x\n")  # atomic replace: a new inode

        def rotated() -> bool:
            return (
                raw(srv, "GET", "/v1/models", headers=bearer("new-token"))[0] == 200
                and raw(srv, "GET", "/v1/models", headers=bearer("old-token"))[0] == 401
            )

        took = eventually(rotated, 3.0, "new token accepted, old token refused")
        assert took < 2.5
        # gRPC reads the same store: the old token is gone there too, the new one is scoped.
        with (
            Client(srv.grpc_url, token="old-token", timeout=10) as c,
            pytest.raises(Unauthenticated),
        ):
            c.list_models()
        with Client(srv.grpc_url, token="new-token", timeout=10) as c:
            assert [m.id for m in c.list_models()[0]] == ["team-a/x"]
            with pytest.raises(PermissionDenied):
                c.model("team-a/y")

        # An in-place edit (same inode) is picked up too.
        path.write_text("third-token\n")
        eventually(
            lambda: (
                raw(srv, "GET", "/v1/models", headers=bearer("third-token"))[0] == 200
                and raw(srv, "GET", "/v1/models", headers=bearer("new-token"))[0] == 401
            ),
            3.0,
            "in-place edit of the token file",
        )

        # A briefly missing or empty file keeps the last good tokens (no lock-out mid-rotation).
        path.unlink()
        time.sleep(1.2)
        assert raw(srv, "GET", "/v1/models", headers=bearer("third-token"))[0] == 200
        path.write_text("# nothing yet\n")
        time.sleep(1.2)
        assert raw(srv, "GET", "/v1/models", headers=bearer("third-token"))[0] == 200


def test_probes_and_metrics_open_by_default(auth_server: WeightServer) -> None:
    assert raw(auth_server, "GET", "/healthz")[0] == 200
    status, data = raw(auth_server, "GET", "/readyz")
    assert status == 200 and json.loads(data)["status"] == "ready"
    status, data = raw(auth_server, "GET", "/metrics")
    assert status == 200 and b"weightserve" in data


def test_grpc_health_open_without_token(auth_server: WeightServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{auth_server.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "weightserve.v1.WeightService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_protected_metrics(root: Root, token_file: Path) -> None:
    with serving(root, token_file=str(token_file), protect_metrics=True) as srv:
        status, data = raw(srv, "GET", "/metrics")
        assert status == 401 and error_type(data) == "Unauthenticated"
        assert raw(srv, "GET", "/metrics", headers=bearer("wrong"))[0] == 401
        status, data = raw(srv, "GET", "/metrics", headers=bearer(FULL_TOKEN))
        assert status == 200 and b"weightserve" in data
        # Probes stay open: a kubelet carries no token.
        assert raw(srv, "GET", "/healthz")[0] == 200
        assert raw(srv, "GET", "/readyz")[0] == 200


# ----------------------------------------------------------------------------- TLS and mTLS


@pytest.mark.parametrize("transport", URLS)
def test_tls_with_the_ca_is_byte_identical(
    tls_server: WeightServer, root: Root, certs: Certs, transport: str
) -> None:
    address = url(tls_server, transport)
    assert address.startswith(("https://", "grpcs://"))
    plane = "flight" if transport == "grpc" else None
    tls = TLSOptions(ca_file=certs.ca)
    with Client(address, tls=tls, timeout=10, data_plane=plane) as client:
        assert {m.id for m in client.list_models()[0]} == set(root.arrays)
        assert_arrays(client.model("big").fetch(prefix=""), root.arrays["big"])
        assert_arrays(client.model("team-a/x").fetch(prefix=""), root.arrays["team-a/x"])
        if transport == "grpc":  # bulk data went over the Flight endpoint, with TLS
            pool = client.transport._flight  # type: ignore[attr-defined]
            assert pool.url.startswith("grpc+tls://")
            assert flight_bytes(tls_server, "big") > 0
    if transport == "grpc":  # by default a grpcs:// client streams over HTTPS, same CA
        with Client(address, tls=tls, timeout=10) as client:
            assert client.planes().streams.address.url.startswith("https://")
            assert_arrays(client.model("big").fetch(prefix=""), root.arrays["big"])


@pytest.mark.parametrize("transport", URLS)
def test_tls_without_the_ca_fails_cleanly(
    tls_server: WeightServer, certs: Certs, transport: str
) -> None:
    # The system trust store does not know the test CA; another CA does not vouch for it.
    for tls in (None, TLSOptions(ca_file=certs.ca.replace("ca.pem", "rogue-ca.pem"))):
        with Client(url(tls_server, transport), tls=tls, timeout=10) as client:
            with pytest.raises(TransportError) as info:
                client.list_models()
            text = str(info.value)
            assert tls_server.config.host in text or "CERTIFICATE_VERIFY_FAILED" in text


@pytest.mark.parametrize("transport", URLS)
def test_plaintext_client_to_tls_port_fails_cleanly(
    tls_server: WeightServer, transport: str
) -> None:
    plain = url(tls_server, transport).replace("https://", "http://").replace("grpcs://", "grpc://")
    with Client(plain, timeout=10) as client, pytest.raises(TransportError):
        client.list_models()


@pytest.mark.parametrize("transport", URLS)
def test_mtls(mtls_server: WeightServer, root: Root, certs: Certs, transport: str) -> None:
    address = url(mtls_server, transport)
    refused = (
        TLSOptions(ca_file=certs.ca),  # no client certificate
        TLSOptions(ca_file=certs.ca, cert_file=certs.rogue_cert, key_file=certs.rogue_key),
    )
    for tls in refused:
        with Client(address, tls=tls, timeout=10) as client, pytest.raises(TransportError):
            client.list_models()
    good = TLSOptions(ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key)
    plane = "flight" if transport == "grpc" else None
    with Client(address, tls=good, timeout=10, data_plane=plane) as client:
        assert {m.id for m in client.list_models()[0]} == set(root.arrays)
        assert_arrays(client.model("team-b/z").fetch(prefix=""), root.arrays["team-b/z"])
        if transport == "grpc":
            assert flight_bytes(mtls_server, "team-b/z") > 0


def test_flight_refuses_clients_without_a_certificate(
    mtls_server: WeightServer, certs: Certs
) -> None:
    ca = Path(certs.ca).read_bytes()
    request = pb.TensorRequest(model="team-b/z", use_prefix=True).SerializeToString()
    rogue = {
        "cert_chain": Path(certs.rogue_cert).read_bytes(),
        "private_key": Path(certs.rogue_key).read_bytes(),
    }
    for extra in ({}, rogue):
        location = f"grpc+tls://127.0.0.1:{mtls_server.flight_port}"
        client = flight.FlightClient(location, tls_root_certs=ca, **extra)
        try:
            with pytest.raises(flight.FlightError):
                client.do_get(flight.Ticket(request)).read_all()
        finally:
            client.close()


# ----------------------------------------------------------------------------- confinement

# Each names something outside the root (the sibling "outside" directory holds a valid model,
# so a server that joined ids to paths would find it), or tries to.
ESCAPES = [
    "../outside/secret",
    "..%2Foutside%2Fsecret",
    "..%2foutside/secret",
    "%2e%2e/outside/secret",
    "%2E%2E%2Foutside%2Fsecret",
    ".%2e/outside/secret",
    "/etc/passwd",
    "%2Fetc%2Fpasswd",
    "a/../../outside/secret",
    "team-a/../../outside/secret",
    "..%2f..%2fetc%2fpasswd",
    "..%2f..%2f..%2f..%2f..%2f..%2fetc%2fpasswd",
    "..%5Coutside%5Csecret",
    "..\\outside\\secret",
    "team-a/x/../../../outside/secret",
    "%00",
    "team-a%00/x",
    ".",
    "..",
    "team-a//x",
    "./team-a/x",
]
# Symlinks inside the root that lead outside it: found, but never served.
SYMLINKS = ["escape-dir", "escape-file.safetensors", "team-c"]


@pytest.fixture(scope="module")
def open_server(root: Root) -> Iterator[WeightServer]:
    with serving(root) as srv:
        yield srv


def test_symlinks_out_of_the_root_are_refused(open_server: WeightServer) -> None:
    status, data = raw(open_server, "GET", "/v1/models")
    listing = json.loads(data)
    served = {m["id"] for m in listing["models"]}
    refused = {p["model"]: p["reason"] for p in listing["problems"]}
    assert not served & set(SYMLINKS)
    for link in SYMLINKS:
        assert "outside the model root" in refused[link], link
    assert SECRET not in data


@pytest.mark.parametrize("model", ESCAPES + SYMLINKS)
def test_http_confinement(open_server: WeightServer, model: str) -> None:
    for method, path, body in (
        ("GET", f"/v1/models/{model}", None),
        ("GET", f"/v1/models/{model}/stream?prefix=", None),
        ("POST", f"/v1/models/{model}/stream", {"prefix": ""}),
        ("POST", f"/v1/models/{model}/stream", {"names": ["secret"]}),
        ("GET", f"/v1/models/{model}/tensors/secret", None),
    ):
        status, data = raw(open_server, method, path, body=body)
        assert 400 <= status < 500 or (model in SYMLINKS and status == 503), (path, status)
        assert SECRET not in data, path
        if model in SYMLINKS:
            assert error_type(data) in ("ModelUnavailable", "ModelNotFound"), path
        elif model not in ("team-a//x", "./team-a/x"):
            assert error_type(data) in ("InvalidRequest", "ModelNotFound"), (path, data)


@pytest.mark.parametrize("model", [m for m in ESCAPES if "%" not in m] + SYMLINKS)
def test_grpc_confinement(open_server: WeightServer, model: str) -> None:
    with Client(open_server.grpc_url, timeout=10) as client:
        with pytest.raises(WeightserveError) as info:
            client.model(model)
        assert SECRET.decode() not in str(info.value)
    if model in SYMLINKS:
        return
    assert isinstance(info.value, (InvalidRequest, NotFound)), info.value
    with grpc.insecure_channel(f"127.0.0.1:{open_server.grpc_port}") as channel:
        call = channel.unary_stream(STREAM, request_serializer=pb.TensorRequest.SerializeToString)
        for request in (
            pb.TensorRequest(model=model, use_prefix=True),
            pb.TensorRequest(model=model, names=["secret"]),
        ):
            with pytest.raises(grpc.RpcError) as err:
                list(call(request, timeout=10))
            assert err.value.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
            ), model


def test_grpc_confinement_raw_percent_forms(open_server: WeightServer) -> None:
    # gRPC carries the id as a protobuf string: nothing decodes '%2F', so these name no model.
    with Client(open_server.grpc_url, timeout=10) as client:
        for model in (m for m in ESCAPES if "%" in m):
            with pytest.raises((InvalidRequest, NotFound)):
                client.model(model)


# ----------------------------------------------------------------------------- limits


class StalledReader:
    """A raw HTTP stream request whose client then reads nothing (tiny receive buffer)."""

    def __init__(self, srv: WeightServer, path: str, source: str | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        if source:
            self.sock.bind((source, 0))
        self.sock.settimeout(20)
        self.sock.connect(("127.0.0.1", srv.http_port))
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: weightserve\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        self.status = int(head.split()[1])
        length = [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
        self.length = int(length[0].split(b":")[1]) if length else 0

    def drain(self) -> int:
        """Read until the server closes; the body bytes received."""
        n = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := self.sock.recv(1 << 20):
                n += len(chunk)
        return n

    def close(self) -> None:
        self.sock.close()


BIG_STREAM = "/v1/models/big/stream?prefix=&chunk_bytes=1048576"


def _grpc_stalled(srv: WeightServer) -> tuple[grpc.Channel, object]:
    """A gRPC stream of the big model whose client took one message and reads no more."""
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}")
    call = channel.unary_stream(STREAM, request_serializer=pb.TensorRequest.SerializeToString)
    it = call(pb.TensorRequest(model="big", use_prefix=True, chunk_bytes=1 << 20), timeout=30)
    next(it)
    return channel, it


@pytest.fixture(scope="module")
def limited_server(root: Root) -> Iterator[WeightServer]:
    limits = Limits(
        max_streams_per_client=1, max_names=4, max_request_bytes=4096, idle_timeout=30.0
    )
    with serving(root, limits=limits) as srv:
        yield srv


def test_streams_per_client(limited_server: WeightServer, root: Root) -> None:
    srv = limited_server
    stalled = StalledReader(srv, BIG_STREAM)
    try:
        assert stalled.status == 200
        eventually(lambda: srv.state.open_streams == 1, 5, "the stalled stream holds a slot")
        # A second stream from the same address: refused on both transports.
        status, data = raw(srv, "GET", "/v1/models/team-a/x/stream?prefix=")
        assert status == 429 and error_type(data) == "ResourceExhausted"
        for transport in URLS:
            # retry_seconds=0: see the refusal itself
            # (tests/service/serving/test_admission.py waits it out)
            with Client(url(srv, transport), timeout=10, retry_seconds=0) as client:
                model = client.model("team-a/x")  # metadata needs no stream slot
                assert model.names() == ["b", "w"]
                with pytest.raises(ResourceExhausted):
                    model.fetch(prefix="")
        time.sleep(0.2)
        assert srv.state.open_streams == 1
    finally:
        stalled.close()
    eventually(lambda: srv.state.open_streams == 0, 5, "the slot is released on disconnect")
    with Client(srv.http_url, timeout=10) as client:
        assert_arrays(client.model("team-a/x").fetch(prefix=""), root.arrays["team-a/x"])


def test_other_address_still_served(limited_server: WeightServer, root: Root) -> None:
    srv = limited_server
    try:
        probe = socket.socket()
        probe.bind(("127.0.0.2", 0))
        probe.close()
    except OSError as e:
        pytest.skip(f"cannot use 127.0.0.2 as a source address: {e}")
    stalled = StalledReader(srv, BIG_STREAM)
    try:
        eventually(lambda: srv.state.open_streams == 1, 5, "the stalled stream holds a slot")
        status, data = raw(
            srv, "POST", "/v1/models/team-a/x/stream", body={"prefix": ""}, source=("127.0.0.2", 0)
        )
        assert status == 200 and len(data) > 0
        # ...and from 127.0.0.2 a second stream is again one too many.
        other = StalledReader(srv, BIG_STREAM, source="127.0.0.2")
        try:
            assert other.status == 200
            eventually(lambda: srv.state.open_streams == 2, 5, "second address holds a slot")
            status, _ = raw(
                srv, "GET", "/v1/models/team-a/x/stream?prefix=", source=("127.0.0.2", 0)
            )
            assert status == 429
        finally:
            other.close()
    finally:
        stalled.close()
    eventually(lambda: srv.state.open_streams == 0, 5, "slots released")


def test_grpc_streams_per_client(limited_server: WeightServer) -> None:
    srv = limited_server
    channel, it = _grpc_stalled(srv)
    try:
        eventually(lambda: srv.state.open_streams == 1, 5, "the stalled gRPC stream holds a slot")
        with (
            Client(srv.grpc_url, timeout=10, retry_seconds=0) as client,
            pytest.raises(ResourceExhausted),
        ):
            client.model("team-a/x").fetch(prefix="")
        assert raw(srv, "GET", "/v1/models/team-a/x/stream?prefix=")[0] == 429
    finally:
        it.cancel()
        channel.close()
    eventually(lambda: srv.state.open_streams == 0, 5, "the slot is released on cancel")


def test_too_many_names(limited_server: WeightServer) -> None:
    names = ["w", "b", "w", "b", "w"]  # 5 > max_names=4 (checked before any lookup)
    status, data = raw(limited_server, "POST", "/v1/models/team-a/x/stream", body={"names": names})
    assert status == 429 and error_type(data) == "ResourceExhausted"
    query = "&".join(f"name={n}" for n in names)
    assert raw(limited_server, "GET", f"/v1/models/team-a/x/stream?{query}")[0] == 429
    assert (
        raw(limited_server, "POST", "/v1/models/team-a/x/stream", body={"names": names[:4]})[0]
        == 200
    )
    with grpc.insecure_channel(f"127.0.0.1:{limited_server.grpc_port}") as channel:
        call = channel.unary_stream(STREAM, request_serializer=pb.TensorRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as info:
            list(call(pb.TensorRequest(model="team-a/x", names=names), timeout=10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_request_body_limit(limited_server: WeightServer) -> None:
    body = {"names": ["w"], "prefix": None, "revision": "x" * 5000}  # > 4096 bytes of JSON
    status, data = raw(limited_server, "POST", "/v1/models/team-a/x/stream", body=body)
    assert status == 413 and error_type(data) == "ResourceExhausted"

    # Without Content-Length (chunked transfer encoding) the limit holds all the same.
    def chunks() -> Iterator[bytes]:
        yield b'{"names": ["w"], "revision": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'

    conn = http.client.HTTPConnection("127.0.0.1", limited_server.http_port, timeout=20)
    try:
        conn.request(
            "POST",
            "/v1/models/team-a/x/stream",
            body=chunks(),
            headers={"content-type": "application/json", "transfer-encoding": "chunked"},
            encode_chunked=True,
        )
        resp = conn.getresponse()
        assert resp.status == 413 and error_type(resp.read()) == "ResourceExhausted"
    finally:
        conn.close()
    # A small chunked body is read normally.
    conn = http.client.HTTPConnection("127.0.0.1", limited_server.http_port, timeout=20)
    try:
        conn.request(
            "POST",
            "/v1/models/team-a/x/stream",
            body=iter([b'{"names": ', b'["w"]}']),
            headers={"content-type": "application/json", "transfer-encoding": "chunked"},
            encode_chunked=True,
        )
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read()
    finally:
        conn.close()
    # gRPC has its own cap on a request message (4 MiB).
    with grpc.insecure_channel(f"127.0.0.1:{limited_server.grpc_port}") as channel:
        call = channel.unary_stream(STREAM, request_serializer=pb.TensorRequest.SerializeToString)
        huge = pb.TensorRequest(model="team-a/x", names=["w"], revision="x" * (5 << 20))
        with pytest.raises(grpc.RpcError) as info:
            list(call(huge, timeout=10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def idle_server(root: Root) -> Iterator[WeightServer]:
    with serving(root, limits=Limits(idle_timeout=1.0)) as srv:
        yield srv


def test_stalled_http_client_is_cut(idle_server: WeightServer, root: Root) -> None:
    srv = idle_server
    stalled = StalledReader(srv, BIG_STREAM)
    try:
        assert stalled.status == 200 and stalled.length > BIG_TENSORS * BIG_TENSOR_BYTES
        started = time.monotonic()
        eventually(lambda: srv.state.open_streams == 1, 5, "the stalled stream holds a slot")
        # Others are served while the stalled stream sits there...
        with Client(srv.http_url, timeout=10) as client:
            assert_arrays(client.model("team-b/z").fetch(prefix=""), root.arrays["team-b/z"])
        # ...and the stalled one is cut after about idle_timeout (1 s), releasing its slot.
        eventually(lambda: srv.state.open_streams == 0, 5, "the stalled stream is cut")
        assert time.monotonic() - started > 0.8
        # The connection ends short of its Content-Length: a cut, not a finished stream.
        assert stalled.drain() < stalled.length
    finally:
        stalled.close()
    with Client(srv.grpc_url, timeout=10) as client:
        assert_arrays(client.model("team-a/y").fetch(prefix=""), root.arrays["team-a/y"])


def test_stalled_grpc_client_is_cut(idle_server: WeightServer, root: Root) -> None:
    srv = idle_server
    channel, it = _grpc_stalled(srv)
    try:
        started = time.monotonic()
        eventually(lambda: srv.state.open_streams == 1, 5, "the stalled gRPC stream holds a slot")
        with Client(srv.grpc_url, timeout=10) as client:
            assert_arrays(client.model("team-b/z").fetch(prefix=""), root.arrays["team-b/z"])
        eventually(lambda: srv.state.open_streams == 0, 5, "the stalled gRPC stream is cut")
        assert time.monotonic() - started > 0.8
        with pytest.raises(grpc.RpcError) as info:
            for _ in it:
                pass
        assert info.value.code() == grpc.StatusCode.CANCELLED
    finally:
        it.cancel()
        channel.close()


def test_node_cache_fills_from_an_mtls_upstream(
    mtls_server: WeightServer, root: Root, certs: Certs, tmp_path: Path
) -> None:
    """An https:// origin is verified with --origin-ca and answered with the node's client
    certificate (--origin-cert/--origin-key); without them the upstream is refused, clearly."""
    node_config = dict(
        http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False,
        cache_dir=str(tmp_path / "node"),
    )  # fmt: skip
    origin = mtls_server.http_url  # https://127.0.0.1:PORT
    tls = (certs.ca, certs.client_cert, certs.client_key)
    trusting = ServerConfig(origin, origin_tls=tls, **node_config)  # type: ignore[arg-type]
    with WeightServer(trusting) as node, Client(node.http_url, timeout=20) as client:
        got = client.model("team-b/z").fetch(prefix="")
    assert_arrays(got, root.arrays["team-b/z"])

    node_config["cache_dir"] = str(tmp_path / "untrusting")
    untrusting = ServerConfig(origin, **node_config)  # type: ignore[arg-type]
    with (
        WeightServer(untrusting) as node,
        Client(node.http_url, timeout=20, retry_seconds=0) as client,
        pytest.raises(WeightserveError) as refused,
    ):
        client.model("team-b/z").fetch(prefix="")
    assert origin.split("://")[1] in str(refused.value)  # names the origin
