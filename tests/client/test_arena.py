"""Bulk fetches land in one aligned arena per stream (huge-page backed), not one buffer per
tensor; arrays are views that keep it alive."""

from __future__ import annotations

import gc

import numpy as np

from weightserve.client import Client
from weightserve.client._client import FetchOptions
from weightserve.client.receive.stream import ALIGNMENT, arena_allocator
from weightserve.client.wire.schema import ChunkHeader


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def test_whole_model_fetch_uses_one_aligned_arena(server) -> None:
    with Client(server.http_url) as client:
        model = client.model("org/sharded", FetchOptions(parallel=1))
        arrays = model.fetch(prefix="")
    roots = {id(_root(a)) for a in arrays.values() if a.nbytes}
    assert len(roots) == 1
    assert all(a.ctypes.data % ALIGNMENT == 0 for a in arrays.values())
    total = sum(a.nbytes for a in arrays.values())
    assert _root(next(iter(arrays.values()))).nbytes >= total
    # One array alone keeps the arena (and so its bytes) alive.
    name, keep = next((n, a) for n, a in arrays.items() if a.nbytes)
    expected = keep.copy()
    del arrays
    gc.collect()
    assert np.array_equal(keep, expected)


def test_arena_gives_larger_than_expected_sizes_their_own_buffer() -> None:
    allocate = arena_allocator({"a": 10, "b": 100})
    header = ChunkHeader("a", "uint8", (10,), (10,), None, 0, 10, 0, 10)
    a = allocate(header)
    b = allocate(ChunkHeader("b", "uint8", (100,), (100,), None, 0, 100, 0, 100))
    assert a.nbytes == 10 and b.nbytes == 100
    assert _root(a) is _root(b)
    assert (b.ctypes.data - a.ctypes.data) == ALIGNMENT  # 10 bytes rounded up to 64
    # Sizes are upper bounds (a shard's part): smaller fits in place, larger gets its own.
    part = allocate(ChunkHeader("b", "uint8", (7,), (7,), None, 0, 7, 0, 7))
    assert part.nbytes == 7 and part.ctypes.data == b.ctypes.data
    other = allocate(ChunkHeader("b", "uint8", (101,), (101,), None, 0, 101, 0, 101))
    assert other.nbytes == 101 and _root(other) is not _root(a)
    stranger = allocate(ChunkHeader("c", "uint8", (3,), (3,), None, 0, 3, 0, 3))
    assert stranger.nbytes == 3 and _root(stranger) is not _root(a)


def test_shard_fetch_uses_one_arena_sized_for_the_parts(server, reference) -> None:
    """A tensor-parallel rank's parts land in one arena too, reserved for each tensor's
    largest part (ceil(rows / 3) rows here), not for the whole model."""
    with Client(server.http_url) as client:
        model = client.model("org/sharded", FetchOptions(parallel=1))
        whole = sum(t.nbytes for t in model.tensors.values())
        parts = model.fetch(prefix="", shard=(1, 3))
    ref = reference("org/sharded")
    for name, r in ref.items():
        want = np.array_split(r.array, 3, axis=0)[1] if r.array.ndim else r.array
        assert parts[name].tobytes() == want.tobytes(), name
    roots = {id(_root(a)) for a in parts.values() if a.nbytes}
    assert len(roots) == 1
    arena = _root(next(a for a in parts.values() if a.nbytes))
    assert sum(a.nbytes for a in parts.values()) <= arena.nbytes < whole
    assert all(a.ctypes.data % ALIGNMENT == 0 for a in parts.values())
