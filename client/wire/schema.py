"""The Arrow schema of tensor data: one schema on HTTP, gRPC and Arrow Flight (and the chunk
digests of the same-node handoff), the whole data contract.

A stream is an Arrow IPC *stream* (schema message, record batches, end-of-stream marker).
Each record batch holds exactly one row, and a row is one chunk of one tensor:

    name           utf8          full tensor name, e.g. "layers.0.attn.q.weight"
    dtype          utf8          wire dtype of ``data`` ("bfloat16", "uint8" for GGML blocks, ...)
    shape          list<int64>   shape of the bytes as served (GGML: the byte shape)
    logical_shape  list<int64>   element shape (GGML: the tensor's shape; else = shape)
    encoding       utf8, null    GGML type name of quantized blocks ("Q4_0"), else null
    offset         int64         byte offset of this chunk within the tensor
    total_bytes    int64         size of the whole tensor (or of the requested slice)
    digest         uint64        xxh3-64 of this chunk's ``data`` bytes
    data           binary        the chunk's bytes, little-endian, C order

Chunks of one tensor come in order, back to back; a tensor is complete when
``offset + len(data) == total_bytes``. A zero-sized tensor is one row with empty ``data``.
``data`` is the last field so that its bytes are the last buffer of each message body: the
server sends them straight from the mapped file and the client reads them straight into the
tensor's final buffer.
"""

from __future__ import annotations

import pyarrow as pa

ARROW_STREAM_MEDIA_TYPE = "application/vnd.apache.arrow.stream"

# Chunks are bounded so that no message is unbounded (gRPC has message size limits, and a
# broken stream resumes from the last complete chunk). 2 MiB: small enough to keep fewer bytes
# in flight per stream, large enough that per-chunk overhead is noise (measured:
# docs/performance.md, "Decisions and the figures behind them").
DEFAULT_CHUNK_BYTES = 2 << 20
# What a bulk load over HTTP asks for (client/transports/http.py): its resume and digest
# granularity, at most this many bytes received again after a break.
BULK_CHUNK_BYTES = 8 << 20
MAX_CHUNK_BYTES = 64 << 20
# The largest gRPC message either side sends or accepts: one chunk and its framing.
MAX_GRPC_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)

TENSOR_SCHEMA = pa.schema(
    [
        pa.field("name", pa.utf8(), nullable=False),
        pa.field("dtype", pa.utf8(), nullable=False),
        pa.field("shape", pa.list_(pa.field("item", pa.int64(), nullable=False)), nullable=False),
        pa.field(
            "logical_shape",
            pa.list_(pa.field("item", pa.int64(), nullable=False)),
            nullable=False,
        ),
        pa.field("encoding", pa.utf8(), nullable=True),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("total_bytes", pa.int64(), nullable=False),
        pa.field("digest", pa.uint64(), nullable=False),
        pa.field("data", pa.binary(), nullable=False),
    ],
    metadata={"weightserve.schema": "tensor-chunks/v1"},
)

FIELD_NAMES = tuple(TENSOR_SCHEMA.names)


class ChunkHeader:
    """Every field of one row except ``data``; ``nbytes`` is the length of ``data``."""

    __slots__ = (
        "name",
        "dtype",
        "shape",
        "logical_shape",
        "encoding",
        "offset",
        "total_bytes",
        "digest",
        "nbytes",
    )

    def __init__(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        logical_shape: tuple[int, ...],
        encoding: str | None,
        offset: int,
        total_bytes: int,
        digest: int,
        nbytes: int,
    ) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = tuple(shape)
        self.logical_shape = tuple(logical_shape)
        self.encoding = encoding
        self.offset = offset
        self.total_bytes = total_bytes
        self.digest = digest
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return (
            f"ChunkHeader({self.name!r}, {self.dtype}, shape={self.shape}, "
            f"offset={self.offset}, nbytes={self.nbytes}/{self.total_bytes})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChunkHeader) and all(
            getattr(self, s) == getattr(other, s) for s in self.__slots__
        )

    @property
    def is_last(self) -> bool:
        return self.offset + self.nbytes == self.total_bytes
