"""Delta updates: what a worker holding revision A needs to hold revision B, per tensor the
cheapest of nothing (same bytes), an element patch (positions and new values) or the whole
tensor; computed once per (A, B) pair and kept for every worker that asks.

An element is the dtype's item (2 bytes for bfloat16, 1 for int8 and for quantized GGUF
blocks, which are patched as bytes). Positions are gaps between changed elements (uint32,
uint64 where a gap does not fit), compressed with zstd; values are the changed elements'
new bytes, compressed where that pays. Each entry carries the target tensor's xxh3-128, which
the client checks after applying it. The wire format is docs/protocol.md, "Delta updates".
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import xxhash

from weightserve.client.wire.delta import PATCH, SAME, WHOLE, DeltaHeader
from weightserve.client.wire.dtypes import wire_dtype
from weightserve.service.readers.base import TensorEntry
from weightserve.service.sources.model import Model

CACHE_BYTES = 1 << 30  # patches kept in memory, least recently used dropped first
CODEC = "zstd"


@dataclass(frozen=True)
class DeltaEntry:
    header: DeltaHeader
    payload: tuple[bytes | memoryview, ...]  # the bytes after the header, in order


def tensor_bytes(model: Model, entry: TensorEntry) -> memoryview:
    """The tensor's bytes as served (C-contiguous), a view of its file's mapping."""
    view = model.mapped(entry.file).view()[entry.offset : entry.offset + entry.nbytes]
    if entry.strides is None:
        return view
    itemsize = wire_dtype(entry.dtype).itemsize
    strided = np.lib.stride_tricks.as_strided(
        np.frombuffer(model.mapped(entry.file).view(), np.uint8)[entry.offset :],
        shape=(*entry.shape, itemsize),
        strides=(*(s * itemsize for s in entry.strides), 1),
    )
    return memoryview(np.ascontiguousarray(strided).reshape(-1).data)


def _element_type(entry: TensorEntry) -> np.dtype:
    """The unsigned integer type of one element (bytes for quantized or packed data)."""
    if entry.encoding is not None:
        return np.dtype(np.uint8)
    size = wire_dtype(entry.dtype).bits // 8
    return np.dtype({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(size, np.uint8))


def plan_entry(name: str, target: Model, base: Model | None) -> DeltaEntry:
    """The cheapest way from ``base``'s tensor ``name`` to ``target``'s."""
    entry = target.tensors[name]
    new = tensor_bytes(target, entry)
    digest = xxhash.xxh3_128_hexdigest(new)
    common = {
        "name": name, "dtype": entry.dtype, "shape": list(entry.shape), "nbytes": entry.nbytes,
        "digest": digest,
    }  # fmt: skip
    old_entry = base.tensors.get(name) if base is not None else None
    if (
        base is None
        or old_entry is None
        or (old_entry.dtype, old_entry.shape, old_entry.nbytes, old_entry.encoding)
        != (entry.dtype, entry.shape, entry.nbytes, entry.encoding)
    ):
        return DeltaEntry(DeltaHeader(kind=WHOLE, **common), (new,))
    old = tensor_bytes(base, old_entry)
    if xxhash.xxh3_128_hexdigest(old) == digest:
        return DeltaEntry(DeltaHeader(kind=SAME, **common), ())
    element = _element_type(entry)
    usable = entry.nbytes - entry.nbytes % element.itemsize
    a = np.frombuffer(old, dtype=np.uint8)[:usable].view(element)
    b = np.frombuffer(new, dtype=np.uint8)[:usable].view(element)
    changed = np.flatnonzero(a != b)
    tail = entry.nbytes - usable  # a packed tensor's last partial element: bytes
    if tail and bytes(old[usable:]) != bytes(new[usable:]):
        return DeltaEntry(DeltaHeader(kind=WHOLE, **common), (new,))
    gaps = np.diff(changed, prepend=0)
    gap_type = np.uint32 if gaps.size == 0 or int(gaps.max()) < 1 << 32 else np.uint64
    positions = pa.compress(gaps.astype(gap_type).tobytes(), codec=CODEC, asbytes=True)
    raw_values = b[changed].tobytes()
    packed = pa.compress(raw_values, codec=CODEC, asbytes=True)
    values, values_codec = (packed, CODEC) if len(packed) < len(raw_values) else (raw_values, "")
    if len(positions) + len(values) >= entry.nbytes:
        return DeltaEntry(DeltaHeader(kind=WHOLE, **common), (new,))
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


class DeltaCache:
    """Patches by (base commit, target commit, tensor), computed once for every worker;
    whole tensors are not kept (they are read from the mapping again)."""

    def __init__(self, limit_bytes: int = CACHE_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[tuple[str, str, str], DeltaEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._computing: dict[tuple[str, str, str], threading.Lock] = {}
        self.computed = 0  # entries computed (not found kept): one per (base, target, tensor)

    def entry(self, name: str, target: Model, base: Model | None) -> DeltaEntry:
        key = (base.commit if base is not None else "", target.commit, name)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found
            computing = self._computing.setdefault(key, threading.Lock())
        with computing:  # concurrent workers asking for one patch compute it once
            with self._lock:
                found = self._entries.get(key)
            if found is None:
                found = plan_entry(name, target, base)
                self._keep(key, found)
                with self._lock:
                    self.computed += 1
        with self._lock:
            self._computing.pop(key, None)
        return found

    def _keep(self, key: tuple[str, str, str], entry: DeltaEntry) -> None:
        if entry.header.kind == WHOLE:
            # The whole tensor is the mapping's view: cheap to give again, costly to keep.
            entry = DeltaEntry(entry.header, ())
        size = sum(len(p) for p in entry.payload) + 256
        with self._lock:
            self._entries[key] = entry
            self._bytes += size
            while self._bytes > self.limit_bytes and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= sum(len(p) for p in dropped.payload) + 256

    def stream(self, target: Model, base: Model | None) -> Iterator[bytes | memoryview]:
        """The delta stream: per tensor of ``target``, one header line and its payload."""
        for name, entry in target.tensors.items():
            found = self.entry(name, target, base)
            yield json.dumps(found.header.to_json(), separators=(",", ":")).encode() + b"\n"
            if found.header.kind == WHOLE:
                yield tensor_bytes(target, entry)
            else:
                yield from found.payload
