"""The hand-framed Arrow IPC stream: pyarrow reads it, it equals pyarrow's bytes, and the
in-place reader reads it (and pyarrow's streams) into caller buffers."""

from __future__ import annotations

import io
import random
import struct

import numpy as np
import pyarrow as pa
import pytest
import xxhash

from weightserve.client.errors import TransportError
from weightserve.client.receive import arrow_reader as ar
from weightserve.client.receive.arrow_reader import ArrowChunkReader, IterSource
from weightserve.client.wire.schema import TENSOR_SCHEMA, ChunkHeader
from weightserve.service.serving import arrow_writer as aw
from weightserve.service.serving.arrow_writer import END_OF_STREAM, chunk_message, schema_message


def _row(
    name,
    dtype,
    shape,
    data,
    *,
    encoding=None,
    logical_shape=None,
    offset=0,
    total=None,
    digest=None,
) -> tuple[ChunkHeader, bytes]:
    header = ChunkHeader(
        name,
        dtype,
        shape,
        shape if logical_shape is None else logical_shape,
        encoding,
        offset,
        len(data) if total is None else total,
        xxhash.xxh3_64_intdigest(data) if digest is None else digest,
        len(data),
    )
    return header, data


def _bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


_BIG = _bytes(5 << 20, 1)
_SPLIT = _bytes(20, 2)

ROWS = [
    _row("model.embed_tokens.weight", "float32", (2, 3), _bytes(24, 3)),
    _row("é", "uint8", (1,), b"\x07"),
    _row("层.0.权重", "bfloat16", (), _bytes(2, 4), digest=0),
    _row("ü🙂", "uint8", (7,), _bytes(7, 5), digest=2**64 - 1),
    _row("a" * 8, "int64", (1,), _bytes(8, 6)),
    _row("x" * 13, "float16", (0, 5), b""),
    _row("empty", "float32", (0,), b"", encoding="Q4_0"),
    _row(
        "blk.0.attn_q.weight",
        "uint8",
        (8, 512),
        _bytes(4096, 7),
        encoding="Q4_0",
        logical_shape=(8, 1024),
    ),
    _row("big", "uint8", (5 << 20,), _BIG),
    _row("split", "int8", (20,), _SPLIT[:7], total=20),
    _row("split", "int8", (20,), _SPLIT[7:], offset=7, total=20),
]
SMALL_ROWS = [r for r in ROWS if r[0].nbytes < 1 << 20]


def our_stream(rows=ROWS) -> bytes:
    parts = [schema_message()]
    for header, data in rows:
        prefix, suffix = chunk_message(header)
        parts += (prefix, data, suffix)
    parts.append(END_OF_STREAM)
    return b"".join(parts)


def record_batch(header: ChunkHeader, data: bytes) -> pa.RecordBatch:
    s = TENSOR_SCHEMA
    return pa.record_batch(
        [
            pa.array([header.name], pa.utf8()),
            pa.array([header.dtype], pa.utf8()),
            pa.array([list(header.shape)], s.field("shape").type),
            pa.array([list(header.logical_shape)], s.field("logical_shape").type),
            pa.array([header.encoding], pa.utf8()),
            pa.array([header.offset], pa.int64()),
            pa.array([header.total_bytes], pa.int64()),
            pa.array([header.digest], pa.uint64()),
            pa.array([data], pa.binary()),
        ],
        schema=s,
    )


def pyarrow_stream(rows=ROWS, **options) -> bytes:
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(**options) if options else None
    with pa.ipc.new_stream(sink, TENSOR_SCHEMA, options=opts) as writer:
        for header, data in rows:
            writer.write_batch(record_batch(header, data))
    return sink.getvalue().to_pybytes()


def row_dict(header: ChunkHeader, data: bytes) -> dict:
    return {
        "name": header.name,
        "dtype": header.dtype,
        "shape": list(header.shape),
        "logical_shape": list(header.logical_shape),
        "encoding": header.encoding,
        "offset": header.offset,
        "total_bytes": header.total_bytes,
        "digest": header.digest,
        "data": data,
    }


