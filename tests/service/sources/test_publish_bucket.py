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
