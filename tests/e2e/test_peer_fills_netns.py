"""A rollout across hosts: one upstream weightserve and four node caches, each in a network
namespace of its own with a 100 Mbit/s link both ways (bench/netns.py), a client on every node
loading the same model at once. The nodes fill from each other: the upstream's link sends
about one copy of the model, not four, and every node holds exactly the upstream's bytes.

Needs root (namespaces) and iproute2; ``python -m bench.fanout`` is the benchmark (1-8
nodes, with and without peers), its figures in docs/performance.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fanout import MODEL, start_cluster, write_model
from bench.netns import Hosts, missing

pytest.importorskip("libtorrent", reason="the peers extra (libtorrent) is not installed")
if missing() is not None:
    pytest.skip(f"needs network namespaces: {missing()}", allow_module_level=True)

NODES = 4


def held(cache_dir: Path) -> dict[str, bytes]:
    data = cache_dir / "node-cache" / "data"
    return {
        p.relative_to(data).as_posix(): p.read_bytes()
        for p in (data / MODEL).rglob("*")
        if p.is_file()
    }


@pytest.mark.slow
def test_four_nodes_loading_at_once_cost_the_upstream_about_one_copy(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model_bytes = write_model(root, size_mib=16, seed=7)
    expected = {p.relative_to(root).as_posix(): p.read_bytes() for p in (root / MODEL).rglob("*")}
    with Hosts(rate_mbit=100) as hosts:
        cluster = start_cluster(hosts, NODES, root, tmp_path, peers=True)
        before = hosts.tx_bytes("up")
        cluster.load_everywhere(MODEL)
        copies = (hosts.tx_bytes("up") - before) / model_bytes
        for i in range(NODES):
            assert held(tmp_path / f"n{i}") == expected, f"node {i}"
        logs = [node.log.read_text() for node in cluster.nodes]
    # Without peers it is 4.0 (every node fills alone); the rest of a copy is headers,
    # listings, joins and the odd piece two nodes took from the upstream at once.
    assert copies < 2.0, copies
    assert sum("from peers" in log for log in logs) == NODES
