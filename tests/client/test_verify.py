"""The chunk digest check and its ``verify`` policy (client/receive/stream.py ``chunk_checker``).

A real server streams a real file through a loopback proxy that flips one byte of a chosen
chunk on the way: ``"full"`` catches it, ``"none"`` hands the changed byte through,
``"sample"`` catches it in a tensor's first chunk and in the chunks ``sampled`` picks, and
misses it elsewhere. Retries are off, so a detected corruption reaches the caller instead of
being resumed past (the proxy flips only once).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from safetensors.numpy import save_file

from weightserve.client import RemoteWeights, load_weights
from weightserve.client._client import Client, FetchOptions
from weightserve.client.errors import DataCorruption
from weightserve.client.receive.stream import chunk_checker, sampled
from weightserve.service.server import ServerConfig, WeightServer

CHUNK = 16 << 10
CHUNKS = 32  # 512 KiB: chunks 21 and 25 of "w" are among those "sample" checks
NAME = "w"
MARK = 32  # bytes of the original data the proxy looks for (random: unique in the stream)


class FlippingProxy:
    """Passes loopback connections to ``upstream_port``; flips the last byte of the first
    occurrence of ``pattern`` in what the server sends, once."""

    def __init__(self, upstream_port: int, pattern: bytes) -> None:
        self.upstream_port = upstream_port
        self.pattern = pattern
        self.flipped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        # Everything is passed on at once (holding bytes back would stall a handshake); the
        # pattern's last byte is flipped, which lies in the current read even when the
        # pattern began in the previous one.
        tail = b""
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if from_server and not self.flipped:
                    at = (tail + data).find(self.pattern)
                    if at >= 0:
                        buf = bytearray(data)
                        buf[at + len(self.pattern) - 1 - len(tail)] ^= 0xFF
                        self.flipped += 1
                        data = bytes(buf)
                    tail = (tail + data)[-(len(self.pattern) - 1) :]
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WeightServer, np.ndarray]]:
    root = tmp_path_factory.mktemp("verify-root")
    (root / "m").mkdir()
    data = np.random.default_rng(7).integers(0, 256, CHUNKS * CHUNK, dtype=np.uint8)
    save_file({NAME: data}, str(root / "m" / "model.safetensors"))
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0)
    with WeightServer(config) as srv:
        yield srv, data


def chunk_index(want_sampled: bool) -> int:
    """A chunk past the first that ``verify="sample"`` does (or does not) check."""
    return next(i for i in range(1, CHUNKS) if sampled(NAME, i * CHUNK) == want_sampled)


@contextlib.contextmanager
def corrupted(served, chunk: int, transport: str = "http") -> Iterator[tuple[str, FlippingProxy]]:
    """A URL whose stream has one byte flipped in chunk ``chunk`` of the tensor."""
    srv, data = served
    start = chunk * CHUNK + 100
    port = srv.http_port if transport == "http" else srv.grpc_port
    proxy = FlippingProxy(port, data[start : start + MARK].tobytes())
    try:
        yield f"{transport}://127.0.0.1:{proxy.port}", proxy
    finally:
        proxy.close()


def fetch(url: str, verify: str | None) -> np.ndarray:
    # flight=False keeps gRPC's data on this connection (StreamTensors) rather than the
    # Flight port the server advertises, which the proxy does not sit in front of.
    with Client(url, flight=False if url.startswith("grpc") else None) as client:
        options = FetchOptions(parallel=1, chunk_bytes=CHUNK, retries=0, verify=verify)
        return client.model("m", options).fetch([NAME])[NAME]


def changed_bytes(got: np.ndarray, want: np.ndarray) -> list[int]:
    return np.flatnonzero(got != want).tolist()


def flipped_at(chunk: int) -> list[int]:
    """Where ``corrupted(..., chunk)`` changes the tensor: its pattern's last byte."""
    return [chunk * CHUNK + 100 + MARK - 1]


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_full_detects_a_flipped_byte_in_any_chunk(served, transport: str) -> None:
    with corrupted(served, chunk_index(want_sampled=False), transport) as (url, proxy):
        with pytest.raises(DataCorruption, match="do not match their digest"):
            fetch(url, "full")
        assert proxy.flipped == 1


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_none_checks_nothing(served, transport: str) -> None:
    chunk = 0
    with corrupted(served, chunk, transport) as (url, proxy):
        got = fetch(url, "none")
    assert proxy.flipped == 1
    assert changed_bytes(got, served[1]) == flipped_at(chunk)  # handed through as sent


