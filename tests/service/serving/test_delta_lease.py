"""The delta stream (``GET /v1/models/ID/-/delta``) is a data route like the tensor streams:
it takes a stream slot (the limits, ``weightserve_open_streams``), holds its files, and is
cut when its client reads nothing. Real servers on loopback port 0; slots held by real
delta streams whose readers stall."""

from __future__ import annotations

import contextlib
import http.client
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from weightserve.client._client import Client
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.serving.state import Limits

MODEL = "team/policy"
MIB = 1 << 20
REQUESTS = 12
HINT = 0.05  # the retry hint (seconds): short, so the crowd finishes fast


def weights(seed: int) -> dict[str, np.ndarray]:
    """16 MiB of tensors that change wholly between seeds: far more than the socket buffers
    hold for a reader that stalls, so a stalled delta stream stays open."""
    rng = np.random.default_rng(seed)
    return {f"layers.{i}.w": rng.integers(0, 256, 4 * MIB, dtype=np.uint8) for i in range(4)}


@contextlib.contextmanager
def serving(root: Path, idle_timeout: float = 60.0) -> Iterator[tuple[WeightServer, str, str]]:
    """A publishing server at two streams (two per client), with two revisions of MODEL."""
    sockets = tempfile.mkdtemp(prefix="ws-")
    limits = Limits(
        max_streams=2, max_streams_per_client=2, retry_after=HINT, idle_timeout=idle_timeout
    )
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, uds=f"{sockets}/ws.sock",
        rescan_seconds=0, watch=False, allow_publish=True, limits=limits, grace_seconds=1,
    )  # fmt: skip
    with WeightServer(config) as srv, Client(srv.http_url) as c:
        first = c.publish(MODEL, weights(1)).commit
        second = c.publish(MODEL, weights(2)).commit
        yield srv, first, second


def delta_path(since: str, revision: str) -> str:
    return f"/v1/models/{MODEL}/-/delta?since={since}&revision={revision}"


def open_delta(srv: WeightServer, path: str, method: str = "GET") -> http.client.HTTPResponse:
    """The answer's status and headers; its body left unread (the caller reads or stalls)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=30)
    # One answer per connection: the response then owns the socket, and closing it closes it.
    conn.request(method, path, headers={"Connection": "close"})
    return conn.getresponse()


def open_streams_gauge(srv: WeightServer) -> float:
    """``weightserve_open_streams{transport="http"}`` as /metrics reports it."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    for line in text.splitlines():
        if line.startswith('weightserve_open_streams{transport="http"}'):
            return float(line.split()[-1])
    return 0.0


def eventually(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_concurrent_deltas_are_admitted_two_at_a_time(tmp_path: Path) -> None:
    with serving(tmp_path) as (srv, first, second):
        path = delta_path(first, second)
        # Twelve at once, none read: two are admitted and stall; ten are refused at once.
        with ThreadPoolExecutor(REQUESTS) as pool:
            answers = list(pool.map(lambda _: open_delta(srv, path), range(REQUESTS)))
        admitted = [a for a in answers if a.status == 200]
        refused = [a for a in answers if a.status == 429]
        assert len(admitted) == 2 and len(refused) == REQUESTS - 2, [a.status for a in answers]
        assert all(a.getheader("retry-after") for a in refused)
        assert open_streams_gauge(srv) == 2
        bodies = [a.read() for a in admitted]  # the two finish: their slots come back
        assert bodies[0] == bodies[1] and len(bodies[0]) > 16 * MIB
        for a in answers:
            a.close()
        eventually(lambda: open_streams_gauge(srv) == 0, "both slots given back")

        # Twelve workers that retry as told: all get the same stream, never more than two
        # open at a time.
        most = 0
        done = threading.Event()

        def sample() -> None:
            nonlocal most
            while not done.is_set():
                most = max(most, srv.state.open_streams)
                time.sleep(0.002)

        def worker(_: int) -> bytes:
            while True:
                answer = open_delta(srv, path)
                try:
                    if answer.status == 200:
                        return answer.read()
                    assert answer.status == 429, answer.status
                    answer.read()
                finally:
                    answer.close()
                time.sleep(float(answer.getheader("retry-after") or HINT))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with ThreadPoolExecutor(REQUESTS) as pool:
                got = list(pool.map(worker, range(REQUESTS)))
        finally:
            done.set()
            sampler.join()
        assert all(body == bodies[0] for body in got)
        assert most == 2
        eventually(lambda: srv.state.open_streams == 0, "every slot given back")


def test_a_since_the_server_never_held_streams_under_the_lease_too(tmp_path: Path) -> None:
    """An unknown commit as ``since`` gets every tensor whole (the documented answer): a full
    download, so it waits for a slot like any other; one that names no revision is a 400."""
    with serving(tmp_path) as (srv, _, second):
        with contextlib.ExitStack() as held:
            for _ in range(2):
                held.enter_context(srv.state.stream_slot("http", "another client"))
            answer = open_delta(srv, delta_path("0" * 40, second))
            answer.read()
            answer.close()
            assert answer.status == 429, answer.status
        for since in ("a:b", "not-a-revision"):
            answer = open_delta(srv, delta_path(since, second))
            answer.read()
            answer.close()
            assert answer.status == 400, (since, answer.status)
        answer = open_delta(srv, delta_path("0" * 40, second))
        body = answer.read()
        answer.close()
        assert answer.status == 200 and answer.getheader("x-weightserve-delta-base") == ""
        assert len(body) > 16 * MIB


def test_head_takes_no_slot_past_its_answer(tmp_path: Path) -> None:
    with serving(tmp_path) as (srv, first, second):
        answer = open_delta(srv, delta_path(first, second), method="HEAD")
        answer.read()
        answer.close()
        assert answer.status == 200 and answer.getheader("x-weightserve-delta-base") == first
        assert srv.state.open_streams == 0


@pytest.mark.parametrize("idle_timeout", [0.5])
def test_a_stalled_delta_reader_is_cut_and_its_slot_freed(
    tmp_path: Path, idle_timeout: float
) -> None:
    with serving(tmp_path, idle_timeout=idle_timeout) as (srv, first, second):
        stalled = [open_delta(srv, delta_path(first, second)) for _ in range(2)]
        assert [a.status for a in stalled] == [200, 200]
        assert srv.state.open_streams == 2
        eventually(lambda: srv.state.open_streams == 0, "the idle cut frees both slots")
        for a in stalled:
            with contextlib.suppress(http.client.HTTPException, OSError):
                a.read()
            a.close()
        answer = open_delta(srv, delta_path(first, second))
        assert answer.status == 200 and len(answer.read()) > 16 * MIB
        answer.close()
