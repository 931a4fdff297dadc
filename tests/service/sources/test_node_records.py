"""A node cache following a busy upstream keeps a bounded number of the upstream's revision
records: the newest few per model, and few models it does not hold."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from tests.support.publishing import serve
from weightserve.client._client import Client
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.origin.announced import (
    UPSTREAM_MODELS_NOT_HELD,
    UPSTREAM_RECORDS_PER_MODEL,
)
from weightserve.service.sources.origin.catalog import OriginCatalog

HELD = "team/held"


def weights(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(64, step, dtype=np.float32)}


def test_a_node_keeps_few_records_of_models_it_does_not_hold(tmp_path: Path) -> None:
    root = tmp_path / "upstream"
    root.mkdir()
    with serve(root, allow_publish=True) as upstream, Client(upstream.http_url) as publisher:
        publisher.publish(HELD, weights(0))
        config = ServerConfig(
            upstream.http_url, http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0,
            watch=False, cache_dir=str(tmp_path / "node"), grace_seconds=1,
        )  # fmt: skip
        with WeightServer(config) as node, Client(node.http_url, retry_seconds=30) as worker:
            worker.model(HELD).fetch()  # the node holds this one
            told: list[str] = []
            watching = threading.Event()

            def watch() -> None:
                with Client(node.http_url) as c:
                    watching.set()
                    for revision in c.model(HELD).watch(timeout=60):
                        told.append(revision.commit)
                        return

            watcher = threading.Thread(target=watch)
            watcher.start()
            watching.wait(10)
            metadata = {"notes": "x" * 4096}
            for step in range(40):  # one model the node does not hold, announced often
                publisher.publish("team/busy", weights(step), metadata=metadata)
            for i in range(UPSTREAM_MODELS_NOT_HELD + 4):  # and many it does not hold
                publisher.publish(f"team/other-{i}", weights(i), metadata=metadata)
            last = publisher.publish(HELD, weights(1))  # the node's follower heard all before
            watcher.join(60)
            assert told == [last.commit]
            catalog = node.catalog
            assert isinstance(catalog, OriginCatalog)
            kept = catalog.revision_log.upstream_records()
            assert 0 < kept <= UPSTREAM_RECORDS_PER_MODEL * (UPSTREAM_MODELS_NOT_HELD + 1)
