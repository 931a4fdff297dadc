"""`weightserve serve ORIGIN`: models listed from an origin (a real SeaweedFS S3 server on
loopback, a local directory, an upstream weightserve) and served through the node's fill
cache: same ids and bytes as the local root, one origin read per model, the cache reused
after a restart, bounded by eviction, and cached models served while the origin is down.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import fixtures_gguf, fixtures_safetensors
from tests.support._util import http_request
from tests.support.byte_proxy import ByteCountingProxy
from tests.support.fixtures_gguf import write_split_gguf
from tests.support.node_caches import (
    MODELS,
    assert_same_tensors,
    config,
    load,
    node_cache,
    reference,
    write_repository,
)
from tests.support.s3_server import S3Server
from weightserve.client import Client
from weightserve.client._cli import main as cli_main
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.origin.base import DEFAULT_PLAN, FillPlan, Origin, OriginFile
from weightserve.service.sources.origin.catalog import OriginCatalog
from weightserve.service.sources.origin.opening import open_origin


def listing(url: str) -> dict[str, str]:
    with Client(url, flight=False) as client:
        models, _ = client.list_models()
    return {m.id: m.state for m in models}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    write_repository(root)
    return root


@pytest.fixture(scope="module")
def local_server(repository: Path) -> Iterator[WeightServer]:
    with WeightServer(
        ServerConfig(
            str(repository),
            http_port=0,
            grpc_port=0,
            flight_port=None,
            rescan_seconds=0,
            watch=False,
        )
    ) as server:
        yield server


def model_bytes(root: Path, model_id: str) -> int:
    return sum(p.stat().st_size for p in (root / model_id).rglob("*") if p.is_file())


# ------------------------------------------------------------------------------- file://


def test_file_origin_lists_remote_then_cached_and_serves_identical_bytes(
    repository: Path, local_server: WeightServer, tmp_path: Path
) -> None:
    with WeightServer(config(repository.as_uri(), tmp_path)) as server:
        assert listing(server.http_url) == {m: "remote" for m in MODELS}
        assert set(listing(local_server.http_url)) == set(MODELS)
        for model_id in MODELS:
            assert_same_tensors(load(server.http_url, model_id), reference(repository, model_id))
        assert listing(server.grpc_url) == {m: "cached" for m in MODELS}
        # Side files travel with the weights (the files API a Hub client or a lower tier uses).
        with Client(server.http_url) as client:
            names = {f.name for f in client.model("big").files()}
        assert "tokenizer/tokenizer.json" in names
        stats = node_cache(server).snapshot()
        total = sum(model_bytes(repository, m) for m in MODELS)
        assert stats.fills == 2 and stats.origin_bytes == total
        text = http_request(server.http_port, "/metrics").body.decode()
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels.get("kind") in (None, "fill")  # a fill's bytes; not the headers'
        }
        assert samples["weightserve_origin_bytes_total"] == total
        assert samples["weightserve_cache_fills_total"] == 2
        assert samples["weightserve_cache_bytes"] == stats.bytes_used


def test_cache_size_bound_evicts_least_recently_used(repository: Path, tmp_path: Path) -> None:
    sizes = {m: model_bytes(repository, m) for m in MODELS}
    limit = max(sizes.values()) + 10  # room for one model at a time
    with WeightServer(config(repository.as_uri(), tmp_path, cache_size=limit)) as server:
        for model_id in [*MODELS, *MODELS]:
            assert_same_tensors(load(server.http_url, model_id), reference(repository, model_id))
            assert node_cache(server).bytes_used() <= limit
        stats = node_cache(server).snapshot()
        assert stats.evictions == 3 and stats.fills == 4


def test_model_larger_than_the_cache_names_both_sizes(repository: Path, tmp_path: Path) -> None:
    with WeightServer(config(repository.as_uri(), tmp_path, cache_size=1000)) as server:
        # Model info is answered from the headers; tensor bytes need the fill.
        assert http_request(server.http_port, "/v1/models/big").status == 200
        reply = http_request(server.http_port, "/v1/models/big/-/stream?prefix=")
        assert reply.status == 507, reply.body  # Insufficient Storage
        text = reply.body.decode()
        assert "larger than the whole node cache" in text and "1000 bytes" in text


# ---------------------------------------------------------------------------------- S3


@pytest.fixture(scope="module")
def s3_prefix(s3_server: S3Server, repository: Path) -> str:
    s3_server.upload(repository, "serving")
    return "serving"


@pytest.mark.s3
def test_s3_origin_same_ids_identical_bytes_second_read_and_restart_cost_nothing(
    s3_server: S3Server,
    s3_prefix: str,
    repository: Path,
    local_server: WeightServer,
    tmp_path: Path,
) -> None:
    with ByteCountingProxy(s3_server.port) as proxy:
        uri = s3_server.uri(s3_prefix, port=proxy.port)
        with WeightServer(config(uri, tmp_path)) as server:
            assert set(listing(server.http_url)) == set(listing(local_server.http_url))
            for model_id in MODELS:
                want = reference(repository, model_id)
                assert_same_tensors(load(server.http_url, model_id), want)
                proxy.reset()
                assert_same_tensors(load(server.grpc_url, model_id), want)
                assert proxy.bytes_from_upstream == 0, model_id
        proxy.reset()
        with WeightServer(config(uri, tmp_path)) as restarted:
            listed = proxy.bytes_from_upstream  # the start lists the origin (HEADs, no bodies)
            assert listing(restarted.http_url) == {m: "cached" for m in MODELS}
            for model_id in MODELS:
                assert_same_tensors(
                    load(restarted.http_url, model_id), reference(repository, model_id)
                )
            assert proxy.bytes_from_upstream == listed
            assert node_cache(restarted).snapshot().fills == 0


@pytest.mark.s3
def test_s3_eight_concurrent_cold_readers_cause_one_fill(
    s3_server: S3Server, s3_prefix: str, repository: Path, tmp_path: Path
) -> None:
    with WeightServer(config(s3_server.uri(s3_prefix), tmp_path, flight_port=0)) as server:
        # HTTP, gRPC StreamTensors and Arrow Flight (a gRPC client's default) alike.
        readers = [(server.http_url, False), (server.grpc_url, False), (server.grpc_url, True)]
        readers = (readers * 3)[:8]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda r: load(r[0], "big", flight=r[1]), readers))
        want = reference(repository, "big")
        for got in results:
            assert_same_tensors(got, want)
        stats = node_cache(server).snapshot()
        assert stats.fills == 1 and stats.origin_bytes == model_bytes(repository, "big")


@pytest.mark.s3
def test_s3_origin_down_serves_cached_models_and_names_the_origin_for_others(
    s3_server: S3Server, s3_prefix: str, repository: Path, tmp_path: Path
) -> None:
    proxy = ByteCountingProxy(s3_server.port)
    uri = s3_server.uri(s3_prefix, port=proxy.port)
    with WeightServer(config(uri, tmp_path)) as server:
        assert_same_tensors(load(server.http_url, "big"), reference(repository, "big"))
        proxy.close()
        server.rescan()  # the origin cannot be listed now
        assert_same_tensors(load(server.http_url, "big"), reference(repository, "big"))
        reply = http_request(server.http_port, "/v1/models/org/sharded")
        assert reply.status == 503, reply.body
        assert f"127.0.0.1:{proxy.port}" in reply.body.decode()
        assert http_request(server.http_port, "/readyz").status == 200


# --------------------------------------------------------------------------- tiered


def test_two_nodes_each_read_each_model_from_the_upstream_once(
    repository: Path, local_server: WeightServer, tmp_path: Path
) -> None:
    total = sum(model_bytes(repository, m) for m in MODELS)
    for node in ("a", "b"):
        with (
            ByteCountingProxy(local_server.http_port) as proxy,
            WeightServer(config(f"http://127.0.0.1:{proxy.port}", tmp_path / node)) as server,
        ):
            for _ in range(2):
                for model_id in MODELS:
                    for url in (server.http_url, server.grpc_url):
                        assert_same_tensors(load(url, model_id), reference(repository, model_id))
            stats = node_cache(server).snapshot()
            assert stats.fills == 2 and stats.origin_bytes == total
            # Listings and headers aside, no byte of a model crossed twice.
            assert total <= proxy.bytes_from_upstream < total + (64 << 10)


# ------------------------------------------------------------------ pins, side files, waits


def test_pinned_model_is_filled_at_start_and_never_evicted(tmp_path: Path) -> None:
    root = tmp_path / "origin"
    write_repository(root)
    (root / "small").mkdir()
    fixtures_safetensors.save_file(
        {"w": np.arange(300_000, dtype=np.float32)}, root / "small" / "model.safetensors"
    )
    others = ["org/sharded", "small"]
    limit = model_bytes(root, "big") + max(model_bytes(root, m) for m in others) + 10
    settings = {"cache_size": limit, "pins": ("big",)}
    with WeightServer(config(root.as_uri(), tmp_path / "cache", **settings)) as server:
        cache = node_cache(server)
        assert cache.cached_models() == ["big"] and cache.snapshot().fills == 1
        assert listing(server.http_url)["big"] == "cached"
        for model_id in [*others, *others]:  # each fill evicts the other unpinned model
            assert_same_tensors(load(server.http_url, model_id), reference(root, model_id))
            assert "big" in cache.cached_models()
        assert_same_tensors(load(server.grpc_url, "big"), reference(root, "big"))
        stats = cache.snapshot()
        assert stats.fills == 1 + 4 and stats.evictions == 3
        assert cache.bytes_used() <= limit


def test_side_files_travel_through_the_files_api_and_the_hub_route(
    repository: Path, local_server: WeightServer, tmp_path: Path
) -> None:
    with WeightServer(config(f"http://127.0.0.1:{local_server.http_port}", tmp_path)) as server:
        for model_id, name in [("org/sharded", "config.json"), ("big", "tokenizer/tokenizer.json")]:
            want = (repository / model_id / name).read_bytes()
            files_api = http_request(server.http_port, f"/v1/models/{model_id}/-/files/{name}")
            assert files_api.status == 200 and files_api.body == want, files_api.body
            hub = http_request(server.http_port, f"/{model_id}/resolve/main/{name}")
            assert hub.status == 200 and hub.body == want, hub.body


class GatedOrigin:
    """A real origin whose fetches wait until ``release`` is set: a fill as slow as a test
    needs, without sleeping."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.description = origin.description
        self.release = threading.Event()

    def __getattr__(self, name: str) -> object:  # ranged reads of headers are not held
        return getattr(self.origin, name)

    def list_files(self) -> list[OriginFile]:
        return self.origin.list_files()

    def fetch(self, file: OriginFile, dest: Path, plan: FillPlan = DEFAULT_PLAN) -> str | None:
        assert self.release.wait(30), "the test never released the fill"
        return self.origin.fetch(file, dest, plan)


