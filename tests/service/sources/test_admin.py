"""The operator's controls of a node cache: prefetch (a fill without a load, with its
progress), evict (refused while in use or pinned) and verify (against the origin), over the
HTTP admin routes and through ``weightserve cache``, with and without an ``admin=`` grant,
through an upstream weightserve and a real S3 server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support import fixtures_safetensors
from tests.support._util import Reply, http_request
from tests.support.node_caches import config, corrupt_in_place, node_cache, write_repository
from tests.support.s3_server import S3Server
from weightserve.client import Client
from weightserve.client._cli import main as cli_main
from weightserve.client.errors import PermissionDenied
from weightserve.service.server import WeightServer
from weightserve.service.serving.auth import Access, parse_tokens
from weightserve.service.sources.files.stamps import file_stamp
from weightserve.service.sources.origin.catalog import OriginCatalog

READER = "reader-token"
OPERATOR = "operator-token"  # may read everything, administer big only


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightServer]:
    """A weightserve over a local root: the origin of the node caches below."""
    root = tmp_path_factory.mktemp("repository")
    write_repository(root)
    with WeightServer(config(str(root), tmp_path_factory.mktemp("upstream"))) as server:
        yield server


def admin(port: int, method: str, model: str, action: str = "", token: str | None = None) -> Reply:
    path = f"/v1/admin/cache/{model}" + (f"/-/{action}" if action else "")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return http_request(port, path, method, headers=headers)


def wait_cached(port: int, model: str, token: str | None = None) -> dict:
    for _ in range(200):
        state = admin(port, "GET", model, token=token).json()
        if state["state"] != "filling":
            return state
        time.sleep(0.05)
    raise AssertionError(f"{model} still filling")


def test_prefetch_evict_verify_over_http_on_this_node(
    upstream: WeightServer, tmp_path: Path
) -> None:
    with WeightServer(config(upstream.http_url, tmp_path)) as node:
        catalog = node.catalog
        assert isinstance(catalog, OriginCatalog)
        reply = admin(node.http_port, "POST", "big", "prefetch")
        assert reply.status == 202, reply.body
        assert reply.json()["state"] in ("filling", "cached")
        state = wait_cached(node.http_port, "big")
        assert state["state"] == "cached" and state["bytes_done"] == state["bytes_total"] > 0
        assert catalog.cache.cached_models() == ["big"]  # warm, without a load

        checked = admin(node.http_port, "POST", "big", "verify").json()
        assert checked["ok"] and {f["status"] for f in checked["files"]} == {"ok"}

        # 16 bytes overwritten on the node's disk: verify finds them and evicts the model.
        shard = catalog.cache.data_dir / "big" / "model.safetensors"
        with open(shard, "r+b") as f:
            f.seek(200)
            f.write(b"\xff" * 16)
        checked = admin(node.http_port, "POST", "big", "verify").json()
        assert not checked["ok"] and checked["evicted"]
        bad = [f for f in checked["files"] if f["status"] != "ok"]
        assert [(f["name"], f["status"]) for f in bad] == [("big/model.safetensors", "corrupt")]
        assert catalog.cache.cached_models() == []

        admin(node.http_port, "POST", "big", "prefetch")
        assert wait_cached(node.http_port, "big")["state"] == "cached"
        reply = admin(node.http_port, "DELETE", "big")
        assert reply.status == 200, reply.body
        assert reply.json()["evicted_bytes"] > 0 and catalog.cache.cached_models() == []
        assert admin(node.http_port, "GET", "big").json()["state"] == "remote"

        # A revision: the one the origin lists is warmed, another is RevisionNotFound.
        commit = http_request(upstream.http_port, "/v1/models/big").json()["commit"]
        assert admin(node.http_port, "POST", f"big@{commit[:12]}", "prefetch").status == 202
        assert wait_cached(node.http_port, "big")["state"] == "cached"
        reply = admin(node.http_port, "POST", "big@0123456789ab", "prefetch")
        assert reply.status == 404 and reply.error()[0] == "RevisionNotFound", reply.body
        assert admin(node.http_port, "DELETE", "big").status == 200

        # Unknown models and models not cached say so.
        assert admin(node.http_port, "POST", "nope", "prefetch").status == 404
        assert admin(node.http_port, "DELETE", "big").status == 404
        assert admin(node.http_port, "POST", "big", "verify").status == 404


def test_verify_reads_every_byte_of_a_file_whose_stamp_is_unchanged(
    upstream: WeightServer, tmp_path: Path
) -> None:
    """Bit rot: 16 bytes changed, the mtime put back and the fill record's stamp made to match
    (so no cheap check at start or per request sees it); the operator's verify hashes every
    byte against the fill record, reports the file, evicts it, and the next fill is whole."""
    with WeightServer(config(upstream.http_url, tmp_path)) as node:
        admin(node.http_port, "POST", "big", "prefetch")
        assert wait_cached(node.http_port, "big")["state"] == "cached"
        expected = Client(node.http_url).model("big").fetch(["w"])["w"]
    shard = tmp_path / "node-cache" / "data" / "big" / "model.safetensors"
    corrupt_in_place(shard)
    state_path = tmp_path / "node-cache" / "state" / "big.json"
    state = json.loads(state_path.read_text())
    state["files"]["big/model.safetensors"]["stamp"] = list(file_stamp(shard.stat()))
    state_path.write_text(json.dumps(state))
    with WeightServer(config(upstream.http_url, tmp_path)) as node:
        cache = node_cache(node)
        assert cache.cached_models() == ["big"]  # the stamp says nothing changed
        checked = admin(node.http_port, "POST", "big", "verify").json()
        assert not checked["ok"] and checked["evicted"], checked
        bad = [(f["name"], f["status"]) for f in checked["files"] if f["status"] != "ok"]
        assert bad == [("big/model.safetensors", "corrupt")]
        assert cache.snapshot().corrupt_files == 1 and cache.cached_models() == []
        got = Client(node.http_url, retry_seconds=30).model("big").fetch(["w"])["w"]
        np.testing.assert_array_equal(got, expected)  # filled again from the origin


def test_evict_is_refused_while_in_use_or_pinned(upstream: WeightServer, tmp_path: Path) -> None:
    with WeightServer(config(upstream.http_url, tmp_path, pins=("org/sharded",))) as node:
        catalog = node.catalog
        assert isinstance(catalog, OriginCatalog)
        reply = admin(node.http_port, "DELETE", "org/sharded")
        assert reply.status == 409 and "pinned" in reply.error()[1]
        with Client(node.http_url, retry_seconds=30) as client:
            client.model("big").fetch(["w"])
        with catalog.using("big"):  # what a stream holds while it reads
            reply = admin(node.http_port, "DELETE", "big")
            assert reply.status == 409 and "in use" in reply.error()[1]
        assert admin(node.http_port, "DELETE", "big").status == 200


def test_a_local_root_has_no_cache_to_act_on(upstream: WeightServer) -> None:
    reply = admin(upstream.http_port, "POST", "big", "prefetch")
    assert reply.status == 400 and "no node cache" in reply.error()[1]


def test_admin_grant_in_the_token_file(upstream: WeightServer, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{READER}\n{OPERATOR}  admin=big\n")
    with WeightServer(config(upstream.http_url, tmp_path / "c", token_file=str(tokens))) as node:
        assert admin(node.http_port, "POST", "big", "prefetch").status == 401
        reply = admin(node.http_port, "POST", "big", "prefetch", token=READER)
        assert reply.status == 403 and "admin=" in reply.error()[1]
        assert (
            admin(node.http_port, "POST", "org/sharded", "prefetch", token=OPERATOR).status == 403
        )
        assert admin(node.http_port, "POST", "big", "prefetch", token=OPERATOR).status == 202
        assert wait_cached(node.http_port, "big", OPERATOR)["state"] == "cached"
        # The grant adds to what the token reads: its read patterns stay as they were.
        with Client(node.http_url, token=READER) as client:
            assert client.model("big").fetch(["w"])["w"].shape == (512, 700)


def test_admin_keyword_and_the_default_without_tokens() -> None:
    (reader, operator) = parse_tokens(f"{READER} org/*\n{OPERATOR} admin=org/* admin=big\n")
    assert reader.patterns == ("org/*",) and reader.admin == ()
    assert operator.patterns == () and operator.admin == ("org/*", "big")
    Access(operator).check_admin("org/x", on_this_node=False)
    # A grant for a model covers its revisions, as read grants do.
    Access(operator).check_admin("big@main", on_this_node=False)
    Access(operator).check_admin("org/x@0123456789ab:fp16", on_this_node=False)
    assert not operator.may_administer("bigger@main")
    with pytest.raises(PermissionDenied, match="admin="):
        Access(reader).check_admin("org/x", on_this_node=True)
    with pytest.raises(PermissionDenied, match="admin="):
        Access(reader).check_admin("org/x@main", on_this_node=True)
    Access(None).check_admin("anything", on_this_node=True)
    with pytest.raises(PermissionDenied, match="token file"):
        Access(None).check_admin("anything", on_this_node=False)
    with pytest.raises(ValueError, match="admin="):
        parse_tokens("t admin=\n")


def test_cache_command(
    upstream: WeightServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{READER}\n{OPERATOR} admin=*\n")
    with WeightServer(config(upstream.http_url, tmp_path / "c", token_file=str(tokens))) as node:
        url = node.http_url
        assert cli_main(["cache", "prefetch", url, "big"]) == 1
        assert "Unauthenticated" in capsys.readouterr().err
        assert cli_main(["cache", "prefetch", url, "big", "--token", READER]) == 1
        assert "PermissionDenied" in capsys.readouterr().err
        assert cli_main(["cache", "prefetch", url, "big", "--token", OPERATOR]) == 0
        assert capsys.readouterr().out.strip() == "big cached"  # (no bar off a terminal)
        assert node_cache(node).cached_models() == ["big"]
        assert cli_main(["cache", "verify", url, "big", "--token", OPERATOR]) == 0
        assert "every file matches the origin" in capsys.readouterr().out
        assert cli_main(["cache", "evict", url, "big", "--token", OPERATOR]) == 0
        assert capsys.readouterr().out.startswith("evicted big")
        assert node_cache(node).cached_models() == []
        with pytest.raises(SystemExit):
            cli_main(["cache", "evict", "grpc://127.0.0.1:1", "big"])


@pytest.mark.s3
def test_prefetch_and_evict_through_an_s3_origin(s3_server: S3Server, tmp_path: Path) -> None:
    root = tmp_path / "origin" / "m"
    root.mkdir(parents=True)
    fixtures_safetensors.save_file(
        {"w": np.ones(1000, dtype=np.float32)}, root / "model.safetensors"
    )
    s3_server.upload(tmp_path / "origin", "admin")
    with WeightServer(config(s3_server.uri("admin"), tmp_path / "c")) as node:
        assert cli_main(["cache", "prefetch", node.http_url, "m", "--quiet"]) == 0
        assert node_cache(node).cached_models() == ["m"]
        checked = admin(node.http_port, "POST", "m", "verify").json()
        assert checked["ok"], checked
        assert cli_main(["cache", "evict", node.http_url, "m"]) == 0
        assert node_cache(node).cached_models() == []


def test_a_prefetch_is_filling_until_its_model_is_served(
    upstream: WeightServer, tmp_path: Path
) -> None:
    """After the bytes arrive the fill still indexes the copy: the state stays ``filling``
    until it is ``cached``, never ``remote`` in between (which ``weightserve cache prefetch``
    took for a failed fill)."""
    root = tmp_path / "origin"
    (root / "m").mkdir(parents=True)
    fixtures_safetensors.save_file(  # many tensors and side files: indexing takes a while
        {f"t{i}": np.ones(64, dtype=np.float32) for i in range(2000)},
        root / "m" / "model.safetensors",
    )
    for i in range(300):
        (root / "m" / f"side{i}.json").write_text("{}")
    with (
        WeightServer(config(str(root), tmp_path / "up")) as origin,
        WeightServer(config(origin.http_url, tmp_path / "node")) as node,
    ):
        seen = [admin(node.http_port, "POST", "m", "prefetch").json()["state"]]
        while seen[-1] != "cached":
            assert len(seen) < 20000, seen[-5:]
            seen.append(admin(node.http_port, "GET", "m").json()["state"])
        assert set(seen) <= {"filling", "cached"}, [s for s in seen if s != "filling"][:3]
