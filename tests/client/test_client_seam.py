"""The client's one transport seam: nothing above ``client/transports/`` asks which transport
it holds or touches http.client; a control verb a transport does not carry is refused with
``WrongTransport`` naming what it needs; http.client's and the socket's errors come up as
weightserve errors; ``weightserve.client.remote`` gives a relay (a node cache's upstream
origin) what it reads of a server through public names."""

from __future__ import annotations

import ast
import http.client
import json
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.paths import REPO
from weightserve.client import Client
from weightserve.client.errors import ServerUnreachable, WrongTransport
from weightserve.client.remote import connect, iter_updates
from weightserve.client.transports.base import CONTROL_VERBS, Connection, carries
from weightserve.client.transports.grpc import GrpcTransport
from weightserve.client.transports.http import HttpTransport
from weightserve.client.wire.delta import WHOLE, DeltaHeader
from weightserve.client.wire.routes import ServerAddress
from weightserve.service.server import ServerConfig, WeightServer

CLIENT = REPO / "client"
TRANSPORTS = CLIENT / "transports"


def _client_modules_above_the_seam() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(CLIENT.rglob("*.py")):
        if TRANSPORTS in path.parents:
            continue
        yield path, ast.parse(path.read_text(), str(path))


def _names(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [n for e in node.elts for n in _names(e)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def test_the_walk_sees_the_client() -> None:
    """A guard for the two tests below, which would pass on an empty walk."""
    found = {p.relative_to(CLIENT).as_posix() for p, _ in _client_modules_above_the_seam()}
    assert {"_client.py", "_publish.py", "_update.py", "_pull_since.py"} <= found
    assert not any(name.startswith("transports/") for name in found)


def test_no_transport_is_asked_for_by_its_class_above_the_seam() -> None:
    transports = {"HttpTransport", "GrpcTransport", "HandoffClient", "FlightPool"}
    found = []
    for path, tree in _client_modules_above_the_seam():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
                and set(_names(node.args[1])) & transports
            ):
                found.append(f"{path.relative_to(CLIENT)}:{node.lineno}")
    assert not found, "a verb the seam lacks, asked for by class: " + ", ".join(found)


def test_http_client_is_imported_and_caught_only_in_the_transports() -> None:
    found = []
    for path, tree in _client_modules_above_the_seam():
        for node in ast.walk(tree):
            hit = (
                (isinstance(node, ast.Import) and any(a.name == "http.client" for a in node.names))
                or (
                    isinstance(node, ast.ImportFrom)
                    and (
                        node.module == "http.client"
                        or (node.module == "http" and any(a.name == "client" for a in node.names))
                    )
                )
                or (
                    isinstance(node, ast.Attribute)
                    and node.attr == "client"
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "http"
                )
            )
            if hit:
                found.append(f"{path.relative_to(CLIENT)}:{node.lineno}")
    assert not found, "http.client above the transports: " + ", ".join(found)


def test_each_transport_says_which_control_verbs_it_carries() -> None:
    http = HttpTransport(ServerAddress("http", False, "127.0.0.1", 9))
    grpc = GrpcTransport(ServerAddress("grpc", False, "127.0.0.1", 9))
    try:
        assert all(carries(http, verb) for verb in CONTROL_VERBS)
        assert {v for v in CONTROL_VERBS if carries(grpc, v)} == {
            "list_revisions",
            "watch_revisions",
        }
        # Refused before any byte travels: the port (9, discard) is never asked.
        with pytest.raises(WrongTransport) as caught:
            grpc.start_upload("m", None, "", {})
        assert str(caught.value) == (
            "publishing needs an http:// server address (the server's HTTP port); "
            "grpc://127.0.0.1:9 is grpc, which does not carry it"
        )
        with pytest.raises(WrongTransport, match="^a delta update needs an http://"):
            grpc.open_delta("m", "a" * 40, None)
        with pytest.raises(WrongTransport, match="^holding a revision needs an http://"):
            grpc.hold("m", "a" * 40, 10)
        with pytest.raises(WrongTransport, match="^an NDJSON watch needs an http://"):
            grpc.open_watch(None, None)
        with pytest.raises(WrongTransport, match="^the size of a delta update needs an http://"):
            grpc.delta_size("m", "a" * 40, None)
        with pytest.raises(WrongTransport, match="^joining a revision's swarm needs an http://"):
            grpc.join_swarm("m", {})
    finally:
        http.close()
        grpc.close()


def _serve(root: Path) -> WeightServer:
    sockets = tempfile.mkdtemp(prefix="ws-")  # a Unix socket path must be short
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, uds=f"{sockets}/ws.sock",
        rescan_seconds=0, watch=False, allow_publish=True,
    )  # fmt: skip
    return WeightServer(config)


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal((32, 16)).astype(np.float32),
        "b": rng.integers(-128, 127, 64, dtype=np.int8),
    }


