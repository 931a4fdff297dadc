"""Publishes a server refuses, or answers in a way the publisher can act on, through real
publishes on loopback: concurrent publishers on one base (compare-and-set on ``main``), a
base removed by retention, names the file system or the catalog cannot take, weights only
in a sub-folder, the same bytes published again. None is a 500, and no message names the
server's staging directory."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support._util import http_request
from tests.support.publishing import (
    begin_upload,
    commit_upload,
    leftovers,
    put_part,
    safetensors_bytes,
    serve,
)
from weightserve.client import _cli
from weightserve.client._client import Client
from weightserve.client._publish import Publication, _patch_stream, publish
from weightserve.client.errors import InvalidRequest, MainMoved
from weightserve.service.server import WeightServer

MODEL = "team/policy"


def weights(seed: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(seed).standard_normal(256).astype(np.float32)}


@pytest.fixture
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("root")


@pytest.fixture
def server(root: Path) -> Iterator[WeightServer]:
    with serve(root, allow_publish=True) as srv:
        yield srv


def test_the_second_of_two_publishers_on_one_base_is_told_main_moved(server, root) -> None:
    port = server.http_port
    with Client(server.http_url) as c:
        base = c.publish(MODEL, weights(1)).commit
        other: list[str] = []

        def publish_meanwhile(sent: int) -> None:
            """While this publisher's bytes travel, another commits on the same base."""
            if other:
                return
            upload = begin_upload(port, MODEL, {"base": base})
            assert (
                put_part(port, MODEL, upload, "tensors", safetensors_bytes(weights(2))).status
                == 200
            )
            reply = commit_upload(port, MODEL, upload)
            assert reply.status == 201
            other.append(reply.json()["commit"])

        with pytest.raises(MainMoved, match="moved to") as moved:
            publish(c.transport, Publication(MODEL, weights(3), base=base), publish_meanwhile)
        assert other and other[0][:16] in str(moved.value)
        assert c.model(MODEL).commit == other[0]  # the first commit stays main
        assert [r.commit for r in c.revisions(MODEL)] == [other[0], base]
    assert leftovers(root) == []


def test_a_base_removed_by_retention_during_an_upload_is_a_conflict(root: Path) -> None:
    with serve(root, allow_publish=True, keep_revisions=1) as srv, Client(srv.http_url) as c:
        port = srv.http_port
        base = c.publish(MODEL, weights(1)).commit
        upload = begin_upload(port, MODEL, {"base": base})
        assert put_part(port, MODEL, upload, "tensors", safetensors_bytes(weights(2))).status == 200
        newer = c.publish(MODEL, weights(3)).commit  # retention removes the base
        assert [r.commit for r in c.revisions(MODEL)] == [newer]
        refused = commit_upload(port, MODEL, upload)
        assert refused.status == 409, refused.body
        kind, message = refused.error()
        assert kind == "MainMoved" and newer in message
        assert c.model(MODEL).commit == newer
    assert leftovers(root) == []


def test_a_patch_onto_a_base_retention_removed_is_a_conflict(root: Path) -> None:
    """The patch arrives after the base it patches was removed: 409, never a 500."""
    with serve(root, allow_publish=True, keep_revisions=1) as srv, Client(srv.http_url) as c:
        port = srv.http_port
        first = weights(1)
        base = c.publish(MODEL, first).commit
        upload = begin_upload(port, MODEL, {"base": base})
        newer = c.publish(MODEL, weights(3)).commit  # retention removes the base
        changed = {name: np.array(value, copy=True) for name, value in first.items()}
        name = next(iter(changed))
        changed[name].reshape(-1)[:3] += 1
        _, chunks = _patch_stream(changed, first)
        refused = put_part(port, MODEL, upload, "patch", b"".join(bytes(c) for c in chunks))
        assert refused.status == 409, refused.body
        assert "was removed" in refused.error()[1]
        assert c.model(MODEL).commit == newer
    assert leftovers(root) == []


@pytest.mark.parametrize(
    "model",
    ["team/a:b", "team/a\nb", "team/" + "x" * 250, "team/" + "é" * 124],
    ids=["colon", "newline", "over-255-bytes", "over-255-utf8-bytes"],
)
def test_a_model_id_the_catalog_would_not_serve_is_refused_at_publish(
    server, root: Path, model: str
) -> None:
    with Client(server.http_url) as c, pytest.raises(InvalidRequest) as refused:
        c.publish(model, weights(1))
    message = str(refused.value)
    assert "cannot be published" in message or "too long to publish" in message
    assert str(root) not in message
    assert leftovers(root) == [] and not any(root.iterdir())


