"""Lean Flight batches: one zero-copy uint8 column per chunk, the row's header in app_metadata.

The weightserve client asks for them with a call header; a Flight client that does not ask
gets the full tensor schema (tests/service/transports/test_flight.py), and the weightserve
client still reads full rows from a server that ignores the header. Servers are real, on loopback; bytes are
compared with the reference readers and checked against each chunk's digest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.flight as flight
import pytest
import xxhash
from safetensors.numpy import save_file

from weightserve.client._client import Client
from weightserve.client.errors import TransportError
from weightserve.client.transports.flight import (
    FORMAT_HEADER,
    LEAN_CHUNK_BYTES,
    LEAN_FORMAT,
    LEAN_SCHEMA,
    decode_chunk_header,
    encode_chunk_header,
)
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client.wire.schema import FIELD_NAMES, ChunkHeader
from weightserve.service.server import ServerConfig, WeightServer

LEAN = flight.FlightCallOptions(headers=[(FORMAT_HEADER.encode(), LEAN_FORMAT.encode())])


def ticket(**fields) -> flight.Ticket:
    return flight.Ticket(pb.TensorRequest(**fields).SerializeToString())


def read_lean(port: int, **fields) -> list[tuple[ChunkHeader, bytes]]:
    """A plain pyarrow Flight client asking for lean batches: every chunk's header and bytes."""
    client = flight.connect(f"grpc://127.0.0.1:{port}")
    try:
        reader = client.do_get(ticket(**fields), LEAN)
        assert reader.schema.equals(LEAN_SCHEMA, check_metadata=True)
        chunks = []
        for batch, meta in reader:
            data = batch.column(0).to_numpy().tobytes()
            chunks.append((decode_chunk_header(meta, len(data)), data))
        return chunks
    finally:
        client.close()


@pytest.mark.parametrize(
    "header",
    [
        ChunkHeader(
            "model.embed_tokens.weight",
            "bfloat16",
            (32000, 64),
            (32000, 64),
            None,
            0,
            4096000,
            2**64 - 1,
            8 << 20,
        ),  # fmt: skip
        ChunkHeader(
            "blk.0.attn_q.weight", "uint8", (64, 36), (64, 64), "Q8_0", 1152, 2304, 7, 1152
        ),  # fmt: skip
        ChunkHeader("scalar", "float32", (), (), None, 0, 4, 1, 4),
        ChunkHeader("empty", "int64", (0, 3), (0, 3), None, 0, 0, 0, 0),
        ChunkHeader("gewichte.größe", "float8_e4m3fn", (7,), (7,), "", 0, 7, 5, 7),
    ],
)
def test_chunk_headers_round_trip(header: ChunkHeader) -> None:
    # Every field survives, an empty encoding stays distinct from none.
    assert decode_chunk_header(encode_chunk_header(header), header.nbytes) == header


def test_malformed_metadata_is_a_transport_error() -> None:
    good = encode_chunk_header(ChunkHeader("w", "float32", (2,), (2,), None, 0, 8, 1, 8))
    with pytest.raises(TransportError, match="malformed"):
        decode_chunk_header(good[:-3], 8)  # truncated inside the dtype
    with pytest.raises(TransportError, match="version 9"):
        decode_chunk_header(b"\x09" + good[1:], 8)


def test_lean_batches_carry_every_model(server, reference, model_id: str) -> None:
    """Rows reassembled from lean batches are the reference tensors, each chunk its digest."""
    ref = reference(model_id)
    chunk = 64 << 10  # several chunks for the larger tensors
    chunks = read_lean(server.flight_port, model=model_id, use_prefix=True, chunk_bytes=chunk)
    parts: dict[str, list[bytes]] = {}
    for header, data in chunks:
        assert len(data) <= chunk  # chunked as asked
        assert header.offset == sum(map(len, parts.get(header.name, ())))
        assert xxhash.xxh3_64_intdigest(data) == header.digest
        parts.setdefault(header.name, []).append(data)
    tensors = {name: b"".join(p) for name, p in parts.items()}
    assert set(tensors) == set(ref)
    for name, r in ref.items():
        assert tensors[name] == r.array.tobytes(), name
        header = next(h for h, _ in chunks if h.name == name)
        assert (header.dtype, header.shape, header.logical_shape, header.encoding) == (
            r.dtype,
            r.shape,
            r.logical_shape,
            r.encoding,
        )


def test_lean_streams_default_to_large_chunks(tmp_path: Path) -> None:
    """With no chunk size in the request, lean streams use LEAN_CHUNK_BYTES (full rows keep
    the smaller default of every transport)."""
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    big = np.random.default_rng(3).integers(0, 255, 2 * LEAN_CHUNK_BYTES + 12345, dtype=np.uint8)
    save_file({"big": big}, root / "m" / "model.safetensors")
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0)
    with WeightServer(config) as srv:
        chunks = read_lean(srv.flight_port, model="m", use_prefix=True)
        assert [len(d) for _, d in chunks] == [LEAN_CHUNK_BYTES, LEAN_CHUNK_BYTES, 12345]
        assert b"".join(d for _, d in chunks) == big.tobytes()
        with Client(srv.grpc_url) as client:
            got = client.model("m").fetch(prefix="")
            reader = client.transport._flight_pool().open(  # type: ignore[attr-defined]
                pb.TensorRequest(model="m", use_prefix=True).SerializeToString()
            )
            try:
                assert reader.read_schema().equals(LEAN_SCHEMA)  # what the client asks for
            finally:
                reader.close()
    np.testing.assert_array_equal(got["big"], big)


def test_client_reads_full_rows_from_a_server_that_ignores_the_header(server, reference) -> None:
    """An older server sends TENSOR_SCHEMA rows whatever the client asks; they still load."""
    ref = reference("mixed")
    with Client(server.grpc_url) as client:
        pool = client.transport._flight_pool()  # type: ignore[attr-defined]
        pool.options = flight.FlightCallOptions()  # no lean header: the server sends rows
        reader = pool.open(pb.TensorRequest(model="mixed", use_prefix=True).SerializeToString())
        try:
            assert tuple(reader.read_schema().names) == FIELD_NAMES
        finally:
            reader.close()
        got = client.model("mixed").fetch(prefix="")
    assert {n: a.tobytes() for n, a in got.items()} == {
        n: r.array.tobytes() for n, r in ref.items()
    }
