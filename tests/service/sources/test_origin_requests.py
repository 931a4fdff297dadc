"""What a node cache's rescans cost its origin, seen by a counting proxy in front of it: one LIST
per rescan of an object store, a HEAD only for an object new or changed (for its ETag), none for
the objects it already knows; one request per rescan of an unchanged
upstream weightserve; and ``weightserve_origin_requests_total{kind, outcome}`` agrees with the
proxy. Real processes: SeaweedFS as S3, an upstream weightserve.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support._util import http_request
from tests.support.byte_proxy import ByteCountingProxy
from tests.support.node_caches import config, load
from tests.support.revisions import arrays, values, write_model
from tests.support.s3_server import S3Server
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.origin.objects import FileSystemOrigin


def origin_requests(server: WeightServer) -> Counter[tuple[str, str]]:
    """``weightserve_origin_requests_total`` by (kind, outcome)."""
    text = http_request(server.http_port, "/metrics").body.decode()
    return Counter(
        {
            (sample.labels["kind"], sample.labels["outcome"]): int(sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "weightserve_origin_requests_total"
        }
    )


def s3_kinds(proxy: ByteCountingProxy) -> Counter[str]:
    """The proxy's requests as S3 calls: list (a GET of the bucket with list-type), head, get."""
    kinds: Counter[str] = Counter()
    for request, count in proxy.requests.items():
        method, target = request.split(" ", 1)
        kind = "list" if "list-type=" in target else method.lower()
        kinds[kind] += count
    return kinds


def test_an_s3_rescan_is_one_list_and_no_head_per_object(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Objects written a second ago count as settled (60 s by default, against clock skew).
    monkeypatch.setattr(FileSystemOrigin, "settle_seconds", 0.0)
    for n in range(3):
        write_model(tmp_path / "models" / "org" / f"m{n}", float(n))
    objects = len(s3_server.upload(tmp_path / "models", "requests"))
    time.sleep(1.1)  # their mtimes (whole seconds) in the past
    with ByteCountingProxy(s3_server.port) as proxy:
        node_config = replace(
            config(s3_server.uri("requests", port=proxy.port), tmp_path / "node"),
            rescan_seconds=0.5,
        )
        with WeightServer(node_config):
            assert s3_kinds(proxy)["head"] == objects  # the first listing: each object's ETag
            proxy.reset()
            time.sleep(3)  # about six rescans on their timer
            rescans = s3_kinds(proxy)
            assert rescans["list"] >= 3
            assert rescans["head"] == 0 and rescans["get"] == 0, proxy.requests

        # Explicit rescans and a fill: the metric counts what the proxy saw, kind by kind.
        proxy.reset()
        with WeightServer(
            config(s3_server.uri("requests", port=proxy.port), tmp_path / "n2")
        ) as node:
            for _ in range(3):
                node.rescan()
            assert values(load(node.http_url, "org/m1")) == values(arrays(1.0))
            seen = s3_kinds(proxy)
            counted = origin_requests(node)
        assert seen["list"] >= 4  # at start, three rescans, any the fill made
        assert seen["head"] >= 1 and seen["get"] >= 1  # a fill checks the version it reads
        for kind in ("list", "head", "get"):
            assert counted[kind, "ok"] == seen[kind], (kind, counted, proxy.requests)
            assert counted[kind, "error"] == 0


def test_an_unchanged_upstream_is_listed_with_one_request_per_rescan(tmp_path: Path) -> None:
    root = tmp_path / "upstream"
    write_model(root / "org" / "m", 1.0)
    write_model(root / "org" / "other", 5.0)
    upstream_config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False
    )
    with (
        WeightServer(upstream_config) as upstream,
        ByteCountingProxy(upstream.http_port) as proxy,
        # Rescans only: a follower's watch and its catch-up listing would be counted too.
        WeightServer(
            config(f"http://127.0.0.1:{proxy.port}", tmp_path / "node", follow=False)
        ) as node,
    ):
        proxy.reset()
        before = origin_requests(node)
        for _ in range(3):
            node.rescan()
        assert proxy.requests == Counter({"GET /v1/models": 3})
        assert origin_requests(node) - before == Counter({("list", "ok"): 3})

        # A changed model is listed again, the unchanged one is not.
        write_model(root / "org" / "m", 2.0)
        upstream.rescan()
        proxy.reset()
        node.rescan()
        assert sorted(proxy.requests) == ["GET /v1/models", "GET /v1/models/org/m/-/files"]