@pytest.mark.parametrize(
    ("names", "refused"),
    [
        (["a%00b.json"], "control character"),
        (["x" * 256 + ".json"], "over the file system's 255 bytes"),
        (["a/" * 1500 + "b.json"], "over 1024 bytes with its folders"),
        (["a.json", "a.json/sub"], "both a file and the folder"),
        (["a/sub.json", "a"], "both a file and the folder"),
        (["model.safetensors/x"], "both a file and the folder"),
    ],
    ids=[
        "nul",
        "over-255-bytes",
        "deeper-than-a-path",
        "file-then-folder",
        "folder-then-file",
        "a-base-file",
    ],
)
def test_a_file_name_the_file_system_cannot_hold_is_a_400(
    server, root: Path, names: list[str], refused: str
) -> None:
    port = server.http_port
    with Client(server.http_url) as c:
        base = c.publish(MODEL, weights(1)).commit
    upload = begin_upload(port, MODEL, {"base": base})
    *accepted, last = names
    for name in accepted:
        assert put_part(port, MODEL, upload, f"files/{name}", b"{}").status == 200
    reply = put_part(port, MODEL, upload, f"files/{last}", b"{}")
    assert reply.status == 400, reply.body
    assert refused in reply.error()[1] and str(root) not in reply.error()[1]
    assert commit_upload(port, MODEL, upload).status in (201, 409)  # the upload goes on


def test_refusals_of_the_upload_name_no_server_path(server, root: Path) -> None:
    port = server.http_port
    answers = []
    bad = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"
    for part in ("tensors", "files/model.safetensors", "files/sub/model.safetensors"):
        upload = begin_upload(port, MODEL)
        assert put_part(port, MODEL, upload, part, bad).status == 200
        answers.append(commit_upload(port, MODEL, upload))
    with Client(server.http_url) as c:
        base = c.publish(MODEL, weights(1)).commit
    upload = begin_upload(port, MODEL, {"base": base})
    answers.append(put_part(port, MODEL, upload, "patch", b'{"name": 1}\n'))
    upload = begin_upload(port, MODEL, {"base": base})
    assert put_part(port, MODEL, upload, "tensors", bad).status == 200
    answers.append(commit_upload(port, MODEL, upload))
    for reply in answers:
        assert 400 <= reply.status < 500, reply.body
        assert str(root) not in reply.error()[1] and ".incoming-" not in reply.error()[1]
    assert leftovers(root) == []


def test_weights_only_in_a_sub_folder_are_refused_naming_it_not_as_gguf(
    server, root: Path, tmp_path: Path
) -> None:
    source = tmp_path / "checkpoint"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "model.safetensors").write_bytes(safetensors_bytes(weights(1)))
    with Client(server.http_url) as c, pytest.raises(InvalidRequest) as refused:
        c.publish(MODEL, files={"config.json": source / "config.json",
                                "sub/model.safetensors": source / "sub/model.safetensors"})  # fmt: skip
    message = str(refused.value)
    assert "GGUF" not in message and "sub" in message and f"{MODEL}/sub" in message
    assert leftovers(root) == []


def test_the_same_bytes_again_publish_nothing_and_keep_mains_record(
    server, tmp_path: Path, capsys
) -> None:
    with Client(server.http_url) as c:
        first = c.publish(MODEL, weights(1), message="step 1")
        again = c.publish(MODEL, weights(1), message="step 1 again")
        assert again.unchanged and not first.unchanged
        assert again.commit == first.commit and again.message == "step 1"
        assert [(r.commit, r.message) for r in c.revisions(MODEL)] == [(first.commit, "step 1")]
    source = tmp_path / "checkpoint"
    source.mkdir()
    (source / "model.safetensors").write_bytes(safetensors_bytes(weights(2)))
    url = f"{server.http_url}/v1/models/team/from-dir"
    assert _cli.main(["publish", url, str(source), "-m", "one", "--quiet"]) == 0
    capsys.readouterr()
    time.sleep(0.01)
    assert _cli.main(["publish", url, str(source), "-m", "two", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "unchanged" in err and "message was not recorded" in err
    with Client(server.http_url) as c:
        assert [r.message for r in c.revisions("team/from-dir")] == ["one"]
        assert out.strip() == c.model("team/from-dir").commit
    assert http_request(server.http_port, "/healthz").status == 200
