"""A delta update is all-or-nothing for the caller's state: the whole stream is read and
checked before any tensor of ``state`` changes, so a stream cut midway leaves every tensor
holding the revision it held; within ``retry_seconds`` the update asks again and lands whole.
Tensors the target revision no longer has are removed from ``state`` and reported."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import publishing
from tests.support.faults import CuttingProxy
from weightserve.client._client import Client
from weightserve.client.errors import ServerUnreachable
from weightserve.service.server import WeightServer

server = publishing.server  # the fixture: a server on loopback that takes publishes

MODEL = "team/staged"
TENSORS = 8
ELEMENTS = 16 << 10  # 64 KiB of float32 each: every tensor of the next revision goes whole
CUT_AFTER = 100 << 10  # the delta stream cut inside its second tensor


def revision(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"layers.{i}.w": rng.standard_normal(ELEMENTS).astype(np.float32) for i in range(TENSORS)
    }


def holds(state: dict[str, np.ndarray], arrays: dict[str, np.ndarray]) -> list[str]:
    """The names of ``arrays`` whose bytes ``state`` holds."""
    return [n for n, a in arrays.items() if np.asarray(state[n]).tobytes() == a.tobytes()]


def test_a_cut_stream_leaves_the_state_untouched(server: WeightServer) -> None:
    first, second = revision(1), revision(2)
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, first).commit
        c.publish(MODEL, second, base=r1)
    state = {n: a.copy() for n, a in first.items()}
    with (
        CuttingProxy(server.http_port, CUT_AFTER) as proxy,
        Client(f"http://127.0.0.1:{proxy.port}", retry_seconds=0) as c,
    ):
        model = c.model(MODEL)
        with pytest.raises(ServerUnreachable, match="cut off"):
            model.update(state, since=r1)
        assert proxy.cuts == 1
    assert holds(state, first) == list(first)  # not one tensor of the next revision


def test_a_cut_stream_is_asked_again_within_the_retry_budget(server: WeightServer) -> None:
    first, second = revision(1), revision(2)
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, first).commit
        r2 = c.publish(MODEL, second, base=r1).commit
    state = {n: a.copy() for n, a in first.items()}
    waits: list[str] = []
    with (
        CuttingProxy(server.http_port, CUT_AFTER) as proxy,
        Client(
            f"http://127.0.0.1:{proxy.port}",
            retry_seconds=5,
            on_wait=lambda reason, _: waits.append(reason),
        ) as c,
    ):
        model = c.model(MODEL)
        assert model.update(state, since=r1).commit == r2
        assert proxy.cuts == 1 and len(waits) == 1, waits
    assert holds(state, second) == list(second)
    assert model.last_update["whole"] == TENSORS


def test_tensors_the_revision_removed_are_removed_and_reported(server: WeightServer) -> None:
    first = revision(1)
    second = {n: a for n, a in first.items() if n not in ("layers.6.w", "layers.7.w")}
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, first).commit
        r2 = c.publish(MODEL, second).commit  # no base: the revision is these tensors only
        state = {n: a.copy() for n, a in first.items()}
        model = c.model(MODEL)
        assert model.update(state, since=r1).commit == r2
    assert sorted(state) == sorted(second)
    assert model.last_update["removed"] == 2 and model.last_update["same"] == TENSORS - 2
    assert model.last_removed == ["layers.6.w", "layers.7.w"]