def test_request_during_a_long_fill_gets_503_with_retry_after_and_progress(
    repository: Path, tmp_path: Path
) -> None:
    origin = GatedOrigin(open_origin(repository.as_uri()))
    catalog = OriginCatalog(partial(NodeCache, origin, tmp_path, 1 << 30), fill_wait_seconds=0.2)
    with WeightServer(config(repository.as_uri(), tmp_path), catalog=catalog) as server:
        reply = http_request(server.http_port, "/v1/models/big/-/stream?prefix=")
        assert reply.status == 503, reply.body
        assert reply.headers["retry-after"] == "2"
        text = reply.body.decode()
        total = model_bytes(repository, "big")
        assert "is being copied into this node's cache" in text, text
        assert f"0 of {total} bytes" in text, text
        assert listing(server.http_url)["big"] == "filling"
        origin.release.set()
        # A client retries within its budget and gets the whole model from the one fill.
        assert_same_tensors(load(server.grpc_url, "big"), reference(repository, "big"))
        assert catalog.cache.snapshot().fills == 1


# --------------------------------------------------------------------------- GGUF


@pytest.fixture(scope="module")
def gguf_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A single-file GGUF at the top, one in a folder, a split GGUF, and a split GGUF with a
    part missing."""
    root = tmp_path_factory.mktemp("gguf-repository")
    fixtures_gguf.write_mixed(root / "tiny.gguf")
    (root / "dir").mkdir()
    fixtures_gguf.write_mixed(root / "dir" / "x.gguf", seed=1)
    write_split_gguf(root / "org" / "llama.gguf")
    parts = write_split_gguf(root / "broken.gguf", seed=2)
    parts[1].unlink()
    return root


def test_gguf_models_keep_their_ids_through_a_file_origin_and_an_upstream(
    gguf_repository: Path, tmp_path: Path
) -> None:
    local_config = config(str(gguf_repository), tmp_path / "upstream-digests")
    with WeightServer(local_config) as upstream:
        with Client(upstream.http_url, flight=False) as client:
            upstream_models, upstream_problems = client.list_models()
        ids = sorted(m.id for m in upstream_models)
        assert ids == ["dir/x.gguf", "org/llama.gguf", "tiny.gguf"]
        assert [p.model for p in upstream_problems] == ["broken.gguf"]
        want = {m: load(upstream.http_url, m) for m in ids}
        for node, root in [
            ("tier", f"http://127.0.0.1:{upstream.http_port}"),
            ("file", gguf_repository.as_uri()),
        ]:
            with WeightServer(config(root, tmp_path / node)) as server:
                assert sorted(listing(server.http_url)) == ids, node
                for model_id in ids:
                    assert_same_tensors(load(server.http_url, model_id), want[model_id])
                assert sorted(listing(server.http_url)) == ids, node  # cached, same ids
                with Client(server.http_url, flight=False) as client:
                    _, problems = client.list_models()
                if node == "file":  # the upstream serves only whole models
                    assert [p.model for p in problems] == ["broken.gguf"]
                    assert "has 2 of its 3 parts" in problems[0].reason
                    reply = http_request(server.http_port, "/v1/models/broken.gguf")
                    assert reply.status == 503 and b"is refused" in reply.body


def test_ls_shows_each_models_state(
    repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with WeightServer(config(repository.as_uri(), tmp_path)) as server:
        load(server.http_url, "big")
        assert cli_main(["ls", server.http_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", "FORMAT", "TENSORS", "SIZE", "STATE", "REVISION"]
    column = lines[0].index("STATE")
    states = {line.split()[0]: line[column:].split()[0] for line in lines[1:]}
    assert states == {"big": "cached", "org/sharded": "remote"}
