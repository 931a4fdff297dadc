"""A server on loopback that takes publishes (HTTP, gRPC and the same-node socket), and the
arrays of a first revision to publish."""

from __future__ import annotations

import http.client
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

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
