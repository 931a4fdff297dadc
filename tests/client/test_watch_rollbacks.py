"""Every change of ``main`` is announced, a rollback included: publish A, B, then A again, and
the HTTP watch, gRPC ``WatchRevisions``, ``RemoteModel.watch``, ``weightserve watch`` and a
node cache's watchers all report the move back to A, each event with a growing sequence; a
watcher resuming from a point retention removed gets the current ``main``, flagged, never an
older held revision. gRPC watchers resume as HTTP ones do, by ``after`` and ``sequence``."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tests.support.publishing import serve
from weightserve.client import _cli
from weightserve.client._client import Client
from weightserve.client._publish import Revision
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2_grpc as pb_grpc
from weightserve.service.server import ServerConfig, WeightServer

MODEL = "team/policy"


def weights(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full((64, 64), step, dtype=np.float32), "b": np.arange(step, step + 4.0)}


def watch_lines(port: int, query: str, wanted: int, timeout: float = 30) -> list[dict]:
    """The events of one raw HTTP watch until ``wanted`` revision events came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    events: list[dict] = []
    try:
        conn.request("GET", f"/v1/models/{MODEL}/-/watch{query}")
        response = conn.getresponse()
        assert response.status == 200
        while sum(e["event"] == "revision" for e in events) < wanted:
            line = response.readline()
            if not line:
                break
            events.append(json.loads(line))
    finally:
        conn.close()
    return events


def grpc_events(port: int, wanted: int, **request: Any) -> list[Any]:
    """The events of one ``WatchRevisions`` call (heartbeats left out) until ``wanted``
    revision events came."""
    events: list[Any] = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        call = stub.WatchRevisions(pb.WatchRequest(model=MODEL, **request), timeout=30)
        try:
            for event in call:
                if event.event != "heartbeat":
                    events.append(event)
                if sum(e.event == "revision" for e in events) >= wanted:
                    break
        finally:
            call.cancel()
    return events


def moves(events: list[Any]) -> list[tuple[str, int, bool]]:
    return [(e.revision.commit, e.sequence, e.history_cut) for e in events if e.event == "revision"]


def watching(
    srv: WeightServer, events: Callable[[], list[Any]], into: list[Any]
) -> threading.Thread:
    """A watch read on a thread into ``into``, started once the server counts it (so the
    next change is announced to it)."""
    thread = threading.Thread(target=lambda: into.extend(events()))
    thread.start()
    until(lambda: srv.state.feed.watchers() == 1)
    return thread


def there_and_back(
    srv: WeightServer, c: Client, events: Callable[[], list[Any]]
) -> tuple[Revision, Revision, list[Any]]:
    """Publish A, then with a watch open (read by ``events``) B and A again: A, B and the
    events the watch read."""
    a = c.publish(MODEL, weights(0))
    live: list[Any] = []
    watcher = watching(srv, events, live)
    b = c.publish(MODEL, weights(1))
    c.publish(MODEL, weights(0))  # the same bytes: main moves back to A
    watcher.join(30)
    return a, b, live


