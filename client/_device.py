"""Load a model's tensors into device memory (a GPU's, through torch) via one ring of
page-locked host memory, locked once: each tensor is received into the ring and copied to the
device on a side stream while the next one arrives.

Page-locking fresh memory for every tensor costs more than the transfer, and pageable memory
holds the whole model on the host first (docs/performance.md, "Into GPU memory"). Here host
memory is the ring plus any tensor larger than it, and the copies overlap the network.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightserve.client._extras import import_torch
from weightserve.client._models import TensorInfo
from weightserve.client.receive.stream import ALIGNMENT, aligned_empty
from weightserve.client.transports.handoff import writable_alias
from weightserve.client.wire.dtypes import wire_dtype
from weightserve.client.wire.schema import ChunkHeader

__all__ = ["DEFAULT_STAGING_BYTES", "StagingRing", "load_to_device", "torch_dtype"]

DEFAULT_STAGING_BYTES = 256 << 20


@dataclass
class _Region:
    start: int
    end: int
    copying: Any = None  # the event recorded after its copy was queued (GPU)
    done: bool = False  # its copy was made or queued (``copying``, if any, says when done)


class StagingRing:
    """Host memory that received tensors land in before their copy to ``device``; page-locked
    where the device is a GPU, and locked at the first tensor that uses it. A region is handed
    out again only once the copy out of it has finished; where none is free without waiting on
    a tensor not yet copied (or the tensor is larger than the ring), the tensor gets memory of
    its own. ``staged`` and ``unstaged`` count the tensors copied to the device from the ring
    and from memory of their own (a same-node handoff's views among them)."""

    def __init__(self, nbytes: int, device: Any) -> None:
        torch = import_torch()  # optional: only device loads need it

        self._torch = torch
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current one
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.size = nbytes
        self._host: Any = None  # the ring, once a tensor needs it
        self._array: np.ndarray | None = None
        self._base = 0
        self._head = 0
        self._regions: list[_Region] = []  # handed out and not yet known to be free
        gpu = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if gpu else None
        self.staged = 0
        self.unstaged = 0
        self._lock = threading.Lock()

    def __enter__(self) -> StagingRing:
        if self.stream is not None:  # targets may still be written by work already queued
            self.stream.wait_stream(self._torch.cuda.current_stream(self.device))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:  # every copy landed before the tensors are handed out
            self.stream.synchronize()

    def allocate(self, header: ChunkHeader) -> np.ndarray:
        """The buffer a tensor of ``header.total_bytes`` is received into (called on the
        receiving thread, while the consumer's thread queues copies)."""
        n = header.total_bytes
        buffer = self._take(n)
        return buffer if buffer is not None else aligned_empty(n)

    def _take(self, n: int) -> np.ndarray | None:
        """A region of ``n`` bytes of the ring, or None where none is free without waiting
        on a tensor whose copy is not queued yet (or ``n`` is larger than the ring)."""
        with self._lock:
            if n == 0 or n > self.size:
                return None
            if self._array is None:
                gpu = self.stream is not None
                self._host = self._torch.empty(self.size, dtype=self._torch.uint8, pin_memory=gpu)
                self._array = self._host.numpy()
                self._base = self._array.ctypes.data
            start = -(-self._head // ALIGNMENT) * ALIGNMENT
            if start + n > self.size:
                start = 0
            overlapping = [r for r in self._regions if r.start < start + n and start < r.end]
            if any(not r.done for r in overlapping):
                return None
            for r in overlapping:
                self._regions.remove(r)
            self._head = start + n
            self._regions.append(_Region(start, start + n))
            buffer = self._array[start : start + n]
        # Outside the lock, so the consumer's copies are queued meanwhile: the regions given
        # up are this thread's alone now, free once their copies have run.
        for r in overlapping:
            if r.copying is not None:
                r.copying.synchronize()
        return buffer

    def copy(self, array: np.ndarray, target: Any) -> None:
        """Queue the copy of a tensor's bytes (``array``) into ``target`` (a tensor of the
        same byte size; any layout). Bytes not received into the ring (a same-node
        handoff's views of the page cache, a tensor that did not fit) are copied from where
        they are, as is a target on a device other than the ring's; staging a handoff's
        views through the ring first measured slower (docs/performance.md, "Into GPU
        memory")."""
        torch = self._torch
        if array.size == 0:
            return
        with self._lock:
            region = self._region_of(array)
        if not array.flags.writeable:  # a handoff view: torch wants a writable array
            alias = writable_alias(array)
            array = alias if alias is not None else array.copy()
        flat = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        source = flat.view(target.dtype).reshape(target.shape)
        event = None
        with torch.no_grad():  # an engine's parameters may require grad
            if region is None or self.stream is None or target.device != self.device:
                target.copy_(source)  # done when it returns: nothing to wait on
            else:
                with torch.cuda.stream(self.stream):
                    target.copy_(source, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self.stream)
        with self._lock:
            if region is None:
                self.unstaged += 1
            else:  # only now may the receiving thread wait on it and reuse it
                region.copying, region.done = event, True
                self.staged += 1

    def _region_of(self, array: np.ndarray) -> _Region | None:
        if self._array is None or array.size == 0:
            return None
        offset = array.__array_interface__["data"][0] - self._base
        for r in self._regions:
            if r.start == offset:
                return r
        return None


def torch_dtype(info: TensorInfo) -> tuple[Any, tuple[int, ...]]:
    """The torch dtype and shape a served tensor takes on a device: its own where torch has
    that dtype, else its raw bytes as ``fetch`` gives them (uint8: GGML blocks in their byte
    shape, packed sub-byte types flat)."""
    torch = import_torch()

    spec = wire_dtype(info.dtype)
    dtype = getattr(torch, info.dtype, None)
    if (
        info.encoding is None
        and spec.numpy_name is not None
        and isinstance(dtype, torch.dtype)
        and dtype.itemsize * math.prod(info.logical_shape) == info.nbytes
    ):
        return dtype, tuple(info.logical_shape)
    shape = tuple(info.shape)
    return torch.uint8, shape if math.prod(shape) == info.nbytes else (info.nbytes,)


def load_to_device(
    received: Callable[[Callable[[ChunkHeader], np.ndarray], int], Generator[tuple[str, Any]]],
    names: Sequence[str],
    tensors: Mapping[str, TensorInfo],
    device: Any,
    into: Mapping[str, Any] | None,
    staging_bytes: int,
) -> tuple[dict[str, Any], StagingRing]:
    """``{name: device tensor}`` of ``names``, as ``received(allocate, window_bytes)`` yields
    them, each written into ``into[name]`` where given, else into a new tensor on ``device``.
    Every ``into`` tensor is checked before any byte moves, so a refusal leaves them all as
    they were."""
    torch = import_torch()

    layouts = {name: torch_dtype(tensors[name]) for name in names}
    for name, target in (into or {}).items():
        if name in layouts and (target.dtype, tuple(target.shape)) != layouts[name]:
            dtype, shape = layouts[name]
            raise ValueError(
                f"{name}: the server has {dtype} {list(shape)}, "
                f"the tensor to load it into is {target.dtype} {list(target.shape)}"
            )
    ring = StagingRing(staging_bytes, device)
    out: dict[str, Any] = {}
    # Tensors received ahead of the consumer stay within half the ring, so the other half is
    # free for the next one once its copies are done.
    arriving = received(ring.allocate, max(1, staging_bytes // 2))
    with ring, contextlib.closing(arriving):  # an error ends the stream at once
        for name, array in arriving:
            target = into.get(name) if into is not None else None
            if target is None:
                dtype, shape = layouts[name]
                target = torch.empty(shape, dtype=dtype, device=ring.device)
            ring.copy(array, target)
            out[name] = target
            del array  # the ring's memory is not the caller's
    return out, ring
