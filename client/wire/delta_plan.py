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
    if xxhash.xxh3_128_hexdigest(old) == digest:
        return DeltaEntry(DeltaHeader(kind=SAME, **common), ())
    element = np.dtype(_UNSIGNED[element_size])
    usable = new.nbytes - new.nbytes % element.itemsize
    a = np.frombuffer(old, dtype=np.uint8)[:usable].view(element)
    b = np.frombuffer(new, dtype=np.uint8)[:usable].view(element)
    changed = np.flatnonzero(a != b)
    tail = new.nbytes - usable  # a packed tensor's last partial element: bytes
    if tail and bytes(old[usable:]) != bytes(new[usable:]):
        return whole
    gaps = np.diff(changed, prepend=0)
    gap_type = np.uint32 if gaps.size == 0 or int(gaps.max()) < 1 << 32 else np.uint64
    positions = pa.compress(gaps.astype(gap_type).tobytes(), codec=CODEC, asbytes=True)
    raw_values = b[changed].tobytes()
    packed = pa.compress(raw_values, codec=CODEC, asbytes=True)
    values, values_codec = (packed, CODEC) if len(packed) < len(raw_values) else (raw_values, "")
    if len(positions) + len(values) >= new.nbytes:
        return whole
    header = DeltaHeader(
        kind=PATCH,
        count=int(changed.size),
        element_bytes=element.itemsize,
        gap_bytes=np.dtype(gap_type).itemsize,
        positions_bytes=len(positions),
        values_bytes=len(values),
        values_raw_bytes=len(raw_values),
        values_codec=values_codec,
        **common,
    )
    return DeltaEntry(header, (positions, values))