def read_all(source, rows=ROWS) -> tuple[list[ChunkHeader], dict[str, bytearray]]:
    """Read a stream with ArrowChunkReader into one buffer per tensor, at each chunk's offset."""
    buffers = {h.name: bytearray(h.total_bytes) for h, _ in rows}

    def destination(header: ChunkHeader) -> memoryview:
        return memoryview(buffers[header.name])[header.offset : header.offset + header.nbytes]

    reader = ArrowChunkReader(source)
    assert reader.read_schema().equals(TENSOR_SCHEMA, check_metadata=True)
    headers = list(reader.chunks(destination))
    assert reader.next_chunk(destination) is None  # stays at the end
    return headers, buffers


def check_read(headers, buffers, rows=ROWS) -> None:
    assert headers == [h for h, _ in rows]
    expected: dict[str, bytearray] = {h.name: bytearray(h.total_bytes) for h, _ in rows}
    for h, data in rows:
        expected[h.name][h.offset : h.offset + h.nbytes] = data
    assert buffers == expected


# -- the writer ------------------------------------------------------------------------


def test_schema_message_is_the_schema():
    msg = schema_message()
    assert msg.startswith(b"\xff\xff\xff\xff") and len(msg) % 8 == 0
    assert pa.ipc.read_schema(pa.py_buffer(msg)).equals(TENSOR_SCHEMA, check_metadata=True)


def test_pyarrow_reads_our_stream():
    reader = pa.ipc.open_stream(our_stream())
    assert reader.schema.equals(TENSOR_SCHEMA, check_metadata=True)
    batches = list(reader)
    assert [b.num_rows for b in batches] == [1] * len(ROWS)
    for batch, (header, data) in zip(batches, ROWS, strict=True):
        batch.validate(full=True)
        assert batch.to_pylist() == [row_dict(header, data)]


def test_bytes_identical_to_pyarrow():
    ours, theirs = our_stream(), pyarrow_stream()
    assert len(ours) == len(theirs)
    assert ours == theirs
    # Per message too, so a failure names the row.
    for header, data in ROWS:
        prefix, suffix = chunk_message(header)
        ref = pyarrow_stream([(header, data)])[len(schema_message()) : -len(END_OF_STREAM)]
        assert prefix + data + suffix == ref, header
        assert (len(prefix) + len(data) + len(suffix)) % 8 == 0


def test_template_equals_flatbuffers_builder():
    """The per-chunk patched template is what the flatbuffers Builder writes from scratch."""
    for header, _ in ROWS:
        prefix, _ = chunk_message(header)
        meta_len = struct.unpack_from("<i", prefix, 4)[0]
        meta = bytearray(prefix[8 : 8 + meta_len])
        htype, table, body_length = ar._parse_message(meta)
        assert htype == ar._HEADER_RECORD_BATCH
        batch = ar._parse_batch(meta, table, body_length)
        nodes = list(zip(batch.nodes[::2], batch.nodes[1::2], strict=True))
        buffers = list(zip(batch.buffers[::2], batch.buffers[1::2], strict=True))
        assert aw.build_metadata(nodes, buffers, body_length) == prefix[: 8 + meta_len]


def test_chunk_message_cache_is_transparent():
    header, data = ROWS[0]
    first = chunk_message(header)
    assert chunk_message(header) == first
    aw._FIXED_CACHE.clear()
    assert chunk_message(header) == first
    # Chunks of one tensor share the cached part; only the tail differs.
    other = ChunkHeader(
        header.name, header.dtype, header.shape, header.logical_shape, header.encoding, 8, 32, 5, 16
    )
    prefix, suffix = chunk_message(other)
    assert (
        prefix + bytes(16) + suffix
        == pyarrow_stream([(other, bytes(16))])[len(schema_message()) : -len(END_OF_STREAM)]
    )


