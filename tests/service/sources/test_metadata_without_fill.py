"""Metadata of a node cache's uncached models without a fill: model info, the tensor index, the
Hub's model_info and paths-info are answered from ranged reads of headers (safetensors, GGUF,
PyTorch zip) and the shard index, through an upstream weightserve and a real S3 server; the
origin bytes are counted with a TCP proxy, and the cache stays empty until tensor bytes are
asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType, GGUFWriter
from huggingface_hub import HfApi

from tests.support import fixtures_gguf, fixtures_safetensors, fixtures_torch
from tests.support._util import http_request
from tests.support.byte_proxy import ByteCountingProxy
from tests.support.node_caches import BIG, MIB, config, node_cache, write_big
from tests.support.s3_server import S3Server
from weightserve.client import Client
from weightserve.service.server import WeightServer


def write_long_header_gguf(path: Path) -> None:
    """A GGUF whose key-values (a 200,000-token vocabulary) are longer than the first prefix
    a node reads: the prefix must grow until the header ends inside it."""
    writer = GGUFWriter(path, arch="llama")
    tokens = [f"token-{i:07d}" for i in range(200_000)]
    writer.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    writer.add_tensor("w", np.arange(1 << 20, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    write_big(root)
    (root / "q").mkdir()
    fixtures_gguf.write_mixed(root / "q" / "tiny.gguf")
    write_long_header_gguf(root / "q" / "vocab.gguf")
    (root / "pt").mkdir()
    fixtures_torch.write_views(root / "pt" / "pytorch_model.bin")
    return root


@pytest.fixture(scope="module")
def upstream(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightServer]:
    with WeightServer(config(str(repository), tmp_path_factory.mktemp("upstream"))) as server:
        yield server


def assert_cache_empty(server: WeightServer) -> None:
    cache = node_cache(server)
    stats = cache.snapshot()
    assert stats.fills == 0 and stats.bytes_used == 0 and not cache.cached_models()
    assert not [p for p in cache.data_dir.rglob("*") if p.is_file()]


def info(port: int, model_id: str) -> dict:
    reply = http_request(port, f"/v1/models/{model_id}")
    assert reply.status == 200, reply.body[:300]
    return reply.json()


def test_model_info_and_hub_metadata_of_an_uncached_256_mib_model_cost_under_1_mib(
    upstream: WeightServer, repository: Path, tmp_path: Path
) -> None:
    want = info(upstream.http_port, BIG)
    with (
        ByteCountingProxy(upstream.http_port) as proxy,
        WeightServer(config(f"http://127.0.0.1:{proxy.port}", tmp_path)) as node,
    ):
        proxy.reset()  # the start lists the upstream's models and files
        got = info(node.http_port, BIG)
        # The upstream lists content digests: the node names the same revision before a fill.
        assert got == want
        hub = HfApi(endpoint=node.http_url)
        model = hub.model_info(BIG, files_metadata=True)
        upstream_model = HfApi(endpoint=upstream.http_url).model_info(BIG, files_metadata=True)
        assert model.sha == upstream_model.sha
        assert {s.rfilename: s.size for s in model.siblings or []} == {
            s.rfilename: s.size for s in upstream_model.siblings or []
        }
        paths = hub.get_paths_info(BIG, ["config.json", "model.safetensors.index.json"])
        assert sorted(p.path for p in paths) == ["config.json", "model.safetensors.index.json"]
        pinned = info(node.http_port, f"{BIG}@{want['commit'][:12]}")
        assert pinned["commit"] == want["commit"] and pinned["tensors"] == want["tensors"]
        assert http_request(node.http_port, f"/v1/models/{BIG}@0123456789ab").status == 404
        # Side files are fetched alone (what AutoConfig and tokenizers read): no fill.
        for path, name in [
            (f"/{BIG}/resolve/main/config.json", "config.json"),
            (f"/v1/models/{BIG}/-/files/tokenizer.json", "tokenizer.json"),
        ]:
            reply = http_request(node.http_port, path)
            assert reply.status == 200, reply.body[:300]
            assert reply.body == (repository / BIG / name).read_bytes()
            assert reply.headers["etag"] == http_request(upstream.http_port, path).headers["etag"]
        assert proxy.bytes_from_upstream < MIB, proxy.bytes_from_upstream
        assert_cache_empty(node)
        # Tensor bytes fill the model, once, and the metadata stays the same.
        with Client(node.http_url, retry_seconds=30) as client:
            got_bytes = client.model(BIG).fetch(["layers.2.b"])["layers.2.b"]
        assert got_bytes.tobytes() == np.arange(4096, dtype=np.float32).tobytes()
        assert node_cache(node).cached_models() == [BIG]
        assert info(node.http_port, BIG) == want


@pytest.mark.parametrize("model_id", ["q/tiny.gguf", "q/vocab.gguf", "pt"])
def test_gguf_and_pytorch_metadata_without_a_fill(
    upstream: WeightServer, repository: Path, tmp_path: Path, model_id: str
) -> None:
    want = info(upstream.http_port, model_id)
    for root in (f"http://127.0.0.1:{upstream.http_port}", repository.as_uri()):
        with WeightServer(config(root, tmp_path / root.partition(":")[0])) as node:
            got = info(node.http_port, model_id)
            if root.startswith("file:"):  # no content digests listed: known once filled
                for key in ("revision", "commit"):
                    assert got.get(key, "") == ""
                    got[key] = want.get(key)
            assert got == want
            assert_cache_empty(node)


@pytest.mark.s3
def test_s3_model_info_of_an_uncached_model_costs_headers_alone(
    s3_server: S3Server, upstream: WeightServer, repository: Path, tmp_path: Path
) -> None:
    s3_server.upload(repository / "q", "headers/q")
    s3_server.upload(repository / "pt", "headers/pt")
    small = tmp_path / "small" / "m"
    small.mkdir(parents=True)
    fixtures_safetensors.save_file(
        {"w": np.ones(8 * MIB // 4, dtype=np.float32)}, small / "model.safetensors"
    )
    s3_server.upload(tmp_path / "small", "headers")
    with ByteCountingProxy(s3_server.port) as proxy:
        uri = s3_server.uri("headers", port=proxy.port)
        with WeightServer(config(uri, tmp_path / "node")) as node:
            proxy.reset()
            got = info(node.http_port, "m")
            assert [t["name"] for t in got["tensors"]] == ["w"] and got["revision"] == ""
            for model_id in ("q/tiny.gguf", "pt"):
                want = info(upstream.http_port, model_id)
                assert info(node.http_port, model_id)["tensors"] == want["tensors"]
            assert proxy.bytes_from_upstream < MIB, proxy.bytes_from_upstream
            assert_cache_empty(node)
