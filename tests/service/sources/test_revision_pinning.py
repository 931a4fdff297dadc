"""Loads that name their revision: ``Client(url).model(ID, revision=R)``, ``ID@R`` in URLs,
``RemoteWeights``/``load_weights(..., revision=R)`` and ``weightserve ls|pull --revision``.

One server on loopback (HTTP, gRPC, Arrow Flight and the same-node handoff) serves a model
whose file is replaced by an atomic rename during the tests: a load pinned to the old commit
gets the old bytes while its stream runs, ``RevisionNotFound`` (naming what the server holds)
once the server sees the new file, never the new bytes; ``main`` gets the new ones.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.support._util import http_request
from tests.support.revisions import TENSORS, arrays, values, write_model
from weightserve.client import _cli
from weightserve.client._client import Client
from weightserve.client.errors import (
    STATUS_TABLE,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RevisionNotFound,
    status_for,
)
from weightserve.client.max.load import load_weights
from weightserve.client.max.weights import RemoteWeights
from weightserve.client.wire.routes import parse_url, split_revision, with_revision
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.sources.revisions.pinning import pick_revision

PLANES = ("http", "grpc", "flight", "handoff")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WeightServer, Path]]:
    root = tmp_path / "root"
    write_model(root / "org" / "m", 1.0)
    (root / "org" / "m" / "config.json").write_text('{"model_type": "test"}')
    sockets = tempfile.mkdtemp(prefix="ws-")  # a Unix socket path must be short
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=0, uds=f"{sockets}/ws.sock",
        rescan_seconds=0, watch=False,
    )  # fmt: skip
    try:
        with WeightServer(config) as srv:
            yield srv, root
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def client_for(srv: WeightServer, plane: str) -> Client:
    if plane == "handoff":
        return Client(f"unix://{srv.config.uds}", data_plane="handoff")
    url = srv.grpc_url if plane in ("grpc", "flight") else srv.http_url
    return Client(url, data_plane=plane)


def test_ids_name_their_revision_one_way() -> None:
    assert split_revision("org/m") == ("org/m", None)
    assert split_revision("org/m@main") == ("org/m", "main")
    # A hub snapshot's sub-model keeps the revision on the repository part, as the Hub does.
    assert split_revision("org/m@v2/unet") == ("org/m/unet", "v2")
    assert split_revision("org/m@abc:fp16") == split_revision("org/m:fp16@abc")
    assert with_revision("org/m", "0123456789ab") == "org/m@0123456789ab"
    assert with_revision("org/m@v2", "v2") == "org/m@v2"
    assert with_revision("org/m", None) == "org/m"
    for bad in ("org/m@", "org/m@a@b"):
        with pytest.raises(InvalidRequest):
            split_revision(bad)
    with pytest.raises(InvalidRequest, match="names revision 'v2'"):
        with_revision("org/m@v2", "v3")
    with pytest.raises(InvalidRequest):
        with_revision("org/m", "refs/pr/1")
    for url in ("http://h:1/v1/models/org/m@v2", "grpc://h:2/org/m@v2"):
        assert parse_url(url)[1] == "org/m@v2"


def test_revision_not_found_is_a_not_found() -> None:
    assert issubclass(RevisionNotFound, NotFound)
    assert RevisionNotFound not in STATUS_TABLE  # NotFound's row
    assert status_for(RevisionNotFound("x")) == (404, "NOT_FOUND")


@pytest.mark.parametrize("plane", PLANES)
def test_a_pinned_load_gets_its_revision_on_every_transport(served, plane: str) -> None:
    srv, _ = served
    with client_for(srv, plane) as client:
        main = client.model("org/m")
        commit, revision = main.commit, main.revision
        assert len(commit) == 40 and commit.startswith(revision)
        for pin in (commit, revision, commit[:12], commit.upper(), "main"):
            model = client.model("org/m", revision=pin)
            assert (model.commit, model.revision) == (commit, revision), pin
            assert model.id == f"org/m@{pin}"
            assert values(model.fetch(prefix="")) == values(arrays(1.0)), pin
        if plane == "handoff":
            assert client.planes().handoff is not None


@pytest.mark.parametrize("plane", PLANES)
def test_a_load_pinned_to_a_replaced_revision_never_gets_the_new_bytes(served, plane: str) -> None:
    srv, root = served
    with client_for(srv, plane) as client:
        old = client.model("org/m").commit
        pinned = client.model("org/m", revision=old)
        # A stream that is under way when the file is replaced reads the old file to its end.
        stream = pinned.iter_tensors(prefix="", window_bytes=1)
        first = next(stream)
        write_model(root / "org" / "m", 2.0)
        srv.rescan()
        rest = dict(stream)
        assert values({first[0]: first[1], **rest}) == values(arrays(1.0))
        # Once the server holds only the new file, the old commit is refused, naming it.
        new = client.model("org/m").commit
        assert new != old
        for load in (
            lambda: client.model("org/m", revision=old),
            lambda: pinned.fetch(prefix=""),
            lambda: client.model_info("org/m", revision=old[:12]),
        ):
            with pytest.raises(RevisionNotFound, match=f"main \\(commit {new}\\)") as e:
                load()
            assert old[:12] in str(e.value)
        assert values(client.model("org/m", revision="main").fetch(prefix="")) == values(
            arrays(2.0)
        )
        assert values(client.model("org/m", revision=new).fetch(prefix="")) == values(arrays(2.0))


def test_names_that_pick_no_revision_or_too_many(served) -> None:
    srv, _ = served
    with Client(srv.http_url) as client:
        commit = client.model("org/m").commit
        with pytest.raises(InvalidRequest, match="too short"):
            client.model("org/m", revision=commit[:11])
        with pytest.raises(RevisionNotFound, match=f"no revision 'v9'.*main \\(commit {commit}"):
            client.model("org/m", revision="v9")
        with pytest.raises(RevisionNotFound):
            client.model("org/m", revision="0" * 40)
        with pytest.raises(InvalidRequest):
            client.model("org/m", revision="a/b")

    # Two held revisions whose commits start alike: a prefix of both is refused.
    def held(digest: str) -> SimpleNamespace:
        return SimpleNamespace(revision_digest=lambda: digest, commit=digest[:40])

    one, two = held("ab" * 6 + "0" * 52), held("ab" * 6 + "1" * 52)
    both = {"main": one, "v1": two}
    with pytest.raises(InvalidRequest, match="ambiguous"):
        pick_revision("org/m", "ab" * 6, both)  # type: ignore[arg-type]
    assert pick_revision("org/m", "ab" * 6 + "1", both) is two  # type: ignore[arg-type]
    assert pick_revision("org/m", "v1", both) is two  # type: ignore[arg-type]


def test_urls_and_max_loads_name_their_revision(served) -> None:
    srv, root = served
    with Client(srv.http_url) as client:
        old = client.model("org/m").commit
    urls = [f"{srv.http_url}/v1/models/org/m@{old}", f"{srv.grpc_url}/org/m@{old[:12]}"]
    for url in urls:
        weights = RemoteWeights(url, use_max=False)
        assert weights.remote_model.commit == old
        assert float(weights.numpy_state_dict()["a"][0]) == 1.0
        weights.close()
    weights = load_weights([f"{srv.http_url}/v1/models/org/m"], use_max=False, revision=old)
    assert weights.remote_model.id == f"org/m@{old}"
    weights.close()
    with pytest.raises(InvalidRequest, match="names revision"):
        load_weights([urls[0]], use_max=False, revision="main")
    write_model(root / "org" / "m", 2.0)
    srv.rescan()
    for url in urls:
        with pytest.raises(RevisionNotFound):
            RemoteWeights(url, use_max=False)
    with pytest.raises(RevisionNotFound):
        load_weights([f"{srv.grpc_url}/org/m"], use_max=False, revision=old)


def test_info_index_and_files_answer_for_the_revision(served) -> None:
    srv, root = served
    port = srv.http_port
    with Client(srv.http_url) as client:
        old = client.model("org/m")
        listing = old.files()
    assert {f.name for f in listing} == {"model.safetensors", "config.json"}
    for path in (f"/v1/models/org/m@{old.commit}", f"/v1/models/org/m@{old.commit}/-/files"):
        reply = http_request(port, path)
        assert reply.status == 200, path
        assert reply.json()["revision"] == old.revision
    info = http_request(port, f"/v1/models/org/m@{old.revision}").json()
    assert info["commit"] == old.commit and [t["name"] for t in info["tensors"]] == list(TENSORS)
    config = http_request(port, f"/v1/models/org/m@{old.commit[:12]}/-/files/config.json")
    assert config.body == b'{"model_type": "test"}'

    write_model(root / "org" / "m", 2.0)
    srv.rescan()
    for path in (
        f"/v1/models/org/m@{old.commit}",
        f"/v1/models/org/m@{old.commit}/-/files",
        f"/v1/models/org/m@{old.commit}/-/files/model.safetensors",
        f"/v1/models/org/m@{old.commit}/-/tensors/a",
    ):
        reply = http_request(port, path)
        assert reply.status == 404, path
        kind, message = reply.error()
        assert kind == "RevisionNotFound" and "it holds main (commit" in message, path
    too_short = http_request(port, f"/v1/models/org/m@{old.commit[:8]}")
    assert (too_short.status, too_short.error()[0]) == (400, "InvalidRequest")
    # gRPC: NOT_FOUND, with the class in the trailers, as every error.
    import grpc

    from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
    from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(srv.grpc_url.removeprefix("grpc://")) as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModel(pb.GetModelRequest(model=f"org/m@{old.commit}"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        fresh = stub.GetModel(pb.GetModelRequest(model="org/m@main"))
        assert fresh.commit.startswith(fresh.revision) and fresh.commit != old.commit


def test_the_command_line_lists_and_pulls_a_revision(served, tmp_path: Path, capsys) -> None:
    srv, root = served
    url = f"{srv.http_url}/v1/models/org/m"
    with Client(srv.http_url) as client:
        old = client.model("org/m").commit
    assert _cli.main(["ls", url, "--revision", old[:12]]) == 0
    assert f"commit {old}" in capsys.readouterr().out
    out = tmp_path / "pulled"
    assert _cli.main(["pull", url, "--revision", old, "--out", str(out), "--quiet"]) == 0
    assert (out / "model.safetensors").read_bytes() == (
        root / "org" / "m" / "model.safetensors"
    ).read_bytes()
    write_model(root / "org" / "m", 2.0)
    srv.rescan()
    capsys.readouterr()
    assert _cli.main(["ls", f"{url}@{old}"]) == 1
    assert "RevisionNotFound" in capsys.readouterr().err
    assert _cli.main(["pull", url, "--revision", old, "--out", str(tmp_path / "x"), "--quiet"]) == 1
    assert "RevisionNotFound" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a server URL lists models: no revision to name
        _cli.main(["ls", srv.http_url, "--revision", old])


def test_tensor_parallel_ranks_load_the_commit_rank_0_resolved(served) -> None:
    srv, root = served
    with Client(srv.http_url) as rank0:
        commit = rank0.model("org/m", revision="main").commit
    write_model(root / "org" / "m", 2.0)  # the model moves on between the ranks' loads
    parts = []
    for rank in range(2):
        with Client(srv.http_url) as client:
            try:
                pinned = client.model("org/m", revision=commit)
                parts.append(pinned.fetch(["a"], shard=(rank, 2))["a"])
            except RevisionNotFound:
                parts.append(None)  # refused, never the new bytes
    whole = arrays(1.0)["a"]
    for rank, part in enumerate(parts):
        assert part is None or np.array_equal(part, np.array_split(whole, 2)[rank])


def test_a_grant_for_a_model_covers_its_revisions(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_model(root / "org" / "m", 1.0)
    write_model(root / "other", 3.0)
    tokens = tmp_path / "tokens"
    tokens.write_text("m-token org/m\n")
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, token_file=str(tokens),
        rescan_seconds=0, watch=False,
    )  # fmt: skip
    with WeightServer(config) as srv, Client(srv.http_url, token="m-token") as client:
        commit = client.model("org/m").commit
        assert client.model("org/m", revision=commit[:12]).commit == commit
        with pytest.raises(PermissionDenied):
            client.model("other", revision="main")


def test_hub_cache_snapshots_are_revisions_of_their_repository(tmp_path: Path) -> None:
    """A hub cache's ``ORG/NAME@REF`` and ``ORG/NAME@SNAPSHOT`` ids are served as before, and
    content commits pick among the repository's snapshots."""
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshots = {"1" * 40: 1.0, "2" * 40: 2.0}
    for sha, value in snapshots.items():
        write_model(repo / "snapshots" / sha, value)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("2" * 40)
    (repo / "refs" / "v1").write_text("1" * 40)
    catalog = Catalog(tmp_path / "hub")
    main, v1 = catalog.get("acme/tiny"), catalog.get("acme/tiny@v1")
    assert catalog.get("acme/tiny@main") is main
    assert catalog.get(f"acme/tiny@{'1' * 40}").commit == v1.commit
    assert catalog.get(f"acme/tiny@{v1.commit[:12]}").commit == v1.commit
    assert catalog.get(f"acme/tiny@{main.commit}").commit == main.commit
    with pytest.raises(RevisionNotFound, match=f"v1 \\(commit {v1.commit}\\)"):
        catalog.get("acme/tiny@v2")


