"""Arrow IPC stream framing for ``TENSOR_SCHEMA`` that never copies tensor bytes.

pyarrow's ``RecordBatchStreamWriter`` assembles every message body in memory, which would copy
each chunk's ``data``. The schema is fixed, so the server frames messages itself instead: for
one row, everything except the ``data`` bytes is a small ``prefix`` (message metadata plus all
body buffers before ``data``'s values), and a ``suffix`` pads the body to 8 bytes. The server
sends ``prefix``, the chunk's bytes straight from the mmap, then ``suffix``; the result is
byte-for-byte what pyarrow writes for the same row (tests check this), so any Arrow reader
reads it.

Stream layout (Arrow columnar format, "IPC Streaming Format", post-0.15 framing)::

    schema_message()                                   once
    prefix | data | suffix                             per chunk, from chunk_message(header)
    END_OF_STREAM                                      once

Encapsulated message: ``0xFFFFFFFF``, int32 metadata length (flatbuffer plus padding so the
body starts 8-aligned), flatbuffer ``Message``, body. In the body every buffer starts on a
multiple of 8, and a buffer's recorded length is its unpadded length (as pyarrow writes it).
"""

from __future__ import annotations

import struct
from functools import cache
from typing import NamedTuple

import flatbuffers
import pyarrow as pa

from weightserve.client.wire.schema import TENSOR_SCHEMA, ChunkHeader

__all__ = ["END_OF_STREAM", "TensorFields", "chunk_message", "prefix_length", "schema_message"]

END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"

_CONTINUATION = b"\xff\xff\xff\xff"

# Flatbuffer enum values and field ids from Arrow's format/Message.fbs and Schema.fbs.
_METADATA_V5 = 4
_HEADER_RECORD_BATCH = 3
_MESSAGE_VERSION, _MESSAGE_HEADER_TYPE, _MESSAGE_HEADER, _MESSAGE_BODY_LENGTH = 0, 1, 2, 3
_BATCH_LENGTH, _BATCH_NODES, _BATCH_BUFFERS = 0, 1, 2

# Field nodes in depth-first order: name, dtype, shape, shape.item, logical_shape,
# logical_shape.item, encoding, offset, total_bytes, digest, data.
NODE_COUNT = 11
# Buffers, in the same order: utf8/binary have (validity, offsets, values), list<int64> has
# (validity, offsets) then its child's (validity, values), int64/uint64 have (validity, values).
BUFFER_COUNT = 26

_NODES = struct.Struct(f"<{2 * NODE_COUNT}q")
_BUFFERS = struct.Struct(f"<{2 * BUFFER_COUNT}q")
_INT64 = struct.Struct("<q")
# The body's last 32 bytes before ``data``: offset, total_bytes, digest values and data's
# int32 offsets [0, nbytes].
_TAIL = struct.Struct("<qqQii")
_STRING_OFFSETS = struct.Struct("<ii")
_PAD = tuple(b"\x00" * n for n in range(8))


def _pad8(n: int) -> int:
    return (n + 7) & ~7


