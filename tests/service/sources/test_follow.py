"""Node caches follow their upstream by watching it: a revision published upstream is filled
into every node that holds the model (no rescan: ``--rescan 0``), and each node tells its own
watchers only once it holds the bytes; a second tier follows the first."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import numpy as np

from weightserve.client._client import Client
from weightserve.client._publish import Revision
from weightserve.service.server import ServerConfig, WeightServer

MODEL = "team/policy"


def weights(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full((256, 256), step, dtype=np.float32), "b": np.arange(step, step + 8.0)}


def node(origin: str, cache: Path) -> WeightServer:
    config = ServerConfig(
        origin, http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False,
        cache_dir=str(cache), grace_seconds=1,
    )  # fmt: skip
    return WeightServer(config)


def test_nodes_follow_a_publish_and_announce_it_once_they_hold_it(tmp_path: Path) -> None:
    root = tmp_path / "upstream"
    root.mkdir()
    upstream = WeightServer(
        ServerConfig(
            str(root),
            http_port=0,
            grpc_port=0,
            flight_port=None,
            rescan_seconds=0,
            watch=False,
            allow_publish=True,
            grace_seconds=1,
        )  # fmt: skip
    ).start()
    try:
        with Client(upstream.http_url) as c:
            first = c.publish(MODEL, weights(1), message="one")
        with contextlib.ExitStack() as stack:
            tier1 = stack.enter_context(node(upstream.http_url, tmp_path / "n1"))
            tier2 = stack.enter_context(node(tier1.http_url, tmp_path / "n2"))
            for server in (tier1, tier2):  # each node holds the model (a worker loaded it)
                with Client(server.http_url, retry_seconds=30) as c:
                    loaded = c.model(MODEL)
                    assert loaded.commit == first.commit
                    loaded.fetch()  # tensor bytes fill the node (metadata alone does not)
            heard: dict[str, list[tuple[Revision, float]]] = {"tier1": [], "tier2": []}

            def watch(name: str, server: WeightServer) -> None:
                with Client(server.http_url) as c:
                    for rev in c.model(MODEL).watch(timeout=30):
                        heard[name].append((rev, time.monotonic()))
                        return

            watchers = [
                threading.Thread(target=watch, args=(name, server))
                for name, server in (("tier1", tier1), ("tier2", tier2))
            ]
            for t in watchers:
                t.start()
            time.sleep(0.5)
            with Client(upstream.http_url) as c:
                second = c.publish(MODEL, weights(2), base=first.commit, message="two")
            published = time.monotonic()
            for t in watchers:
                t.join(30)
            for name in heard:
                assert [rev.commit for rev, _ in heard[name]] == [second.commit], name
                assert heard[name][0][0].message == "two"  # the upstream's record, passed on
                print(f"{name} told {heard[name][0][1] - published:.3f} s after the publish")
            upstream.stop()  # the nodes already hold the new bytes: no origin needed
            for server in (tier1, tier2):
                with Client(server.http_url, retry_seconds=0) as c:
                    model = c.model(MODEL)
                    assert model.commit == second.commit
                    got = model.fetch()
                    assert np.array_equal(np.asarray(got["w"]), weights(2)["w"])
    finally:
        upstream.stop()


def test_a_stopping_node_cuts_its_upstream_watch(tmp_path: Path) -> None:
    """The watch of the upstream would end only at its next heartbeat: a node's stop cuts it,
    and its thread has ended when stop returns."""
    root = tmp_path / "upstream"
    root.mkdir()
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False,
    )  # fmt: skip
    with WeightServer(config) as upstream:
        before = set(threading.enumerate())
        cache = node(upstream.http_url, tmp_path / "n").start()
        try:
            deadline = time.monotonic() + 30
            while upstream.state.feed.watchers() == 0:  # the node's watch is connected
                assert time.monotonic() < deadline, "the node never watched its upstream"
                time.sleep(0.02)
        finally:
            cache.stop()
        following = [
            t for t in threading.enumerate() if t.name == "weightserve-follow" and t not in before
        ]
        assert following == []
        deadline = time.monotonic() + 30
        while upstream.state.feed.watchers():  # the upstream saw the watch end
            assert time.monotonic() < deadline, "the watch was never cut"
            time.sleep(0.02)