@pytest.mark.parametrize(
    "change",
    [
        {"digest": -1},
        {"digest": 2**64},
        {"nbytes": -1},
        {"nbytes": 2**31},
        {"offset": 2**63},
        {"shape": (2**63,)},
    ],
)
def test_chunk_message_rejects_values_outside_the_schema(change):
    fields = {s: getattr(ROWS[0][0], s) for s in ChunkHeader.__slots__} | change
    with pytest.raises(ValueError, match="does not fit the tensor schema"):
        chunk_message(ChunkHeader(**fields))


# -- the reader ------------------------------------------------------------------------


def test_reader_reads_our_stream():
    check_read(*read_all(io.BytesIO(our_stream())))


def test_reader_reads_pyarrow_streams():
    check_read(*read_all(io.BytesIO(pyarrow_stream())))
    # Metadata V4 is laid out differently enough to exercise the parser; same rows.
    check_read(*read_all(io.BytesIO(pyarrow_stream(metadata_version=pa.ipc.MetadataVersion.V4))))


def test_reader_agrees_with_pyarrow_on_unusual_layouts():
    """Arrays pyarrow builds in other ways (sliced, non-zero first offsets, bitmaps present
    with no nulls, empty batches in between): our reader sees what pyarrow's reader sees."""
    s = TENSOR_SCHEMA
    values = pa.py_buffer(b"..hello")
    data = pa.Array.from_buffers(
        pa.binary(), 1, [None, pa.py_buffer(struct.pack("<ii", 2, 7)), values]
    )
    name = pa.array(["zz", "tensor"], pa.utf8()).slice(1, 1)
    shape = pa.array([[9, 9], [5]], s.field("shape").type).slice(1, 1)
    enc = pa.array(["Q8_0", None], pa.utf8(), mask=np.array([False, False])).slice(0, 1)
    batch = pa.record_batch(
        [
            name,
            pa.array(["uint8"]),
            shape,
            shape,
            enc,
            pa.array([0], pa.int64()),
            pa.array([5], pa.int64()),
            pa.array([7], pa.uint64()),
            data,
        ],
        schema=s,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, s) as writer:
        writer.write_batch(batch.slice(0, 0))
        writer.write_batch(batch)
        writer.write_batch(batch.slice(0, 0))
    stream = sink.getvalue().to_pybytes()
    expected = [r for b in pa.ipc.open_stream(stream) for r in b.to_pylist()]
    assert len(expected) == 1

    got = []

    def destination(header):
        got.append(bytearray(header.nbytes))
        return memoryview(got[-1])

    reader = ArrowChunkReader(io.BytesIO(stream))
    headers = list(reader.chunks(destination))
    assert [row_dict(h, bytes(d)) for h, d in zip(headers, got, strict=True)] == expected


def test_reader_places_data_into_numpy_destinations():
    rows = [_row("w", "float32", (3, 4), np.arange(12, dtype=np.float32).tobytes())]
    out = np.zeros((3, 4), np.float32)
    reader = ArrowChunkReader(io.BytesIO(our_stream(rows)))
    assert list(reader.chunks(lambda h: memoryview(out))) == [rows[0][0]]
    assert (out == np.arange(12).reshape(3, 4)).all()


@pytest.mark.parametrize(
    "dest", [lambda h: memoryview(bytearray(h.nbytes + 1)), lambda h: memoryview(bytes(h.nbytes))]
)
def test_reader_rejects_wrong_destinations(dest):
    reader = ArrowChunkReader(io.BytesIO(our_stream(SMALL_ROWS[:1])))
    with pytest.raises(ValueError, match="must be writable"):
        reader.next_chunk(dest)


