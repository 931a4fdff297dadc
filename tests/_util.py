"""Small helpers shared by tests: reading an index entry's bytes straight from its file, and
recording the tensor streams a client opens."""

from __future__ import annotations

from typing import Any

import numpy as np

from weightserve.client._dtypes import numpy_dtype, wire_dtype
from weightserve.service.readers.base import TensorEntry


def entry_bytes(entry: TensorEntry) -> bytes:
    """The tensor's bytes, C-contiguous, read from the file with plain reads (no mmap)."""
    if entry.strides is None:
        with open(entry.file, "rb") as f:
            f.seek(entry.offset)
            data = f.read(entry.nbytes)
        assert len(data) == entry.nbytes
        return data
    itemsize = wire_dtype(entry.dtype).itemsize
    raw = np.fromfile(entry.file, dtype=np.uint8)
    base = raw[entry.offset :]
    arr = np.lib.stride_tricks.as_strided(
        base.view(np.uint8),
        shape=(*entry.shape, itemsize),
        strides=(*(s * itemsize for s in entry.strides), 1),
    )
    return np.ascontiguousarray(arr).tobytes()


def entry_array(entry: TensorEntry) -> np.ndarray:
    """The tensor as a NumPy array of its served dtype and shape."""
    return np.frombuffer(entry_bytes(entry), dtype=numpy_dtype(entry.dtype)).reshape(entry.shape)


def record_streams(transport: Any) -> list[Any]:
    """Every StreamParams the transport opens a tensor stream with, from now on."""
    opened: list[Any] = []
    original = transport.open_chunks

    def recording(model: str, params: Any) -> Any:
        opened.append(params)
        return original(model, params)

    transport.open_chunks = recording
    return opened