def test_node_caches_serve_the_origins_revisions(tmp_path: Path) -> None:
    """Two node caches in front of one upstream: both report the upstream's commit; once the
    upstream's model changes, a load pinned to the old commit gets the old bytes or
    RevisionNotFound on either node, never the new bytes, and ``main`` gets the new."""
    root = tmp_path / "upstream"
    write_model(root / "org" / "m", 1.0)
    upstream_config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False
    )
    with WeightServer(upstream_config) as upstream, contextlib.ExitStack() as nodes:
        origin = f"http://127.0.0.1:{upstream.http_port}"
        caches = [
            nodes.enter_context(
                WeightServer(
                    ServerConfig(
                        origin,
                        http_port=0,
                        grpc_port=0,
                        flight_port=None,
                        rescan_seconds=0,
                        watch=False,
                        cache_dir=str(tmp_path / f"node-{n}"),
                    )  # fmt: skip
                )
            )
            for n in range(2)
        ]
        with Client(upstream.http_url) as client:
            old = client.model("org/m").commit
        for node in caches:
            with Client(node.http_url, retry_seconds=30) as client:
                pinned = client.model("org/m", revision=old)
                assert pinned.commit == old
                assert values(pinned.fetch(prefix="")) == values(arrays(1.0))
        write_model(root / "org" / "m", 2.0)
        upstream.rescan()
        for node in caches:
            node.rescan()
            with Client(node.http_url, retry_seconds=30) as client:
                try:
                    got = client.model("org/m", revision=old).fetch(prefix="")
                    assert values(got) == values(arrays(1.0))
                except RevisionNotFound as e:
                    assert old in str(e)
                new = client.model("org/m", revision="main")
                assert new.commit != old
                assert values(new.fetch(prefix="")) == values(arrays(2.0))
