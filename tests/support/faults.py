"""Helpers for tests that change files under a server or break transfers: seeded tensors
saved by atomic rename, a proxy that cuts a connection after some bytes, a one-shot trigger,
waiting for a condition."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from weightserve.client._client import Client

MIB = 1 << 20

CHUNK = 1 * MIB


def tensors(seed: int, count: int, nbytes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.integers(0, 256, nbytes, dtype=np.uint8) for i in range(count)}


def save_atomic(arrays: dict[str, np.ndarray], path: Path) -> None:
    """Write a new version beside the file, then rename it over (what a careful writer does)."""
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(arrays, tmp)
    os.replace(tmp, path)


def assert_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
        assert got[name].tobytes() == arr.tobytes(), name


def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def connect(target: str, transport: str, **options) -> Client:
    return Client(target, flight=transport != "grpc-streamtensors", **options)


def once(action: Callable[[], None], after_bytes: int = 1) -> Callable[[int], None]:
    """An ``on_bytes`` callback that runs ``action`` once, when that many bytes arrived."""
    state = {"got": 0, "done": False}

    def on_bytes(n: int) -> None:
        state["got"] += n
        if not state["done"] and state["got"] >= after_bytes:
            state["done"] = True
            action()

    on_bytes.state = state  # type: ignore[attr-defined]
    return on_bytes


class CuttingProxy:
    """A loopback TCP proxy that cuts the first connection carrying more than ``cut_after``
    bytes from the server, once, right after passing exactly ``cut_after`` of them on (so
    the client has the answer's head and part of its body, however the server's writes
    were batched: a cut before any byte looks like a kept-alive connection the server
    closed, which a client rightly asks again on); every other connection is passed through
    untouched.

    Given several upstream ports it sends each new connection to the next one in turn, as a
    plain round-robin load balancer (a Kubernetes Service) does: ``connections`` counts them.
    """

    def __init__(self, upstream_port: int | list[int], cut_after: int) -> None:
        ports = upstream_port if isinstance(upstream_port, list) else [upstream_port]
        self.upstream_ports = ports
        self.connections = [0] * len(ports)
        self.cut_after = cut_after
        self.cuts = 0
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._start(self._accept)

    def _start(self, target: Callable, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            turn = sum(self.connections) % len(self.upstream_ports)
            self.connections[turn] += 1
            upstream = socket.create_connection(("127.0.0.1", self.upstream_ports[turn]))
            self._socks += [client, upstream]
            self._start(self._pump, client, upstream, False)
            self._start(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while data := src.recv(256 << 10):
                if from_server and seen + len(data) > self.cut_after:
                    with self._lock:
                        cut = self.cuts == 0
                        self.cuts += cut
                    if cut:
                        dst.sendall(data[: self.cut_after - seen])
                        for s in (src, dst):
                            s.shutdown(socket.SHUT_RDWR)
                            s.close()
                        return
                seen += len(data)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
