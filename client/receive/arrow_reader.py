"""Read an Arrow IPC stream of ``TENSOR_SCHEMA`` with each chunk's bytes read in place.

pyarrow's stream reader reads every message body into buffers it allocates; taking tensor
bytes out of those would be a second copy. ``ArrowChunkReader`` instead parses each
RecordBatch's metadata itself, reads the small buffers that precede ``data`` in the body,
decodes them into a ``ChunkHeader``, asks the caller where the chunk goes
(``destination(header)``), and reads the ``data`` bytes from the source straight into that
memory.

It reads any conforming writer's stream of this schema, not only ours: buffer positions come
from the metadata, not from our own layout. The one requirement beyond the Arrow format is
that ``data``'s values are the body's last non-empty buffer (true of every writer that lays
buffers out in field order, pyarrow included), since that is what lets them go straight to
their destination.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import pyarrow as pa

from weightserve.client.errors import TransportError
from weightserve.client.wire.schema import TENSOR_SCHEMA, ChunkHeader

__all__ = ["ArrowChunkReader", "IterSource", "Source"]


class Source(Protocol):
    """Anything with ``readinto``: returns the bytes read, 0 at end of stream."""

    def readinto(self, view: memoryview, /) -> int | None: ...


# Flatbuffer enum values and field ids from Arrow's format/Message.fbs.
_METADATA_V4, _METADATA_V5 = 3, 4
_HEADER_SCHEMA, _HEADER_DICTIONARY_BATCH, _HEADER_RECORD_BATCH = 1, 2, 3
_HEADER_NAMES = {0: "NONE", 1: "Schema", 2: "DictionaryBatch", 3: "RecordBatch", 4: "Tensor",
                 5: "SparseTensor"}  # fmt: skip
_MESSAGE_VERSION, _MESSAGE_HEADER_TYPE, _MESSAGE_HEADER, _MESSAGE_BODY_LENGTH = 0, 1, 2, 3
_BATCH_LENGTH, _BATCH_NODES, _BATCH_BUFFERS, _BATCH_COMPRESSION = 0, 1, 2, 3

_NODE_COUNT = 11  # name, dtype, shape, shape.item, logical_shape, .item, encoding, offset,
_BUFFER_COUNT = 26  # total_bytes, digest, data; buffers as in service/serving/arrow_writer.py
_NODES = struct.Struct(f"<{2 * _NODE_COUNT}q")
_BUFFERS = struct.Struct(f"<{2 * _BUFFER_COUNT}q")
_NULLABLE_NODES = frozenset({6})  # encoding
_LIST_CHILD = {2: 3, 4: 5}  # list node -> its item node
# Buffer index of each value the header needs.
_NAME, _DTYPE, _ENCODING = (0, 1, 2), (3, 4, 5), (14, 15, 16)
_SHAPE, _LOGICAL_SHAPE = (7, 9), (11, 13)  # (offsets, item values)
_OFFSET, _TOTAL_BYTES, _DIGEST = 18, 20, 22
_DATA_OFFSETS, _DATA_VALUES = 24, 25

_PREFIX = struct.Struct("<Ii")
_CONTINUATION = 0xFFFFFFFF
_I32X2 = struct.Struct("<ii")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")

# Bounds against garbage lengths: real metadata is under 1 KiB, and the body before ``data``
# holds a name, a dtype and two shapes.
_MAX_METADATA = 16 << 20
_MAX_BODY_BEFORE_DATA = 16 << 20
_SKIP_CHUNK = 64 << 10
# The metadata of the last schema message that passed read_schema's checks.
_schema_seen: bytes | None = None
# Record-batch metadata already parsed and checked -> (its batch, where ``data`` starts):
# a stream's batches share a few layouts, and a tensor asked for again has the very same.
_layouts: dict[bytes, tuple[_Batch, int]] = {}
_MAX_LAYOUTS = 4096


class _Malformed(Exception):
    """Raised inside the parser; turned into TransportError with the stream's context."""


def _u32(buf: bytes | bytearray, at: int) -> int:
    if not 0 <= at <= len(buf) - 4:
        raise _Malformed("flatbuffer offset out of bounds")
    return int.from_bytes(buf[at : at + 4], "little")