@cache
def schema_message() -> bytes:
    """The stream's first message: ``TENSOR_SCHEMA`` as pyarrow encapsulates it (computed once)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, TENSOR_SCHEMA):
        pass
    stream = sink.getvalue().to_pybytes()
    if not stream.endswith(END_OF_STREAM):  # pragma: no cover - pyarrow always writes it
        raise RuntimeError("pyarrow wrote an IPC stream without the end-of-stream marker")
    return stream[: -len(END_OF_STREAM)]


def _int64_pairs(b: flatbuffers.Builder, pairs: list[tuple[int, int]]) -> int:
    """A vector of 16-byte structs of two int64 fields, in order (Arrow's FieldNode and
    Buffer); vectors of structs are written back to front."""
    b.StartVector(16, len(pairs), 8)
    for first, second in reversed(pairs):
        b.Prep(8, 16)
        b.PrependInt64(second)
        b.PrependInt64(first)
    return b.EndVector()


def build_metadata(
    nodes: list[tuple[int, int]], buffers: list[tuple[int, int]], body_length: int
) -> bytes:
    """Encapsulated RecordBatch metadata (continuation, length, flatbuffer, padding), 1 row.

    Built with the ``flatbuffers`` Builder in the order Arrow's C++ writer uses (nodes vector,
    buffers vector, RecordBatch table with fields added largest first, then Message), so the
    bytes equal pyarrow's. ``chunk_message`` builds this once as a template and patches
    numbers into it; this function is the reference the tests compare the template against.
    """
    b = flatbuffers.Builder(1024)
    nodes_vec = _int64_pairs(b, nodes)  # (length, null_count) each
    buffers_vec = _int64_pairs(b, buffers)  # (offset, length) each

    b.StartObject(5)  # RecordBatch: length, nodes, buffers, compression, variadicBufferCounts
    b.PrependInt64Slot(_BATCH_LENGTH, 1, 0)
    b.PrependUOffsetTRelativeSlot(_BATCH_BUFFERS, buffers_vec, 0)
    b.PrependUOffsetTRelativeSlot(_BATCH_NODES, nodes_vec, 0)
    batch = b.EndObject()

    b.StartObject(5)  # Message: version, header_type, header, bodyLength, custom_metadata
    b.PrependInt64Slot(_MESSAGE_BODY_LENGTH, body_length, 0)
    b.PrependUOffsetTRelativeSlot(_MESSAGE_HEADER, batch, 0)
    b.PrependInt16Slot(_MESSAGE_VERSION, _METADATA_V5, 0)
    b.PrependUint8Slot(_MESSAGE_HEADER_TYPE, _HEADER_RECORD_BATCH, 0)
    b.Finish(b.EndObject())
    flat = bytes(b.Output())
    padded = _pad8(8 + len(flat)) - 8
    return _CONTINUATION + struct.pack("<i", padded) + flat + _PAD[padded - len(flat)]


class _Template:
    """The RecordBatch metadata, built once, and where its numbers sit.

    For this schema the metadata's shape never changes: 11 nodes, 26 buffers, and no scalar
    that could equal its flatbuffer default (the body is never empty, the length is always
    1), so the Builder omits nothing value-dependent. Each chunk therefore packs its numbers
    into a copy of one template instead of running the (slow, pure Python) Builder.
    """

    def __init__(self) -> None:
        # Distinct sentinels whose byte patterns cannot occur elsewhere in the metadata.
        sentinel = 0x5EA1_0000_0000_0000
        nodes = [(sentinel + 2 * i, sentinel + 2 * i + 1) for i in range(NODE_COUNT)]
        buffers = [
            (sentinel + 0x100 + 2 * i, sentinel + 0x101 + 2 * i) for i in range(BUFFER_COUNT)
        ]
        body_length = sentinel + 0x1000
        meta = build_metadata(nodes, buffers, body_length)
        self.nodes_at = self._find(meta, _NODES.pack(*(v for n in nodes for v in n)))
        self.buffers_at = self._find(meta, _BUFFERS.pack(*(v for b in buffers for v in b)))
        self.body_length_at = self._find(meta, _INT64.pack(body_length))
        self.bytes = meta

    @staticmethod
    def _find(haystack: bytes, needle: bytes) -> int:
        at = haystack.find(needle)
        if at < 0 or haystack.find(needle, at + 1) >= 0:  # pragma: no cover - a bug here
            raise RuntimeError("could not locate a field in the RecordBatch metadata template")
        return at


_TEMPLATE = _Template()
# Where the body length and data's values length sit in the metadata; both vary per chunk.
_BODY_LENGTH_AT = _TEMPLATE.body_length_at
_DATA_LENGTH_AT = _TEMPLATE.buffers_at + 16 * (BUFFER_COUNT - 1) + 8


def _string_buffers(value: bytes, at: int, buffers: list[int], body: list[bytes]) -> int:
    """Append one utf8/binary row of ``value`` (validity, offsets, values); return new ``at``."""
    n = len(value)
    buffers += (at, 0, at, 8, at + 8, n)
    body.append(_STRING_OFFSETS.pack(0, n))
    body.append(value)
    body.append(_PAD[-n & 7])
    return at + 8 + _pad8(n)


def _list_buffers(values: tuple[int, ...], at: int, buffers: list[int], body: list[bytes]) -> int:
    """Append one list<int64> row (validity, offsets, item validity, item values)."""
    n = len(values)
    buffers += (at, 0, at, 8, at + 8, 0, at + 8, 8 * n)
    body.append(_STRING_OFFSETS.pack(0, n))
    body.append(struct.pack(f"<{n}q", *values))
    return at + 8 + 8 * n


class _Fixed:
    """Per-tensor part of a chunk's prefix: everything up to the ``offset`` field's values."""

    __slots__ = ("head", "body_before_tail")

    def __init__(self, head: bytes, body_before_tail: int) -> None:
        self.head = head  # metadata (body/data lengths still to patch) + body so far
        self.body_before_tail = body_before_tail


class TensorFields(NamedTuple):
    """The fields every chunk of one tensor repeats (``ChunkHeader``'s first five)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    logical_shape: tuple[int, ...]
    encoding: str | None


def _build_fixed(tensor: TensorFields) -> _Fixed:
    name, dtype, shape, logical_shape, encoding = tensor
    buffers: list[int] = []
    body: list[bytes] = []
    at = _string_buffers(name.encode(), 0, buffers, body)
    at = _string_buffers(dtype.encode(), at, buffers, body)
    at = _list_buffers(shape, at, buffers, body)
    at = _list_buffers(logical_shape, at, buffers, body)
    if encoding is None:
        # A null row: a 1-byte validity bitmap (bit 0 clear), offsets [0, 0], no values.
        buffers += (at, 1, at + 8, 8, at + 16, 0)
        body.append(b"\x00" * 8 + _STRING_OFFSETS.pack(0, 0))
        at += 16
    else:
        at = _string_buffers(encoding.encode(), at, buffers, body)
    tail = at
    # offset, total_bytes, digest: (validity, values) each; data: validity, offsets, values.
    buffers += (at, 0, at, 8, at + 8, 0, at + 8, 8, at + 16, 0, at + 16, 8)
    buffers += (at + 24, 0, at + 24, 8, at + 32, 0)  # data's values length is patched per chunk
    nodes = (1, 0, 1, 0, 1, 0, len(shape), 0, 1, 0, len(logical_shape), 0,
             1, 1 if encoding is None else 0, 1, 0, 1, 0, 1, 0, 1, 0)  # fmt: skip
    meta = bytearray(_TEMPLATE.bytes)
    _NODES.pack_into(meta, _TEMPLATE.nodes_at, *nodes)
    _BUFFERS.pack_into(meta, _TEMPLATE.buffers_at, *buffers)
    return _Fixed(bytes(meta) + b"".join(body), tail)


# Chunks of one tensor, and the same tensor requested again by other clients, share all but
# the last 32 bytes of the prefix. Bounded; cleared wholesale when full (thread-safe, simple).
_FIXED_CACHE: dict[TensorFields, _Fixed] = {}
_FIXED_CACHE_MAX = 4096


def _fixed(key: TensorFields) -> _Fixed:
    fixed = _FIXED_CACHE.get(key)
    if fixed is None:
        fixed = _build_fixed(key)
        if len(_FIXED_CACHE) >= _FIXED_CACHE_MAX:
            _FIXED_CACHE.clear()
        _FIXED_CACHE[key] = fixed
    return fixed


def prefix_length(tensor: TensorFields) -> int:
    """The length of every chunk prefix of this tensor (``chunk_message``): a stream's length
    is known without framing each chunk."""
    try:
        return len(_fixed(tensor).head) + _TAIL.size
    except struct.error as exc:
        raise ValueError(f"tensor {tensor.name!r} does not fit the tensor schema: {exc}") from None


def chunk_message(header: ChunkHeader) -> tuple[bytes, bytes]:
    """The framing around one chunk: ``prefix + data + suffix`` is one RecordBatch message.

    ``data`` must be ``header.nbytes`` long; it is the body's last buffer, so the caller
    sends it from wherever it lives (the mmap). ``suffix`` pads the body to 8 bytes and is
    empty when ``nbytes`` is a multiple of 8. Raises ValueError for numbers that do not fit
    the schema's types.
    """
    nbytes = header.nbytes
    key = TensorFields(
        header.name, header.dtype, header.shape, header.logical_shape, header.encoding
    )
    try:
        fixed = _fixed(key)
        if nbytes < 0:
            raise struct.error("nbytes is negative")
        prefix = bytearray(fixed.head)
        _INT64.pack_into(prefix, _BODY_LENGTH_AT, fixed.body_before_tail + 32 + _pad8(nbytes))
        _INT64.pack_into(prefix, _DATA_LENGTH_AT, nbytes)
        prefix += _TAIL.pack(header.offset, header.total_bytes, header.digest, 0, nbytes)
    except struct.error as exc:
        raise ValueError(
            f"chunk header does not fit the tensor schema: {header!r}: {exc}"
        ) from None
    return bytes(prefix), _PAD[-nbytes & 7]
