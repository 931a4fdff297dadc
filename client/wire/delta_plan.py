"""Planning one tensor's delta, the same on both sides: the server's delta stream to workers and
a publisher's patch against its base both send, per tensor, the cheapest of nothing, an element
patch or the whole tensor (cheapest for the worker's CPU too where a tensor is large), in the
form of client/wire/delta.py.

The diff (``changed_elements``) runs in one native pass over both tensors where the optional
extension ``weightserve.client.wire._diffnative`` (client/wire/_diffnative.c) was built at
install, and on NumPy otherwise; both give the same plans, byte for byte. The environment
variable ``WEIGHTSERVE_NATIVE=0``, read once at import, forces NumPy's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from weightserve.client.wire.delta import PATCH, SAME, WHOLE, DeltaHeader
from weightserve.client.wire.dtypes import wire_dtype

try:
    import weightserve.client.wire._diffnative as _diffnative
except ImportError:  # built only where the install found a C compiler
    _diffnative = None
# Whether the diff runs natively unless a caller says otherwise.
NATIVE = _diffnative is not None and os.environ.get("WEIGHTSERVE_NATIVE", "1") != "0"

CODEC = "zstd"
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Elements compared at a time: the chunk's flags stay in the CPU's cache, where finding the few
# set ones is cheap (docs/performance.md, "Delta updates on a trained model"), and the chunk of
# the new tensor is hashed from there (the native diff, with no flags, is fastest at this size
# too, for that hash).
COMPARE_CHUNK = 1 << 18
_GAP_TYPES = tuple((t, int(np.iinfo(t).max)) for t in (np.uint8, np.uint16, np.uint32, np.uint64))
# From this size on a tensor's patch is planned for the worker's CPU as well as the wire: more
# than half its elements changed goes whole (scattering them costs more than the bytes saved),
# and values are compressed only while they are at most VALUES_COMPRESSED_SHARE of it (zstd
# decodes float bits far slower than a worker applies; docs/performance.md, "Delta updates on
# a trained model"). Smaller tensors take whichever is fewer bytes.
CPU_BOUND_BYTES = 64 << 10
VALUES_COMPRESSED_SHARE = 1 / 16


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
    *,
    native: bool | None = None,
) -> DeltaEntry:
    """The cheapest way from ``old`` (None: not held, or another dtype or shape) to ``new``,
    the tensor's bytes, patched as elements of ``element_size`` bytes (from CPU_BOUND_BYTES
    on, cheap for the worker's CPU too). ``native`` as ``changed_elements``'."""

    def entry(kind: str, digest: str, **fields: Any) -> DeltaHeader:
        return DeltaHeader(
            kind=kind, name=name, dtype=dtype, shape=list(shape), nbytes=new.nbytes,
            digest=digest, **fields,
        )  # fmt: skip

    def whole() -> DeltaEntry:
        return DeltaEntry(entry(WHOLE, xxhash.xxh3_128_hexdigest(new)), (new,))

    if old is None or old.nbytes != new.nbytes:
        return whole()
    element = np.dtype(_UNSIGNED[element_size])
    usable = new.nbytes - new.nbytes % element.itemsize
    tail = new.nbytes - usable  # a packed tensor's last partial element: bytes
    if tail and bytes(old[usable:]) != bytes(new[usable:]):
        return whole()
    b = np.frombuffer(new, dtype=np.uint8)[:usable].view(element)
    large = new.nbytes >= CPU_BOUND_BYTES
    # The digest is taken chunk by chunk as the compare reads them (from cache: one pass over
    # the tensor's memory instead of two).
    hasher = xxhash.xxh3_128()
    found = changed_elements(
        np.frombuffer(old, dtype=np.uint8)[:usable].view(element),
        b,
        b.size // 2 if large else None,
        hasher,
        native=native,
    )
    if found is None:
        return whole()
    hasher.update(new[usable:])
    digest = hasher.hexdigest()
    gaps, changed = found
    if changed.size == 0:
        return DeltaEntry(entry(SAME, digest), ())
    positions = pa.compress(gaps.tobytes(), codec=CODEC, asbytes=True)
    raw_values = changed.tobytes()
    values, values_codec = raw_values, ""
    if not large or len(raw_values) <= new.nbytes * VALUES_COMPRESSED_SHARE:
        packed = pa.compress(raw_values, codec=CODEC, asbytes=True)
        if len(packed) < len(raw_values):
            values, values_codec = packed, CODEC
    if len(positions) + len(values) >= new.nbytes:
        return DeltaEntry(entry(WHOLE, digest), (new,))
    header = entry(
        PATCH,
        digest,
        count=int(changed.size),
        element_bytes=element.itemsize,
        gap_bytes=gaps.itemsize,
        positions_bytes=len(positions),
        values_bytes=len(values),
        values_raw_bytes=len(raw_values),
        values_codec=values_codec,
    )
    return DeltaEntry(header, (positions, values))


@dataclass
class _Chunk:
    """One compare chunk's changes: ``gaps[0]``, the gap from the chunk before, is set last."""

    start: int
    first: int  # the first and last changed index in the tensor
    last: int
    gaps: np.ndarray
    values: np.ndarray
    widest: int  # the widest gap inside the chunk