def _table_fields(buf: bytearray, table: int, count: int) -> list[int]:
    """Absolute positions of a flatbuffer table's first ``count`` fields (0 = absent)."""
    if not 0 <= table <= len(buf) - 4:
        raise _Malformed("flatbuffer table out of bounds")
    vtable = table - int.from_bytes(buf[table : table + 4], "little", signed=True)
    if not 0 <= vtable <= len(buf) - 4:
        raise _Malformed("flatbuffer vtable out of bounds")
    vt_size, table_size = struct.unpack_from("<HH", buf, vtable)
    if vt_size < 4 or vtable + vt_size > len(buf) or table + table_size > len(buf):
        raise _Malformed("flatbuffer vtable is inconsistent")
    present = min(count, (vt_size - 4) // 2)
    offsets = struct.unpack_from(f"<{present}H", buf, vtable + 4)
    fields = [0] * count
    for i, off in enumerate(offsets):
        if off:
            if off >= table_size:
                raise _Malformed("flatbuffer field lies outside its table")
            fields[i] = table + off
    return fields


def _indirect(buf: bytearray, field: int) -> int:
    """Follow a field holding a uoffset (to a table or a vector)."""
    return field + _u32(buf, field)


def _struct_vector(buf: bytearray, field: int, expected: int, what: str, layout: struct.Struct):
    """Unpack a vector of ``expected`` 16-byte structs; the count must match the schema."""
    if not field:
        raise _Malformed(f"record batch has no {what}")
    vector = _indirect(buf, field)
    count = _u32(buf, vector)
    if count != expected:
        raise _Malformed(f"record batch has {count} {what}, the tensor schema has {expected}")
    if vector + 4 + 16 * count > len(buf):
        raise _Malformed(f"record batch {what} run past the metadata")
    return layout.unpack_from(buf, vector + 4)


class _Batch:
    """What the parser extracted from one RecordBatch message's metadata."""

    __slots__ = ("length", "body_length", "nodes", "buffers")

    def __init__(self, length: int, body_length: int, nodes: tuple, buffers: tuple) -> None:
        self.length = length
        self.body_length = body_length
        self.nodes = nodes
        self.buffers = buffers


def _parse_message(meta: bytearray) -> tuple[int, int, int]:
    """(header type, header table position, body length) of a flatbuffer ``Message``."""
    root = _u32(meta, 0)
    version, header_type, header, body_length = _table_fields(meta, root, 4)
    v = struct.unpack_from("<h", meta, version)[0] if version else 0
    if v not in (_METADATA_V4, _METADATA_V5):
        raise _Malformed(f"unsupported Arrow metadata version {v} (need V4 or V5)")
    htype = meta[header_type] if header_type else 0
    if not header:
        raise _Malformed("message has no header")
    blen = _I64.unpack_from(meta, body_length)[0] if body_length else 0
    if blen < 0:
        raise _Malformed(f"negative body length {blen}")
    return htype, _indirect(meta, header), blen


def _parse_batch(meta: bytearray, table: int, body_length: int) -> _Batch:
    length, nodes, buffers, compression = _table_fields(meta, table, 4)
    if compression:
        raise _Malformed("compressed record batch bodies are not supported")
    n = _I64.unpack_from(meta, length)[0] if length else 0
    return _Batch(
        n,
        body_length,
        _struct_vector(meta, nodes, _NODE_COUNT, "field nodes", _NODES),
        _struct_vector(meta, buffers, _BUFFER_COUNT, "buffers", _BUFFERS),
    )


def _check_layout(batch: _Batch) -> int:
    """Check nodes and buffer bounds; return the end of the body part before ``data``."""
    nodes, buffers, body_length = batch.nodes, batch.buffers, batch.body_length
    for i in range(_NODE_COUNT):
        length, nulls = nodes[2 * i], nodes[2 * i + 1]
        if i in (3, 5):
            continue  # list items: checked against their list's offsets while decoding
        if length != 1:
            raise _Malformed(f"field node {i} has length {length}, the batch has 1 row")
        if nulls != 0 and not (i in _NULLABLE_NODES and nulls == 1):
            raise _Malformed(f"field node {i} has {nulls} nulls")
    if nodes[7] or nodes[11]:
        raise _Malformed("a shape list holds null items")
    small_end = 0
    for i in range(_BUFFER_COUNT):
        offset, length = buffers[2 * i], buffers[2 * i + 1]
        if offset < 0 or length < 0 or offset + length > body_length:
            raise _Malformed(f"buffer {i} ({offset}, {length}) lies outside the body")
        if length and i != _DATA_VALUES:
            small_end = max(small_end, offset + length)
    data_at, data_length = buffers[2 * _DATA_VALUES], buffers[2 * _DATA_VALUES + 1]
    if not data_length:
        # An empty data buffer may sit anywhere (some writers give empty buffers offset 0);
        # what matters is reading every small buffer before "data" is placed.
        data_at = small_end
    elif small_end > data_at:
        raise _Malformed("the data buffer is not the last buffer of the body")
    if data_at > _MAX_BODY_BEFORE_DATA:
        raise _Malformed(f"{data_at} body bytes before the data buffer")
    return data_at


def _offsets(body: bytearray, buffers: tuple, index: int, limit: int) -> tuple[int, int]:
    """Row 0's [start, end) from an int32 offsets buffer, checked against ``limit``."""
    offset, length = buffers[2 * index], buffers[2 * index + 1]
    if length < 8:
        raise _Malformed(f"offsets buffer {index} is {length} bytes, needs 8")
    start, end = _I32X2.unpack_from(body, offset)
    if not 0 <= start <= end <= limit:
        raise _Malformed(f"offsets [{start}, {end}) of buffer {index} exceed {limit}")
    return start, end


def _string(body: bytearray, buffers: tuple, indices: tuple[int, int, int]) -> str:
    start, end = _offsets(body, buffers, indices[1], buffers[2 * indices[2] + 1])
    at = buffers[2 * indices[2]]
    try:
        return body[at + start : at + end].decode()
    except UnicodeDecodeError as exc:
        raise _Malformed(f"a string field is not valid UTF-8: {exc}") from None


def _int_list(body: bytearray, batch: _Batch, indices: tuple[int, int], item_node: int):
    buffers = batch.buffers
    start, end = _offsets(body, buffers, indices[0], batch.nodes[2 * item_node])
    offset, length = buffers[2 * indices[1]], buffers[2 * indices[1] + 1]
    if 8 * end > length:
        raise _Malformed("a shape's values run past their buffer")
    return struct.unpack_from(f"<{end - start}q", body, offset + 8 * start)


def _scalar(body: bytearray, buffers: tuple, index: int, layout: struct.Struct) -> int:
    if buffers[2 * index + 1] < 8:
        raise _Malformed(f"value buffer {index} is shorter than 8 bytes")
    return layout.unpack_from(body, buffers[2 * index])[0]


def _decode_header(body: bytearray, batch: _Batch) -> tuple[ChunkHeader, int]:
    """The row's header and where its data starts within the data values buffer."""
    buffers = batch.buffers
    encoding = None
    if batch.nodes[13] == 0:  # encoding's null count
        encoding = _string(body, buffers, _ENCODING)
    else:
        at, length = buffers[2 * _ENCODING[0]], buffers[2 * _ENCODING[0] + 1]
        if length < 1 or body[at] & 1:
            raise _Malformed("encoding's null count and validity bitmap disagree")
    start, end = _offsets(body, buffers, _DATA_OFFSETS, buffers[2 * _DATA_VALUES + 1])
    header = ChunkHeader(
        _string(body, buffers, _NAME),
        _string(body, buffers, _DTYPE),
        _int_list(body, batch, _SHAPE, 3),
        _int_list(body, batch, _LOGICAL_SHAPE, 5),
        encoding,
        _scalar(body, buffers, _OFFSET, _I64),
        _scalar(body, buffers, _TOTAL_BYTES, _I64),
        _scalar(body, buffers, _DIGEST, _U64),
        end - start,
    )
    return header, start


class ArrowChunkReader:
    """Reads a tensor-chunk Arrow IPC stream from ``source``, one chunk at a time.

    ``read_schema()`` reads and checks the schema message (``next_chunk`` calls it if the
    caller has not). ``next_chunk(destination)`` reads one row: it decodes the header, calls
    ``destination(header)`` for a writable buffer of exactly ``header.nbytes`` bytes, reads
    the chunk's bytes into it, and returns the header; it returns None at the end-of-stream
    marker. A stream that breaks, ends early, or is not this schema raises TransportError.
    """

    def __init__(self, source: Source) -> None:
        self._source = source
        self._schema: pa.Schema | None = None
        self._done = False
        self._scratch: bytearray | None = None
        # A source that can give a small stream whole (``whole()``: a memoryview or None) is
        # parsed from memory: a small answer's seven reads were three layers of readinto
        # each (docs/performance.md, "Small requests").
        self._take_whole: Callable[[], memoryview | None] | None = getattr(source, "whole", None)
        self._memory: memoryview | None = None
        self._at = 0  # how far into _memory the stream was read

    # -- reading from the source --------------------------------------------------------

    def _from_memory(self, n: int, ended: str) -> memoryview:
        """The next ``n`` bytes of a stream held whole."""
        memory, at = self._memory, self._at
        assert memory is not None
        if at + n > len(memory):
            raise TransportError(ended)
        self._at = at + n
        return memory[at : at + n]

    def _fill(self, view: memoryview, ended: str = "stream ended before its end marker") -> None:
        if self._memory is not None:
            view[:] = self._from_memory(len(view), ended)
            return
        readinto = self._source.readinto
        while view:
            n = readinto(view)
            if not n:
                raise TransportError(ended)
            view = view[n:]

    def _read(self, n: int, ended: str = "stream ended before its end marker") -> bytearray:
        if self._memory is not None:
            return bytearray(self._from_memory(n, ended))
        buf = bytearray(n)
        self._fill(memoryview(buf), ended)
        return buf

    def _skip(self, n: int) -> None:
        if n <= 0:
            return
        if self._memory is not None:
            self._from_memory(n, "stream ended before its end marker")
            return
        if self._scratch is None:
            self._scratch = bytearray(_SKIP_CHUNK)
        scratch = memoryview(self._scratch)
        while n:
            k = min(n, _SKIP_CHUNK)
            self._fill(scratch[:k])
            n -= k

    def _read_message(self, ended: str) -> tuple[bytes, bytearray] | None:
        """(8-byte prefix, metadata) of the next message, or None at the end marker."""
        prefix = self._read(8, ended)
        marker, length = _PREFIX.unpack(prefix)
        if marker != _CONTINUATION:
            raise TransportError(
                "not an Arrow IPC stream: a message does not start with the continuation marker"
            )
        if length == 0:
            return None
        if not 0 < length <= _MAX_METADATA:
            raise TransportError(f"Arrow IPC message declares {length} bytes of metadata")
        return bytes(prefix), self._read(length, ended)

    # -- public API ---------------------------------------------------------------------

    def read_schema(self) -> pa.Schema:
        """Read the schema message and check that it is ``TENSOR_SCHEMA``."""
        if self._schema is not None:
            return self._schema
        if self._take_whole is not None:  # the first read of the stream
            take, self._take_whole = self._take_whole, None
            self._memory = take()
        ended = "stream ended before its schema"
        message = self._read_message(ended)
        if message is None:
            raise TransportError(ended)
        prefix, meta = message
        global _schema_seen
        if _schema_seen is not None and _schema_seen == meta:
            # The very bytes checked before: every stream of a server starts with them, and
            # parsing them again was a tenth of a small request's client time.
            self._schema = TENSOR_SCHEMA
            return TENSOR_SCHEMA
        try:
            htype, _, body_length = _parse_message(meta)
        except (_Malformed, struct.error) as exc:
            raise TransportError(f"malformed Arrow IPC schema message: {exc}") from None
        if htype != _HEADER_SCHEMA:
            raise TransportError(
                f"first Arrow IPC message is a {_HEADER_NAMES.get(htype, htype)}, not a Schema"
            )
        if body_length:
            raise TransportError(f"schema message has a {body_length}-byte body")
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(prefix + meta))
        except (pa.ArrowException, OSError, ValueError) as exc:  # ArrowIOError is an OSError
            raise TransportError(f"unreadable Arrow schema: {exc}") from None
        if not schema.equals(TENSOR_SCHEMA):
            raise TransportError(
                f"stream schema is not the tensor schema:\n{schema}\nexpected:\n{TENSOR_SCHEMA}"
            )
        if schema.metadata != TENSOR_SCHEMA.metadata:
            raise TransportError(
                f"stream schema version {schema.metadata!r} is not {TENSOR_SCHEMA.metadata!r}"
            )
        self._schema = schema
        _schema_seen = bytes(meta)
        return schema

    def next_chunk(self, destination: Callable[[ChunkHeader], memoryview]) -> ChunkHeader | None:
        """Read one chunk into ``destination(header)``; None at the end of the stream."""
        if self._done:
            return None
        if self._schema is None:
            self.read_schema()
        while True:
            message = self._read_message("stream ended before its end marker")
            if message is None:
                self._done = True
                return None
            try:
                key = bytes(message[1])
                known = _layouts.get(key)
                if known is None:
                    htype, table, body_length = _parse_message(message[1])
                    if htype != _HEADER_RECORD_BATCH:
                        raise _Malformed(
                            f"a {_HEADER_NAMES.get(htype, htype)} message where a RecordBatch "
                            "belongs"
                        )
                    batch = _parse_batch(message[1], table, body_length)
                    if batch.length == 0:  # an empty batch carries no chunk; legal, skip it
                        self._skip(body_length)
                        continue
                    if batch.length != 1:
                        raise _Malformed(
                            f"a record batch of {batch.length} rows (need 1 per batch)"
                        )
                    data_at = _check_layout(batch)
                    if len(_layouts) >= _MAX_LAYOUTS:
                        _layouts.clear()
                    _layouts[key] = (batch, data_at)
                else:
                    batch, data_at = known
                    body_length = batch.body_length
                body = self._read(data_at)
                header, start = _decode_header(body, batch)
            except (_Malformed, struct.error) as exc:
                raise TransportError(f"malformed Arrow IPC record batch: {exc}") from None
            break
        view = memoryview(destination(header))
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.readonly or view.nbytes != header.nbytes:
            raise ValueError(
                f"destination for {header!r} must be writable and {header.nbytes} bytes, "
                f"got {'read-only ' if view.readonly else ''}{view.nbytes} bytes"
            )
        self._skip(start)
        self._fill(view)
        self._skip(body_length - data_at - start - header.nbytes)
        return header

    def close(self) -> None:
        """Close the source (a stream left unfinished is abandoned, not drained)."""
        self._memory = None  # the source's buffer: another request's once it is closed
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def chunks(self, destination: Callable[[ChunkHeader], memoryview]) -> Iterator[ChunkHeader]:
        """Iterate ``next_chunk(destination)`` until the end of the stream."""
        while (header := self.next_chunk(destination)) is not None:
            yield header


class IterSource:
    """``readinto`` over an iterable of bytes-like pieces (e.g. gRPC messages).

    Copying from each piece into the requested view is unavoidable here: the pieces already
    exist as separate objects. Leftovers of a piece are kept for the next call.
    """

    def __init__(self, pieces: Iterable[bytes | bytearray | memoryview]) -> None:
        self._pieces = iter(pieces)
        self._current = memoryview(b"")

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` as far as the pieces go; fewer bytes only at the end, 0 after it."""
        view = memoryview(view)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        wanted = len(view)
        filled = 0
        current = self._current
        while filled < wanted:
            if not current:
                piece = next(self._pieces, None)
                if piece is None:
                    break
                current = memoryview(piece)
                if current.format != "B" or current.ndim != 1:
                    current = current.cast("B")
                continue
            n = min(len(current), wanted - filled)
            view[filled : filled + n] = current[:n]
            current = current[n:]
            filled += n
        self._current = current
        return filled

    def close(self) -> None:
        """Stop the underlying iterator (cancels a gRPC call, closes a generator)."""
        for method in ("cancel", "close"):
            stop = getattr(self._pieces, method, None)
            if stop is not None:
                stop()
                return
