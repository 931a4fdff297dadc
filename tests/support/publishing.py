"""A server on loopback that takes publishes (HTTP, gRPC and the same-node socket), and the
arrays of a first revision to publish."""

from __future__ import annotations

import http.client
import json
import os
import select
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tests.support._util import Reply, http_request
from weightserve.service.server import ServerConfig, WeightServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[WeightServer]:
    with serve(tmp_path, allow_publish=True, grace_seconds=1) as srv:
        yield srv


def first_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "layers.0.w": rng.standard_normal((512, 512)).astype(ml_dtypes.bfloat16),
        "norm": rng.standard_normal(512).astype(np.float32),
        "embed.q": rng.integers(-128, 127, (256, 64), dtype=np.int8),
        "head": rng.standard_normal(16).astype(np.float32),
    }


def raw(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def leftovers(root: Path) -> list[str]:
    """What an upload left under the root: its incoming directories. (``os.walk``, not
    ``rglob``: the server removes them while this looks, and a directory gone between
    listing and entering it is skipped, not an error.)"""
    return [
        name
        for _, dirs, files in os.walk(root)
        for name in dirs + files
        if name.startswith(".incoming-")
    ]


def serve(root: Path, **options: object) -> WeightServer:
    sockets = tempfile.mkdtemp(prefix="ws-")  # a Unix socket path must be short
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, uds=f"{sockets}/ws.sock",
        rescan_seconds=0, watch=False, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    return WeightServer(config)


def put_patch(port: int, model: str, base: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """The server's answer to ``body`` sent as a patch against ``base`` in a new upload."""
    uploads = f"/v1/models/{model}/-/uploads"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", uploads, body=json.dumps({"base": base}).encode())
        upload = json.loads(conn.getresponse().read())["upload"]
        conn.request("PUT", f"{uploads}/{upload}/patch", body=body)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    """A safetensors file of ``tensors``, as the reference writer writes it."""
    from safetensors.numpy import save

    return save(tensors)


def begin_upload(port: int, model: str, body: dict | None = None) -> str:
    """A new upload of ``model`` through the raw route; its id."""
    reply = http_request(port, f"/v1/models/{model}/-/uploads", "POST", body=body or {})
    assert reply.status == 201, reply.body
    return str(reply.json()["upload"])


def put_part(port: int, model: str, upload: str, part: str, data: bytes) -> Reply:
    """One part (``files/NAME``, ``tensors``, ``patch``) of an upload, whole."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("PUT", f"/v1/models/{model}/-/uploads/{upload}/{part}", body=data)
        return Reply(conn.getresponse())
    finally:
        conn.close()


def commit_upload(port: int, model: str, upload: str) -> Reply:
    return http_request(port, f"/v1/models/{model}/-/uploads/{upload}/commit", "POST")


class SlowPart:
    """A part's PUT whose body is sent in pieces when the test says so: its headers (with
    the whole Content-Length) and ``first`` bytes now."""

    def __init__(self, port: int, model: str, upload: str, part: str, data: bytes, first: int):
        self.data = data
        self.sent = first
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.putrequest("PUT", f"/v1/models/{model}/-/uploads/{upload}/{part}")
        self.conn.putheader("content-length", str(len(data)))
        self.conn.endheaders()
        self.conn.send(data[:first])

    def answered(self, within: float) -> bool:
        """Whether the server answered (or closed) within ``within`` seconds."""
        assert self.conn.sock is not None
        # poll, not select: in a long test run descriptors pass select's limit of 1024.
        poller = select.poll()
        poller.register(self.conn.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(within * 1000))

    def finish(self) -> Reply:
        self.conn.send(self.data[self.sent :])
        return self.answer()

    def answer(self) -> Reply:
        try:
            return Reply(self.conn.getresponse())
        finally:
            self.conn.close()

    def close(self) -> None:
        self.conn.close()
