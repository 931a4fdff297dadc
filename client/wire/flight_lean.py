"""Arrow Flight's *lean* batches, the form both sides of a Flight ``DoGet`` agree on: asked
for with the ``weightserve-flight-batches: lean-1`` call header, each chunk is a record batch
of one ``uint8`` column, ``data`` (the chunk's bytes), with the rest of its row in the batch's
``app_metadata`` (``encode_chunk_header``; docs/protocol.md has the layout). A call without
the header gets the full tensor schema (client/wire/schema.py).
"""

from __future__ import annotations

import struct
from typing import Any

import pyarrow as pa

from weightserve.client.errors import TransportError
from weightserve.client.wire.schema import ChunkHeader

# Lean batches: asked for with this call header; without it a server sends TENSOR_SCHEMA rows.
FORMAT_HEADER = "weightserve-flight-batches"
LEAN_FORMAT = "lean-1"
LEAN_SCHEMA = pa.schema(
    [pa.field("data", pa.uint8(), nullable=False)],
    metadata={"weightserve.schema": "tensor-chunks-lean/v1"},
)
# The server's chunk size for lean streams when the request names none. Below glibc's 32 MiB
# mmap threshold (larger messages are mapped and unmapped by the receiving malloc each time);
# fewer, larger chunks save server CPU while the client's receive buffers grow with the
# message: 4 MiB is where the two meet (docs/performance.md has the figures).
LEAN_CHUNK_BYTES = 4 << 20
# app_metadata: version, ndim, logical ndim, flags (1: encoding present), name length,
# offset, total_bytes, digest; then shape and logical_shape (int64 each), the name (UTF-8),
# dtype and encoding (a length byte each, then ASCII). Little-endian, 32 bytes fixed.
_LEAN_FIXED = struct.Struct("<BBBBIqqQ")
_LEAN_VERSION = 1


def encode_chunk_header(header: ChunkHeader) -> bytes:
    """A chunk's row, all but ``data``, as a lean batch's ``app_metadata``."""
    name, dtype = header.name.encode(), header.dtype.encode()
    encoding = b"" if header.encoding is None else header.encoding.encode()
    dims = (*header.shape, *header.logical_shape)
    fixed = _LEAN_FIXED.pack(
        _LEAN_VERSION,
        len(header.shape),
        len(header.logical_shape),
        0 if header.encoding is None else 1,
        len(name),
        header.offset,
        header.total_bytes,
        header.digest,
    )
    return b"".join(
        (
            fixed,
            struct.pack(f"<{len(dims)}q", *dims),
            name,
            bytes((len(dtype),)),
            dtype,
            bytes((len(encoding),)),
            encoding,
        )
    )


def decode_chunk_header(meta: Any, nbytes: int) -> ChunkHeader:
    """The header ``encode_chunk_header`` wrote; ``nbytes`` is the batch's row count."""
    try:
        version, ndim, lndim, flags, name_len, offset, total, digest = _LEAN_FIXED.unpack_from(meta)
        if version != _LEAN_VERSION:
            raise TransportError(f"lean Flight batch of version {version} (this client reads 1)")
        at = _LEAN_FIXED.size
        dims = struct.unpack_from(f"<{ndim + lndim}q", meta, at)
        at += 8 * (ndim + lndim)
        raw = memoryview(meta)
        name = str(raw[at : at + name_len], "utf-8")
        at += name_len
        dtype = str(raw[at + 1 : at + 1 + raw[at]], "ascii")
        at += 1 + raw[at]
        encoding = str(raw[at + 1 : at + 1 + raw[at]], "ascii") if flags & 1 else None
        at += 1 + raw[at]
        if at != len(raw):
            raise IndexError(f"{len(raw)} bytes, {at} expected")
    except (struct.error, IndexError, UnicodeDecodeError, TypeError) as e:
        raise TransportError(f"malformed lean Flight batch metadata: {e}") from None
    return ChunkHeader(
        name, dtype, dims[:ndim], dims[ndim:], encoding, offset, total, digest, nbytes
    )
