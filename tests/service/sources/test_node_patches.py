"""A node cache that holds a model builds the upstream's new revision of it from its own copy
and the upstream's delta stream: the upstream sends patches, not files (counted through a
proxy), and the node's file is byte-identical to the upstream's; a node whose copy is not the
base fetches the file whole and is still right."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tests.support._util import http_request
from tests.support.byte_proxy import ByteCountingProxy
from weightserve.client._client import Client
from weightserve.client._publish import Revision
from weightserve.service.server import ServerConfig, WeightServer

MODEL = "team/policy"


def first_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "layers.0.w": rng.standard_normal((1024, 1024)).astype(ml_dtypes.bfloat16),
        "norm": rng.standard_normal(1024).astype(np.float32),
    }


def step(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """1 % of the bfloat16 elements move; the norm stays."""
    rng = np.random.default_rng(1)
    nxt = {name: array.copy() for name, array in weights.items()}
    w = nxt["layers.0.w"].reshape(-1)
    moved = rng.choice(w.size, w.size // 100, replace=False)
    w[moved] = (w[moved].astype(np.float32) + 0.5).astype(ml_dtypes.bfloat16)
    return nxt


@contextlib.contextmanager
def setup(
    tmp_path: Path, follow: bool = True
) -> Iterator[tuple[WeightServer, ByteCountingProxy, WeightServer, Revision]]:
    """An upstream holding R1 of the model, a proxy in front of it, a node over the proxy that
    holds R1 (a worker loaded it) and follows the upstream's watch, or else rescans it."""
    root = tmp_path / "upstream"
    root.mkdir()
    upstream_config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False,
        allow_publish=True, grace_seconds=1,
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(WeightServer(upstream_config))
        with Client(upstream.http_url) as c:
            first = c.publish(MODEL, first_weights(), message="one")
        proxy = stack.enter_context(ByteCountingProxy(upstream.http_port))
        node_config = ServerConfig(
            f"http://127.0.0.1:{proxy.port}", http_port=0, grpc_port=0, flight_port=None,
            rescan_seconds=0 if follow else 0.5, watch=False, cache_dir=str(tmp_path / "node"),
            grace_seconds=1, follow=follow,
        )  # fmt: skip
        node = stack.enter_context(WeightServer(node_config))
        with Client(node.http_url, retry_seconds=30) as c:
            model = c.model(MODEL)
            assert model.commit == first.commit
            model.fetch()  # tensor bytes fill the node
        yield upstream, proxy, node, first


def weight_file(node_dir: Path) -> Path:
    """The node's copy of the model's weights."""
    (found,) = (node_dir / "node-cache" / "data" / MODEL).glob("[!.]*.safetensors")
    return found


def upstream_bytes(upstream: WeightServer, name: str) -> bytes:
    """The file of the model's main revision, as the upstream serves it."""
    with Client(upstream.http_url) as client:
        source = client.transport.open_file(MODEL, name, 0, None)
        try:
            data = bytearray(source.length)
            view, done = memoryview(data), 0
            while done < len(data) and (got := source.readinto(view[done:])):
                done += got
            return bytes(data[:done])
        finally:
            source.close()


def wait_for_commit(node: WeightServer, commit: str) -> None:
    """Until the node's copy is of ``commit`` (its listing names the origin's revision as soon
    as it is listed, before the bytes are here)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        models = http_request(node.http_port, "/v1/models").json()["models"]
        held = next((m.get("cached_revision") for m in models if m["id"] == MODEL), None)
        if held and commit.startswith(held):
            return
        time.sleep(0.1)
    raise AssertionError(f"the node did not reach {commit}")


def origin_bytes(node: WeightServer) -> Counter[str]:
    """``weightserve_origin_bytes_total`` by kind."""
    text = http_request(node.http_port, "/metrics").body.decode()
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "weightserve_origin_bytes_total":
                counts[sample.labels["kind"]] += int(sample.value)
    return counts


def test_a_node_follows_a_publish_with_a_patch(tmp_path: Path) -> None:
    with setup(tmp_path) as (upstream, proxy, node, first):
        before = origin_bytes(node)
        proxy.reset()
        with Client(upstream.http_url) as c:
            second = c.publish(MODEL, step(first_weights()), base=first.commit, message="two")
        wait_for_commit(node, second.commit)  # the node follows its upstream's watch
        node_file = weight_file(tmp_path / "node")
        wanted = upstream_bytes(upstream, node_file.name)
        assert node_file.read_bytes() == wanted
        size = len(wanted)
        print(f"{proxy.bytes_from_upstream} bytes from the upstream for a {size}-byte file")
        assert proxy.bytes_from_upstream < size // 10
        after = origin_bytes(node)
        assert after["patch"] > before["patch"]
        assert after["fill"] == before["fill"]  # no byte of the file was fetched
        with Client(node.http_url, retry_seconds=0) as c:
            got = c.model(MODEL).fetch()
        want = step(first_weights())["layers.0.w"]
        assert np.asarray(got["layers.0.w"]).tobytes() == want.tobytes()


def test_a_node_whose_copy_is_not_the_base_fetches_the_file_whole(tmp_path: Path) -> None:
    with setup(tmp_path) as (upstream, proxy, node, first):
        node_file = weight_file(tmp_path / "node")
        with open(node_file, "r+b") as f:  # a byte of a tensor changed under the node
            f.seek(node_file.stat().st_size - 10)
            f.write(b"\xff")
        proxy.reset()
        with Client(upstream.http_url) as c:
            second = c.publish(MODEL, step(first_weights()), base=first.commit, message="two")
        wait_for_commit(node, second.commit)
        wanted = upstream_bytes(upstream, node_file.name)
        assert weight_file(tmp_path / "node").read_bytes() == wanted
        assert proxy.bytes_from_upstream > len(wanted)  # the patch, then the whole file
        assert origin_bytes(node)["patch"] > 0


def test_a_node_that_rescans_instead_of_following_fills_from_a_patch(tmp_path: Path) -> None:
    with setup(tmp_path, follow=False) as (upstream, proxy, node, first):
        proxy.reset()
        with Client(upstream.http_url) as c:
            second = c.publish(MODEL, step(first_weights()), base=first.commit, message="two")
        time.sleep(1.5)  # the node's rescan lists the new revision
        with Client(node.http_url, retry_seconds=30) as c:
            model = c.model(MODEL)
            got = model.fetch()
            assert model.commit == second.commit
        want = step(first_weights())["layers.0.w"]
        assert np.asarray(got["layers.0.w"]).tobytes() == want.tobytes()
        node_file = weight_file(tmp_path / "node")
        wanted = upstream_bytes(upstream, node_file.name)
        assert node_file.read_bytes() == wanted
        assert proxy.bytes_from_upstream < len(wanted) // 10
