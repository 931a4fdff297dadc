"""A node cache's listing follows its origin: after one rescan, every node's ``/v1/models`` (and
gRPC ListModels) reports the revision the origin holds now for every model, requested or not;
a model the node holds of an older version is ``outdated``, its copy's revision apart
(``cached_revision``), never reported as current. Real processes: an upstream weightserve and
SeaweedFS as S3 in front of two node caches each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support._util import http_request
from tests.support.s3_server import S3Server
from tests.test_origin_serving import config, node_cache
from tests.test_revision_pinning import arrays, values, write_model
from weightserve.client import Client
from weightserve.service.server import ServerConfig, WeightServer


def listing(server: WeightServer) -> dict[str, dict]:
    """The server's ``/v1/models``, by model id."""
    return {m["id"]: m for m in http_request(server.http_port, "/v1/models").json()["models"]}


@contextlib.contextmanager
def two_nodes(origin: str, tmp_path: Path) -> Iterator[list[WeightServer]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(WeightServer(config(origin, tmp_path / f"node-{n}")))
            for n in range(2)
        ]


def test_every_nodes_listing_shows_the_upstreams_revision_within_one_rescan(
    tmp_path: Path,
) -> None:
    root = tmp_path / "upstream"
    write_model(root / "org" / "m", 1.0)
    write_model(root / "org" / "other", 5.0)
    upstream_config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False
    )
    with (
        WeightServer(upstream_config) as upstream,
        two_nodes(upstream.http_url, tmp_path) as (loaded, idle),
    ):
        with Client(loaded.http_url, retry_seconds=30) as client:
            assert values(client.model("org/m").fetch(prefix="")) == values(arrays(1.0))
        before = listing(upstream)
        for node in (loaded, idle):
            for model_id in ("org/m", "org/other"):  # the origin's, cached or not
                got = listing(node)[model_id]
                want = before[model_id]
                assert (got["revision"], got["commit"]) == (want["revision"], want["commit"])
                assert len(got["commit"]) == 40 and got["commit"].startswith(got["revision"])
        assert listing(loaded)["org/m"]["state"] == "cached"
        assert listing(loaded)["org/m"]["cached_revision"] == before["org/m"]["revision"]
        assert listing(idle)["org/m"]["state"] == "remote"

        write_model(root / "org" / "m", 2.0)  # a new file renamed over the old
        write_model(root / "org" / "other", 6.0)
        upstream.rescan()
        fills = node_cache(loaded).snapshot().fills
        for node in (loaded, idle):
            node.rescan()  # one rescan, no request for either model
        after = listing(upstream)
        for model_id in ("org/m", "org/other"):
            assert after[model_id]["commit"] != before[model_id]["commit"]
            for node in (loaded, idle):
                got = listing(node)[model_id]
                want = after[model_id]
                assert (got["revision"], got["commit"]) == (want["revision"], want["commit"])
        outdated = listing(loaded)["org/m"]
        assert outdated["state"] == "outdated"
        assert outdated["cached_revision"] == before["org/m"]["revision"]
        assert listing(idle)["org/m"]["state"] == "remote"
        assert listing(idle)["org/m"]["cached_revision"] == ""
        # The model's info follows too, from its headers: no fill.
        info = http_request(loaded.http_port, "/v1/models/org/m").json()
        assert (info["revision"], info["commit"]) == (
            after["org/m"]["revision"],
            after["org/m"]["commit"],
        )
        assert node_cache(loaded).snapshot().fills == fills  # the listing filled nothing

        with Client(loaded.grpc_url) as client:  # gRPC ListModels says the same
            summary = {m.id: m for m in client.list_models()[0]}["org/m"]
            assert (summary.state, summary.commit) == ("outdated", after["org/m"]["commit"])
            assert summary.cached_revision == before["org/m"]["revision"]
        with Client(loaded.http_url, retry_seconds=30) as client:
            assert values(client.model("org/m").fetch(prefix="")) == values(arrays(2.0))
        current = listing(loaded)["org/m"]
        assert current["state"] == "cached"
        assert current["revision"] == current["cached_revision"] == after["org/m"]["revision"]


@pytest.mark.s3
def test_an_s3_object_changed_under_a_cached_model_lists_it_outdated(
    s3_server: S3Server, tmp_path: Path
) -> None:
    source = tmp_path / "origin"
    write_model(source / "m", 1.0)
    s3_server.upload(source, "listing")
    with two_nodes(s3_server.uri("listing"), tmp_path) as (loaded, idle):
        with Client(loaded.http_url, retry_seconds=30) as client:
            assert values(client.model("m").fetch(prefix="")) == values(arrays(1.0))
        cached = listing(loaded)["m"]
        assert cached["state"] == "cached" and cached["revision"] == cached["cached_revision"]
        old = cached["revision"]
        assert len(cached["commit"]) == 40
        # ETags alone: the revision of a model not held is known once it is filled.
        assert (listing(idle)["m"]["state"], listing(idle)["m"]["revision"]) == ("remote", "")

        write_model(source / "m", 2.0)
        s3_server.upload(source, "listing")  # a new object over the old: another ETag
        fills = node_cache(loaded).snapshot().fills
        for node in (loaded, idle):
            node.rescan()
        outdated = listing(loaded)["m"]
        assert outdated["state"] == "outdated" and outdated["cached_revision"] == old
        assert (outdated["revision"], outdated["commit"]) == ("", "")  # never the old one
        assert listing(idle)["m"]["state"] == "remote"
        info = http_request(loaded.http_port, "/v1/models/m").json()
        assert info["revision"] != old  # described from its headers: known once filled
        assert node_cache(loaded).snapshot().fills == fills

        with Client(loaded.http_url, retry_seconds=30) as client:
            assert values(client.model("m").fetch(prefix="")) == values(arrays(2.0))
        current = listing(loaded)["m"]
        assert current["state"] == "cached" and current["revision"] not in ("", old)
        assert current["cached_revision"] == current["revision"]
