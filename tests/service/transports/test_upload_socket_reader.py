"""A large upload's body is read straight from the connection's socket on a thread of its
own (service/transports/http/body_reader.py), not in uvicorn's 256 KiB messages: the bytes
land whole, a publisher that stalls or goes away mid-body is cut off with the upload
discarded, the connection closes after the answer (its parser never saw those bytes), and
past ``BODY_READERS`` uploads at once the messages carry the body again."""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.support import publishing as pub
from tests.support.publishing import SlowPart, begin_upload, commit_upload, leftovers, put_part
from weightserve.client._client import Client
from weightserve.service.server import WeightServer
from weightserve.service.transports.http import streaming
from weightserve.service.transports.http.body_reader import RAW_BODY_MIN_BYTES

MODEL = "team/big"
MiB = 1 << 20


@pytest.fixture
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("root")


@pytest.fixture
def server(root: Path) -> Iterator[WeightServer]:
    with pub.serve(root, allow_publish=True, upload_body_timeout=2) as srv:
        yield srv


def socket_bytes(server: WeightServer) -> int:
    app = server.http_app
    assert app is not None
    return app.socket_body_bytes


def wait_for(condition, what: str, seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_large_publish_lands_whole_through_the_socket_reader(server, root: Path) -> None:
    rng = np.random.default_rng(7)
    tensors = {f"w{i}": rng.standard_normal(3 * MiB // 4, dtype=np.float32) for i in range(8)}
    with Client(server.http_url) as c:
        commit = c.publish(MODEL, tensors).commit
        # Most of the 24 MiB came from the socket (uvicorn may have buffered the first pieces).
        wait_for(lambda: socket_bytes(server) > 20 * MiB, "the socket reader did not engage")
        # The server answers other requests as before (the upload's connection was closed).
        assert c.model(MODEL).commit == commit
        served = c.model(MODEL).fetch()
    stored = load_file(root / "models--team--big" / "snapshots" / commit / "model.safetensors")
    for name, value in tensors.items():
        assert stored[name].tobytes() == value.tobytes()
        assert np.asarray(served[name]).tobytes() == value.tobytes()


def test_the_connection_closes_after_a_body_read_from_the_socket(server) -> None:
    port = server.http_port
    upload = begin_upload(port, MODEL)
    body = pub.safetensors_bytes({"w": np.arange(RAW_BODY_MIN_BYTES, dtype=np.float32)})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("PUT", f"/v1/models/{MODEL}/-/uploads/{upload}/tensors", body=body)
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()
        assert reply.getheader("connection") == "close"
        assert reply.read()
    finally:
        conn.close()
    assert socket_bytes(server) > 0
    assert commit_upload(port, MODEL, upload).status == 201


def test_a_body_that_stalls_on_the_socket_is_cut_and_its_upload_removed(server, root) -> None:
    port = server.http_port
    upload = begin_upload(port, MODEL)
    data = pub.safetensors_bytes({"w": np.ones(2 * MiB, np.float32)})
    slow = SlowPart(port, MODEL, upload, "tensors", data, first=256 << 10)
    try:
        # More after the reader took over, then nothing.
        wait_for(lambda: list(root.glob("*/snapshots/.incoming-*")), "the upload never began")
        slow.conn.send(data[256 << 10 : 3 * MiB])
        slow.sent = 3 * MiB
        assert slow.answered(within=20), "a stalled body was never cut off"
        reply = slow.answer()
    finally:
        slow.close()
    assert reply.status == 400 and "nothing arrived for 2 s" in reply.error()[1]
    assert reply.headers.get("connection") == "close"
    assert socket_bytes(server) > 0
    wait_for(lambda: not leftovers(root), "the stalled upload was left behind")
    assert put_part(port, MODEL, upload, "tensors", data).status == 404


def test_a_publisher_gone_mid_body_discards_the_upload(server, root: Path) -> None:
    port = server.http_port
    upload = begin_upload(port, MODEL)
    data = pub.safetensors_bytes({"w": np.ones(2 * MiB, np.float32)})
    slow = SlowPart(port, MODEL, upload, "tensors", data, first=3 * MiB)
    wait_for(lambda: socket_bytes(server) > 0 or leftovers(root), "the upload never began")
    slow.close()
    wait_for(lambda: not leftovers(root), "the cut-off upload was left behind")
    assert put_part(port, MODEL, upload, "tensors", data).status == 404
    with Client(server.http_url) as c:  # the server goes on serving
        assert c.publish(MODEL, {"w": np.zeros(4, np.float32)}).commit


def test_past_the_reading_threads_the_messages_carry_the_body(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streaming, "BODY_READERS", 1)
    with pub.serve(root, allow_publish=True, upload_body_timeout=30) as srv:
        port = srv.http_port
        upload = begin_upload(port, MODEL)
        first = pub.safetensors_bytes({"a": np.full(MiB, 1, np.float32)})
        second = pub.safetensors_bytes({"b": np.full(MiB, 2, np.float32)})
        holding = SlowPart(port, MODEL, upload, "files/a.safetensors", first, first=512 << 10)
        try:
            wait_for(lambda: list(root.glob("*/snapshots/.incoming-*/model/a.safetensors")),
                     "the first part never began")  # fmt: skip
            # The only reading thread is taken: this part goes through the ASGI messages.
            assert put_part(port, MODEL, upload, "files/b.safetensors", second).status == 200
            assert srv.http_app is not None and srv.http_app.socket_body_bytes == 0
            assert holding.finish().status == 200
        finally:
            holding.close()
        assert srv.http_app.socket_body_bytes > 0
        record = commit_upload(port, MODEL, upload)
        assert record.status == 201, record.body
        snapshot = root / "models--team--big" / "snapshots" / record.json()["commit"]
        assert (snapshot / "a.safetensors").read_bytes() == first
        assert (snapshot / "b.safetensors").read_bytes() == second


@pytest.mark.parametrize("path", ["socket", "messages"])
def test_each_large_file_is_hashed_as_it_arrives_and_not_read_again_at_commit(
    path: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest the commit names a file of 1 MiB or more by is taken as its bytes pass,
    whichever path carried them (the socket, or uvicorn's messages when no reading thread is
    free): the commit hashes none of them again, and each digest is its file's."""
    from weightserve.client.wire.digests import file_digest
    from weightserve.service.sources.revisions import content

    hashed: list[str] = []
    hash_file = content.hash_file

    def counted(file: Path, stamp):  # type: ignore[no-untyped-def]
        hashed.append(file.name)
        return hash_file(file, stamp)

    monkeypatch.setattr(content, "hash_file", counted)
    if path == "messages":
        monkeypatch.setattr(streaming, "BODY_READERS", 0)
    weights = pub.safetensors_bytes({"w": np.arange(2 * MiB, dtype=np.float32)})
    extra = np.random.default_rng(3).bytes(3 * MiB // 2)
    with pub.serve(root, allow_publish=True) as srv:
        port = srv.http_port
        upload = begin_upload(port, MODEL)
        assert put_part(port, MODEL, upload, "tensors", weights).status == 200
        assert put_part(port, MODEL, upload, "files/extra.bin", extra).status == 200
        record = commit_upload(port, MODEL, upload)
        assert record.status == 201, record.body
        assert (socket_bytes(srv) > 0) == (path == "socket")
        assert hashed == [], f"the commit read {hashed} again"
        snapshot = root / "models--team--big" / "snapshots" / record.json()["commit"]
        with Client(srv.http_url) as c:
            listed = {f.name: f.etag for f in c.model(MODEL).files()}
    for name in ("model.safetensors", "extra.bin"):
        assert listed[name] == file_digest(snapshot / name), name
    assert (snapshot / "extra.bin").read_bytes() == extra
