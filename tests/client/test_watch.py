"""Watching revisions: 32 watchers of one model on a real server each see every published
revision once, in order, through a server restart in the middle; ``since`` replays what came
after a commit; ``weightserve watch`` prints them."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from weightserve.client import _cli
from weightserve.client._client import Client
from weightserve.client._publish import Revision
from weightserve.client.max.weights import RemoteWeights
from weightserve.service.server import ServerConfig, WeightServer

WATCHERS = 32


def weights(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full((8, 8), step, dtype=np.float32), "b": np.arange(step, step + 4.0)}


def serve(root: Path, port: int = 0) -> WeightServer:
    config = ServerConfig(
        str(root), http_port=port, grpc_port=0, flight_port=None, rescan_seconds=0,
        watch=False, allow_publish=True, grace_seconds=2,
    )  # fmt: skip
    return WeightServer(config).start()


def test_every_watcher_sees_every_revision_in_order_through_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    server = serve(root)
    port = server.http_port
    url = server.http_url
    try:
        with Client(url) as c:
            first = c.publish("team/policy", weights(0))
        seen: list[list[str]] = [[] for _ in range(WATCHERS)]
        connected = threading.Barrier(WATCHERS + 1)

        def follow(i: int) -> None:
            with Client(url) as c:
                model = c.model("team/policy")
                connected.wait()
                for rev in model.watch(timeout=60):
                    seen[i].append(rev.commit)
                    if len(seen[i]) == 3:
                        return

        threads = [threading.Thread(target=follow, args=(i,)) for i in range(WATCHERS)]
        for t in threads:
            t.start()
        connected.wait()
        time.sleep(0.5)  # every watch stream open
        published = []
        with Client(url) as c:
            published.append(c.publish("team/policy", weights(1), base=first.commit).commit)
            published.append(c.publish("team/policy", weights(2)).commit)
        deadline = time.monotonic() + 20
        while any(len(s) < 2 for s in seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        server.stop()  # the watchers lose their connections...
        server = serve(root, port)  # ...and come back to a restarted server
        with Client(url) as c:
            published.append(c.publish("team/policy", weights(3)).commit)
        for t in threads:
            t.join(60)
        assert all(s == published for s in seen), [s for s in seen if s != published][:2]
    finally:
        server.stop()


def test_since_replays_what_came_after_a_commit(tmp_path: Path, capsys) -> None:
    root = tmp_path / "root"
    root.mkdir()
    server = serve(root)
    try:
        with Client(server.http_url) as c:
            revisions = [
                c.publish("team/policy", weights(s), message=f"step {s}") for s in range(3)
            ]
            model = c.model("team/policy")
            replayed = list(model.watch(since=revisions[0].commit[:12], timeout=1.5))
        assert replayed == revisions[1:]
        assert all(isinstance(r, Revision) for r in replayed)
        url = f"{server.http_url}/v1/models/team/policy"
        assert _cli.main(["watch", url, "--since", revisions[0].commit, "--timeout", "1"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in lines] == [r.commit for r in revisions[1:]]
        assert lines[-1].endswith("step 2")
    finally:
        server.stop()


def test_a_worker_follows_published_revisions_into_a_torch_module(tmp_path: Path) -> None:
    """The documented worker loop: watch, then load the revision named into a module in place
    (``load_state_dict``), and the same for an engine's ``load_weights(iterable)``."""
    torch = pytest.importorskip("torch")
    root = tmp_path / "root"
    root.mkdir()
    server = serve(root)
    url = f"{server.http_url}/v1/models/team/net"
    trainer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    worker = torch.nn.Linear(16, 8).to(torch.bfloat16)
    weight_before = worker.weight
    engine: dict[str, np.ndarray] = {}
    try:
        with Client(server.http_url) as c:
            first = c.publish("team/net", trainer.state_dict())
            followed: list[str] = []

            def follow() -> None:
                for rev in c.model("team/net").watch(since=first.commit, timeout=30):
                    worker.load_state_dict(
                        RemoteWeights(url, revision=rev.commit).torch_state_dict()
                    )
                    pinned = c.model("team/net", revision=rev.commit)
                    engine.update((name, np.array(a)) for name, a in pinned.iter_tensors())
                    followed.append(rev.commit)
                    return

            thread = threading.Thread(target=follow)
            thread.start()
            with torch.no_grad():
                trainer.weight.add_(1.0)
            second = c.publish("team/net", trainer.state_dict(), base=first.commit)
            thread.join(30)
        assert followed == [second.commit]
        assert worker.weight is weight_before  # updated in place: the module keeps working
        assert torch.equal(worker.weight, trainer.weight) and torch.equal(worker.bias, trainer.bias)
        expected = trainer.weight.view(torch.uint16).numpy()
        assert np.array_equal(engine["weight"].view(np.uint16), expected)
    finally:
        server.stop()


def test_revisions_are_listed_and_watched_over_grpc(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    server = serve(root)
    try:
        with Client(server.http_url) as http, Client(server.grpc_url) as grpc_client:
            first = http.publish("team/policy", weights(0), metadata={"step": 0})
            second = http.publish("team/policy", weights(1))
            model = grpc_client.model("team/policy")
            assert model.revisions() == http.revisions("team/policy")
            assert model.revisions()[1].metadata == {"step": 0}
            assert list(model.watch(since=first.commit, timeout=1.0)) == [second]
            live: list[Revision] = []
            watcher = threading.Thread(
                target=lambda: live.extend(itertools.islice(model.watch(timeout=20), 1))
            )
            watcher.start()
            time.sleep(0.5)
            third = http.publish("team/policy", weights(2))
            watcher.join(20)
            assert live == [third]
    finally:
        server.stop()
