"""Admission under load: crowds of workers at a small stream limit all get their weights.

- A refused stream carries a retry hint on every transport (HTTP ``Retry-After``, gRPC's
  ``grpc-retry-pushback-ms`` trailer, Flight's ``extra_info``); final refusals carry none.
- A crowd of concurrent fetches, and a ``weightserve pull``, at ``max_streams=2`` all succeed:
  the clients wait and retry with jittered backoff within their time budget.
- The per-client limit is keyed by the token when tokens are configured, so two tokens from
  one address are two clients (and the token never shows in an error).
- A load started while the server is down completes once it comes up; one that never comes
  up fails after the budget with an error that says so.

Real servers on loopback ports; stream slots are held either by real stalled streams or
through the server's own ``ServiceState.stream_slot``, so tests never race the timing of
real loads to get a refusal.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pyarrow.flight as flight
import pytest
from safetensors.numpy import save_file

from weightserve.client._cli import main as cli_main
from weightserve.client._client import Client, FetchOptions
from weightserve.client.errors import ResourceExhausted, ServerUnreachable
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.serving.state import Limits

MIB = 1 << 20
STREAM = "/weightserve.v1.WeightService/StreamTensors"
TRANSPORTS = ("http", "grpc", "grpc-streamtensors")  # "grpc": tensor data over Flight
TOKEN_A = "token-a-0123456789abcdef"
TOKEN_B = "token-b-fedcba9876543210"
HINT = 0.25  # the servers' retry hint (seconds): short, so the crowds finish fast


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTSERVE_TOKEN", raising=False)
    monkeypatch.delenv("WEIGHTSERVE_RETRY_SECONDS", raising=False)


@dataclass
class Root:
    path: Path
    arrays: dict[str, dict[str, np.ndarray]]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Root:
    path = tmp_path_factory.mktemp("admission")
    rng = np.random.default_rng(3)
    arrays = {
        # 8 chunks of 1 MiB: a stream lasts as long as its reader takes over them
        "crowd": {f"layer.{i}": rng.standard_normal(MIB // 4).astype(np.float32) for i in range(8)},
        # 32 MiB: far more than socket buffers and HTTP/2 windows hold for a stalled reader
        "big": {f"t{i}": rng.integers(0, 256, 8 * MIB, dtype=np.uint8) for i in range(4)},
    }
    for model_id, tensors in arrays.items():
        (path / model_id).mkdir()
        save_file(tensors, path / model_id / "model.safetensors")
    return Root(path, arrays)


@contextlib.contextmanager
def serving(root: Root, limits: Limits, **config: object) -> Iterator[WeightServer]:
    srv = WeightServer(
        ServerConfig(
            str(root.path),
            http_port=0,
            grpc_port=0,
            flight_port=0,
            rescan_seconds=0,
            limits=limits,
            **config,  # type: ignore[arg-type]
        )
    ).start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


@pytest.fixture(scope="module")
def busy_server(root: Root) -> Iterator[WeightServer]:
    """Two streams at a time for everyone."""
    with serving(root, Limits(max_streams=2, retry_after=HINT)) as srv:
        yield srv


def url(srv: WeightServer, transport: str) -> str:
    return srv.http_url if transport == "http" else srv.grpc_url


def connect(srv: WeightServer, transport: str, **options: object) -> Client:
    return Client(url(srv, transport), flight=transport != "grpc-streamtensors", **options)  # type: ignore[arg-type]


def assert_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].tobytes() == arr.tobytes(), name


@contextlib.contextmanager
def all_slots_taken(srv: WeightServer) -> Iterator[contextlib.ExitStack]:
    """Every stream slot of ``srv`` held (by another client); close the stack to free them."""
    with contextlib.ExitStack() as held:
        for _ in range(srv.state.limits.max_streams):
            held.enter_context(srv.state.stream_slot("http", "another client"))
        yield held


def raw_http(
    srv: WeightServer, method: str, path: str, body: object = None
) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=20)
    headers = {"content-type": "application/json"} if body is not None else {}
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp


def eventually(check, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.02)


# ----------------------------------------------------------------------------- the retry hint


def test_refusals_carry_a_retry_hint_on_every_transport(busy_server: WeightServer) -> None:
    srv = busy_server
    request = pb.TensorRequest(model="crowd", use_prefix=True)
    with all_slots_taken(srv):
        resp = raw_http(srv, "GET", "/v1/models/crowd/stream?prefix=")
        assert resp.status == 429
        assert resp.getheader("retry-after") == "1"  # whole seconds, at least 1

        with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
            call = channel.unary_stream(
                STREAM, request_serializer=pb.TensorRequest.SerializeToString
            )
            with pytest.raises(grpc.RpcError) as refused:
                list(call(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(refused.value.trailing_metadata())
        assert trailers["grpc-retry-pushback-ms"] == str(int(HINT * 1000))
        assert trailers["weightserve-error"] == "ResourceExhausted"

        client = flight.FlightClient(f"grpc+tcp://127.0.0.1:{srv.flight_port}")
        try:
            with pytest.raises(flight.FlightError) as refused_flight:
                client.do_get(flight.Ticket(request.SerializeToString())).read_all()
        finally:
            client.close()
        detail = json.loads(refused_flight.value.extra_info)
        assert detail["type"] == "ResourceExhausted" and detail["retry_after"] == HINT

        # The weightserve client turns each into a ResourceExhausted that says it is temporary.
        for transport in TRANSPORTS:
            with (
                connect(srv, transport, retry_seconds=0) as c,
                pytest.raises(ResourceExhausted) as e,
            ):
                c.model("crowd").fetch(prefix="")
            assert e.value.retry_after is not None and e.value.retry_after >= HINT, transport


def test_final_refusals_carry_no_hint_and_are_not_retried(root: Root) -> None:
    with serving(root, Limits(max_names=2, max_request_bytes=1024, retry_after=HINT)) as srv:
        too_long = raw_http(srv, "POST", "/v1/models/crowd/stream", {"revision": "x" * 2000})
        assert too_long.status == 413 and too_long.getheader("retry-after") is None
        names = ["layer.0", "layer.1", "layer.2"]  # 3 > max_names
        too_many = raw_http(srv, "POST", "/v1/models/crowd/stream", {"names": names})
        assert too_many.status == 429 and too_many.getheader("retry-after") is None
        for transport in TRANSPORTS:
            with connect(srv, transport, retry_seconds=30) as client:
                model = client.model("crowd")
                started = time.monotonic()
                with pytest.raises(ResourceExhausted) as e:
                    model.fetch(names)
                assert e.value.retry_after is None, transport
                assert time.monotonic() - started < 5, f"{transport}: a final refusal was retried"


def test_a_busy_server_is_waited_for_within_the_budget_only(busy_server: WeightServer) -> None:
    srv = busy_server
    with all_slots_taken(srv), connect(srv, "http", retry_seconds=1) as client:
        model = client.model("crowd")  # metadata takes no stream slot
        started = time.monotonic()
        with pytest.raises(ResourceExhausted) as e:
            model.fetch(prefix="")
        waited = time.monotonic() - started
    assert 1.0 <= waited < 4.0
    assert "gave up after retrying for 1 s" in str(e.value)
    assert "WEIGHTSERVE_RETRY_SECONDS" in str(e.value)


# ----------------------------------------------------------------------------- crowds


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_crowd_at_a_small_stream_limit_all_succeeds(
    busy_server: WeightServer, root: Root, transport: str
) -> None:
    srv = busy_server
    workers = 6
    start = threading.Barrier(workers)
    waits: list[str] = []
    results: list[object] = [None] * workers

    def worker(i: int) -> None:
        try:
            with connect(srv, transport, on_wait=lambda reason, s: waits.append(reason)) as c:
                model = c.model("crowd", FetchOptions(parallel=1, chunk_bytes=MIB))
                start.wait(timeout=30)
                # A slow reader keeps its stream (and slot) open for a while: the crowd
                # really is larger than the limit at once.
                results[i] = model.fetch(prefix="", on_bytes=lambda n: time.sleep(0.04))
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    failures = [r for r in results if not isinstance(r, dict)]
    assert not failures, failures
    for got in results:
        assert_arrays(got, root.arrays["crowd"])  # type: ignore[arg-type]
    assert "server busy" in waits  # some were refused at first, and waited
    eventually(lambda: srv.state.open_streams == 0, 5, "every slot is released")


def test_cli_pull_waits_for_a_busy_server(
    busy_server: WeightServer, root: Root, tmp_path: Path
) -> None:
    srv = busy_server
    out = tmp_path / "pulled"
    with all_slots_taken(srv) as held:
        done: list[int] = []
        pull = threading.Thread(
            target=lambda: done.append(
                cli_main(["pull", f"{srv.http_url}/v1/models/crowd", "--out", str(out), "--quiet"])
            )
        )
        pull.start()
        time.sleep(0.8)  # refused at least once meanwhile
        assert pull.is_alive()
        held.close()
        pull.join(timeout=60)
    assert done == [0]
    from safetensors.numpy import load_file

    assert_arrays(load_file(out / "model.safetensors"), root.arrays["crowd"])


def test_cli_retry_flag_is_validated(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(SystemExit) as e:
            cli_main(["pull", "http://127.0.0.1:1/v1/models/m", "--retry-seconds", bad])
        assert e.value.code == 2
        assert "--retry-seconds" in capsys.readouterr().err


def test_draining_server_is_waited_for(busy_server: WeightServer, root: Root) -> None:
    """A server shutting down refuses new streams with a hint; the client tries again (behind
    a Service that reaches another replica; here the same server, back in service)."""
    srv = busy_server
    waits: list[str] = []
    with connect(srv, "grpc", on_wait=lambda reason, s: waits.append(reason)) as client:
        model = client.model("crowd")
        draining = srv.state.lifecycle.draining
        draining.set()
        try:
            threading.Timer(0.6, draining.clear).start()
            got = model.fetch(prefix="")
        finally:
            draining.clear()
    assert_arrays(got, root.arrays["crowd"])
    assert "model reloading or server shutting down" in waits


# ----------------------------------------------------------------------------- per-client keys


def stalled_grpc_stream(srv: WeightServer, token: str) -> tuple[grpc.Channel, object]:
    """A gRPC stream of the big model whose client took one message and reads no more."""
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}")
    call = channel.unary_stream(STREAM, request_serializer=pb.TensorRequest.SerializeToString)
    stream = call(
        pb.TensorRequest(model="big", use_prefix=True, chunk_bytes=MIB),
        metadata=[("authorization", f"Bearer {token}")],
        timeout=30,
    )
    next(stream)
    return channel, stream


def test_per_client_limit_is_keyed_by_token(root: Root, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
    limits = Limits(max_streams_per_client=1, retry_after=HINT)
    with serving(root, limits, token_file=str(tokens)) as srv:
        channel, stream = stalled_grpc_stream(srv, TOKEN_A)
        try:
            eventually(lambda: srv.state.open_streams == 1, 5, "token A's stream holds a slot")
            # Token A is at its limit, on every transport...
            for transport in TRANSPORTS:
                with (
                    connect(srv, transport, token=TOKEN_A, retry_seconds=0) as client,
                    pytest.raises(ResourceExhausted) as refused,
                ):
                    client.model("crowd").fetch(prefix="")
                message = str(refused.value)
                assert "token " in message and TOKEN_A not in message, message
                assert refused.value.retry_after is not None
            # ...while token B, from the same address, is a client of its own.
            for transport in TRANSPORTS:
                with connect(srv, transport, token=TOKEN_B, retry_seconds=0) as client:
                    assert_arrays(client.model("crowd").fetch(prefix=""), root.arrays["crowd"])
        finally:
            stream.cancel()  # type: ignore[attr-defined]
            channel.close()
        eventually(lambda: srv.state.open_streams == 0, 5, "the slot is released on cancel")


# ----------------------------------------------------------------------------- server down


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport", ("http", "grpc"))
def test_a_load_waits_for_a_server_that_comes_up_late(root: Root, transport: str) -> None:
    config = ServerConfig(
        str(root.path),
        http_port=free_port(),
        grpc_port=free_port(),
        flight_port=free_port(),
        rescan_seconds=0,
    )
    target = (
        f"http://127.0.0.1:{config.http_port}"
        if transport == "http"
        else f"grpc://127.0.0.1:{config.grpc_port}"
    )
    started: list[WeightServer] = []

    def start_late() -> None:
        time.sleep(1.5)
        started.append(WeightServer(config).start())

    late = threading.Thread(target=start_late)
    late.start()
    waits: list[str] = []
    try:
        with Client(target, retry_seconds=30, on_wait=lambda r, s: waits.append(r)) as client:
            got = client.model("crowd").fetch(prefix="")
    finally:
        late.join(timeout=30)
        for srv in started:
            srv.stop(grace=1.0)
    assert_arrays(got, root.arrays["crowd"])
    assert waits and set(waits) == {"server unreachable"}


@pytest.mark.parametrize("transport", ("http", "grpc"))
def test_a_server_that_never_comes_up_fails_after_the_budget(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    monkeypatch.setenv("WEIGHTSERVE_RETRY_SECONDS", "1")
    port = free_port()  # nothing listens there
    target = f"{'http' if transport == 'http' else 'grpc'}://127.0.0.1:{port}"
    started = time.monotonic()
    with Client(target) as client, pytest.raises(ServerUnreachable) as e:
        client.model("crowd")
    waited = time.monotonic() - started
    assert 1.0 <= waited < 5.0
    assert f"127.0.0.1:{port}" in str(e.value)
    assert "gave up after retrying for 1 s" in str(e.value)


def test_cli_gives_up_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    rc = cli_main(["ls", f"http://127.0.0.1:{port}", "--retry-seconds", "0.5"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "ServerUnreachable" in err and "gave up after retrying for 0.5 s" in err
    assert "Traceback" not in err


def test_retry_budget_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSERVE_RETRY_SECONDS", "2.5")
    with Client("http://127.0.0.1:1") as client:
        assert client.retry_seconds == 2.5
    with Client("http://127.0.0.1:1", retry_seconds=0) as client:
        assert client.retry_seconds == 0
    monkeypatch.setenv("WEIGHTSERVE_RETRY_SECONDS", "a while")
    with pytest.raises(ValueError, match="WEIGHTSERVE_RETRY_SECONDS"):
        Client("http://127.0.0.1:1")
