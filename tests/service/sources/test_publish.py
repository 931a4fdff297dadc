"""Publishing revisions: ``Client.publish`` / ``RemoteModel.publish`` / ``weightserve publish``
against a real server on loopback; the published arrays read back byte-identical on every
transport; a refused or interrupted publish leaves ``main`` where it was and nothing behind;
publish rights; revisions listed, kept across a restart, held and retained."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.support._util import http_request
from tests.support.fixtures_gguf import write_mixed
from tests.support.publishing import leftovers, raw, serve
from weightserve.client import _cli
from weightserve.client._client import Client
from weightserve.client.errors import (
    CheckpointError,
    InvalidRequest,
    PermissionDenied,
    RevisionNotFound,
)
from weightserve.service.server import WeightServer

PLANES = ("http", "grpc", "handoff")


def weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "layers.0.w": rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16),
        "layers.0.b": rng.standard_normal(32).astype(np.float32),
        "embed.q": rng.integers(-128, 127, (16, 8), dtype=np.int8),
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    found = tmp_path / "root"
    found.mkdir()
    return found


@pytest.fixture
def server(root: Path) -> Iterator[WeightServer]:
    with serve(root, allow_publish=True) as srv:
        yield srv


def client_for(srv: WeightServer, plane: str) -> Client:
    if plane == "handoff":
        return Client(f"unix://{srv.config.uds}", data_plane="handoff")
    return Client(srv.grpc_url if plane == "grpc" else srv.http_url, data_plane=plane)


@pytest.mark.parametrize("plane", PLANES)
def test_published_arrays_load_byte_identical_on_every_transport(server, plane: str) -> None:
    published = weights(1)
    with Client(server.http_url) as c:
        revision = c.publish("team/policy", published, message="step 1")
    assert revision.parent is None and revision.message == "step 1"
    with client_for(server, plane) as c:
        model = c.model("team/policy")
        assert model.commit == revision.commit
        got = model.fetch()
        for name, array in published.items():
            assert model.tensors[name].dtype == {"layers.0.w": "bfloat16",
                "layers.0.b": "float32", "embed.q": "int8"}[name]  # fmt: skip
            assert raw(got[name]) == raw(array), name
        pinned = c.model(f"team/policy@{revision.commit}").fetch(["embed.q"])
        assert raw(pinned["embed.q"]) == raw(published["embed.q"])


def test_a_publish_on_a_base_keeps_what_it_does_not_give(server, root: Path) -> None:
    first = weights(1)
    with Client(server.http_url) as c:
        r1 = c.publish("team/policy", first, files={"config.json": b'{"layers": 1}'})
        model = c.model("team/policy")
        changed = {"layers.0.b": first["layers.0.b"] + 1, "head": np.ones(4, np.float32)}
        r2 = model.publish(changed, base=r1.commit, message="step 2")
        assert r2.parent == r1.commit and r2.commit != r1.commit
        now = c.model("team/policy")
        assert now.commit == r2.commit
        got = now.fetch()
        assert raw(got["layers.0.b"]) == raw(changed["layers.0.b"])
        assert raw(got["head"]) == raw(changed["head"])
        assert raw(got["layers.0.w"]) == raw(first["layers.0.w"])
        old = c.model("team/policy", revision=r1.commit).fetch()
        assert set(old) == set(first) and raw(old["layers.0.b"]) == raw(first["layers.0.b"])
        assert [r.commit for r in now.revisions()] == [r2.commit, r1.commit]
    # The revision is ordinary checkpoint files: the reference reader reads it.
    snapshot = root / "models--team--policy" / "snapshots" / r2.commit
    assert set(load_file(snapshot / "model.safetensors")) == {*first, "head"}
    assert (snapshot / "config.json").read_bytes() == b'{"layers": 1}'
    # Side files through the Hub's routes, at main and at the older commit.
    for rev in ("main", r1.commit):
        reply = http_request(server.http_port, f"/team/policy/resolve/{rev}/config.json")
        assert reply.status == 200 and reply.body == b'{"layers": 1}'


def test_a_malformed_publish_is_refused_and_main_stays(server, root: Path) -> None:
    with Client(server.http_url) as c:
        good = c.publish("team/policy", weights(1))
        bad = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"
        with pytest.raises(CheckpointError, match="model.safetensors"):
            c.publish("team/policy", files={"model.safetensors": bad})
        with pytest.raises(RevisionNotFound):
            c.publish("team/policy", weights(2), base="0" * 40)
        assert c.model("team/policy").commit == good.commit
        assert [r.commit for r in c.revisions("team/policy")] == [good.commit]
    assert leftovers(root) == []


def test_a_publish_of_gguf_files_alone_says_a_gguf_file_is_a_model_of_its_own(
    server, root: Path, tmp_path: Path
) -> None:
    write_mixed(tmp_path / "model.gguf")
    with (
        Client(server.http_url) as c,
        pytest.raises(InvalidRequest, match="served as a model of its own"),
    ):
        c.publish("team/quant", files={"model.gguf": tmp_path / "model.gguf"})
    assert leftovers(root) == []


_CUT_OFF_PUBLISHER = textwrap.dedent(
    """
    import http.client, json, sys, time
    port = int(sys.argv[1])
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("POST", "/v1/models/team/policy/-/uploads", body=b"{}")
    upload = json.loads(conn.getresponse().read())["upload"]
    conn.putrequest("PUT", f"/v1/models/team/policy/-/uploads/{upload}/tensors")
    conn.putheader("content-length", str(64 << 20))
    conn.endheaders()
    conn.send(b"\\0" * (8 << 20))
    print("sending", flush=True)
    time.sleep(600)
    """
)


def test_a_publisher_killed_mid_upload_leaves_main_and_nothing_behind(server, root: Path) -> None:
    with Client(server.http_url) as c:
        before = c.publish("team/policy", weights(1)).commit
    child = subprocess.Popen(
        [sys.executable, "-c", _CUT_OFF_PUBLISHER, str(server.http_port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "sending"
        deadline = time.monotonic() + 10
        while not leftovers(root) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leftovers(root), "the upload never reached the server"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.communicate()  # waits, and closes its stdout
    deadline = time.monotonic() + 10
    while leftovers(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(root) == []
    with Client(server.http_url) as c:
        assert c.model("team/policy").commit == before
        assert [r.commit for r in c.revisions("team/policy")] == [before]


def test_publishing_needs_a_publish_grant_or_allow_publish(root: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("reader team/*\ntrainer publish=team/policy\n")
    with serve(root, token_file=str(tokens)) as srv:
        with (
            Client(srv.http_url, token="reader") as c,
            pytest.raises(PermissionDenied, match="publish=PATTERN"),
        ):
            c.publish("team/policy", weights(1))
        with Client(srv.http_url, token="trainer") as c:
            with pytest.raises(PermissionDenied):
                c.publish("team/other", weights(1))
            revision = c.publish("team/policy", weights(1))
            assert c.model("team/policy").commit == revision.commit  # publish implies read
        with Client(srv.http_url, token="reader") as c:
            assert c.model("team/policy").commit == revision.commit
    with (  # no token file, no --allow-publish
        serve(root) as srv,
        Client(srv.http_url) as c,
        pytest.raises(PermissionDenied, match="--allow-publish"),
    ):
        c.publish("team/policy", weights(2))
    assert leftovers(root) == []


def test_revisions_survive_a_restart_and_retention_keeps_held_ones(root: Path) -> None:
    with serve(root, allow_publish=True, keep_revisions=2) as srv, Client(srv.http_url) as c:
        first = c.publish("team/policy", weights(1), message="1")
        model = c.model("team/policy")
        model.hold(first.commit, 60)
        commits = [first.commit]
        for step in (2, 3, 4):
            commits.append(model.publish(weights(step), message=str(step)).commit)
        listed = [r.commit for r in model.revisions()]
        # main and the one before it, and the held first one; the second was removed.
        assert listed == [commits[3], commits[2], commits[0]]
        with pytest.raises(RevisionNotFound):
            c.model("team/policy", revision=commits[1])
        model.hold(first.commit, 0)
        model.publish(weights(5))
        assert first.commit not in [r.commit for r in model.revisions()]
        kept = model.revisions()
    with serve(root, allow_publish=True, keep_revisions=2) as srv, Client(srv.http_url) as c:
        assert c.revisions("team/policy") == kept
        assert c.model("team/policy").commit == kept[0].commit


def test_the_command_line_publishes_a_directory(server, tmp_path: Path, capsys) -> None:
    source = tmp_path / "checkpoint"
    source.mkdir()
    save_file(weights(3), str(source / "model.safetensors"))
    (source / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    url = f"{server.http_url}/v1/models/team/from-dir"
    assert _cli.main(["publish", url, str(source), "-m", "from disk", "--quiet"]) == 0
    commit = capsys.readouterr().out.strip()
    with Client(server.http_url) as c:
        model = c.model("team/from-dir")
        assert model.commit == commit
        assert {f.name for f in model.files()} == {"model.safetensors", "tokenizer.json"}
        assert c.revisions("team/from-dir")[0].message == "from disk"
    shutil.rmtree(source)


def test_retention_keeps_a_revision_while_it_is_streamed(root: Path) -> None:
    big = {"w": np.zeros(8 << 20, dtype=np.float32)}  # 32 MiB: more than the socket buffers
    with serve(root, allow_publish=True, keep_revisions=1) as srv, Client(srv.http_url) as c:
        first = c.publish("team/policy", big)
        conn = http.client.HTTPConnection("127.0.0.1", srv.http_port)
        conn.request("GET", f"/v1/models/team/policy@{first.commit}/-/stream?prefix=")
        reply = conn.getresponse()
        assert reply.status == 200 and reply.read(1024)  # the stream is open, not drained
        second = c.publish("team/policy", weights(2))
        assert [r.commit for r in c.revisions("team/policy")] == [second.commit, first.commit]
        conn.close()
        deadline = time.monotonic() + 10
        while srv.state.open_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        third = c.publish("team/policy", weights(3))
        assert [r.commit for r in c.revisions("team/policy")] == [third.commit]
