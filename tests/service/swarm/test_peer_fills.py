"""Node caches fill from each other through a revision's private swarm (libtorrent, SSL
torrents) on loopback: a node that joins after another holds the revision takes it from that
peer and not from the upstream; a peer that sends bad pieces is banned and the fill still ends
with exact bytes; a node without the model's grant is refused by the upstream and by every
peer; a node whose upstream runs no swarm fills from it alone; eviction stops the seeding.

The cluster in network namespaces (shaped links, several nodes at once) is
tests/e2e/test_peer_fills_netns.py; the benchmark is ``python -m bench.fanout``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support._util import http_request
from tests.support.node_caches import write_model
from weightserve.client._client import Client
from weightserve.client.errors import PermissionDenied
from weightserve.client.remote import connect
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.swarm.certs import SwarmAuthority
from weightserve.service.sources.swarm.engine import (
    PeerEngine,
    PeerSettings,
    SwarmUnavailable,
)

pytest.importorskip("libtorrent", reason="the peers extra (libtorrent) is not installed")

MODEL = "team/llm"
TENSOR_BYTES = 6 << 20


def upstream_config(root: Path, cache: Path, **extra: object) -> ServerConfig:
    settings: dict[str, object] = {"peers": True, **extra}
    return ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False,
        cache_dir=str(cache), grace_seconds=1, **settings,  # type: ignore[arg-type]
    )  # fmt: skip


def node_config(upstream: WeightServer, cache: Path, **extra: object) -> ServerConfig:
    return ServerConfig(
        upstream.http_url, http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0,
        watch=False, follow=False, cache_dir=str(cache), peers=True, peer_port=0,
        grace_seconds=1, **extra,  # type: ignore[arg-type]
    )  # fmt: skip


@contextlib.contextmanager
def cluster(
    tmp_path: Path,
    nodes: int,
    node_extra: dict[str, object] | None = None,
    **upstream_extra: object,
) -> Iterator[tuple]:
    root = tmp_path / "root"
    written = write_model(root, MODEL, TENSOR_BYTES, seed=3)
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(
            WeightServer(upstream_config(root, tmp_path / "up", **upstream_extra))
        )
        servers = [
            stack.enter_context(
                WeightServer(node_config(upstream, tmp_path / f"n{i}", **(node_extra or {})))
            )
            for i in range(nodes)
        ]
        yield upstream, servers, written


def load(node: WeightServer, token: str | None = None) -> None:
    with Client(node.http_url, token=token) as client:
        assert client.model(MODEL).fetch()


def held(node: WeightServer) -> dict[str, bytes]:
    data = Path(node.config.cache_dir or "") / "node-cache" / "data"
    return {
        p.relative_to(data).as_posix(): p.read_bytes()
        for p in data.rglob("*")
        if p.is_file() and not p.relative_to(data).as_posix().startswith(".")
    }


def engine(node: WeightServer) -> PeerEngine:
    peers = node.catalog.cache.peers  # type: ignore[attr-defined]
    assert peers is not None, "the node runs no swarm"
    return peers.engine


def metric(node: WeightServer, name: str, **labels: str) -> float:
    text = http_request(node.http_port, "/metrics").body.decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def model_bytes(written: dict[str, bytes]) -> int:
    return sum(len(b) for b in written.values())


def test_a_node_after_another_takes_the_revision_from_it(tmp_path: Path) -> None:
    # Patient nodes: on a machine whose cores are busy with other work, the default second
    # without a peer's piece can pass while the seed is merely slow, and the upstream is asked.
    patient = {"peer_patience_seconds": 20.0}
    with cluster(tmp_path, 2, patient) as (upstream, (first, second), written):
        load(first)
        assert engine(first).seeding() == {MODEL: engine(first).seeding()[MODEL]}
        load(second)
        assert held(first) == written and held(second) == written
        total = model_bytes(written)
        # The second node found a seed: everything came from it, nothing from the upstream.
        got = engine(second).snapshot()
        assert got.from_peers >= total * 0.95, got
        assert got.from_upstream <= total * 0.05, got
        assert metric(second, "weightserve_origin_bytes_total", kind="fill", source="peers") > 0
        assert engine(first).snapshot().uploaded >= total * 0.95
        # The first filled from the upstream (alone: no peer held anything yet).
        assert engine(first).snapshot().from_upstream >= total * 0.95


def test_a_peer_sending_bad_pieces_is_banned_and_the_fill_ends_exact(tmp_path: Path) -> None:
    with cluster(tmp_path, 1) as (upstream, (node,), written):
        # A liar, admitted like any node (the upstream takes no token here), seeding the
        # revision; once libtorrent checked its copy, every byte of it is flipped on disk (a
        # seed checks a piece once, before it first sends it).
        transport = connect(upstream.http_url)
        liar = PeerEngine(PeerSettings(port=0, host="127.0.0.1"), transport.join_swarm)
        try:
            admission = liar.admit(MODEL, None)
            copy = tmp_path / "liar"
            paths = {}
            for name in admission.files():
                paths[name] = copy / name
                paths[name].parent.mkdir(parents=True, exist_ok=True)
                paths[name].write_bytes(written[f"{MODEL}/{name}"])
            liar.seed(admission, paths)
            seeded = liar._seeded[MODEL].handle  # noqa: SLF001 - a liar needs the engine's insides
            seeded.force_recheck()
            deadline = time.monotonic() + 30
            while not seeded.status().is_seeding:
                assert time.monotonic() < deadline, "the liar's copy was not checked"
                time.sleep(0.05)
            for path in paths.values():
                flipped = bytes(b ^ 0xFF for b in path.read_bytes())
                with open(path, "r+b") as f:  # in place: libtorrent keeps reading this file
                    f.write(flipped)
            load(node)
            assert held(node) == written
            counters = engine(node).snapshot()
            assert counters.hash_failures >= 1 and counters.peers_banned >= 1, counters
            assert metric(node, "weightserve_peer_bans_total") >= 1
        finally:
            liar.close()
            transport.close()


def test_a_node_without_the_grant_gets_nothing_from_peers(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"reader-token {MODEL}\nother-token other/*\n")
    root = tmp_path / "root"
    written = write_model(root, MODEL, TENSOR_BYTES, seed=4)
    config = upstream_config(root, tmp_path / "up", token_file=str(tokens))
    with (
        WeightServer(config) as upstream,
        WeightServer(node_config(upstream, tmp_path / "n0", origin_token="reader-token")) as seeder,
    ):
        load(seeder)
        assert held(seeder) == written
        seeded = engine(seeder).seeding()[MODEL]
        # The upstream admits no node whose token may not read the model.
        refused = connect(upstream.http_url, token="other-token")
        stranger = PeerEngine(
            PeerSettings(port=0, host="127.0.0.1", stall_seconds=3), refused.join_swarm
        )
        try:
            with pytest.raises(PermissionDenied):
                stranger.admit(MODEL, None)
            # Nor does a peer: the torrent alone (had some other way) with a certificate
            # that is not the revision's authority's gets no byte from the seeder.
            admitted = connect(upstream.http_url, token="reader-token")
            real = PeerEngine(PeerSettings(port=0, host="127.0.0.1"), admitted.join_swarm)
            admission = real.admit(MODEL, seeded)
            real.close()
            admitted.close()
            forged = replace(
                admission,
                certificate=SwarmAuthority.create(seeded)
                .sign(stranger.certificate_request, "stranger")
                .decode(),
                peers=[("127.0.0.1", engine(seeder).port)],
                seeds=frozenset({("127.0.0.1", engine(seeder).port)}),
            )
            wanted = admission.files()

            def no_upstream(name: str, offset: int, length: int) -> bytes:
                raise PermissionDenied("the stranger may not read the upstream either")

            with pytest.raises(SwarmUnavailable):
                stranger.fill(forged, wanted, tmp_path / "stranger", no_upstream, lambda n: None)
            assert stranger.snapshot().from_peers == 0
            assert engine(seeder).snapshot().uploaded == 0
        finally:
            stranger.close()
            refused.close()


def test_an_upstream_without_a_swarm_fills_the_node_alone(tmp_path: Path) -> None:
    with cluster(tmp_path, 1, peers=False) as (upstream, (node,), written):
        load(node)
        assert held(node) == written
        counters = engine(node).snapshot()
        assert (counters.from_peers, counters.from_upstream, counters.seeding) == (0, 0, 0)
        total = model_bytes(written)
        assert metric(node, "weightserve_origin_bytes_total", kind="fill", source="origin") == total


def test_eviction_stops_the_seeding(tmp_path: Path) -> None:
    with cluster(tmp_path, 1) as (upstream, (node,), written):
        load(node)
        assert MODEL in engine(node).seeding()
        assert metric(node, "weightserve_peer_seeding_revisions") == 1
        node.catalog.cache.evict(MODEL)  # type: ignore[attr-defined]
        assert engine(node).seeding() == {}
        assert metric(node, "weightserve_peer_seeding_revisions") == 0


def test_closing_a_seeding_node_waits_for_libtorrent_not_for_a_timeout(tmp_path: Path) -> None:
    # Each torrent's removal waits for libtorrent's alert that its files are closed; closing
    # once stopped the alert pump before removing, so a node seeding two revisions took 30 s
    # to stop (the second removal's alert had no pump left to hear it).
    other = "team/other"
    write_model(tmp_path / "root", other, TENSOR_BYTES, seed=4)
    with cluster(tmp_path, 1) as (upstream, (node,), written):
        load(node)
        with Client(node.http_url) as client:
            assert client.model(other).fetch()
        peers = engine(node)
        assert set(peers.seeding()) == {MODEL, other}
        started = time.monotonic()
        peers.close()
        assert time.monotonic() - started < 10
        assert peers.seeding() == {}


def test_a_restarted_node_seeds_what_it_held(tmp_path: Path) -> None:
    with cluster(tmp_path, 1) as (upstream, (node,), written):
        load(node)
        commit = engine(node).seeding()[MODEL]
        node.stop()
        with WeightServer(node_config(upstream, tmp_path / "n0")) as again:
            deadline = time.monotonic() + 30
            while engine(again).seeding() != {MODEL: commit}:
                assert time.monotonic() < deadline, engine(again).seeding()
                time.sleep(0.1)
            assert held(again) == written


def step(weights: dict[str, np.ndarray], seed: int, fraction: float) -> dict[str, np.ndarray]:
    """``fraction`` of every tensor's values moved."""
    rng = np.random.default_rng(seed)
    moved = {}
    for name, array in weights.items():
        flat = array.copy().reshape(-1)
        where = rng.choice(flat.size, max(1, int(flat.size * fraction)), replace=False)
        flat[where] += 1.0
        moved[name] = flat.reshape(array.shape)
    return moved