@pytest.mark.parametrize("split", ["1", "3", "random", "messages"])
def test_iter_source(split):
    stream = our_stream(SMALL_ROWS)
    if split == "messages":
        pieces: list = [schema_message()]
        for header, data in SMALL_ROWS:
            prefix, suffix = chunk_message(header)
            pieces.append(memoryview(prefix + data + suffix))
        pieces += [b"", bytearray(END_OF_STREAM)]
    elif split == "random":
        rng = random.Random(9)
        pieces, at = [], 0
        while at < len(stream):
            n = rng.choice([0, 1, 2, 5, 8, 64, 1000, 5000])
            pieces.append(stream[at : at + n])
            at += n
    else:
        n = int(split)
        pieces = [stream[i : i + n] for i in range(0, len(stream), n)]
    check_read(*read_all(IterSource(iter(pieces)), SMALL_ROWS), SMALL_ROWS)


def test_iter_source_semantics():
    src = IterSource([b"abc", b"", b"defg"])
    buf = bytearray(5)
    assert src.readinto(memoryview(buf)) == 5 and buf == b"abcde"
    assert src.readinto(memoryview(buf)) == 2 and buf[:2] == b"fg"
    assert src.readinto(memoryview(buf)) == 0

    closed = []

    def gen():
        try:
            yield b"x"
        finally:
            closed.append(True)

    g = IterSource(gen())
    g.readinto(memoryview(bytearray(1)))
    g.close()
    assert closed == [True]


# -- broken streams ----------------------------------------------------------------------


def _drain(stream: bytes) -> None:
    list(ArrowChunkReader(io.BytesIO(stream)).chunks(lambda h: memoryview(bytearray(h.nbytes))))


def test_truncated_streams_raise():
    stream = our_stream(SMALL_ROWS)
    _drain(stream)
    for cut in range(len(stream)):
        with pytest.raises(TransportError, match="ended before its"):
            _drain(stream[:cut])


@pytest.mark.parametrize(
    "stream, message",
    [
        (b"", "ended before its schema"),
        (b"hello, world, this is not arrow", "continuation marker"),
        (b"\xff\xff\xff\xff" + b"\x7f" * 4, "declares"),
        (b"\xff\xff\xff\xff\x10\x00\x00\x00" + bytes(16), "malformed"),
        (END_OF_STREAM, "ended before its schema"),
        (schema_message() + schema_message() + END_OF_STREAM, "a Schema message"),
        (our_stream()[: len(schema_message())] + b"\x00" * 8, "continuation marker"),
    ],
)
def test_garbage_raises(stream, message):
    with pytest.raises(TransportError, match=message):
        _drain(stream)


def test_other_schemas_and_features_are_refused():
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, pa.schema([("x", pa.int64())])) as w:
        w.write_batch(pa.record_batch([pa.array([1])], names=["x"]))
    with pytest.raises(TransportError, match="not the tensor schema"):
        _drain(sink.getvalue().to_pybytes())

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, TENSOR_SCHEMA.with_metadata({"weightserve.schema": "v9"})):
        pass
    with pytest.raises(TransportError, match="version"):
        _drain(sink.getvalue().to_pybytes())

    two_rows = pa.concat_batches([record_batch(*ROWS[0]), record_batch(*ROWS[1])])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, TENSOR_SCHEMA) as w:
        w.write_batch(two_rows)
    with pytest.raises(TransportError, match="2 rows"):
        _drain(sink.getvalue().to_pybytes())

    with pytest.raises(TransportError, match="compressed"):
        _drain(pyarrow_stream(SMALL_ROWS, compression="zstd"))


def test_mutated_streams_raise_only_transport_errors():
    """Flipping bytes anywhere in the framing either still reads or raises TransportError."""
    stream = bytearray(our_stream(SMALL_ROWS[:4]))
    rng = random.Random(11)

    class TooBig(Exception):
        pass

    def destination(header):
        if header.nbytes > 1 << 20:
            raise TooBig
        return memoryview(bytearray(header.nbytes))

    outcomes = {"ok": 0, "error": 0}
    for _ in range(3000):
        mutated = bytearray(stream)
        for _ in range(rng.choice([1, 2, 4])):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            list(ArrowChunkReader(io.BytesIO(bytes(mutated))).chunks(destination))
            outcomes["ok"] += 1
        except (TransportError, TooBig):
            outcomes["error"] += 1
    assert outcomes["error"] > 0
