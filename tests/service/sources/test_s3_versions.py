"""A node cache over a versioned S3 bucket keeps serving a revision its origin moved on from:
``ID@R`` is filled from the object versions recorded when R was filled, byte-identical to R
on every route, also after the copy was evicted and after a restart, while ``main`` gets the
newest. An unversioned bucket gives RevisionNotFound naming what the node holds; an object
version deleted from the bucket, a clear RevisionNotFound naming it. Real processes:
SeaweedFS as S3 (its gateway keeps versions), weightserve node caches in front of it."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore.config
import botocore.session
import numpy as np
import pytest
from safetensors.numpy import load as reference_tensors
from safetensors.numpy import save

from tests.support._util import http_request
from tests.support.node_caches import assert_same_tensors, config, node_cache
from tests.support.s3_server import S3Server
from weightserve.client import Client
from weightserve.client._cli import main as cli_main
from weightserve.client.errors import RevisionNotFound
from weightserve.service.server import WeightServer

pytestmark = pytest.mark.s3

WEIGHTS = "org/m/model.safetensors"
CONFIG = b'{"model_type": "test"}'
PLANES = ("http", "grpc")


def weights(seed: int) -> bytes:
    """A safetensors file of about 256 KiB; every seed gives other bytes of the same size."""
    rng = np.random.default_rng(seed)
    return save(
        {
            "embed.weight": rng.standard_normal(1 << 16, dtype=np.float32),
            "norm.weight": rng.standard_normal(64, dtype=np.float32),
        }
    )


@pytest.fixture
def s3(s3_server: S3Server) -> Any:
    """botocore's S3 client of the test server (path-style: only 127.0.0.1 is asked)."""
    return botocore.session.Session().create_client(
        "s3",
        region_name="us-east-1",
        endpoint_url=f"http://{s3_server.endpoint}",
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key=s3_server.secret_key,
        config=botocore.config.Config(s3={"addressing_style": "path"}),
    )


def bucket_uri(s3_server: S3Server, bucket: str, prefix: str) -> str:
    return (
        f"s3://{bucket}/{prefix}?endpoint_override={s3_server.endpoint}&scheme=http"
        "&region=us-east-1"
    )


@pytest.fixture
def versioned(s3: Any) -> Iterator[str]:
    """A new bucket with versioning on."""
    bucket = f"versioned-{secrets.token_hex(4)}"
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    yield bucket


def put(s3: Any, bucket: str, key: str, data: bytes) -> str | None:
    """Write an object; its version id (None on an unversioned bucket)."""
    return s3.put_object(Bucket=bucket, Key=key, Body=data).get("VersionId")