def until(condition: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_rollback_is_announced_on_every_watch(tmp_path: Path, capsys) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with serve(root, allow_publish=True) as upstream, Client(upstream.http_url) as publisher:
        first = publisher.publish(MODEL, weights(0))
        config = ServerConfig(
            upstream.http_url, http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0,
            watch=False, cache_dir=str(tmp_path / "node"), grace_seconds=1,
        )  # fmt: skip
        with WeightServer(config) as node:
            with Client(node.http_url, retry_seconds=30) as worker:
                worker.model(MODEL).fetch()  # the node holds the model: it follows it
            heard: dict[str, list[str]] = {}
            raw: list[dict] = []

            def follow(name: str, url: str) -> None:
                with Client(url) as c:
                    heard[name] = []
                    for revision in c.model(MODEL).watch(timeout=60):
                        heard[name].append(revision.commit)
                        if len(heard[name]) == 2:
                            return

            def command_line() -> None:
                url = f"{upstream.http_url}/v1/models/{MODEL}"
                assert _cli.main(["watch", url, "--timeout", "20"]) == 0

            threads = [
                threading.Thread(target=follow, args=("http", upstream.http_url)),
                threading.Thread(target=follow, args=("grpc", upstream.grpc_url)),
                threading.Thread(target=follow, args=("node", node.http_url)),
                threading.Thread(target=lambda: raw.extend(watch_lines(upstream.http_port, "", 2))),
                threading.Thread(target=command_line),
            ]
            for t in threads:
                t.start()
            # Every watch open: four on the upstream, the node's own follower, one on the node.
            until(lambda: upstream.state.feed.watchers() == 5 and node.state.feed.watchers() == 1)
            second = publisher.publish(MODEL, weights(1))
            # A node announces what it holds: once it holds B (a node that never held B
            # would have nothing to announce when main moves back to A).
            until(lambda: len(heard.get("node", [])) == 1)
            back = publisher.publish(MODEL, weights(0))  # the same bytes: main moves back
            assert back.commit == first.commit
            until(lambda: len(heard.get("node", [])) == 2)  # the node filled A again
            for t in threads:
                t.join(60)
    moves = [second.commit, first.commit]
    assert heard == {"http": moves, "grpc": moves, "node": moves}
    revisions = [e for e in raw if e["event"] == "revision"]
    assert [e["commit"] for e in revisions] == moves
    assert revisions[0]["sequence"] < revisions[1]["sequence"]
    assert raw[0]["event"] == "hello" and raw[0]["sequence"] < revisions[0]["sequence"]
    printed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert printed == moves


def test_a_watcher_resumes_by_sequence_and_by_commit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with serve(root, allow_publish=True) as srv, Client(srv.http_url) as c:
        a, b, live = there_and_back(srv, c, lambda: watch_lines(srv.http_port, "", 2))
        hello, *moves = live
        assert [e["commit"] for e in moves] == [b.commit, a.commit]
        assert hello["sequence"] < moves[0]["sequence"] < moves[1]["sequence"]
        resumed = watch_lines(srv.http_port, f"?after={moves[0]['sequence']}", 1)
        assert resumed[0]["sequence"] == moves[1]["sequence"]  # hello: main's own change
        assert [(e["commit"], e["sequence"]) for e in resumed[1:]] == [
            (a.commit, moves[1]["sequence"])
        ]
        # At A before B (its first sequence): B and the move back, though A is main again.
        since_first = watch_lines(srv.http_port, f"?since={a.commit}&after={hello['sequence']}", 2)
        assert [e["commit"] for e in since_first[1:]] == [b.commit, a.commit]
        model = c.model(MODEL)
        # Resuming from B: the move back to A. From A (main now): nothing missed.
        assert [r.commit for r in model.watch(since=b.commit, timeout=1.0)] == [a.commit]
        assert list(model.watch(since=a.commit, timeout=1.0)) == []


def test_a_since_that_retention_removed_gets_main_not_an_older_held_revision(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with serve(root, allow_publish=True, keep_revisions=2) as srv, Client(srv.http_url) as c:
        held = c.publish(MODEL, weights(0))
        model = c.model(MODEL)
        model.hold(held.commit, 600)  # an older revision kept by a hold
        removed = c.publish(MODEL, weights(1)).commit
        kept = [c.publish(MODEL, weights(step)).commit for step in (2, 3, 4)]
        listed = [r.commit for r in model.revisions()]
        assert removed not in listed and held.commit in listed
        # The changes after the removed one that are still held, never the older held one.
        _, *events = watch_lines(srv.http_port, f"?since={removed}", 2)
        assert [e["commit"] for e in events] == kept[1:]
        assert [r.commit for r in model.watch(since=removed, timeout=1.0)] == kept[1:]
        # A point the server never announced (or no longer remembers): main, flagged.
        _, *events = watch_lines(srv.http_port, f"?since={'f' * 40}", 1)
        assert [(e["commit"], e["history_cut"]) for e in events] == [(kept[-1], True)]
        _, *events = watch_lines(srv.http_port, "?after=1", 1)
        assert [(e["commit"], e["history_cut"]) for e in events] == [(kept[-1], True)]
        # gRPC alike: the changes still held, or main flagged where the history is cut.
        hello, *events = grpc_events(srv.grpc_port, 2, since=removed)
        assert [(c, cut) for c, _, cut in moves(events)] == [(k, False) for k in kept[1:]]
        for point in ({"since": "f" * 40}, {"after": 1}, {"after": 0}):
            hello, cut = grpc_events(srv.grpc_port, 1, **point)
            assert moves([cut]) == [(kept[-1], hello.sequence, True)]
        with Client(srv.grpc_url) as g:
            assert [r.commit for r in g.model(MODEL).watch(since=removed, timeout=1.0)] == kept[1:]


def test_a_grpc_watcher_resumes_by_sequence(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with serve(root, allow_publish=True) as srv, Client(srv.http_url) as c:
        a, b, live = there_and_back(srv, c, lambda: grpc_events(srv.grpc_port, 2))
        hello, *changes = live
        assert hello.event == "hello" and hello.main == a.commit
        (_, at_b, _), (_, at_a, _) = moves(changes)
        assert moves(changes) == [(b.commit, at_b, False), (a.commit, at_a, False)]
        assert 0 < hello.sequence < at_b < at_a
        # Resumed after B: the move back to A, then the next change live, nothing else.
        resumed: list[Any] = []
        watcher = watching(srv, lambda: grpc_events(srv.grpc_port, 2, after=at_b), resumed)
        d = c.publish(MODEL, weights(2))
        watcher.join(30)
        assert resumed[0].sequence == at_a  # hello: the change that made A main
        assert [(commit, cut) for commit, _, cut in moves(resumed)] == [
            (a.commit, False),
            (d.commit, False),
        ]
        assert moves(resumed)[0][1] == at_a
        # At A before B (its first sequence): B, the rollback and D, though A was main again.
        _, *since_first = grpc_events(srv.grpc_port, 3, since=a.commit, after=hello.sequence)
        assert [commit for commit, _, _ in moves(since_first)] == [b.commit, a.commit, d.commit]


def test_remote_model_watch_over_grpc_resumes_by_sequence_after_a_restart(
    tmp_path: Path,
) -> None:
    """A watcher at A that missed B and the move back to A while its server was down is told
    both when it reconnects: by commit alone A is main, so nothing would seem missed."""
    root = tmp_path / "root"
    root.mkdir()
    heard: list[str] = []

    def follow(url: str) -> None:
        with Client(url) as watcher:
            for revision in watcher.model(MODEL).watch(timeout=60):
                heard.append(revision.commit)
                if len(heard) == 2:
                    return

    with serve(root, allow_publish=True, grace_seconds=1) as srv:
        with Client(srv.http_url) as c:
            a = c.publish(MODEL, weights(0))
        port = srv.grpc_port
        following = threading.Thread(target=follow, args=(srv.grpc_url,))
        following.start()
        until(lambda: srv.state.feed.watchers() == 1)
    # While the watched server is down, another over the same root moves main to B and back.
    with serve(root, allow_publish=True, grace_seconds=1) as other, Client(other.http_url) as c:
        b = c.publish(MODEL, weights(1))
        c.publish(MODEL, weights(0))
    config = ServerConfig(
        str(root), http_port=0, grpc_port=port, flight_port=None, rescan_seconds=0,
        watch=False, grace_seconds=1,
    )  # fmt: skip
    with WeightServer(config):
        following.join(60)
    assert heard == [b.commit, a.commit]


def test_an_overrun_grpc_watcher_reconnects_and_misses_nothing(tmp_path: Path) -> None:
    """A watcher that reads nothing while many large announcements pass is cut by the server
    (RESOURCE_EXHAUSTED over gRPC, as an ``overrun`` event ends an HTTP watch);
    ``RemoteModel.watch`` reconnects by sequence and reports every change, in order."""
    root = tmp_path / "root"
    root.mkdir()
    heard: list[str] = []
    failed: list[BaseException] = []
    stalled, resume = threading.Event(), threading.Event()
    published: list[str] = []
    # Every revision kept: retention's removals are skipped on resuming, by design.
    with serve(root, allow_publish=True, keep_revisions=64) as srv, Client(srv.http_url) as c:
        c.publish(MODEL, weights(0))

        def follow() -> None:
            try:
                with Client(srv.grpc_url) as watcher:
                    for revision in watcher.model(MODEL).watch(timeout=120):
                        heard.append(revision.commit)
                        if len(heard) == 1:
                            stalled.set()
                            resume.wait(120)  # reads nothing while the rest are published
                        if len(heard) == len(published) and len(published) > 1:
                            return
            except BaseException as e:  # noqa: BLE001 - reported by the test below
                failed.append(e)

        following = threading.Thread(target=follow)
        following.start()
        until(lambda: srv.state.feed.watchers() == 1)
        published.append(c.publish(MODEL, weights(1)).commit)
        assert stalled.wait(30)
        big = {"notes": "x" * (512 << 10)}  # fills the stream's flow-control window fast
        for step in range(2, 40):
            published.append(c.publish(MODEL, weights(step), metadata=big).commit)
        resume.set()
        following.join(120)
    assert not failed, failed
    assert heard == published
