"""Clients that stop reading do not stall the others: HTTP streams are written on a pool of
writer threads of the app's own, one per admitted stream, not on asyncio's default executor
(``cores + 4`` threads), where each stalled client held a thread in ``poll`` until the idle
timeout. The stalled streams are cut at that timeout and counted."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.commands import clean_env, start_server
from tests.support.http_streams import expected_body, fetch, serving
from weightserve.service.serving.state import Limits, ServiceState
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.transports.http.streaming import WRITER_THREAD_NAME

BIG = "big.weight"  # 16 MiB: more than a stalled client's socket buffers take
IDLE_TIMEOUT = 4.0
# More stalled clients than asyncio's default executor has threads on this machine.
STALLED = max(8, min(32, (os.cpu_count() or 1) + 4) + 2)


def eventually(check: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def idle_cuts(state: ServiceState) -> float:
    return sum(
        sample.value
        for metric in state.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "weightserve_errors_total"
        and sample.labels["transport"] == "http"
        and sample.labels["error"] == "IdleTimeout"
    )


def write_big_model(root: Path) -> None:
    (root / "m").mkdir(parents=True)
    weight = np.random.default_rng(3).standard_normal((4096, 1024), dtype=np.float32)
    save_file({BIG: weight}, str(root / "m" / "model.safetensors"))


def stall(port: int) -> socket.socket:
    """A client that asks for the big tensor and never reads a byte of the answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    sock.connect(("127.0.0.1", port))
    request = f"GET /v1/models/m/-/stream?name={BIG} HTTP/1.1\r\nHost: x\r\n\r\n"
    sock.sendall(request.encode())
    return sock


@pytest.mark.slow
def test_stalled_clients_do_not_stop_a_reading_one(tmp_path: Path) -> None:
    write_big_model(tmp_path)
    limits = Limits(
        max_streams=STALLED + 2, max_streams_per_client=STALLED + 2, idle_timeout=IDLE_TIMEOUT
    )
    state = ServiceState(Catalog(tmp_path), limits)
    chunk = limits.chunk_bytes
    expected = expected_body(state, BIG, chunk)
    with serving(state, "httptools") as (port, app):
        stalled = [stall(port) for _ in range(STALLED)]
        try:
            # Every stalled stream has its writer, blocked on a full socket.
            eventually(
                lambda: app.direct_streams == STALLED, "the stalled streams did not start", 10
            )
            eventually(
                lambda: (
                    sum(t.name.startswith(WRITER_THREAD_NAME) for t in threading.enumerate())
                    >= STALLED
                ),
                "the stalled streams have no writer threads",
                10,
            )
            started = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            body = fetch(conn, BIG, chunk)
            took = time.monotonic() - started
            conn.close()
            assert body == expected
            assert took < IDLE_TIMEOUT / 2, f"a reading client waited {took:.1f} s"
            # The stalled ones still hold their slots (the reading one's is given back just
            # after its last byte, on the server's loop).
            eventually(lambda: state.open_streams == STALLED, "slots not as expected", 5)
            # Each stalled stream is cut at the idle timeout, its slot given back and counted.
            eventually(
                lambda: state.open_streams == 0, "stalled streams were not cut", 3 * IDLE_TIMEOUT
            )
            eventually(lambda: idle_cuts(state) == STALLED, "idle cuts not counted", 5)
        finally:
            for sock in stalled:
                sock.close()


@pytest.mark.slow
def test_stalled_clients_do_not_hold_the_exit_past_the_grace_period(tmp_path: Path) -> None:
    """Once the grace period is over the listener stops without waiting for open streams;
    their writer threads are cut with it, instead of each waiting on its client up to the
    idle timeout while the exiting process joins them."""
    write_big_model(tmp_path / "root")
    idle_timeout, grace = 60, 1
    served = start_server(
        [str(tmp_path / "root"), "--http-port", "0", "--grpc-port", "0", "--flight-port", "0",
         "--no-watch", "--grace", str(grace), "--idle-timeout", str(idle_timeout)],
        clean_env(),
        tmp_path,
    )  # fmt: skip
    port = int(served.http.rsplit(":", 1)[1])
    stalled = [stall(port) for _ in range(3)]
    try:
        # Each stalled stream is on its writer thread, blocked on a full socket.
        time.sleep(1.0)
        started = time.monotonic()
        assert served.stop(signal.SIGTERM, timeout=idle_timeout / 2) == 0
        took = time.monotonic() - started
    finally:
        for sock in stalled:
            sock.close()
    assert took < grace + 10, f"the server took {took:.1f} s to exit"
    log = served.stderr.read_text()
    assert "3 streams still open after 1 s; closing them" in log
    assert log.count("stream of model m to 127.0.0.1 cut:") == 3, log
