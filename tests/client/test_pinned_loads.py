"""A model resolved before a publish keeps loading its own revision while the server holds
it: the index a ``RemoteModel`` read names a commit, and every stream of it is pinned to that
commit, on every data plane, whatever ``main`` has become since. Loads racing a publisher
never fail and never mix two revisions."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.support import publishing
from weightserve.client._client import Client
from weightserve.service.server import WeightServer

server = publishing.server  # the fixture: a server on loopback that takes publishes

MODEL = "team/pinned"
PUBLISHES = 6
LOAD_SECONDS = 60.0  # a bound on the racing loads, should the publisher stall


def revision(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layers.{i}.w": rng.standard_normal(4096).astype(np.float32) for i in range(4)}


def bytes_of(arrays: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {n: np.asarray(a).tobytes() for n, a in arrays.items()}


def connect(srv: WeightServer, plane: str) -> Client:
    url = srv.grpc_url if plane == "grpc" else srv.http_url
    return Client(url, data_plane=plane, retry_seconds=0)


@pytest.mark.parametrize("plane", ["http", "grpc", "handoff"])
def test_a_model_resolved_before_a_publish_loads_its_own_revision(
    server: WeightServer, plane: str
) -> None:
    first, second = revision(1), revision(2)
    with Client(server.http_url) as publisher, connect(server, plane) as c:
        r1 = publisher.publish(MODEL, first).commit
        model = c.model(MODEL)
        assert model.commit == r1
        r2 = publisher.publish(MODEL, second, base=r1).commit
        assert bytes_of(model.fetch()) == bytes_of(first)  # its revision, still held
        assert bytes_of(model.fetch(["layers.2.w"])) == bytes_of(
            {"layers.2.w": first["layers.2.w"]}
        )
        fresh = c.model(MODEL)
        assert fresh.commit == r2 and bytes_of(fresh.fetch()) == bytes_of(second)


def test_loads_racing_publishes_never_fail_or_mix(server: WeightServer) -> None:
    revisions = [bytes_of(revision(seed)) for seed in range(PUBLISHES + 1)]
    with Client(server.http_url) as publisher:
        publisher.publish(MODEL, revision(0))
    done = threading.Event()
    errors: list[BaseException] = []

    def publish_all() -> None:
        try:
            with Client(server.http_url) as c:
                for seed in range(1, PUBLISHES + 1):
                    c.publish(MODEL, revision(seed))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done.set()

    loads, failed = 0, []
    thread = threading.Thread(target=publish_all)
    deadline = time.monotonic() + LOAD_SECONDS
    with Client(server.http_url, data_plane="http", retry_seconds=0) as c:
        thread.start()
        while not done.is_set() and time.monotonic() < deadline:
            try:
                model = c.model(MODEL)
                got = bytes_of(model.fetch())
            except Exception as e:  # noqa: BLE001 - counted: no load may fail
                failed.append(repr(e))
                continue
            loads += 1
            assert got in revisions, model.commit  # one revision whole, never a mix
    thread.join(timeout=60)
    assert not errors, errors
    assert failed == [], (len(failed), loads, failed[:3])
    assert loads > 0