def test_sample_checks_the_first_chunk_and_the_sampled_ones(served) -> None:
    for chunk in (0, chunk_index(want_sampled=True)):
        with corrupted(served, chunk) as (url, proxy):
            with pytest.raises(DataCorruption):
                fetch(url, "sample")
            assert proxy.flipped == 1
    skipped = chunk_index(want_sampled=False)
    with corrupted(served, skipped) as (url, proxy):
        got = fetch(url, "sample")
    assert proxy.flipped == 1
    assert changed_bytes(got, served[1]) == flipped_at(skipped)


def test_sample_picks_a_stable_fraction() -> None:
    # The same chunks on every call (a pure function of name and offset), about 1 in 8.
    picks = [sampled("model.layers.3.mlp.up_proj.weight", i * CHUNK) for i in range(4000)]
    assert picks == [sampled("model.layers.3.mlp.up_proj.weight", i * CHUNK) for i in range(4000)]
    assert picks[0]
    assert 0.09 < sum(picks[1:]) / 3999 < 0.16


def test_weights_and_environment_carry_the_policy(served, monkeypatch) -> None:
    chunk = chunk_index(want_sampled=False)
    with corrupted(served, chunk) as (url, _):
        weights = RemoteWeights(
            f"{url}/v1/models/m", verify="sample", use_max=False,
            options=FetchOptions(retries=0, chunk_bytes=CHUNK),
        )  # fmt: skip
        with weights:
            got = weights.numpy_state_dict()[NAME]
    assert changed_bytes(got, served[1]) == flipped_at(chunk)
    monkeypatch.setenv("WEIGHTSERVE_VERIFY", "none")
    assert FetchOptions().verify == "none"
    with corrupted(served, 0) as (url, _):
        weights = load_weights(
            [f"{url}/v1/models/m"], use_max=False,
            options=FetchOptions(retries=0, chunk_bytes=CHUNK),
        )  # fmt: skip
        with weights:
            got = weights.numpy_state_dict()[NAME]
    assert changed_bytes(got, served[1]) == flipped_at(0)
    monkeypatch.setenv("WEIGHTSERVE_VERIFY", "none")  # the keyword wins over the variable
    with corrupted(served, 0) as (url, _):
        weights = load_weights(
            [f"{url}/v1/models/m"], use_max=False, verify="full",
            options=FetchOptions(retries=0, chunk_bytes=CHUNK),
        )  # fmt: skip
        with weights, pytest.raises(DataCorruption):
            weights.numpy_state_dict()


def test_invalid_values_name_the_choices(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"verify must be one of full, sample, none, got 'all'"):
        FetchOptions(verify="all")
    with pytest.raises(ValueError, match="full, sample, none"):
        chunk_checker("sampled")
    monkeypatch.setenv("WEIGHTSERVE_VERIFY", "yes")
    with pytest.raises(ValueError, match=r"WEIGHTSERVE_VERIFY must be one of full, sample, none"):
        FetchOptions()
    monkeypatch.delenv("WEIGHTSERVE_VERIFY")
    with pytest.raises(ValueError, match="full, sample, none"):
        RemoteWeights("http://127.0.0.1:9/v1/models/m", verify="off", use_max=False)
    cli = [
        sys.executable,
        "-m",
        "weightserve.client._cli",
        "pull",
        "http://127.0.0.1:9/v1/models/m",
    ]
    done = subprocess.run([*cli, "--verify", "off"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--verify: need one of full, sample, none, got 'off'" in done.stderr


def test_checker_reports_what_it_checked() -> None:
    data = memoryview(b"x" * 64)
    digest = xxhash.xxh3_64_intdigest(data)
    assert chunk_checker("full")("t", 64, digest, data) is True
    assert chunk_checker("none")("t", 0, digest + 1, data) is False  # not even the first
    assert chunk_checker("sample")("t", 0, digest, data) is True
    with pytest.raises(DataCorruption, match="'t': bytes 0..64"):
        chunk_checker("sample")("t", 0, digest + 1, data)