def test_over_grpc_publishing_holds_and_updates_are_refused_and_revisions_listed(
    tmp_path: Path,
) -> None:
    with _serve(tmp_path) as srv:
        with Client(srv.http_url) as c:
            first = c.publish("team/m", _weights(1))
        with Client(srv.grpc_url) as c:
            with pytest.raises(WrongTransport, match="^publishing needs an http://"):
                c.publish("team/m", _weights(2))
            model = c.model("team/m")
            assert [r.commit for r in model.revisions()] == [first.commit]
            with pytest.raises(WrongTransport, match="^holding a revision needs"):
                model.hold(first.commit, 10)
            state = {k: v.copy() for k, v in _weights(1).items()}
            with pytest.raises(WrongTransport, match="^a delta update needs"):
                model.update(state, since=first.commit)
            with pytest.raises(WrongTransport, match="^a delta update needs"):
                model.iter_updates(since=first.commit)


def test_a_relay_reads_a_server_through_public_names(tmp_path: Path) -> None:
    """What a node cache's upstream origin does: list, read a file's range, watch every
    model's lines, read the delta stream — with ``weightserve.client.remote`` alone."""
    with _serve(tmp_path) as srv:
        with Client(srv.http_url) as c:
            first = c.publish("team/m", _weights(1))
        server = connect(srv.http_url)
        try:
            assert "team/m" in [m["id"] for m in server.list_models()["models"]]
            files = server.list_files("team/m")["files"]
            source = server.open_file("team/m", files[0]["name"], 0, 8)
            try:
                assert source.etag == files[0]["etag"] and source.length == 8
            finally:
                source.close()
            watch = server.open_watch(None, None)
            try:
                hello = json.loads(watch.readline(silence=10))
                assert hello["event"] == "hello", hello
                with Client(srv.http_url) as c:
                    second = c.publish("team/m", _weights(2), base=first.commit)
                while (event := json.loads(watch.readline(silence=10)))["event"] != "revision":
                    pass
                assert event["commit"] == second.commit
            finally:
                watch.close()
            target, updates = iter_updates(server, "team/m", first.commit)
            assert (target.commit, target.base) == (second.commit, first.commit)
            assert sorted(u.name for u in updates) == ["a", "b"]
        finally:
            server.close()


class _OneAnswer:
    """A server that answers one request with ``head`` and ``body`` and then, after
    ``hang`` seconds, closes: an answer cut short or gone silent."""

    def __init__(self, head: bytes, body: bytes, hang: float = 0.0) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.head, self.body, self.hang = head, body, hang
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._answer, daemon=True)
        self.thread.start()

    def _answer(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(self.head + self.body)
            self.done.wait(self.hang)

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize("cut", ["short", "silent"])
def test_a_line_stream_cut_or_silent_is_server_unreachable(cut: str) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
    if cut == "short":  # a chunk announced longer than what comes before the close
        answer = _OneAnswer(head + b"transfer-encoding: chunked\r\n\r\n", b'40\r\n{"event"')
    else:  # headers, a first line, then nothing for longer than the silence allowed
        answer = _OneAnswer(head + b"\r\n", b'{"event": "hello"}\n', hang=30)
    transport = HttpTransport(
        ServerAddress("http", False, "127.0.0.1", answer.port), Connection(timeout=5)
    )
    try:
        lines = transport.open_watch("m", None)
        try:
            with pytest.raises(ServerUnreachable, match="the answer was cut off") as caught:
                while lines.readline(silence=0.3):
                    pass
        finally:
            lines.close()
        # The foreign error is kept as the cause, for whoever debugs the connection.
        assert isinstance(caught.value.__cause__, OSError | http.client.HTTPException)
    finally:
        transport.close()
        answer.close()


def test_a_delta_stream_that_ends_inside_a_payload_is_server_unreachable() -> None:
    header = DeltaHeader(kind=WHOLE, name="w", dtype="uint8", shape=[16], nbytes=16)
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\nconnection: close\r\n"
        b"x-weightserve-commit: " + b"b" * 40 + b"\r\n\r\n"
    )
    body = json.dumps(header.to_json()).encode() + b"\n" + bytes(10)  # 6 bytes short
    answer = _OneAnswer(head, body)
    transport = HttpTransport(
        ServerAddress("http", False, "127.0.0.1", answer.port), Connection(timeout=5)
    )
    try:
        target, updates = iter_updates(transport, "m", "a" * 40)
        assert target.commit == "b" * 40
        with pytest.raises(ServerUnreachable, match="the update of 'm' was cut off"):
            list(updates)
    finally:
        transport.close()
        answer.close()


def test_no_client_module_over_800_lines_and_no_class_over_450() -> None:
    """Generated stubs aside: a module or class past these has more than one concern."""
    too_long = []
    for path in sorted(CLIENT.rglob("*.py")):
        if CLIENT / "wire" / "proto" in path.parents:
            continue
        text = path.read_text()
        if text.count("\n") > 800:
            too_long.append(f"{path.relative_to(CLIENT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > 450:
                    too_long.append(f"{path.relative_to(CLIENT)}:{node.name}: {lines} lines")
    assert not too_long, too_long
