"""Publishing into a bucket: a node over SeaweedFS takes a publish and writes the revision
into the bucket in the hub cache's layout (objects, record, ``refs/main`` last); another node
over the same bucket serves it and, holding the model, follows the next publish at its rescan
and tells its watchers once it holds the bytes."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from tests.support._util import http_request
from tests.support.node_caches import node_cache
from tests.support.s3_server import S3Server
from weightserve.client._client import Client
from weightserve.client._publish import Revision
from weightserve.service.server import ServerConfig, WeightServer

MODEL = "team/policy"


def weights(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full((128, 64), step, dtype=np.float32), "b": np.arange(step, step + 4.0)}


def node(uri: str, cache: Path, **settings: object) -> WeightServer:
    return WeightServer(
        ServerConfig(
            uri,
            http_port=0,
            grpc_port=0,
            flight_port=None,
            watch=False,
            cache_dir=str(cache),
            grace_seconds=1,
            **settings,  # type: ignore[arg-type]
        )  # fmt: skip
    )


def publish_into(uri: str, cache: Path, tensors: dict[str, np.ndarray]) -> Revision:
    """``tensors`` and a config published into the bucket by a node that then stops."""
    with (
        node(uri, cache, allow_publish=True, rescan_seconds=0) as publisher,
        Client(publisher.http_url) as c,
    ):
        return c.publish(MODEL, tensors, files={"config.json": b"{}"})


def wait_for(check, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.s3
def test_a_publish_into_a_bucket_is_followed_by_a_node_over_it(
    s3_server: S3Server, tmp_path: Path
) -> None:
    prefix = f"published-{uuid.uuid4().hex[:8]}"
    uri = s3_server.uri(prefix)
    with (
        node(uri, tmp_path / "a", allow_publish=True, rescan_seconds=0) as publisher,
        node(uri, tmp_path / "b", rescan_seconds=0.5) as follower,
    ):
        with Client(publisher.http_url) as c:
            first = c.publish(MODEL, weights(1), files={"config.json": b"{}"}, message="one")
        # The bucket holds ordinary files in the hub cache's layout, main named last.
        fs, root = pafs.FileSystem.from_uri(uri)
        with fs.open_input_stream(f"{root}/models--team--policy/refs/main") as ref:
            assert ref.read().decode() == first.commit
        with Client(follower.http_url, retry_seconds=30) as c:
            wait_for(lambda: MODEL in {m.id for m in c.list_models()[0]})
            got = c.model(MODEL).fetch()  # the follower fills it (over S3 the commit is
            assert np.array_equal(np.asarray(got["w"]), weights(1)["w"])  # known once held)
            assert c.model(MODEL).commit == first.commit
            assert c.revisions(MODEL)[0].commit == first.commit
        heard: list[Revision] = []

        def watch() -> None:
            with Client(follower.http_url) as c:
                heard.extend(itertools.islice(c.model(MODEL).watch(timeout=30), 1))

        watcher = threading.Thread(target=watch)
        watcher.start()
        time.sleep(0.5)
        with Client(publisher.http_url) as c:
            second = c.model(MODEL).publish(
                {"w": weights(2)["w"]}, base=first.commit, message="two"
            )
        watcher.join(30)
        assert [r.commit for r in heard] == [second.commit]
        with Client(follower.http_url) as c:
            model = c.model(MODEL)
            assert model.commit == second.commit
            got = model.fetch()
            assert np.array_equal(np.asarray(got["w"]), weights(2)["w"])
            assert np.array_equal(np.asarray(got["b"]), weights(1)["b"])  # kept from the base
        with Client(publisher.http_url) as c:
            listed = [r.commit for r in c.revisions(MODEL)]
            assert listed == [second.commit, first.commit]
            assert c.revisions(MODEL)[0].message == "two"


@pytest.mark.s3
def test_the_tensor_parallel_recipe_over_a_bucket_before_any_fill(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """README: rank 0 resolves ``main``, every rank loads ``revision=commit``. A node that
    never filled the model lists its commit from the bucket's ``refs/main``."""
    uri = s3_server.uri(f"recipe-{uuid.uuid4().hex[:8]}")
    published = publish_into(uri, tmp_path / "a", weights(3))
    with node(uri, tmp_path / "b", rescan_seconds=0) as fresh:
        with Client(fresh.http_url) as c:
            listed = {m.id: m for m in c.list_models()[0]}
            assert listed[MODEL].commit == published.commit  # listed, not filled
            commit = c.model(MODEL).commit  # rank 0
            assert commit == published.commit
            assert c.revisions(MODEL)[0].commit == published.commit
        ranks = []
        for _ in range(2):  # every rank, each with its own client
            with Client(fresh.http_url) as c:
                model = c.model(MODEL, revision=commit)
                assert model.commit == commit
                ranks.append(model.fetch())
        for got in ranks:
            assert np.array_equal(np.asarray(got["w"]), weights(3)["w"])


@pytest.mark.s3
def test_model_info_of_a_published_model_over_a_bucket_fills_nothing(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The Hub's model info (and ours) of a published model is answered from the listing and
    the bucket's ``refs/main``: no byte of the model is copied into the node's cache."""
    uri = s3_server.uri(f"info-{uuid.uuid4().hex[:8]}")
    published = publish_into(uri, tmp_path / "a", weights(4))
    with node(uri, tmp_path / "b", rescan_seconds=0) as fresh:
        info = http_request(fresh.http_port, f"/api/models/{MODEL}")
        assert info.status == 200, info.body
        assert info.json()["sha"] == published.commit
        assert {s["rfilename"] for s in info.json()["siblings"]} >= {
            "config.json",
            "model.safetensors",
        }
        pinned = http_request(fresh.http_port, f"/api/models/{MODEL}/revision/{published.commit}")
        assert pinned.status == 200 and pinned.json()["sha"] == published.commit
        with Client(fresh.http_url) as c:
            assert c.model(MODEL).commit == published.commit
        cache = node_cache(fresh)
        assert cache.cached_models() == []
        assert cache.progress(MODEL) is None
        assert not any(p.is_file() for p in cache.data_dir.rglob("*"))
