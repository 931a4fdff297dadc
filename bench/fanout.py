"""``python -m bench.fanout``: a rollout to N node caches, with and without peer fills, in
network namespaces on this machine (root; bench/netns.py). One upstream weightserve and N node
caches, each on its own host with a link shaped to ``--rate-mbit`` both ways, one client per
node loading the same model at once. Printed per N and mode: the upstream's egress in copies of
the model (the bytes its link sent) and the seconds until every node's client had the whole
model; then the same for a revision published while the nodes follow the upstream.

No timing is asserted anywhere; tests/e2e/test_peer_fills.py runs a small version.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.checkpoint import REPO, RESULTS_DIR
from bench.netns import Hosts, Server, missing

MODEL = "fanout/model"
HTTP_PORT = 8080
PEER_PORT = 6881
_PORTS = ["--http-port", str(HTTP_PORT), "--grpc-port", "0", "--flight-port", "-1"]

# A client on a node: imports first, then waits for "go" on stdin, so that the clock measures
# the load and not the interpreter's start.
_CLIENT = """
import sys, time
from weightserve.client._client import Client
client = Client(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
start = time.monotonic()
arrays = client.model(sys.argv[2]).fetch()
print(time.monotonic() - start, sum(a.nbytes for a in arrays.values()), flush=True)
"""


# In the upstream's namespace: a revision published (the same tensors at every step, every
# value new); with a held revision, every node's watch is opened from it first, and the
# seconds until every node announced that it holds the new one are measured.
_PUBLISHER = """
import json, sys, threading, time
import numpy as np
from weightserve.client._client import Client
upstream, model, held, seed, layers = sys.argv[1:6]
nodes = sys.argv[6:]
rng = np.random.default_rng(int(seed))
weights = {f"layers.{i}.weight": rng.standard_normal((256, 1024), dtype=np.float32)
           for i in range(int(layers))}
arrived = {}
def follow(url):
    with Client(url) as client:
        for revision in client.model(model).watch(since=held, timeout=90):
            arrived[url] = (time.monotonic(), revision.commit)
            return
threads = [threading.Thread(target=follow, args=(url,)) for url in nodes if held != "-"]
for t in threads:
    t.start()
time.sleep(1 if threads else 0)
start = time.monotonic()
with Client(upstream) as client:
    published = client.publish(model, weights, message="the next step")
committed = time.monotonic()
for t in threads:
    t.join()
assert all(commit == published.commit for _, commit in arrived.values()), arrived
follow_s = max((at for at, _ in arrived.values()), default=committed) - committed
print(json.dumps({"commit": published.commit, "publish_s": committed - start,
                  "follow_s": follow_s, "model_bytes": sum(w.nbytes for w in weights.values())}))
"""


def write_model(root: Path, size_mib: int, seed: int) -> int:
    """A safetensors model of about ``size_mib`` MiB of float32 noise under ``root/MODEL``;
    its file bytes."""
    from safetensors.numpy import save_file

    directory = root / MODEL
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = 256
    tensors = {
        f"layers.{i}.weight": rng.standard_normal((rows, 1024), dtype=np.float32)
        for i in range(max(1, size_mib))
    }
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"seed": seed, "layers": len(tensors)}))
    return sum(f.stat().st_size for f in directory.iterdir())


def env() -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSERVE_")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    environ["PYTHONUNBUFFERED"] = "1"
    return environ


@dataclass
class Cluster:
    hosts: Hosts
    upstream: Server
    nodes: list[Server]
    work: Path

    def load_everywhere(self, model: str) -> float:
        """Every node's client loads ``model`` at once: seconds until the last has it."""
        clients = [
            self.hosts.popen(
                f"n{i}",
                [sys.executable, "-c", _CLIENT, node.http, model],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env(),
            )  # fmt: skip
            for i, node in enumerate(self.nodes)
        ]
        for client in clients:
            assert client.stdout is not None
            if client.stdout.readline().strip() != "ready":
                raise RuntimeError("a client did not start")
        start = time.monotonic()
        for client in clients:
            assert client.stdin is not None
            client.stdin.write("go\n")
            client.stdin.flush()
        for client in clients:
            out, _ = client.communicate(timeout=600)
            if client.returncode != 0:
                raise RuntimeError(f"a client failed: {out}")
        return time.monotonic() - start


def start_upstream(hosts: Hosts, root: Path, work: Path) -> Server:
    address = hosts.add("up")
    return hosts.serve(
        "up",
        [str(root), "--host", address, *_PORTS, "--cache-dir", str(work / "up"),
         "--allow-publish", "--rescan", "1"],
        work, env(),
    )  # fmt: skip


def start_nodes(hosts: Hosts, upstream: Server, nodes: int, work: Path, peers: bool) -> Cluster:
    servers = []
    for i in range(nodes):
        address = hosts.add(f"n{i}")
        args = [upstream.http, "--host", address, *_PORTS, "--cache-dir", str(work / f"n{i}")]
        args += ["--peer-port", str(PEER_PORT)] if peers else ["--no-peers"]
        servers.append(hosts.serve(f"n{i}", args, work, env()))
    return Cluster(hosts, upstream, servers, work)


def start_cluster(hosts: Hosts, nodes: int, root: Path, work: Path, peers: bool) -> Cluster:
    """An upstream serving ``root`` and ``nodes`` node caches over it, each on its own host."""
    return start_nodes(hosts, start_upstream(hosts, root, work), nodes, work, peers)


def publish(cluster: Cluster, held: str, size_mib: int, seed: int) -> dict[str, Any]:
    """A revision published on the upstream; with ``held`` (the commit the nodes hold; "-":
    none), while every node follows it: seconds from the commit until every node announced
    it holds it."""
    publisher = cluster.hosts.popen(
        "up",
        [sys.executable, "-c", _PUBLISHER, cluster.upstream.http, MODEL, held, str(seed),
         str(max(1, size_mib)), *(node.http for node in cluster.nodes)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
    )  # fmt: skip
    out, err = publisher.communicate(timeout=900)
    if publisher.returncode != 0:
        raise RuntimeError(f"the publish failed: {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def rollout(
    nodes: int,
    size_mib: int,
    rate: float,
    peers: bool,
    seed: int,
    keep_logs: Path | None = None,
    follow: bool = True,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ws-fanout-") as tmp, Hosts(rate_mbit=rate) as hosts:
        work = Path(tmp)
        try:
            return _rollout(hosts, work, nodes, size_mib, peers, seed, follow)
        finally:
            if keep_logs is not None:
                kept = keep_logs / f"{'peers' if peers else 'upstream'}-{nodes}"
                kept.mkdir(parents=True, exist_ok=True)
                for log in work.glob("serve-*.log"):
                    shutil.copy(log, kept / log.name)


def _rollout(
    hosts: Hosts, work: Path, nodes: int, size_mib: int, peers: bool, seed: int, follow: bool
) -> dict[str, Any]:
    (work / "root").mkdir()
    upstream = start_upstream(hosts, work / "root", work)
    # Published (a revision to move on from), before the nodes list the upstream.
    first = publish(Cluster(hosts, upstream, [], work), "-", size_mib, seed)
    model_bytes = first["model_bytes"]
    cluster = start_nodes(hosts, upstream, nodes, work, peers)
    before = hosts.tx_bytes("up")
    seconds = cluster.load_everywhere(MODEL)
    egress = hosts.tx_bytes("up") - before
    followed: dict[str, Any] = {}
    if follow:
        before = hosts.tx_bytes("up")
        followed = publish(cluster, first["commit"], size_mib, seed + 1000)
        followed["upstream_egress_bytes"] = hosts.tx_bytes("up") - before
        followed["upstream_copies"] = followed["upstream_egress_bytes"] / model_bytes
    return {
        "nodes": nodes,
        "peers": peers,
        "model_bytes": model_bytes,
        "seconds": seconds,
        "upstream_egress_bytes": egress,
        "upstream_copies": egress / model_bytes,
        "published": followed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fanout", description=__doc__)
    p.add_argument("--nodes", default="1,2,4,8", help="node counts, comma-separated")
    p.add_argument("--size-mib", type=int, default=64, help="the model's size")
    p.add_argument("--rate-mbit", type=float, default=200, help="every link's rate")
    p.add_argument(
        "--modes", default="peers,upstream", help="peers (peer fills), upstream (--no-peers)"
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "fanout.json")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the servers' logs here")
    args = p.parse_args(argv)
    why = missing()
    if why is not None:
        raise SystemExit(f"bench.fanout: {why}")
    rows = []
    for mode in args.modes.split(","):
        for n in (int(x) for x in args.nodes.split(",")):
            row = rollout(
                n, args.size_mib, args.rate_mbit, mode == "peers", seed=n, keep_logs=args.keep_logs
            )
            rows.append(row)
            print(
                f"{mode:>8} N={n}: upstream sent {row['upstream_copies']:.2f} copies, every "
                f"node loaded in {row['seconds']:.2f} s", flush=True,
            )  # fmt: skip
            if row["published"]:
                published = row["published"]
                print(
                    f"{'':>8} N={n}, a published revision followed: upstream sent "
                    f"{published['upstream_copies']:.2f} copies, every node held it "
                    f"{published['follow_s']:.2f} s after the commit", flush=True,
                )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
