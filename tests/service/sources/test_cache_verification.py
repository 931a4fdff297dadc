"""Node caches are verified against the origin: a cached file whose bytes no longer match its
fill record (16 bytes overwritten in place, size and mtime kept, as bit rot or an attacker
leaves it) is never served: found at start, on a request or by a stream's first mapping, it
is filled again or the model refused with the file named; and every node caching the same
origin content reports the origin's revision, commit and ETags. Real processes: SeaweedFS as
S3, an upstream weightserve, node caches in front of both."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from tests.support._util import http_request
from tests.support.byte_proxy import ByteCountingProxy
from tests.support.node_caches import (
    MODELS,
    CountingOrigin,
    assert_same_tensors,
    config,
    corrupt_in_place,
    files_of,
    node_cache,
    reference,
    write_model,
    write_repository,
)
from tests.support.s3_server import S3Server
from weightserve.client import Client
from weightserve.client._client import FetchOptions
from weightserve.client.errors import ModelUnavailable
from weightserve.service.server import WeightServer
from weightserve.service.sources.cache.integrity import CacheDigests
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.files.stamps import file_stamp
from weightserve.service.sources.origin.opening import open_origin

LIMIT = 1 << 20


def cached(cache_dir: Path, name: str) -> Path:
    """A file in the node cache of a server started with ``config(..., cache_dir)``."""
    return cache_dir / "node-cache" / "data" / name


def fetch_verified(url: str, model_id: str) -> dict[str, np.ndarray]:
    with Client(url, retry_seconds=30, flight=False) as client:
        return client.model(model_id, FetchOptions(verify="full")).fetch(prefix="")


def files_listing(port: int, model_id: str) -> dict:
    """What the files API says of a model: revision, commit, and each file's size and ETag."""
    reply = http_request(port, f"/v1/models/{model_id}/-/files")
    assert reply.status == 200, reply.body
    return json.loads(reply.body)


