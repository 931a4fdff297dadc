"""The one safetensors header writer, for every file either side writes (a publish, a patch
applied on the server, a pull's converted file): a header naming each tensor's dtype, shape
and byte range, then the tensors' bytes in the header's order.

The format's own rules: 8 bytes of little-endian header length, then the JSON header padded
with spaces to a multiple of 8 (so every tensor's bytes start aligned), then the data. The
JSON is written as the format's reference writer (``safetensors.numpy.save``) writes it,
byte for byte: compact, ``__metadata__`` first, names in UTF-8, never escaped to ASCII.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from weightserve.client.wire.dtypes import wire_dtype


@dataclass(frozen=True)
class LayoutEntry:
    """One tensor of a safetensors file to be written."""

    name: str
    dtype: str  # a wire dtype name (client/wire/dtypes.py)
    shape: tuple[int, ...]
    nbytes: int


def safetensors_header(
    entries: Iterable[LayoutEntry], metadata: dict[str, str] | None = None
) -> bytes:
    """The header (length prefix included) of a file whose data holds ``entries``' bytes back
    to back, in order, with ``metadata`` (an empty one written as such, none for None). A
    dtype the format has no code for is refused by name."""
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for e in entries:
        code = wire_dtype(e.dtype).safetensors
        if code is None:
            raise ValueError(f"tensor {e.name!r}: dtype {e.dtype} has no safetensors code")
        if e.name in header:
            raise ValueError(f"tensor {e.name!r} is named twice")
        header[e.name] = {
            "dtype": code,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