def changed_elements(
    old: np.ndarray,
    new: np.ndarray,
    limit: int | None = None,
    hasher: Any = None,
    *,
    native: bool | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Where ``new`` differs from ``old`` (arrays of one shape) as gaps between the changed
    elements (the first gap is the first index), in the narrowest unsigned integer that holds
    them, and the changed elements of ``new``; None when more than ``limit`` differ. Chunk by
    chunk, never an index per element of the whole tensor at once; ``hasher`` (an xxhash
    object) is given each chunk of ``new`` in order when the whole tensor is compared.

    ``native``: True runs the native diff (integer elements of contiguous 1-D arrays; others
    take NumPy's path), False NumPy's, None the module's choice (``NATIVE``)."""
    if native is None:
        native = NATIVE
    elif native and _diffnative is None:
        raise RuntimeError("the native diff (weightserve.client.wire._diffnative) is not built")
    if (
        native
        and new.dtype.kind in "ui"
        and new.itemsize in _UNSIGNED
        and old.dtype == new.dtype
        and old.ndim == new.ndim == 1
        and old.size == new.size
        and old.flags.c_contiguous
        and new.flags.c_contiguous
    ):
        return _native_changes(old, new, limit, hasher)
    return _numpy_changes(old, new, limit, hasher)


def _native_changes(
    old: np.ndarray, new: np.ndarray, limit: int | None, hasher: Any
) -> tuple[np.ndarray, np.ndarray] | None:
    """``changed_elements`` in one native pass per chunk: gaps and values written as the
    compare finds them, into buffers that grow where many elements changed."""
    assert _diffnative is not None
    size = new.size
    # Gaps inside a tensor are below its size (narrowed once the widest is known).
    gap_type = np.uint64 if size >> 32 else np.uint32
    gap_size = np.dtype(gap_type).itemsize
    # One past the limit is enough to know it was passed.
    most = size if limit is None else min(size, limit + 1)
    capacity = min(most, max(COMPARE_CHUNK, size >> 4))  # a 16th of the elements, then doubled
    gaps = np.empty(capacity, dtype=gap_type)
    values = np.empty(capacity, dtype=new.dtype)
    written = last = widest = 0
    for start in range(0, size, COMPARE_CHUNK):
        stop = min(start + COMPARE_CHUNK, size)
        position = start
        while True:
            written, position, last, chunk_widest = _diffnative.diff(
                old, new, new.itemsize, position, stop, gaps, gap_size, values, written, last
            )
            widest = max(widest, chunk_widest)
            if position == stop or written == most:
                break
            capacity = min(most, 2 * capacity)
            gaps = _grown(gaps, written, capacity)
            values = _grown(values, written, capacity)
        if limit is not None and written > limit:
            return None
        if hasher is not None:  # the chunk of ``new`` is still in the CPU's cache
            hasher.update(new[start:stop])
    final_type = next(t for t, bound in _GAP_TYPES if widest <= bound)
    return gaps[:written].astype(final_type), values[:written]


def _grown(array: np.ndarray, kept: int, size: int) -> np.ndarray:
    """A new array of ``size`` elements that starts with ``array[:kept]``."""
    grown = np.empty(size, dtype=array.dtype)
    grown[:kept] = array[:kept]
    return grown


def _numpy_changes(
    old: np.ndarray, new: np.ndarray, limit: int | None, hasher: Any
) -> tuple[np.ndarray, np.ndarray] | None:
    """``changed_elements`` on NumPy: a flag per element of a chunk, then its set ones."""
    flags = np.empty(min(COMPARE_CHUNK, new.size), dtype=bool)
    chunks: list[_Chunk] = []
    dense: list[int] = []  # mostly changed: indexed once ``limit`` is known not to be passed
    total = 0
    for start in range(0, new.size, COMPARE_CHUNK):
        stop = min(start + COMPARE_CHUNK, new.size)
        chunk = flags[: stop - start]
        np.not_equal(old[start:stop], new[start:stop], out=chunk)
        if hasher is not None:
            hasher.update(new[start:stop])
        count = int(np.count_nonzero(chunk))
        total += count
        if limit is not None and total > limit:
            return None
        if limit is not None and chunk.size > count > chunk.size // 2:
            dense.append(start)
        elif count:
            chunks.append(_changes(chunk, count, start, new))
    for start in dense:
        stop = min(start + COMPARE_CHUNK, new.size)
        chunk = flags[: stop - start]
        np.not_equal(old[start:stop], new[start:stop], out=chunk)
        chunks.append(_changes(chunk, int(np.count_nonzero(chunk)), start, new))
    if dense:
        chunks.sort(key=lambda c: c.start)
    last = widest = 0
    for c in chunks:
        c.gaps[0] = c.first - last
        widest = max(widest, c.widest, c.first - last)
        last = c.last
    gap_type = next(t for t, most in _GAP_TYPES if widest <= most)
    if not chunks:
        return np.empty(0, dtype=gap_type), new[:0]
    gaps = np.concatenate([c.gaps for c in chunks], dtype=gap_type, casting="unsafe")
    return gaps, np.concatenate([c.values for c in chunks])


def _changes(flags: np.ndarray, count: int, start: int, new: np.ndarray) -> _Chunk:
    """The changes ``flags`` (one chunk's, ``count`` set) mark in ``new`` from ``start``."""
    stop = start + flags.size
    # Gaps inside a chunk are below COMPARE_CHUNK; the first one below the tensor's size.
    gaps = np.empty(count, dtype=np.uint64 if new.size >> 32 else np.uint32)
    if count == flags.size:  # every element: no index to find
        gaps.fill(1)
        return _Chunk(start, start, stop - 1, gaps, new[start:stop], 1)
    indices = np.flatnonzero(flags)
    np.subtract(indices[1:], indices[:-1], out=gaps[1:], casting="unsafe")
    widest = int(gaps[1:].max()) if count > 1 else 0
    values = new[start:stop][indices]
    return _Chunk(start, start + int(indices[0]), start + int(indices[-1]), gaps, values, widest)