def corrupt_count(server: WeightServer) -> float:
    text = http_request(server.http_port, "/metrics").body.decode()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return samples["weightserve_cache_corrupt_files_total"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    write_repository(root)
    return root


@pytest.fixture(scope="module")
def local_server(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WeightServer]:
    """The upstream: a weightserve over the repository itself."""
    digests = tmp_path_factory.mktemp("upstream-digests")
    with WeightServer(config(str(repository), digests)) as server:
        yield server


# ------------------------------------------------------------------------- the cache alone


def test_fill_record_holds_the_origin_bytes_digest_and_the_catalog_reports_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "origin"
    written = write_model(root, "org/m", 64 << 10, seed=1)
    origin = CountingOrigin(open_origin(root.as_uri()))
    with NodeCache(origin, tmp_path / "cache", LIMIT) as cache:
        path = cache.ensure("org/m", files_of(origin, "org/m"))
        state = json.loads((tmp_path / "cache" / "state" / "org%2Fm.json").read_text())
        for name, data in written.items():
            assert state["files"][name]["digest"] == xxhash.xxh3_128_hexdigest(data)
        weights = path / "model.safetensors"
        stamp = file_stamp(weights.stat())
        digests = CacheDigests(cache)
        want = xxhash.xxh3_128_hexdigest(written["org/m/model.safetensors"])
        assert digests.digest(weights.resolve(), stamp) == want
        corrupt_in_place(weights)
        # The record answers for the recorded stamp; the file as it is now is refused.
        with pytest.raises(ModelUnavailable, match="does not match what was filled") as e:
            digests.digest(weights.resolve(), file_stamp(weights.stat()))
        assert want in str(e.value) and "org/m/model.safetensors" in str(e.value)
        assert e.value.retry_after is not None  # the client retries; the next use refills
        assert cache.snapshot().corrupt_files == 1 and not weights.exists()
        origin.fetched.clear()
        cache.ensure("org/m", files_of(origin, "org/m"))
        assert origin.fetched == ["org/m/model.safetensors"]  # that file alone, again
        assert weights.read_bytes() == written["org/m/model.safetensors"]


def test_corruption_is_found_at_start_and_the_file_filled_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "origin"
    written = write_model(root, "org/m", 64 << 10, seed=2)
    origin = CountingOrigin(open_origin(root.as_uri()))
    with NodeCache(origin, tmp_path / "cache", LIMIT) as cache:
        cache.ensure("org/m", files_of(origin, "org/m"))
    weights = tmp_path / "cache" / "data" / "org/m/model.safetensors"
    corrupt_in_place(weights)
    with caplog.at_level(logging.WARNING), NodeCache(origin, tmp_path / "cache", LIMIT) as cache:
        assert cache.cached_models() == [] and cache.snapshot().corrupt_files == 1
        lines = [r.getMessage() for r in caplog.records if "does not match" in r.getMessage()]
        assert len(lines) == 1 and "org/m/model.safetensors" in lines[0]
        assert "org/m" in (cache.corruption("org/m") or "")
        cache.ensure("org/m", files_of(origin, "org/m"))
        assert weights.read_bytes() == written["org/m/model.safetensors"]
        assert cache.corruption("org/m") is None


def test_unchanged_stamp_costs_no_read_and_a_rehash_that_matches_keeps_the_file(
    tmp_path: Path,
) -> None:
    root = tmp_path / "origin"
    write_model(root, "org/m", 64 << 10, seed=3)
    origin = CountingOrigin(open_origin(root.as_uri()))
    with NodeCache(origin, tmp_path / "cache", LIMIT) as cache:
        cache.ensure("org/m", files_of(origin, "org/m"))
    weights = tmp_path / "cache" / "data" / "org/m/model.safetensors"
    os.utime(weights)  # a new stamp, the same bytes: hashed again at start, kept
    with NodeCache(origin, tmp_path / "cache", LIMIT) as cache:
        assert cache.cached_models() == ["org/m"] and cache.snapshot().corrupt_files == 0
        state = json.loads((tmp_path / "cache" / "state" / "org%2Fm.json").read_text())
        record = state["files"]["org/m/model.safetensors"]
        assert record["stamp"] == list(file_stamp(weights.stat()))


def test_a_full_check_finds_bytes_changed_under_an_unchanged_stamp(tmp_path: Path) -> None:
    root = tmp_path / "origin"
    write_model(root, "org/m", 64 << 10, seed=6)
    origin = CountingOrigin(open_origin(root.as_uri()))
    with NodeCache(origin, tmp_path / "cache", LIMIT) as cache:
        cache.ensure("org/m", files_of(origin, "org/m"))
    weights = tmp_path / "cache" / "data" / "org/m/model.safetensors"
    corrupt_in_place(weights)
    state_path = tmp_path / "cache" / "state" / "org%2Fm.json"
    state = json.loads(state_path.read_text())
    state["files"]["org/m/model.safetensors"]["stamp"] = list(file_stamp(weights.stat()))
    state_path.write_text(json.dumps(state))  # bit rot: the stamp says nothing changed
    with NodeCache(origin, tmp_path / "cache", LIMIT) as cache:
        cache.check("org/m")
        assert cache.snapshot().corrupt_files == 0 and cache.cached_models() == ["org/m"]
        cache.check("org/m", full=True)  # every byte read: an operator's verify
        assert cache.snapshot().corrupt_files == 1 and cache.cached_models() == []
        assert not weights.exists()


def test_a_file_written_in_place_is_dropped_on_its_file_system_event(tmp_path: Path) -> None:
    root = tmp_path / "origin"
    written = write_model(root, "org/m", 64 << 10, seed=5)
    origin = CountingOrigin(open_origin(root.as_uri()))
    with NodeCache(origin, tmp_path / "cache", LIMIT, watch=True) as cache:
        path = cache.ensure("org/m", files_of(origin, "org/m"))
        time.sleep(0.5)  # the watch is set up
        corrupt_in_place(path / "model.safetensors")
        deadline = time.monotonic() + 15
        while cache.snapshot().corrupt_files == 0:  # no request, no rescan: the event alone
            assert time.monotonic() < deadline, "the change was not noticed"
            time.sleep(0.05)
        assert cache.cached_models() == []
        cache.ensure("org/m", files_of(origin, "org/m"))
        assert (path / "model.safetensors").read_bytes() == written["org/m/model.safetensors"]


def test_a_state_without_fill_digests_is_filled_again(tmp_path: Path) -> None:
    root = tmp_path / "origin"
    written = write_model(root, "org/m", 64 << 10, seed=4)
    origin = CountingOrigin(open_origin(root.as_uri()))
    with NodeCache(origin, tmp_path / "cache", LIMIT) as cache:
        cache.ensure("org/m", files_of(origin, "org/m"))
    state_path = tmp_path / "cache" / "state" / "org%2Fm.json"
    state = json.loads(state_path.read_text())
    state["format"] = 1
    state["files"] = {
        n: {"size": f["size"], "version": f["version"]} for n, f in state["files"].items()
    }
    state_path.write_text(json.dumps(state))
    origin.fetched.clear()
    with NodeCache(origin, tmp_path / "cache", LIMIT) as cache:
        assert cache.cached_models() == []
        path = cache.ensure("org/m", files_of(origin, "org/m"))
        assert sorted(origin.fetched) == sorted(written)
        assert (path / "model.safetensors").read_bytes() == written["org/m/model.safetensors"]


# ------------------------------------------------------------------- servers: S3 origin


@pytest.fixture(scope="module")
def s3_prefix(s3_server: S3Server, repository: Path) -> str:
    s3_server.upload(repository, "verified")
    return "verified"


@pytest.mark.s3
def test_s3_corrupted_cache_file_is_never_served_also_after_a_restart(
    s3_server: S3Server,
    s3_prefix: str,
    repository: Path,
    local_server: WeightServer,
    tmp_path: Path,
) -> None:
    uri = s3_server.uri(s3_prefix)
    want = reference(repository, "big")
    origin_view = files_listing(local_server.http_port, "big")  # the same files, served
    weights = cached(tmp_path, "big/model.safetensors")
    with WeightServer(config(uri, tmp_path)) as server:
        assert_same_tensors(fetch_verified(server.http_url, "big"), want)
        assert files_listing(server.http_port, "big") == origin_view
        corrupt_in_place(weights)
        assert_same_tensors(fetch_verified(server.http_url, "big"), want)  # refilled first
        assert files_listing(server.http_port, "big") == origin_view
        assert corrupt_count(server) == 1
        assert node_cache(server).snapshot().fills == 2
        with WeightServer(config(uri, tmp_path / "second")) as second:  # another node
            assert_same_tensors(fetch_verified(second.http_url, "big"), want)
            assert files_listing(second.http_port, "big") == origin_view
        corrupt_in_place(weights)
    with WeightServer(config(uri, tmp_path)) as restarted:
        assert node_cache(restarted).snapshot().corrupt_files == 1  # found at start
        assert_same_tensors(fetch_verified(restarted.grpc_url, "big"), want)
        assert files_listing(restarted.http_port, "big") == origin_view
        assert weights.read_bytes() == (repository / "big" / "model.safetensors").read_bytes()


# ------------------------------------------------------------- servers: upstream origin


def test_two_nodes_report_the_upstreams_revision_commit_and_etags_through_corruption(
    repository: Path, local_server: WeightServer, tmp_path: Path
) -> None:
    upstream = f"http://127.0.0.1:{local_server.http_port}"
    origin_view = {m: files_listing(local_server.http_port, m) for m in MODELS}
    shard = sorted((repository / "org" / "sharded").glob("*.safetensors"))[0].name
    with (
        WeightServer(config(upstream, tmp_path / "a")) as a,
        WeightServer(config(upstream, tmp_path / "b")) as b,
    ):
        for node in (a, b):
            for model_id in MODELS:
                assert_same_tensors(
                    fetch_verified(node.grpc_url, model_id), reference(repository, model_id)
                )
                assert files_listing(node.http_port, model_id) == origin_view[model_id]
            with Client(node.http_url, flight=False) as client:
                models, _ = client.list_models()
            revisions = {m.id: m.revision for m in models}
            assert revisions == {m: origin_view[m]["revision"] for m in MODELS}
        corrupt_in_place(cached(tmp_path / "a", f"org/sharded/{shard}"), offset=200)
        want = reference(repository, "org/sharded")
        assert_same_tensors(fetch_verified(a.http_url, "org/sharded"), want)
        for node in (a, b):
            assert files_listing(node.http_port, "org/sharded") == origin_view["org/sharded"]
        assert corrupt_count(a) == 1 and corrupt_count(b) == 0


def test_bit_rot_under_an_unchanged_stamp_is_caught_before_the_first_chunk(
    repository: Path, local_server: WeightServer, tmp_path: Path
) -> None:
    """Bytes changed, stamp as recorded (what a restart cannot see without reading): the
    first mapping is hashed against the fill record before a chunk digest is computed."""
    upstream = f"http://127.0.0.1:{local_server.http_port}"
    want = reference(repository, "big")
    with WeightServer(config(upstream, tmp_path)) as server:
        assert_same_tensors(fetch_verified(server.http_url, "big"), want)
    weights = cached(tmp_path, "big/model.safetensors")
    corrupt_in_place(weights)
    state_path = tmp_path / "node-cache" / "state" / "big.json"
    state = json.loads(state_path.read_text())
    state["files"]["big/model.safetensors"]["stamp"] = list(file_stamp(weights.stat()))
    state_path.write_text(json.dumps(state))
    with WeightServer(config(upstream, tmp_path)) as restarted:
        assert node_cache(restarted).snapshot().corrupt_files == 0  # the stamps agree
        assert_same_tensors(fetch_verified(restarted.http_url, "big"), want)
        assert corrupt_count(restarted) == 1
        assert files_listing(restarted.http_port, "big") == files_listing(
            local_server.http_port, "big"
        )


def test_corrupt_file_with_the_origin_down_refuses_the_model_naming_the_file(
    repository: Path, local_server: WeightServer, tmp_path: Path
) -> None:
    proxy = ByteCountingProxy(local_server.http_port)
    upstream = f"http://127.0.0.1:{proxy.port}"
    with WeightServer(config(upstream, tmp_path)) as server:
        assert_same_tensors(fetch_verified(server.http_url, "big"), reference(repository, "big"))
    proxy.close()
    corrupt_in_place(cached(tmp_path, "big/model.safetensors"))
    with WeightServer(config(upstream, tmp_path)) as restarted:
        reply = http_request(restarted.http_port, "/v1/models/big")
        assert reply.status == 503, reply.body
        text = reply.body.decode()
        assert "big/model.safetensors" in text and "does not match" in text, text
        assert "xxh3-128" in text and "cannot be listed" in text, text
