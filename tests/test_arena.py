"""Bulk fetches land in one aligned arena per stream (huge-page backed), not one buffer per
tensor; arrays are views that keep it alive."""

from __future__ import annotations

import gc

import numpy as np

from weightserve.client import Client
from weightserve.client._client import FetchOptions
from weightserve.client._receive import ALIGNMENT, arena_allocator
from weightserve.client._schema import ChunkHeader


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


def test_arena_gives_unexpected_sizes_their_own_buffer() -> None:
    allocate = arena_allocator({"a": 10, "b": 100})
    header = ChunkHeader("a", "uint8", (10,), (10,), None, 0, 10, 0, 10)
    a = allocate(header)
    b = allocate(ChunkHeader("b", "uint8", (100,), (100,), None, 0, 100, 0, 100))
    assert a.nbytes == 10 and b.nbytes == 100
    assert _root(a) is _root(b)
    assert (b.ctypes.data - a.ctypes.data) == ALIGNMENT  # 10 bytes rounded up to 64
    other = allocate(ChunkHeader("b", "uint8", (7,), (7,), None, 0, 7, 0, 7))
    assert other.nbytes == 7 and _root(other) is not _root(a)
    stranger = allocate(ChunkHeader("c", "uint8", (3,), (3,), None, 0, 3, 0, 3))
    assert stranger.nbytes == 3 and _root(stranger) is not _root(a)
