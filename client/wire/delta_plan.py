"""Planning one tensor's delta, the same on both sides: the server's delta stream to workers and
a publisher's patch against its base both send, per tensor, the cheapest of nothing, an element
patch or the whole tensor, in the form of client/wire/delta.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import xxhash

from weightserve.client.wire.delta import PATCH, SAME, WHOLE, DeltaHeader
from weightserve.client.wire.dtypes import wire_dtype

CODEC = "zstd"
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Elements compared at a time: the chunk's flags stay in the CPU's cache, where finding the few
# set ones is cheap (docs/performance.md, "Delta updates on a trained model").
COMPARE_CHUNK = 1 << 18
_GAP_TYPES = (np.uint8, np.uint16, np.uint32, np.uint64)


@dataclass(frozen=True)
class DeltaEntry:
    header: DeltaHeader
    payload: tuple[bytes | memoryview, ...]  # the bytes after the header, in order


def element_bytes(dtype: str) -> int:
    """The size of one patched element of ``dtype``: its item (1 for packed sub-byte types)."""
    size = wire_dtype(dtype).bits // 8
    return size if size in _UNSIGNED else 1


def header_line(header: DeltaHeader) -> bytes:
    """A tensor's header as it travels: one JSON line."""
    return json.dumps(header.to_json(), separators=(",", ":")).encode() + b"\n"


def plan_delta(
    name: str,
    dtype: str,
    shape: Sequence[int],
    new: memoryview,
    old: memoryview | None,
    element_size: int,
) -> DeltaEntry:
    """The cheapest way from ``old`` (None: not held, or another dtype or shape) to ``new``,
    the tensor's bytes, patched as elements of ``element_size`` bytes."""
    digest = xxhash.xxh3_128_hexdigest(new)
    common = {
        "name": name, "dtype": dtype, "shape": list(shape), "nbytes": new.nbytes, "digest": digest,
    }  # fmt: skip
    whole = DeltaEntry(DeltaHeader(kind=WHOLE, **common), (new,))
    if old is None or old.nbytes != new.nbytes:
        return whole
    element = np.dtype(_UNSIGNED[element_size])
    usable = new.nbytes - new.nbytes % element.itemsize
    tail = new.nbytes - usable  # a packed tensor's last partial element: bytes
    if tail and bytes(old[usable:]) != bytes(new[usable:]):
        return whole
    b = np.frombuffer(new, dtype=np.uint8)[:usable].view(element)
    gaps, changed = changed_elements(np.frombuffer(old, dtype=np.uint8)[:usable].view(element), b)
    if changed.size == 0:
        return DeltaEntry(DeltaHeader(kind=SAME, **common), ())
    positions = pa.compress(gaps.tobytes(), codec=CODEC, asbytes=True)
    raw_values = changed.tobytes()
    packed = pa.compress(raw_values, codec=CODEC, asbytes=True)
    values, values_codec = (packed, CODEC) if len(packed) < len(raw_values) else (raw_values, "")
    if len(positions) + len(values) >= new.nbytes:
        return whole
    header = DeltaHeader(
        kind=PATCH,
        count=int(changed.size),
        element_bytes=element.itemsize,
        gap_bytes=gaps.itemsize,
        positions_bytes=len(positions),
        values_bytes=len(values),
        values_raw_bytes=len(raw_values),
        values_codec=values_codec,
        **common,
    )
    return DeltaEntry(header, (positions, values))


def changed_elements(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where ``new`` differs from ``old`` (arrays of one shape) as gaps between the changed
    elements (the first gap is the first index), in the narrowest unsigned integer that holds
    them, and the changed elements of ``new``. Chunk by chunk, never an index per element of
    the whole tensor at once."""
    flags = np.empty(min(COMPARE_CHUNK, new.size), dtype=bool)
    every = np.arange(flags.size, dtype=np.int64)
    gaps: list[np.ndarray] = []
    values: list[np.ndarray] = []
    last = widest = 0  # the last changed index so far; the widest gap
    for start in range(0, new.size, COMPARE_CHUNK):
        stop = min(start + COMPARE_CHUNK, new.size)
        chunk = flags[: stop - start]
        np.not_equal(old[start:stop], new[start:stop], out=chunk)
        count = int(np.count_nonzero(chunk))
        if not count:
            continue
        indices = every[: chunk.size] if count == chunk.size else np.flatnonzero(chunk)
        chunk_gaps = np.diff(indices, prepend=last - start)
        widest = max(widest, int(chunk_gaps.max()))
        gaps.append(chunk_gaps.astype(np.uint64 if widest >> 32 else np.uint32))
        values.append(new[start:stop] if count == chunk.size else new[start:stop][indices])
        last = start + int(indices[-1])
    gap_type = next(t for t in _GAP_TYPES if widest <= np.iinfo(t).max)
    if not gaps:
        return np.empty(0, dtype=gap_type), new[:0]
    return np.concatenate(gaps, dtype=gap_type, casting="unsafe"), np.concatenate(values)
