"""Small one-tensor answers kept whole per revision (``KeptAnswers``,
service/transports/http/tensors.py): asked again, a tensor's stream is the same bytes, counted
in the metrics each time, and a file overwritten in place is never answered from what was
kept."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support._util import http_request
from weightserve.client._client import Client
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.transports.http.tensors import KeptAnswers

PATH = "/v1/models/m/-/tensors/norm"


def write(root: Path, value: float) -> np.ndarray:
    (root / "m").mkdir(parents=True, exist_ok=True)
    norm = np.full(512, value, dtype=np.float32)
    save_file({"norm": norm, "big": np.zeros((64, 1024), np.float32)}, str(root / "m" / "x.st"))
    os.replace(root / "m" / "x.st", root / "m" / "model.safetensors")
    return norm


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WeightServer, Path]]:
    write(tmp_path, 1.0)
    config = ServerConfig(
        str(tmp_path), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False
    )
    with WeightServer(config) as srv:
        yield srv, tmp_path


def settled(read: Callable[[], float]) -> float:
    """A counter once it stopped moving (the server counts just after the last byte)."""
    value = read()
    for _ in range(40):
        time.sleep(0.05)
        if (again := read()) == value:
            break
        value = again
    return value


def test_a_tensor_asked_again_is_the_same_stream_counted_each_time(served) -> None:
    srv, _ = served
    metrics = srv.state.metrics

    def tensors() -> float:
        return metrics.tensors_served.labels("http", "m")._value.get()

    def data_bytes() -> float:
        return metrics.bytes_served.labels("http", "m")._value.get()

    first = http_request(srv.http_port, PATH)
    assert first.status == 200
    kept_before, tensors_before, bytes_before = (
        KeptAnswers.served,
        settled(tensors),
        settled(data_bytes),
    )
    again = [http_request(srv.http_port, PATH) for _ in range(3)]
    assert KeptAnswers.served - kept_before == 3
    assert [r.body for r in again] == [first.body] * 3
    without_date = {k: v for k, v in first.headers.items() if k != "date"}
    assert [{k: v for k, v in r.headers.items() if k != "date"} for r in again] == [
        without_date
    ] * 3
    assert settled(tensors) == tensors_before + 3
    assert settled(data_bytes) == bytes_before + 3 * 512 * 4
    # The client checks the kept stream's digest as any other's.
    with Client(srv.http_url) as client:
        got = client.model("m").fetch(["norm"])["norm"]
    assert np.array_equal(got, np.full(512, 1.0, np.float32))
    # A large tensor is not kept.
    before = KeptAnswers.served
    for _ in range(2):
        assert http_request(srv.http_port, "/v1/models/m/-/tensors/big").status == 200
    assert KeptAnswers.served == before


def test_a_file_overwritten_in_place_is_not_answered_from_kept_bytes(served) -> None:
    srv, root = served
    old = http_request(srv.http_port, PATH)
    assert old.status == 200 and old.rows()["norm"] == np.full(512, 1.0, np.float32).tobytes()
    path = root / "m" / "model.safetensors"
    data = bytearray(path.read_bytes())
    at = data.index(np.full(512, 1.0, np.float32).tobytes())
    fresh = np.full(512, 2.0, dtype=np.float32)
    data[at : at + fresh.nbytes] = fresh.tobytes()
    st = path.stat()
    with open(path, "r+b") as f:  # in place: same inode and size, a later mtime
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    for _ in range(3):
        reply = http_request(srv.http_port, PATH)
        if reply.status == 200:
            assert reply.rows()["norm"] == fresh.tobytes()
        else:
            assert reply.error()[0] == "ModelUnavailable"
    assert http_request(srv.http_port, PATH).rows()["norm"] == fresh.tobytes()
