"""A node cache's listing follows its origin: after one rescan, every node's ``/v1/models`` (and
gRPC ListModels) reports the revision the origin holds now for every model, requested or not;
a model the node holds of an older version is ``outdated``, its copy's revision apart
(``cached_revision``), never reported as current. Real processes: an upstream weightserve and
SeaweedFS as S3 in front of two node caches each.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from safetensors.numpy import save_file

from tests.support._util import http_request
from tests.support.node_caches import config, node_cache
from tests.support.revisions import arrays, values, write_model
from tests.support.s3_server import S3Server
from weightserve.client import Client
from weightserve.client.errors import RevisionNotFound
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


def test_a_node_serves_the_revision_it_holds_after_its_origin_moved_on(tmp_path: Path) -> None:
    """``ID@R`` for the copy a node holds is served as it is, with no origin byte read, on
    HTTP and gRPC, until a ``main`` load refills the model; R then names nothing held."""
    root = tmp_path / "upstream"
    write_model(root / "org" / "m", 1.0)
    upstream_config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False
    )
    with (
        WeightServer(upstream_config) as upstream,
        WeightServer(config(upstream.http_url, tmp_path / "node")) as node,
    ):
        with Client(node.http_url, retry_seconds=30) as client:
            assert values(client.model("org/m").fetch(prefix="")) == values(arrays(1.0))
        old = listing(node)["org/m"]["commit"]
        write_model(root / "org" / "m", 2.0)  # a new file renamed over the old
        upstream.rescan()
        node.rescan()
        new = listing(upstream)["org/m"]["commit"]
        assert new != old and listing(node)["org/m"]["state"] == "outdated"
        before = node_cache(node).snapshot()
        for url in (node.http_url, node.grpc_url):
            with Client(url, retry_seconds=30) as client:
                for pin in (old, old[:12]):
                    got = client.model(f"org/m@{pin}").fetch(prefix="")
                    assert values(got) == values(arrays(1.0)), (url, pin)
                # Neither held nor the origin's: refused without a fill, naming both.
                with pytest.raises(RevisionNotFound, match=f"main \\(commit {old}.*{new}"):
                    client.model(f"org/m@{'0' * 40}").fetch(prefix="")
        info = http_request(node.http_port, f"/v1/models/org/m@{old}").json()
        assert info["commit"] == old
        after = node_cache(node).snapshot()
        assert (after.origin_bytes, after.fills) == (before.origin_bytes, before.fills)
        assert listing(node)["org/m"]["state"] == "outdated"

        with Client(node.http_url, retry_seconds=30) as client:
            assert values(client.model("org/m").fetch(prefix="")) == values(arrays(2.0))
            assert values(client.model(f"org/m@{new}").fetch(prefix="")) == values(arrays(2.0))
        assert node_cache(node).snapshot().origin_bytes > after.origin_bytes
        for url in (node.http_url, node.grpc_url):
            with (
                Client(url, retry_seconds=30) as client,
                pytest.raises(RevisionNotFound, match=f"main \\(commit {new}"),
            ):
                client.model(f"org/m@{old}").fetch(prefix="")


def test_a_stream_of_the_held_revision_outlives_a_refill(tmp_path: Path) -> None:
    """A stream pinned to the copy a node holds, running while a ``main`` load refills the
    model from its moved-on origin, ends with the held revision's bytes (the refill renames
    new files over the old, whose mapping the stream keeps); then R names nothing held."""
    root = tmp_path / "upstream"
    big = 16 * 1024 * 1024  # float32s: 64 MiB, more than the sockets buffer between them

    def write_big(value: float) -> None:
        (root / "big").mkdir(parents=True, exist_ok=True)
        fresh = root / "big" / "model.safetensors.tmp"
        save_file({"w": np.full(big, value, dtype=np.float32)}, str(fresh))
        os.replace(fresh, root / "big" / "model.safetensors")

    write_big(1.0)
    upstream_config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False
    )
    with (
        WeightServer(upstream_config) as upstream,
        WeightServer(config(upstream.http_url, tmp_path / "node")) as node,
        Client(node.http_url, retry_seconds=30) as client,
    ):
        assert client.model("big").fetch(prefix="")["w"][-1] == 1.0
        old = listing(node)["big"]["commit"]
        write_big(2.0)
        upstream.rescan()
        node.rescan()
        connection = http.client.HTTPConnection("127.0.0.1", node.http_port, timeout=60)
        connection.request("GET", f"/v1/models/big@{old}/-/stream?prefix=")
        response = connection.getresponse()
        assert response.status == 200
        head = response.read(1 << 16)  # the stream is under way, most of it unsent
        assert client.model("big").fetch(prefix="")["w"][-1] == 2.0  # the refill
        table = pa.ipc.open_stream(io.BytesIO(head + response.read())).read_all()
        connection.close()
        pinned = np.concatenate(
            [np.frombuffer(c.as_py(), np.float32) for c in table.column("data")]
        )
        assert pinned.size == big and bool((pinned == 1.0).all())
        with pytest.raises(RevisionNotFound):
            client.model(f"big@{old}").fetch(prefix="")
