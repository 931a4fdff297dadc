"""From a tensor request to the pieces of an Arrow IPC stream.

``plan_stream`` resolves and validates a request against a model before a single byte is
sent (so errors become proper statuses, not broken streams). ``stream_messages`` then yields the
stream message by message, each as bytes-like parts: small framing ``bytes`` and, for tensor
data, ``memoryview`` slices of the shared mmap — the server never copies contiguous tensor data.
Only strided sources (non-contiguous PyTorch views, shards along an inner axis) are gathered
into a new buffer, one tensor at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from weightserve.client.errors import (
    InvalidRequest,
    ModelUnavailable,
    ResourceExhausted,
    RevisionMismatch,
)
from weightserve.client.wire.dtypes import wire_dtype
from weightserve.client.wire.schema import ChunkHeader
from weightserve.service.readers.base import TensorEntry
from weightserve.service.serving.arrow_writer import (
    END_OF_STREAM,
    TensorFields,
    chunk_message,
    prefix_length,
    schema_message,
)
from weightserve.service.serving.request import Shard, TensorRequest
from weightserve.service.sources.files.chunk_digests import Framing
from weightserve.service.sources.files.mapped import MappedFile
from weightserve.service.sources.model import Model
from weightserve.service.sources.revisions.pinning import names_content

# GGML block geometry: elements per block and bytes per block, from the gguf package.
try:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    _BLOCKS = {t.name: GGML_QUANT_SIZES[t] for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}
except ImportError:  # pragma: no cover - gguf is a server dependency
    _BLOCKS = {}


class FileMessage(tuple[bytes | memoryview, ...]):
    """A stream message (its parts, as any message: ``(prefix, data)`` or, when the suffix is
    not empty, ``(prefix, data, suffix)``) whose data part, ``message[1]``, is the bytes of
    ``mapped`` from ``file_offset`` on: a transport may send them from the file itself
    (``sendfile``) rather than from the mapping. Holding it keeps the file open."""

    prefix: bytes
    suffix: bytes
    mapped: MappedFile
    file_offset: int

    def __new__(
        cls, framing: Framing, data: bytes | memoryview, mapped: MappedFile, file_offset: int
    ) -> FileMessage:
        prefix, suffix = framing
        message = super().__new__(cls, (prefix, data, suffix) if suffix else (prefix, data))
        message.prefix, message.suffix = prefix, suffix
        message.mapped = mapped
        message.file_offset = file_offset
        return message


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor (or its requested slice) as it will go on the wire."""

    entry: TensorEntry
    dtype: str
    shape: tuple[int, ...]
    logical_shape: tuple[int, ...]
    encoding: str | None
    nbytes: int
    start: int  # first byte to send (resume)
    # Contiguous source: absolute byte range in the file. None -> gather with ``index``.
    byte_offset: int | None
    index: tuple[slice, ...] | None = None


