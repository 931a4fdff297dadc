"""A node cache's fill as an operator watches it: progress counted in bytes as they land from
a slowed upstream, and a stalled upstream given up on within ``--origin-stall-seconds``."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support import fixtures_safetensors
from tests.support._util import http_request
from tests.support.byte_proxy import SlowProxy
from tests.support.s3_server import S3Server
from weightserve.client import Client
from weightserve.client.errors import OriginUnavailable
from weightserve.service.server import ServerConfig, WeightServer

MODEL = "slow"
FILE_BYTES = 4 << 20


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightServer]:
    root = tmp_path_factory.mktemp("upstream")
    (root / MODEL).mkdir()
    weights = np.random.default_rng(5).standard_normal(FILE_BYTES // 4, dtype=np.float32)
    fixtures_safetensors.save_file({"w": weights}, root / MODEL / "model.safetensors")
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False
    )
    with WeightServer(config) as server:
        yield server


@contextlib.contextmanager
def node(
    upstream: WeightServer, tmp_path: Path, rate: float | None = None, **settings: object
) -> Iterator[tuple[WeightServer, SlowProxy]]:
    proxy = SlowProxy(upstream.http_port, rate)
    try:
        config = ServerConfig(
            f"http://127.0.0.1:{proxy.port}",
            http_port=0,
            grpc_port=0,
            flight_port=None,
            rescan_seconds=0,
            watch=False,
            cache_dir=str(tmp_path),
            **settings,  # type: ignore[arg-type]
        )
        with WeightServer(config) as server:
            yield server, proxy
    finally:
        proxy.close()


def cache_state(server: WeightServer) -> dict:
    reply = http_request(server.http_port, f"/v1/admin/cache/{MODEL}")
    assert reply.status == 200, reply.body
    return json.loads(reply.body)


def watch_fill(server: WeightServer) -> list[int]:
    """Prefetch the model and read its progress every 0.2 s until the fill ends: the
    readings (``bytes_done``) while it filled."""
    reply = http_request(server.http_port, f"/v1/admin/cache/{MODEL}/-/prefetch", "POST")
    assert reply.status == 202, reply.body
    readings: list[int] = []
    deadline = time.monotonic() + 30
    while (state := cache_state(server))["state"] == "filling":
        assert time.monotonic() < deadline, state
        readings.append(state["bytes_done"])
        time.sleep(0.2)
    assert state["state"] == "cached", state
    return readings


def test_progress_grows_within_a_file_as_its_bytes_land(
    upstream: WeightServer, tmp_path: Path
) -> None:
    with node(upstream, tmp_path, rate=1.5 * (1 << 20)) as (server, _):
        readings = watch_fill(server)
        # The model is one file: readings strictly between none and all of it are progress
        # within that file, in the bytes that landed so far.
        within = sorted({r for r in readings if 0 < r < FILE_BYTES})
        assert len(within) >= 2, readings


def test_a_stalled_upstream_fails_the_fill_within_the_stall_bound(
    upstream: WeightServer, tmp_path: Path
) -> None:
    with node(upstream, tmp_path, origin_stall_seconds=2.0) as (server, proxy):
        proxy.stall_after = proxy.bytes_from_upstream + (256 << 10)  # listing done: stall reads
        started = time.monotonic()
        with (
            Client(server.http_url, retry_seconds=0, flight=False) as client,
            pytest.raises(OriginUnavailable) as failed,
        ):
            client.model(MODEL).fetch(prefix="")
        elapsed = time.monotonic() - started
        message = str(failed.value)
        assert elapsed < 25, (elapsed, message)
        assert f"127.0.0.1:{proxy.port}" in message, message
        assert f"{MODEL}/model.safetensors" in message, message
        assert "2 s without a byte, --origin-stall-seconds" in message, message


@pytest.mark.s3
def test_object_storage_progress_grows_per_ranged_read(s3_server: S3Server, tmp_path: Path) -> None:
    part = 256 << 10
    (tmp_path / "models" / MODEL).mkdir(parents=True)
    weights = np.random.default_rng(6).standard_normal(FILE_BYTES // 4, dtype=np.float32)
    fixtures_safetensors.save_file({"w": weights}, tmp_path / "models" / MODEL / "w.safetensors")
    size = len(s3_server.upload(tmp_path / "models", "progress")[f"{MODEL}/w.safetensors"])
    proxy = SlowProxy(s3_server.port, rate=1.5 * (1 << 20))
    config = ServerConfig(
        s3_server.uri("progress", port=proxy.port),
        http_port=0,
        grpc_port=0,
        flight_port=None,
        rescan_seconds=0,
        watch=False,
        cache_dir=str(tmp_path / "node"),
        fill_concurrency=1,
        fill_part_size=part,
    )
    try:
        with WeightServer(config) as server:
            readings = watch_fill(server)
    finally:
        proxy.close()
    # One file: progress within it, counted as each ranged read (one part) lands.
    within = sorted({r for r in readings if 0 < r < size})
    assert len(within) >= 2, readings
    assert all(r % part == 0 for r in within), within
