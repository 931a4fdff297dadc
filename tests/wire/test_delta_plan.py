"""Element patches of tensors larger than one compare chunk (client/wire/delta_plan.py): an
update through a real server lands bit for bit where the changes skip whole chunks, fill
whole chunks, sit on chunk boundaries, or move the last element, with gaps of every width;
large tensors planned for the worker's CPU (values raw where many changed, whole where most)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tests.support.publishing import serve
from weightserve.client._client import Client
from weightserve.client.wire.delta_plan import COMPARE_CHUNK, CPU_BOUND_BYTES
from weightserve.service.server import WeightServer

MODEL = "team/chunks"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[WeightServer]:
    with serve(tmp_path, allow_publish=True, grace_seconds=1) as srv:
        yield srv


def test_patches_across_compare_chunks_land_bit_for_bit(server: WeightServer) -> None:
    rng = np.random.default_rng(3)
    size = 4 * COMPARE_CHUNK + 17
    first = {
        "w": rng.standard_normal(size).astype(ml_dtypes.bfloat16),
        "q": rng.integers(-128, 127, size, dtype=np.int8),
        "f": rng.standard_normal(2 * COMPARE_CHUNK).astype(np.float32),
    }
    second = {name: array.copy() for name, array in first.items()}
    w = second["w"].view(np.uint16)
    w[COMPARE_CHUNK : 2 * COMPARE_CHUNK] ^= 1  # one whole chunk, none before it
    w[2 * COMPARE_CHUNK - 1 : 2 * COMPARE_CHUNK + 1] ^= 2  # both sides of a boundary
    w[3 * COMPARE_CHUNK + rng.choice(COMPARE_CHUNK, 300, replace=False)] ^= 4  # sparse
    w[-1] ^= 8  # the last element, after a gap wider than a chunk's
    q = second["q"].view(np.uint8)
    q[rng.choice(size, size // 50, replace=False)] ^= 1  # narrow gaps everywhere
    second["f"][[0, COMPARE_CHUNK, 2 * COMPARE_CHUNK - 1]] += 1  # gaps of a whole chunk
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, first)
        r2 = c.publish(MODEL, second, base=r1.commit)
        state = {name: array.copy() for name, array in first.items()}
        held = dict(state)
        model = c.model(MODEL)
        assert model.update(state, since=r1.commit).commit == r2.commit
        for name, array in second.items():
            assert state[name] is held[name], name
            assert state[name].tobytes() == array.tobytes(), name
        done = model.last_update
        assert (done["patch"], done["whole"], done["refetched"]) == (3, 0, 0)
        assert done["wire_bytes"] < sum(a.nbytes for a in second.values()) // 2


def test_large_tensors_are_planned_for_the_workers_cpu(server: WeightServer) -> None:
    rng = np.random.default_rng(4)
    size = CPU_BOUND_BYTES // 2  # bfloat16 elements: exactly CPU_BOUND_BYTES
    first = {
        name: rng.standard_normal(size).astype(ml_dtypes.bfloat16)
        for name in ("sparse", "moderate", "dense", "small")
    }
    first["small"] = first["small"][:512]
    second = {name: array.copy() for name, array in first.items()}
    for name, share in (("sparse", 0.01), ("moderate", 0.2), ("dense", 0.6), ("small", 1.0)):
        flat = second[name].view(np.uint16)
        flat[rng.random(flat.size) < share] ^= 1
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, first)
        c.publish(MODEL, second, base=r1.commit)
        model = c.model(MODEL)
        updates = {u.name: u for u in model.iter_updates(since=r1.commit)}
        state = {name: array.copy() for name, array in first.items()}
        model.update(state, since=r1.commit)
        for name, array in second.items():
            assert state[name].tobytes() == array.tobytes(), name
    # Few changes: values compressed; a fifth: values raw (zstd decodes them slower than a
    # worker applies); most: whole; a small tensor takes the fewest bytes, a patch.
    assert (updates["sparse"].kind, updates["sparse"].header.values_codec) == ("patch", "zstd")
    assert (updates["moderate"].kind, updates["moderate"].header.values_codec) == ("patch", "")
    assert updates["dense"].kind == "whole"
    assert updates["small"].kind == "patch"
