"""An upload against a careless or hostile publisher, through the raw publish routes on a
real server: a revision never changes once its commit answers, ``--max-upload-bytes`` holds
for the whole upload (parts sent before, beside and after one another), stalled bodies and
idle uploads expire, and received files are durable before ``refs/main`` names them."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from threading import Thread

import numpy as np
import pytest

from tests.support import publishing as pub
from tests.support._util import Reply, http_request
from tests.support.publishing import SlowPart, begin_upload, commit_upload, leftovers, put_part
from weightserve.client._client import Client
from weightserve.service.server import WeightServer

MODEL = "team/policy"
MiB = 1 << 20


def tensors(seed: int, elements: int = 1024) -> bytes:
    rng = np.random.default_rng(seed)
    return pub.safetensors_bytes({"w": rng.standard_normal(elements).astype(np.float32)})


@pytest.fixture
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("root")


@pytest.fixture
def server(root: Path) -> Iterator[WeightServer]:
    with pub.serve(root, allow_publish=True, upload_body_timeout=30) as srv:
        yield srv


def wait_until_gone(root: Path) -> list[str]:
    deadline = time.monotonic() + 15
    while leftovers(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    return leftovers(root)


def arrived(root: Path, name: str) -> None:
    """Wait until an upload's file ``name`` is being written under the root."""
    deadline = time.monotonic() + 15
    while not list(root.glob(f"*/snapshots/.incoming-*/model/{name}")):
        assert time.monotonic() < deadline, f"{name} never reached the server"
        time.sleep(0.02)


def test_a_commit_waits_for_a_file_still_arriving_and_its_revision_never_changes(
    server, root: Path
) -> None:
    port = server.http_port
    upload = begin_upload(port, MODEL)
    assert put_part(port, MODEL, upload, "tensors", tensors(1)).status == 200
    config = b'{"layers": 1, "padding": "' + b"x" * 200_000 + b'"}'
    slow = SlowPart(port, MODEL, upload, "files/config.json", config, first=1000)
    arrived(root, "config.json")
    committed: list[Reply] = []
    committing = Thread(target=lambda: committed.append(commit_upload(port, MODEL, upload)))
    committing.start()
    try:
        committing.join(1.0)
        assert not committed, "the commit answered while a file of its upload was arriving"
        late = http_request(port, f"/v1/models/{MODEL}/-/uploads/{upload}/files/late.json", "PUT")
        assert late.status == 409 and "late.json" in late.error()[1]
        assert slow.finish().status == 200
    finally:
        slow.close()
        committing.join(30)
    assert committed and committed[0].status == 201, committed[0].body
    commit = committed[0].json()["commit"]
    # Bytes after the commit are refused: the upload is gone.
    after = put_part(port, MODEL, upload, "files/config.json", b"{}")
    assert after.status == 404
    with Client(server.http_url) as c:
        model = c.model(MODEL)
        assert model.commit == commit
        listed = {f.name: f for f in model.files()}
    served = http_request(port, f"/{MODEL}/resolve/{commit}/config.json")
    assert served.status == 200 and served.body == config
    assert served.headers["etag"].strip('"') == listed["config.json"].etag
    snapshot = root / "models--team--policy" / "snapshots" / commit
    assert (snapshot / "config.json").read_bytes() == config
    assert leftovers(root) == []


def test_a_commit_waiting_on_a_stalled_file_is_refused_and_main_stays(root: Path) -> None:
    with pub.serve(root, allow_publish=True, upload_body_timeout=1) as srv:
        port = srv.http_port
        with Client(srv.http_url) as c:
            before = c.publish(MODEL, {"w": np.ones(8, np.float32)}).commit
        upload = begin_upload(port, MODEL)
        assert put_part(port, MODEL, upload, "tensors", tensors(2)).status == 200
        slow = SlowPart(port, MODEL, upload, "files/config.json", b"{}" * 50_000, first=10)
        try:
            arrived(root, "config.json")  # its body is being received before the commit
            refused = commit_upload(port, MODEL, upload)
            assert refused.status == 409, refused.body
            kind, message = refused.error()
            assert kind == "PublishConflict" and "discarded" in message
            stalled = slow.answer()
            assert stalled.status == 400 and "--upload-body-timeout" in stalled.error()[1]
            assert stalled.headers.get("connection") == "close"
        finally:
            slow.close()
        with Client(srv.http_url) as c:
            assert c.model(MODEL).commit == before
    assert wait_until_gone(root) == []


def test_a_stalled_file_body_expires_and_its_upload_is_removed(root: Path) -> None:
    with pub.serve(root, allow_publish=True, upload_body_timeout=1) as srv:
        upload = begin_upload(srv.http_port, MODEL)
        slow = SlowPart(srv.http_port, MODEL, upload, "tensors", tensors(3, 1 << 16), first=100)
        try:
            assert slow.answered(within=20), "a stalled body was never cut off"
            reply = slow.answer()
        finally:
            slow.close()
        assert reply.status == 400 and "nothing arrived for 1 s" in reply.error()[1]
        assert wait_until_gone(root) == []
        gone = put_part(srv.http_port, MODEL, upload, "tensors", tensors(3))
        assert gone.status == 404