@pytest.fixture
def sockets() -> Iterator[str]:
    """A directory for the same-node socket (a Unix socket path must be short)."""
    directory = tempfile.mkdtemp(prefix="ws-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def node(uri: str, cache_dir: Path, cache_size: int, uds: str | None = None) -> WeightServer:
    return WeightServer(config(uri, cache_dir, cache_size=cache_size, uds=uds))


def fetch_model(
    server: WeightServer, revision: str | None, plane: str = "http"
) -> tuple[str, dict]:
    """(commit, tensors) of ``org/m`` at ``revision`` as the node serves it."""
    url = {"grpc": server.grpc_url, "handoff": f"unix://{server.config.uds}"}.get(
        plane, server.http_url
    )
    with Client(url, retry_seconds=30, data_plane=plane) as client:
        tensors = client.model("org/m", revision=revision).fetch(prefix="")
        # Over object storage the commit is known once the node holds the model.
        return client.model("org/m", revision=revision).commit, tensors


def assert_serves(server: WeightServer, commit: str, data: bytes, *, hub: bool = True) -> None:
    """Every route answers ``org/m@commit`` with exactly ``data``'s bytes (``hub``: the Hub
    routes too)."""
    for plane in (*PLANES, "handoff") if server.config.uds else PLANES:
        got_commit, tensors = fetch_model(server, commit, plane)
        assert got_commit == commit, plane
        assert_same_tensors(tensors, reference_tensors(data))
    port = server.http_port
    file = http_request(port, f"/v1/models/org/m@{commit}/-/files/model.safetensors")
    assert (file.status, file.body) == (200, data)
    if hub:
        info = http_request(port, f"/api/models/org/m/revision/{commit}")
        assert info.status == 200 and info.json()["sha"] == commit
        resolved = http_request(port, f"/org/m/resolve/{commit}/model.safetensors")
        assert (resolved.status, resolved.body) == (200, data)


def test_a_past_revision_is_filled_from_its_object_versions(
    s3_server: S3Server,
    s3: Any,
    versioned: str,
    tmp_path: Path,
    sockets: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    one, two = weights(1), weights(2)
    first_version = put(s3, versioned, WEIGHTS, one)
    assert first_version  # the gateway keeps versions
    put(s3, versioned, "org/m/config.json", CONFIG)
    uri = bucket_uri(s3_server, versioned, "")
    # Room for one copy of the model: a past revision's copy evicts the newest and back.
    room = len(one) + len(CONFIG) + (len(one) >> 1)
    cache_dir = tmp_path / "node"
    with node(uri, cache_dir, room) as server:
        old, tensors = fetch_model(server, None)
        assert_same_tensors(tensors, reference_tensors(one))
        put(s3, versioned, WEIGHTS, two)
        server.rescan()
        new, tensors = fetch_model(server, "main")
        assert new != old
        assert_same_tensors(tensors, reference_tensors(two))

        # Filled from the versions recorded; the Hub routes too, naming the commit, without
        # trading the room's one copy back to main.
        assert_serves(server, old, one)
        cache = node_cache(server)
        copy = f".revisions/{old}/org/m"
        assert cache.cached_models() == [copy]  # the newest was evicted for it: one fits
        with Client(server.http_url, retry_seconds=30) as client:
            assert client.model("org/m", revision=old[:12]).commit == old
            listed = {m.id: m for m in client.list_models()[0]}
        assert listed["org/m"].commit in ("", new)  # main stays the newest

        new_again, tensors = fetch_model(server, "main")
        assert new_again == new
        assert_same_tensors(tensors, reference_tensors(two))
        assert cache.cached_models() == ["org/m"]  # the copy was evicted in turn

    # The history outlives the process: the copy, evicted before, is filled again.
    with node(uri, cache_dir, 1 << 30, uds=f"{sockets}/ws.sock") as restarted:
        # The operator warms the past revision: its copy, named by its commit.
        assert (
            cli_main(["cache", "prefetch", restarted.http_url, f"org/m@{old[:12]}", "--quiet"]) == 0
        )
        assert f"org/m@{old} cached" in capsys.readouterr().out
        assert node_cache(restarted).cached_models() == [copy, "org/m"]
        assert_serves(restarted, old, one)
        latest, tensors = fetch_model(restarted, "main")
        assert latest == new
        assert_same_tensors(tensors, reference_tensors(two))

        # The version R was filled from is deleted: R cannot be filled again, and says why.
        s3.delete_object(Bucket=versioned, Key=WEIGHTS, VersionId=first_version)
        assert cli_main(["cache", "evict", restarted.http_url, f"org/m@{old}"]) == 0
        assert copy not in node_cache(restarted).cached_models()
        with pytest.raises(RevisionNotFound) as refused:
            fetch_model(restarted, old)
        message = str(refused.value)
        assert "model.safetensors" in message and first_version in message
        reply = http_request(restarted.http_port, f"/v1/models/org/m@{old}")
        assert (reply.status, reply.error()[0]) == (404, "RevisionNotFound")
        assert_same_tensors(fetch_model(restarted, None)[1], reference_tensors(two))


def test_an_unversioned_bucket_serves_only_what_the_node_holds(
    s3_server: S3Server, s3: Any, tmp_path: Path
) -> None:
    prefix = f"unversioned-{secrets.token_hex(4)}"
    bucket = s3_server.bucket
    assert put(s3, bucket, f"{prefix}/{WEIGHTS}", weights(3)) is None
    put(s3, bucket, f"{prefix}/org/m/config.json", CONFIG)
    with node(bucket_uri(s3_server, bucket, prefix), tmp_path / "node", 1 << 30) as server:
        old, _ = fetch_model(server, None)
        put(s3, bucket, f"{prefix}/{WEIGHTS}", weights(4))
        server.rescan()
        new, tensors = fetch_model(server, "main")
        assert new != old
        assert_same_tensors(tensors, reference_tensors(weights(4)))
        with pytest.raises(RevisionNotFound, match=f"main \\(commit {new}\\)"):
            fetch_model(server, old)
