"""The files API of a node cache's uncached model without a fill: the HTTP and gRPC file
listings, a side file read over both, gRPC model info, `weightserve ls` and the browser's
routes cost under 1 MiB of origin bytes for a 64 MiB model, over an upstream weightserve and a
real S3 server (SeaweedFS). The bytes are counted at a TCP proxy in front of the origin and
``weightserve_origin_bytes_total{kind}`` agrees; the model stays ``remote`` until a weight
file's bytes are asked for, which fill it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support._util import http_request
from tests.support.byte_proxy import ByteCountingProxy
from tests.support.commands import run_cli
from tests.support.node_caches import config, node_cache, write_big
from tests.support.s3_server import S3Server
from weightserve.client import Client
from weightserve.service.server import WeightServer

MIB = 1 << 20
MODEL = "org/mid"  # 64 MiB of weights in two shards, with an index and side files
SHARD = "model-00001-of-00002.safetensors"
# What one answer adds at the proxy beyond the bytes counted: its status line and headers.
ANSWER_OVERHEAD = 4096


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    write_big(root, MODEL, 32 * MIB)
    return root


@pytest.fixture(scope="module")
def upstream(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightServer]:
    with WeightServer(config(str(repository), tmp_path_factory.mktemp("upstream"))) as server:
        yield server


def origin_counts(server: WeightServer) -> Counter[str]:
    """``weightserve_origin_bytes_total`` by kind (``fill``, ``header``, ``file``), and
    ``weightserve_origin_requests_total`` of every kind but ``watch`` (``requests``)."""
    text = http_request(server.http_port, "/metrics").body.decode()
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "weightserve_origin_bytes_total":
                counts[sample.labels["kind"]] += int(sample.value)
            elif (
                sample.name == "weightserve_origin_requests_total"
                and sample.labels["kind"] != "watch"  # a follower's one long request at start
            ):
                counts["requests"] += int(sample.value)
    return counts


def state(server: WeightServer) -> str:
    models = http_request(server.http_port, "/v1/models").json()["models"]
    return next(m["state"] for m in models if m["id"] == MODEL)


def read_file(url: str, name: str, offset: int = 0, length: int | None = None) -> tuple[bytes, str]:
    """A file's bytes (or a range of them) and its ETag, through the client's transport."""
    with Client(url, retry_seconds=30) as client:
        source = client.transport.open_file(MODEL, name, offset, length)
        try:
            data = bytearray(source.length)
            view, done = memoryview(data), 0
            while done < len(data) and (got := source.readinto(view[done:])):
                done += got
            return bytes(data[:done]), source.etag
        finally:
            source.close()


def assert_grpc_listing(node: WeightServer, want: dict) -> None:
    """gRPC ListFiles names the files, sizes and ETags of the HTTP listing ``want``."""
    with Client(node.grpc_url, retry_seconds=30) as client:
        files = client.model(MODEL).files()
    assert {(f.name, f.size, f.etag) for f in files} == {
        (f["name"], f["size"], f["etag"]) for f in want["files"]
    }


def read_metadata(node: WeightServer, upstream: WeightServer, repository: Path) -> None:
    """What a browser, `weightserve ls`, AutoConfig or a tokenizer asks of the node: model info
    over both transports and side files over both, each as the upstream (a local root)
    answers it."""
    want = http_request(upstream.http_port, f"/v1/models/{MODEL}").json()
    assert http_request(node.http_port, "/").status == 200  # the browser's page, its listing
    assert state(node) == "remote"
    info = http_request(node.http_port, f"/v1/models/{MODEL}").json()  # the browser's view
    assert info["tensors"] == want["tensors"]
    with Client(node.grpc_url, retry_seconds=30) as client:
        assert sorted(client.model(MODEL).info.tensors) == sorted(
            t["name"] for t in want["tensors"]
        )
    for url in (f"{node.http_url}/v1/models/{MODEL}", f"{node.grpc_url}/{MODEL}"):
        listed = run_cli("ls", url)
        assert listed.returncode == 0, listed.stderr
        assert "layers.2.b" in listed.stdout and "64.0 MiB" in listed.stdout, listed.stdout
    for url, name in [(node.http_url, "config.json"), (node.grpc_url, "tokenizer.json")]:
        data, etag = read_file(url, name)
        assert data == (repository / MODEL / name).read_bytes()
        # A content digest before any fill: the ETag every node and the upstream give it.
        assert etag == read_file(upstream.http_url, name)[1]


def assert_cheap(node: WeightServer, proxy: ByteCountingProxy, before: Counter[str]) -> None:
    """Under 1 MiB at the proxy, all of it counted by the metric as header or side-file bytes
    (beyond each answer's head), every request the proxy saw counted, and the model still
    remote with nothing in the cache."""
    counted = origin_counts(node) - before
    seen = proxy.bytes_from_upstream
    assert seen < MIB, (seen, proxy.requests)
    assert counted["fill"] == 0 and counted["header"] > 0 and counted["file"] > 0, counted
    answers = sum(n for request, n in proxy.requests.items() if request != "GET /v1/watch")
    assert counted["requests"] == answers, (counted, proxy.requests)
    assert counted["header"] + counted["file"] <= seen
    assert seen <= counted["header"] + counted["file"] + answers * ANSWER_OVERHEAD, (counted, seen)
    assert state(node) == "remote"
    cache = node_cache(node)
    assert node_cache(node).snapshot().fills == 0 and not cache.cached_models()


def test_upstream_origin_listings_and_side_files_without_a_fill(
    upstream: WeightServer, repository: Path, tmp_path: Path
) -> None:
    want = http_request(upstream.http_port, f"/v1/models/{MODEL}/-/files").json()
    with (
        ByteCountingProxy(upstream.http_port) as proxy,
        WeightServer(config(f"http://127.0.0.1:{proxy.port}", tmp_path)) as node,
    ):
        proxy.reset()  # the start lists the upstream's models and files
        before = origin_counts(node)
        # The upstream lists content digests: both listings are its own, before a fill.
        assert http_request(node.http_port, f"/v1/models/{MODEL}/-/files").json() == want
        assert_grpc_listing(node, want)
        read_metadata(node, upstream, repository)
        assert_cheap(node, proxy, before)

        # A weight file's bytes fill the model, once; the listing stays the upstream's.
        data, etag = read_file(node.http_url, SHARD, offset=8, length=100)
        assert data == (repository / MODEL / SHARD).read_bytes()[8:108]
        assert state(node) == "cached"
        total = sum(f["size"] for f in want["files"])
        assert origin_counts(node)["fill"] == node_cache(node).snapshot().origin_bytes == total
        assert http_request(node.http_port, f"/v1/models/{MODEL}/-/files").json() == want


@pytest.mark.s3
def test_s3_origin_side_files_without_a_fill_and_a_listing_once_filled(
    s3_server: S3Server, upstream: WeightServer, repository: Path, tmp_path: Path
) -> None:
    s3_server.upload(repository / MODEL, f"files/{MODEL}")
    with ByteCountingProxy(s3_server.port) as proxy:
        uri = s3_server.uri("files", port=proxy.port)
        with WeightServer(config(uri, tmp_path / "node")) as node:
            proxy.reset()
            before = origin_counts(node)
            read_metadata(node, upstream, repository)
            assert_cheap(node, proxy, before)

            # A weight file's bytes fill the model (over gRPC).
            data, _ = read_file(node.grpc_url, SHARD, offset=8, length=100)
            assert data == (repository / MODEL / SHARD).read_bytes()[8:108]
            assert state(node) == "cached"
            # The listing names each file's content digest, which a pull and a lower tier
            # verify against: over object storage it is the filled model's, the upstream's.
            want = http_request(upstream.http_port, f"/v1/models/{MODEL}/-/files").json()
            assert http_request(node.http_port, f"/v1/models/{MODEL}/-/files").json() == want


@pytest.mark.s3
def test_s3_pull_of_an_uncached_model_verifies_against_the_etags_listed(
    s3_server: S3Server, upstream: WeightServer, repository: Path, tmp_path: Path
) -> None:
    """Over object storage the listing fills the model first: the ETags it names are the
    content digests the pull checks each file's bytes against. So does a side file read
    pinned to a commit, which only the fill tells."""
    s3_server.upload(repository / MODEL, f"pull/{MODEL}")
    with (
        WeightServer(config(s3_server.uri("pull"), tmp_path / "node")) as node,
        Client(node.grpc_url, retry_seconds=30) as client,
    ):
        out = client.model(MODEL).download(tmp_path / "out")
        for path in (repository / MODEL).iterdir():
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name
        assert state(node) == "cached"

    commit = http_request(upstream.http_port, f"/v1/models/{MODEL}").json()["commit"]
    with WeightServer(config(s3_server.uri("pull"), tmp_path / "second")) as node:
        side = f"/v1/models/{MODEL}/-/files/config.json?revision="
        assert http_request(node.http_port, side).status == 200  # no revision named: alone
        assert state(node) == "remote"
        pinned = http_request(node.http_port, side + commit)
        assert pinned.status == 200, pinned.body[:300]
        assert pinned.body == (repository / MODEL / "config.json").read_bytes()
        assert state(node) == "cached"