def test_an_idle_upload_is_removed_without_any_other_request(root: Path) -> None:
    with pub.serve(root, allow_publish=True, upload_idle_timeout=2) as srv:
        upload = begin_upload(srv.http_port, MODEL)
        assert put_part(srv.http_port, MODEL, upload, "tensors", tensors(4)).status == 200
        assert leftovers(root)
        assert wait_until_gone(root) == []
        gone = commit_upload(srv.http_port, MODEL, upload)
        assert gone.status == 404 and "idle" in gone.error()[1]


def test_the_upload_limit_counts_tensors_sent_before_a_file(root: Path) -> None:
    with pub.serve(root, allow_publish=True, max_upload_bytes=4 * MiB) as srv:
        port = srv.http_port
        upload = begin_upload(port, MODEL)
        assert put_part(port, MODEL, upload, "tensors", tensors(5, 3 * MiB // 4)).status == 200
        over = put_part(port, MODEL, upload, "files/extra.bin", b"\0" * (3 * MiB))
        assert over.status == 429, over.body
        assert "--max-upload-bytes" in over.error()[1]
        record = commit_upload(port, MODEL, upload)  # refused before any byte: the rest stays
        assert record.status == 201 and record.json()["bytes"] <= 4 * MiB
    assert leftovers(root) == []


def test_parts_sent_side_by_side_cannot_hold_more_than_the_limit(root: Path) -> None:
    with pub.serve(root, allow_publish=True, max_upload_bytes=4 * MiB) as srv:
        port = srv.http_port
        upload = begin_upload(port, MODEL)
        parts = [
            SlowPart(port, MODEL, upload, f"files/part{i}.bin", b"\1" * (2 * MiB), first=1024)
            for i in range(6)
        ]
        try:
            refused = [p for p in parts if p.answered(within=5)]
            assert len(refused) == 4  # two reserve the whole limit; the others wait for none
            for part in refused:
                reply = part.answer()
                assert reply.status == 429 and "--max-upload-bytes" in reply.error()[1]
            for part in parts:
                if part not in refused:
                    assert part.finish().status == 200
        finally:
            for part in parts:
                part.close()
        assert put_part(port, MODEL, upload, "tensors", tensors(6)).status == 429
        assert put_part(port, MODEL, upload, "files/part0.bin", b"").status == 200
        assert put_part(port, MODEL, upload, "tensors", tensors(6)).status == 200
        record = commit_upload(port, MODEL, upload)
        assert record.status == 201 and record.json()["bytes"] <= 4 * MiB


def test_received_files_are_synced_before_refs_main_names_them(
    server, root: Path, monkeypatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the system call still runs; which file it was is noted
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    port = server.http_port
    upload = begin_upload(port, MODEL)
    for name in ("config.json", "sub/tokenizer.json"):
        assert put_part(port, MODEL, upload, f"files/{name}", b"{}").status == 200
    assert put_part(port, MODEL, upload, "tensors", tensors(7)).status == 200
    reply = commit_upload(port, MODEL, upload)
    assert reply.status == 201
    commit = reply.json()["commit"]
    refs = root / "models--team--policy" / "refs"
    main_synced = next(i for i, p in enumerate(synced) if Path(p).parent == refs)
    before_main = synced[:main_synced]
    incoming = next(Path(p) for p in before_main if "/.incoming-" in p)
    staged = incoming.parents[len(incoming.relative_to(root).parts) - 4]
    for name in ("config.json", "sub/tokenizer.json", "tensors.safetensors"):
        where = staged / ("model/" + name if name != "tensors.safetensors" else name)
        assert str(where) in before_main, name
    snapshots = root / "models--team--policy" / "snapshots"
    assert str(snapshots) in before_main  # the snapshot's rename is durable
    assert str(staged / "model" / "sub") in before_main  # and the entries inside it
    assert (snapshots / commit / "sub" / "tokenizer.json").read_bytes() == b"{}"


def test_a_revision_of_hundreds_of_small_files_is_served_whole(root: Path, tmp_path) -> None:
    files = {f"side/{i:03d}.json": b'{"i": %d}' % i for i in range(300)}
    cache = tmp_path / "cache"  # file digests kept in their table, as `serve` keeps them
    with pub.serve(root, allow_publish=True, cache_dir=str(cache)) as srv:
        with Client(srv.http_url) as c:
            revision = c.publish(MODEL, {"w": np.ones(16, np.float32)}, files=files)
            again = c.publish(MODEL, {"w": np.zeros(16, np.float32)}, files=files)
            model = c.model(MODEL)
            assert model.commit == again.commit != revision.commit
            listed = {f.name: f for f in model.files()}
        assert set(listed) == {*files, "model.safetensors"}
        for name in ("side/000.json", "side/150.json", "side/299.json"):
            served = http_request(srv.http_port, f"/{MODEL}/resolve/{again.commit}/{name}")
            assert served.body == files[name]
            assert served.headers["etag"].strip('"') == listed[name].etag
    assert leftovers(root) == []
