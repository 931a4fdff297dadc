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

import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from weightserve.client.wire.delta import WHOLE
from weightserve.client.wire.delta_plan import DeltaEntry, element_bytes, header_line, plan_delta
from weightserve.client.wire.dtypes import wire_dtype
from weightserve.service.readers.base import TensorEntry
from weightserve.service.sources.model import Model

CACHE_BYTES = 1 << 30  # patches kept in memory, least recently used dropped first


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


def plan_entry(name: str, target: Model, base: Model | None) -> DeltaEntry:
    """The cheapest way from ``base``'s tensor ``name`` to ``target``'s."""
    entry = target.tensors[name]
    old_entry = base.tensors.get(name) if base is not None else None
    old = None
    if (
        base is not None
        and old_entry is not None
        and (old_entry.dtype, old_entry.shape, old_entry.nbytes, old_entry.encoding)
        == (entry.dtype, entry.shape, entry.nbytes, entry.encoding)
    ):
        old = tensor_bytes(base, old_entry)
    # Quantized blocks are patched as bytes.
    size = 1 if entry.encoding is not None else element_bytes(entry.dtype)
    return plan_delta(name, entry.dtype, entry.shape, tensor_bytes(target, entry), old, size)


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
            yield header_line(found.header)
            if found.header.kind == WHOLE:
                yield tensor_bytes(target, entry)
            else:
                yield from found.payload