def _slice_entry(entry: TensorEntry, shard: Shard | None) -> PlannedTensor:
    itemsize = wire_dtype(entry.dtype).itemsize
    shape, logical = entry.shape, entry.logical_shape
    if shard is None or shard.count == 1 or len(shape) <= shard.axis:
        # Tensors with fewer dims than the axis (biases, norms, scalars) are replicated
        # whole to every rank, as tensor parallelism does with them.
        offset = entry.offset if entry.contiguous else None
        return PlannedTensor(
            entry,
            entry.dtype,
            shape,
            logical,
            entry.encoding,
            entry.nbytes,
            0,
            offset,
            None if entry.contiguous else (),
        )
    if wire_dtype(entry.dtype).bits % 8:
        # Packed sub-byte elements (float4, float6): a slice can start inside a byte, and the
        # byte arithmetic below assumes whole-byte items. Refuse rather than send wrong bytes.
        raise InvalidRequest(
            f"tensor {entry.name!r} has the packed dtype {entry.dtype} "
            f"({wire_dtype(entry.dtype).bits} bits per element) and cannot be sharded; "
            "request it whole"
        )
    axis = shard.axis
    if entry.encoding is not None and axis == len(shape) - 1:
        # Quantized blocks run along the last axis: split whole blocks, never inside one.
        block_elems, block_bytes = _BLOCKS[entry.encoding]
        lo, hi = shard.bounds(shape[-1] // block_bytes)
        start, stop = lo * block_bytes, hi * block_bytes
        new_logical = (*logical[:-1], (hi - lo) * block_elems)
    else:
        start, stop = shard.bounds(shape[axis])
        new_logical = tuple(stop - start if i == axis else d for i, d in enumerate(logical))
    new_shape = tuple(stop - start if i == axis else d for i, d in enumerate(shape))
    nbytes = math.prod(new_shape) * itemsize
    if entry.contiguous and all(d == 1 for d in shape[:axis]):
        # Everything before the axis is trivial: the slice is one contiguous byte range.
        row_bytes = math.prod(shape[axis + 1 :]) * itemsize
        return PlannedTensor(
            entry,
            entry.dtype,
            new_shape,
            new_logical,
            entry.encoding,
            nbytes,
            0,
            entry.offset + start * row_bytes,
        )
    index = tuple(slice(start, stop) if i == axis else slice(None) for i in range(len(shape)))
    return PlannedTensor(
        entry, entry.dtype, new_shape, new_logical, entry.encoding, nbytes, 0, None, index
    )


def plan_stream(
    model: Model, request: TensorRequest, max_names: int = 100_000
) -> list[PlannedTensor]:
    if request.revision and not names_content(model, request.revision):
        raise RevisionMismatch(
            f"model {model.id!r} is at revision {model.revision}, the request names "
            f"{request.revision}; start the transfer again"
        )
    if request.names is not None:
        if len(request.names) > max_names:
            raise ResourceExhausted(
                f"{len(request.names)} names in one request; the limit is {max_names}"
            )
        entries = [model.tensor(n) for n in request.names]
    else:
        entries = list(model.with_prefix(request.prefix or ""))
    planned = [_slice_entry(e, request.shard) for e in entries]
    if request.resume_tensor is not None:
        names = [p.entry.name for p in planned]
        if request.resume_tensor not in names:
            raise InvalidRequest(f"resume tensor {request.resume_tensor!r} is not in this request")
        at = names.index(request.resume_tensor)
        first = planned[at]
        if request.resume_offset > first.nbytes:
            raise InvalidRequest(
                f"resume offset {request.resume_offset} is past the end of "
                f"{first.entry.name!r} ({first.nbytes} bytes)"
            )
        planned = [_with_start(first, request.resume_offset), *planned[at + 1 :]]
    # Map every file the stream reads now, so it reads them as they are at its start (a file
    # renamed over later does not mix into it) and a replaced file fails here, as a status.
    model.pin(p.entry.file for p in planned)
    return planned


def _with_start(p: PlannedTensor, start: int) -> PlannedTensor:
    return PlannedTensor(
        p.entry,
        p.dtype,
        p.shape,
        p.logical_shape,
        p.encoding,
        p.nbytes,
        start,
        p.byte_offset,
        p.index,
    )


def _source_bytes(model: Model, p: PlannedTensor) -> memoryview:
    """The tensor's (slice's) bytes: a view of the mmap, or one gathered buffer if strided."""
    entry = p.entry
    if p.byte_offset is not None:
        whole = model.mapped(entry.file).view()
        if p.byte_offset + p.nbytes > len(whole):
            raise ModelUnavailable(f"model {model.id!r}: {entry.file.name} shrank since indexing")
        return whole[p.byte_offset : p.byte_offset + p.nbytes]
    return gathered_bytes(model, entry, p.index)


def gathered_bytes(
    model: Model, entry: TensorEntry, index: tuple[slice, ...] | None = None
) -> memoryview:
    """A strided tensor's bytes (or ``index``'s part of them) gathered into one C-ordered
    buffer, its file checked unchanged before and after the gather reads the mapping."""
    itemsize = wire_dtype(entry.dtype).itemsize
    mapped = model.mapped(entry.file)
    raw = np.frombuffer(mapped.view(), dtype=np.uint8)
    mapped.ensure_unchanged(mapped.size)  # the gather below reads the mapping in user space
    strides = entry.strides or tuple(
        math.prod(entry.shape[i + 1 :]) for i in range(len(entry.shape))
    )
    # A trailing byte axis lets one gather serve every dtype, bfloat16 and float8 included.
    elements = np.lib.stride_tricks.as_strided(
        raw[entry.offset :],
        shape=(*entry.shape, itemsize),
        strides=(*(s * itemsize for s in strides), 1),
        writeable=False,
    )
    if index:
        elements = elements[(*index, slice(None))]
    gathered = np.ascontiguousarray(elements).data.cast("B")
    mapped.ensure_unchanged(mapped.size)  # so the copy is of one version (see MappedFile.digest)
    return gathered


def stream_length(planned: Sequence[PlannedTensor], chunk_bytes: int) -> int:
    """Exact byte length of the stream, so HTTP can send Content-Length (no chunked framing)."""
    total = len(schema_message()) + len(END_OF_STREAM)
    for p in planned:
        # Every chunk of a tensor has a prefix of one length; only its padding varies.
        prefix = prefix_length(
            TensorFields(p.entry.name, p.dtype, p.shape, p.logical_shape, p.encoding)
        )
        for _, n in _chunk_bounds(p, chunk_bytes):
            total += prefix + n + (-n & 7)
    return total


def _chunk_bounds(p: PlannedTensor, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    if p.nbytes == 0:
        yield 0, 0
        return
    offset = p.start
    if offset == p.nbytes:
        return
    while offset < p.nbytes:
        n = min(chunk_bytes, p.nbytes - offset)
        yield offset, n
        offset += n


class FileChecks:
    """When a stream checks its files unchanged (``MappedFile.ensure_unchanged``).

    Always before bytes are read here (a digest not yet known: a truncated page is SIGBUS).
    Bytes that are not read here, a known digest's, are checked before every chunk unless
    ``every_bytes`` says otherwise: a transport whose consumer never reads the mapping in
    user space (``sendfile``, where the kernel reports a truncation as a short send) sets it
    to its batch, and an overwrite in place is then noticed within one batch, the client's
    per-chunk digests refusing any mixed bytes before that.
    """

    __slots__ = ("every_bytes", "_mapped", "_unchecked")

    def __init__(self, every_bytes: int = 0) -> None:
        self.every_bytes = every_bytes
        self._mapped: MappedFile | None = None
        self._unchecked = 0  # bytes of ``_mapped`` taken since its last check

    def before_reading(self, mapped: MappedFile, end: int) -> None:
        mapped.ensure_unchanged(end)
        self._mapped, self._unchecked = mapped, 0

    def before_sending(self, mapped: MappedFile, end: int, n: int) -> None:
        if mapped is not self._mapped or self._unchecked + n > self.every_bytes:
            self.before_reading(mapped, end)
        self._unchecked += n


def stream_chunks(
    model: Model,
    planned: Sequence[PlannedTensor],
    chunk_bytes: int,
    on_tensor: Callable[[], None] | None = None,
    checks: FileChecks | None = None,
) -> Iterator[tuple[ChunkHeader, memoryview]]:
    """Every chunk of the stream in order: its row header (digest included) and its bytes,
    a view of the mmap (or of the gathered buffer for strided sources). ``on_tensor`` is
    called once a tensor's last chunk has been taken (for the tensors-served metric)."""
    checks = checks or FileChecks()
    for p in planned:
        source = _source_bytes(model, p) if p.nbytes else memoryview(b"")
        mapped = model.mapped(p.entry.file) if p.byte_offset is not None else None
        for offset, n in _chunk_bounds(p, chunk_bytes):
            data = source[offset : offset + n]
            if mapped is not None:  # contiguous bytes of the file: the digest may be known
                digest = _file_digest(mapped, p.byte_offset + offset, data, checks)  # type: ignore[operator]
            else:
                digest = xxhash.xxh3_64_intdigest(data)
            header = _chunk_header(p, offset, digest, n)
            yield header, data
            if on_tensor is not None and header.is_last:
                on_tensor()


def _chunk_header(p: PlannedTensor, offset: int, digest: int, n: int) -> ChunkHeader:
    """The row header of ``p``'s chunk of ``n`` bytes at ``offset``."""
    return ChunkHeader(
        p.entry.name, p.dtype, p.shape, p.logical_shape, p.encoding, offset, p.nbytes, digest, n
    )


def _file_digest(
    mapped: MappedFile, start: int, data: memoryview, checks: FileChecks, whole: bool = False
) -> int:
    """The digest of ``data``, the mapped bytes from ``start`` (``whole``: a whole tensor),
    with the file checked as ``checks`` says: before reading them when the digest is not
    known yet (``digest`` checks again after)."""
    n = len(data)
    known = mapped.chunks.known(start, n) if n else None
    if known is None:
        if n:
            checks.before_reading(mapped, start + n)
        return mapped.digest(start, data, whole)
    checks.before_sending(mapped, start + n, n)
    return known


class MessageStream:
    """The messages of ``stream_messages``, an iterator; ``checks`` says how often the files
    are checked (a transport sending with ``sendfile`` may make that once per batch)."""

    __slots__ = ("checks", "_messages")

    def __init__(self, messages: Iterator[tuple[bytes | memoryview, ...]], checks: FileChecks):
        self.checks = checks
        self._messages = messages

    def __iter__(self) -> MessageStream:
        return self

    def __next__(self) -> tuple[bytes | memoryview, ...]:
        return next(self._messages)

    def close(self) -> None:
        self._messages.close()  # type: ignore[attr-defined]


def stream_messages(
    model: Model,
    planned: Sequence[PlannedTensor],
    chunk_bytes: int,
    on_tensor: Callable[[], None] | None = None,
) -> MessageStream:
    """The whole Arrow IPC stream, one IPC message at a time, each as its parts.

    Tensor data parts are views of the mmap; a message whose data lies in a file as it is
    is a ``FileMessage``, which says where (HTTP may send those bytes with ``sendfile``).
    HTTP writes the parts one by one; gRPC joins a message's parts into one protobuf message.
    """
    checks = FileChecks()
    return MessageStream(_messages(model, planned, chunk_bytes, on_tensor, checks), checks)


def _messages(
    model: Model,
    planned: Sequence[PlannedTensor],
    chunk_bytes: int,
    on_tensor: Callable[[], None] | None,
    checks: FileChecks,
) -> Iterator[tuple[bytes | memoryview, ...]]:
    yield (schema_message(),)
    for p in planned:
        if p.byte_offset is None or not p.nbytes:  # gathered, or empty: no file bytes
            for header, data in stream_chunks(model, (p,), chunk_bytes, on_tensor, checks):
                prefix, suffix = chunk_message(header)
                yield (prefix, data, suffix) if suffix else (prefix, data)
            continue
        yield from _file_messages(model, p, chunk_bytes, checks)
        if on_tensor is not None and p.start < p.nbytes:
            on_tensor()
    yield (END_OF_STREAM,)


def _file_messages(
    model: Model, p: PlannedTensor, chunk_bytes: int, checks: FileChecks
) -> Iterator[FileMessage]:
    """The chunks of a tensor whose bytes lie in its file as they are. A chunk's framing is
    kept beside its digest (``ChunkDigests.keep_framing``), so a chunk sent before costs a
    look-up, not a header built and packed again."""
    mapped = model.mapped(p.entry.file)
    source = _source_bytes(model, p)
    chunks = mapped.chunks
    tensor = (p.entry.name, p.dtype, p.shape, p.logical_shape, p.encoding, p.nbytes)
    base = p.byte_offset
    assert base is not None
    for offset, n in _chunk_bounds(p, chunk_bytes):
        start = base + offset
        data = source[offset : offset + n]
        owner = (tensor, offset)
        framing = chunks.framing(start, n, owner)
        if framing is None:
            digest = _file_digest(mapped, start, data, checks, n == p.nbytes)
            framing = chunk_message(_chunk_header(p, offset, digest, n))
            chunks.keep_framing(start, n, owner, framing)
        else:
            checks.before_sending(mapped, start + n, n)
        yield FileMessage(framing, data, mapped, start)
