"""Sixty watchers that stop reading and publishes with a megabyte of metadata each: the server
serializes each announcement once, bounds what a stalled watcher may queue (it is told it was
overrun and its stream ends), answers ``/healthz`` meanwhile, and its memory stays bounded;
metadata over its documented limit is refused."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import numpy as np
import pytest

from tests.support._util import http_request
from tests.support.commands import ANY_PORTS, clean_env, start_server
from weightserve.client._client import Client
from weightserve.client.errors import InvalidRequest
from weightserve.service.serving.feed import WATCH_QUEUE_EVENTS
from weightserve.service.sources.publishing.uploads import MAX_METADATA_BYTES

MODEL = "team/policy"
WATCHERS = 60
MiB = 1 << 20


def weights(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(64, step, dtype=np.float32)}


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def stalled_watch(port: int) -> socket.socket:
    """A watch that reads its first bytes (the stream is open) and then nothing more."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /v1/models/{MODEL}/-/watch HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    sock.settimeout(30)
    assert sock.recv(1)
    return sock


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status")
def test_stalled_watchers_and_big_metadata_keep_the_server_small(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    served = start_server([str(root), *ANY_PORTS, "--allow-publish"], clean_env(), tmp_path)
    port = int(served.http.rsplit(":", 1)[1])
    try:
        with Client(served.http) as c, contextlib.ExitStack() as sockets:
            c.publish(MODEL, weights(0))
            watchers = [sockets.enter_context(stalled_watch(port)) for _ in range(WATCHERS)]
            before = status_kib(served.proc.pid, "VmRSS")
            with pytest.raises(InvalidRequest, match="metadata"):
                c.publish(MODEL, weights(1), metadata={"notes": "x" * (4 * MiB)})
            under_limit = {"notes": "x" * (MAX_METADATA_BYTES - 64)}
            # More than a watcher may queue, beyond what the socket buffers take in.
            for step in range(1, WATCH_QUEUE_EVENTS + 12):
                c.publish(MODEL, weights(step), metadata=under_limit)
                assert http_request(port, "/healthz").status == 200
            growth_mib = (status_kib(served.proc.pid, "VmHWM") - before) / 1024
            print(f"peak RSS growth: {growth_mib:.0f} MiB for {WATCHERS} stalled watchers")
            # One copy per watcher in its socket's buffer at most, and each line once: far
            # under what a copy per watcher per revision would take (60 x 27 MiB).
            assert growth_mib < 256
            # A stalled watcher that reads again is told it fell behind, and its stream ends.
            watcher = watchers[0]
            received = b""
            while chunk := watcher.recv(1 << 20):
                received += chunk
            assert b'"event":"overrun"' in received[-1024:]
    finally:
        assert served.stop() == 0