def test_followers_fill_a_heavy_revision_from_peers_and_patch_a_light_one(
    tmp_path: Path,
) -> None:
    """Three nodes follow the upstream. A revision that moves every value in the same layout
    would cost the upstream three deltas as big as the model: the nodes fill it through the
    swarm instead. One that moves 1 % of the values is patched, as without peers."""
    rng = np.random.default_rng(5)
    first = {
        f"layers.{i}.weight": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(6)
    }
    root = tmp_path / "root"
    root.mkdir()
    config = upstream_config(root, tmp_path / "up", allow_publish=True)
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(WeightServer(config))
        with Client(upstream.http_url) as c:
            held = c.publish(MODEL, first, message="one").commit
        nodes = [
            stack.enter_context(
                WeightServer(replace(node_config(upstream, tmp_path / f"n{i}"), follow=True))
            )
            for i in range(3)
        ]
        for node in nodes:
            load(node)

        def publish_and_follow(weights: dict[str, np.ndarray], message: str) -> str:
            with Client(upstream.http_url) as c:
                commit = c.publish(MODEL, weights, message=message).commit
            for node in nodes:
                with Client(node.http_url) as c:
                    announced = next(iter(c.model(MODEL).watch(since=held, timeout=120)))
                    assert announced.commit == commit
                    got = c.model(MODEL).fetch()
                assert all(np.array_equal(got[n], weights[n]) for n in weights)
            return commit

        def patched(node: WeightServer) -> float:
            return metric(node, "weightserve_origin_bytes_total", kind="patch")

        def from_peers(node: WeightServer) -> float:
            return metric(node, "weightserve_origin_bytes_total", kind="fill", source="peers")

        total = sum(w.nbytes for w in first.values())
        before = [(patched(n), from_peers(n)) for n in nodes]
        heavy = step(first, 6, 1.0)
        held = publish_and_follow(heavy, "every value")
        after = [(patched(n), from_peers(n)) for n in nodes]
        assert sum(a[0] - b[0] for a, b in zip(after, before, strict=True)) < total, after
        assert sum(a[1] - b[1] for a, b in zip(after, before, strict=True)) > 0, after

        light = step(heavy, 7, 0.01)
        publish_and_follow(light, "one percent")
        last = [(patched(n), from_peers(n)) for n in nodes]
        assert all(c[0] > a[0] for c, a in zip(last, after, strict=True)), last  # patched
        assert [c[1] for c in last] == [a[1] for a in after], last  # nothing through peers


def test_the_upload_cap_holds_for_peers_on_the_same_network(tmp_path: Path) -> None:
    """A seeder capped at 2 MiB/s takes at least 2 s to hand a 6 MiB model to a node on its
    own network (libtorrent exempts such peers from its limits unless told); a lower bound of
    the cap's effect, not a timing of the transfer."""
    root = tmp_path / "root"
    written = write_model(root, MODEL, TENSOR_BYTES, seed=8)
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(WeightServer(upstream_config(root, tmp_path / "up")))
        capped = replace(node_config(upstream, tmp_path / "n0"), peer_upload_limit=2 << 20)
        seeder = stack.enter_context(WeightServer(capped))
        load(seeder)
        # Patient: a capped seed sends in bursts, and a busy machine can space them past the
        # default second, after which the upstream would give what is missing.
        patient = node_config(upstream, tmp_path / "n1", peer_patience_seconds=20.0)
        taker = stack.enter_context(WeightServer(patient))
        started = time.monotonic()
        load(taker)
        elapsed = time.monotonic() - started
        assert held(taker) == written
        got = engine(taker).snapshot()
        assert got.from_peers >= model_bytes(written) * 0.5, got
        assert elapsed >= 0.8 * got.from_peers / (2 << 20), (elapsed, got)
