"""GGUF reader: index one ``.gguf`` file (llama.cpp's format, v2 and v3), or the parts of a split
GGUF as one model, without touching their data.

The header is parsed here with plain, bounded file reads rather than ``gguf.GGUFReader``: that
reader memory-maps the whole file, builds NumPy views of every tensor and accepts counts and
offsets that leave the file. We check every count, string, offset and size against the file
size before trusting it, so a corrupt or hostile file fails with one named ``CheckpointError``
instead of a crash, a huge allocation or a view past the end of the file.

What comes out (``ModelContents``):

- tensors in file order (MAX's ``GGUFWeights.items()`` order). Plain types (F32, F16, BF16,
  F64, I8..I64) keep their dtype; every other GGML type is served as raw blocks: dtype
  ``uint8``, ``encoding`` = the GGML type name, ``shape`` = the byte shape (last dim = blocks x
  block bytes) and ``logical_shape`` = the element shape. GGUF lists dims innermost first; all
  shapes here are in NumPy order (reversed).
- ``metadata``: every key-value as a JSON-friendly Python value (arrays whole, nested arrays as
  nested lists), plus ``gguf.version`` (int) and ``gguf.value_types`` (key -> GGUF value type
  name, ``ARRAY[<item type>]`` for arrays; for nested arrays the first inner array's type) so
  the metadata can be written back with the same types. These two keys win over file keys of
  the same name.
- ``alignment``: ``general.alignment`` (default 32).

Big-endian GGUF files are refused: their tensor bytes are big-endian and the wire carries
little-endian dtypes.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
    Keys,
)

from weightserve.service.readers import errors
from weightserve.service.readers.base import ModelContents, TensorEntry

# v2 and v3 share one layout (v3 only added big-endian files); v1 had 32-bit counts.
SUPPORTED_VERSIONS = (2, 3)
# Large tokenizers (250k tokens + merges) take tens of MB; 256 MiB leaves ample room while
# keeping a hostile header from making the server read gigabytes at start-up.
MAX_HEADER_BYTES = 256 << 20
# llama.cpp allows 4 dims; a little slack for other writers, but a bound all the same.
MAX_DIMS = 8
# Deep enough for any real metadata; stops a recursion bomb of nested arrays.
MAX_ARRAY_NESTING = 8
_INT64_LIMIT = 1 << 63  # ggml stores dims and sizes as int64

# Little-endian struct formats of the fixed-size value types.
_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<B",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# The smallest encoding of one item of each type, to bound counts before reading items.
_MIN_ITEM_BYTES = {
    **{t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()},
    GGUFValueType.STRING: 8,
    GGUFValueType.ARRAY: 12,
}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_FIXED_HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, kv count

# GGML types served with their own element dtype; every other type is served as raw blocks.
PLAIN_DTYPES: dict[GGMLQuantizationType, str] = {
    GGMLQuantizationType.F32: "float32",
    GGMLQuantizationType.F16: "float16",
    GGMLQuantizationType.BF16: "bfloat16",
    GGMLQuantizationType.F64: "float64",
    GGMLQuantizationType.I8: "int8",
    GGMLQuantizationType.I16: "int16",
    GGMLQuantizationType.I32: "int32",
    GGMLQuantizationType.I64: "int64",
}


class _HeaderCursor:
    """Sequential reads from the start of a file; every read is checked against the file size
    and the header cap before any byte is read, so no length field can trigger a big read."""

    def __init__(self, f: BinaryIO, path: Path, size: int, cap: int) -> None:
        self.f, self.path, self.size, self.cap = f, path, size, cap
        self.buf = bytearray()
        self.pos = 0

    def take(self, n: int, what: str) -> int:
        """Reserve the next ``n`` bytes; returns their position in ``buf``."""
        start, end = self.pos, self.pos + n
        if end > self.size:
            raise errors.TruncatedFile(
                self.path, f"{what} needs {n} bytes at offset {start}; the file has {self.size}"
            )
        if end > self.cap:
            raise errors.HeaderTooLarge(
                self.path, f"{what} ends at byte {end}; the header limit is {self.cap} bytes"
            )
        if end > len(self.buf):
            # Read ahead in 64 KiB steps: values come in their thousands, so one read per
            # value would be slow, while a small step reads little past the header's end.
            want = max(end - len(self.buf), 64 << 10)
            self.buf += self.f.read(min(want, self.size - len(self.buf)))
            if end > len(self.buf):  # the file shrank after we measured it
                raise errors.TruncatedFile(self.path, f"{what}: file ended at {len(self.buf)}")
        self.pos = end
        return start

    def scalar(self, vtype: int, what: str) -> Any:
        fmt = _SCALAR_FORMATS[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def raw_string(self, what: str) -> bytes:
        n = self.u64(f"length of {what}")
        start = self.take(n, what)
        return bytes(self.buf[start : start + n])

    def name(self, what: str) -> str:
        """A key or tensor name: must be valid UTF-8, since clients address tensors by it."""
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise errors.MalformedHeader(self.path, f"{what} is not valid UTF-8: {e}") from None

    def count(self, item_bytes: int, what: str) -> int:
        """A uint64 count of items of at least ``item_bytes`` each, bounded by the file."""
        n = self.u64(what)
        if n * item_bytes > self.size - self.pos:
            raise errors.CountOverflow(
                self.path,
                f"{what} is {n}: {n} items of >= {item_bytes} bytes cannot fit in the "
                f"{self.size - self.pos} bytes left in the file",
            )
        return n


class GGUFReader:
    """Reads one ``.gguf`` file into a ``ModelContents`` (header only, strictly validated)."""

    format: ClassVar[str] = "gguf"

    def __init__(self, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self.max_header_bytes = max_header_bytes

    def read(self, files: Sequence[Path]) -> ModelContents:
        """One ``.gguf`` file, or the parts of a split GGUF in order (part 1 first)."""
        if not files:
            raise ValueError("a GGUF model needs at least one .gguf file")
        parts = []
        for file in files:
            path = Path(file)
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size  # of the file we hold open, not a later one
                parts.append(self._read(_HeaderCursor(f, path, size, self.max_header_bytes)))
        return parts[0] if len(parts) == 1 else _join_split([Path(f) for f in files], parts)

    def _read(self, c: _HeaderCursor) -> ModelContents:
        path = c.path
        magic = c.u32("magic")
        if magic != GGUF_MAGIC:
            raise errors.BadMagic(
                path, f"first 4 bytes are {struct.pack('<I', magic)!r}, not b'GGUF'"
            )
        version = c.u32("version")
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if version not in SUPPORTED_VERSIONS:
            if swapped in (1, 2, 3):
                detail = f"big-endian GGUF v{swapped}; only little-endian files are served"
            elif version == 1:
                detail = "GGUF v1 (32-bit counts) is obsolete; re-convert with current llama.cpp"
            else:
                detail = f"version {version}; supported: {', '.join(map(str, SUPPORTED_VERSIONS))}"
            raise errors.UnsupportedVersion(path, detail)
        n_tensors, n_kv = c.u64("tensor count"), c.u64("metadata kv count")
        room = c.size - _FIXED_HEADER_BYTES
        if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > room:
            raise errors.CountOverflow(
                path, f"{n_tensors} tensors and {n_kv} key-values cannot fit in {c.size} bytes"
            )

        metadata: dict[str, Any] = {}
        value_types: dict[str, str] = {}
        for _ in range(n_kv):
            key = c.name("metadata key")
            if key in metadata:
                raise errors.MalformedHeader(path, f"metadata key {key!r} appears twice")
            vtype = c.u32(f"value type of {key!r}")
            metadata[key], value_types[key] = self._value(c, vtype, key, 0)

        alignment = metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
        if Keys.General.ALIGNMENT in metadata and value_types[Keys.General.ALIGNMENT] != "UINT32":
            raise errors.MalformedHeader(
                path,
                f"general.alignment has type {value_types[Keys.General.ALIGNMENT]}, not UINT32",
            )
        if alignment <= 0 or alignment & (alignment - 1):
            raise errors.MalformedHeader(
                path, f"general.alignment {alignment} is not a power of two"
            )

        infos = []
        for i in range(n_tensors):
            name = c.name(f"name of tensor #{i}")
            n_dims = c.u32(f"n_dims of {name!r}")
            if n_dims > MAX_DIMS:
                raise errors.MalformedHeader(path, f"{n_dims} dims > {MAX_DIMS}", tensor=name)
            dims = [c.u64(f"dims of {name!r}") for _ in range(n_dims)]
            infos.append((name, dims, c.u32(f"type of {name!r}"), c.u64(f"offset of {name!r}")))
        data_start = -(-c.pos // alignment) * alignment  # tensor data begins aligned

        tensors: dict[str, TensorEntry] = {}
        for name, dims, raw_type, rel_offset in infos:
            if name in tensors:
                raise errors.DuplicateTensor(path, "listed twice in the tensor infos", tensor=name)
            tensors[name] = self._entry(c, name, dims, raw_type, rel_offset, data_start, alignment)
        _check_no_overlap(path, tensors.values())

        metadata["gguf.version"] = version
        metadata["gguf.value_types"] = value_types
        return ModelContents(
            format=self.format, tensors=tensors, metadata=metadata, alignment=alignment
        )

    def _value(self, c: _HeaderCursor, vtype: int, key: str, depth: int) -> tuple[Any, str]:
        """One metadata value and its type name; arrays are read whole, in one go if numeric."""
        if vtype == GGUFValueType.STRING:
            # Values are informative (tensors do not depend on them): a stray invalid byte in,
            # say, one tokenizer entry must not make the whole model unservable.
            return c.raw_string(f"value of {key!r}").decode("utf-8", errors="replace"), "STRING"
        if vtype == GGUFValueType.BOOL:
            b = c.scalar(vtype, f"value of {key!r}")
            if b > 1:
                raise errors.MalformedHeader(c.path, f"bool value of {key!r} is {b}, not 0 or 1")
            return bool(b), "BOOL"
        if vtype in _SCALAR_FORMATS:
            return c.scalar(vtype, f"value of {key!r}"), GGUFValueType(vtype).name
        if vtype != GGUFValueType.ARRAY:
            raise errors.MalformedHeader(
                c.path, f"metadata {key!r} has value type {vtype}; known types are 0..12"
            )
        if depth >= MAX_ARRAY_NESTING:
            raise errors.MalformedHeader(c.path, f"{key!r} nests arrays deeper than {depth}")
        itype = c.u32(f"item type of array {key!r}")
        if itype not in _MIN_ITEM_BYTES:
            raise errors.MalformedHeader(
                c.path, f"array {key!r} has item type {itype}; known types are 0..12"
            )
        n = c.count(_MIN_ITEM_BYTES[itype], f"item count of array {key!r}")
        if itype in _SCALAR_FORMATS:
            width = _MIN_ITEM_BYTES[itype]
            start = c.take(n * width, f"items of array {key!r}")
            dtype = np.dtype(_SCALAR_FORMATS[itype])
            items = np.frombuffer(bytes(c.buf[start : start + n * width]), dtype=dtype)
            if itype == GGUFValueType.BOOL:
                if np.any(items > 1):
                    raise errors.MalformedHeader(c.path, f"bool array {key!r} holds values > 1")
                items = items.astype(bool)
            return items.tolist(), f"ARRAY[{GGUFValueType(itype).name}]"
        values, inner = [], GGUFValueType(itype).name
        for i in range(n):
            v, t = self._value(c, itype, key, depth + 1)
            values.append(v)
            if i == 0:
                inner = t
        return values, f"ARRAY[{inner}]"

    def _entry(
        self,
        c: _HeaderCursor,
        name: str,
        dims: list[int],
        raw_type: int,
        rel_offset: int,
        data_start: int,
        alignment: int,
    ) -> TensorEntry:
        path = c.path
        try:
            gtype = GGMLQuantizationType(raw_type)
            block_elems, block_bytes = GGML_QUANT_SIZES[gtype]
        except (ValueError, KeyError):
            raise errors.UnknownDType(
                path, f"GGML type {raw_type} is unknown", tensor=name
            ) from None
        numel = math.prod(dims)
        if any(d >= _INT64_LIMIT for d in dims) or numel >= _INT64_LIMIT:
            raise errors.CountOverflow(path, f"dims {dims} overflow int64", tensor=name)
        ne0 = dims[0] if dims else 1  # the innermost (contiguous) dimension holds the blocks
        if ne0 % block_elems:
            raise errors.SizeMismatch(
                path,
                f"{gtype.name} packs {block_elems} elements per block; ne0 = {ne0} is not a multiple",
                tensor=name,
            )
        if rel_offset % alignment:
            raise errors.MisalignedTensor(
                path,
                f"offset {rel_offset} is not a multiple of the alignment {alignment}",
                tensor=name,
            )
        nbytes = numel // block_elems * block_bytes
        offset = data_start + rel_offset
        if offset + nbytes > c.size:
            raise errors.OffsetOutOfFile(
                path,
                f"bytes [{offset}, {offset + nbytes}) end past the file size {c.size}",
                tensor=name,
            )
        logical = tuple(reversed(dims))
        if gtype in PLAIN_DTYPES:
            dtype, shape, encoding = PLAIN_DTYPES[gtype], logical, None
        else:
            shape = (*logical[:-1], logical[-1] // block_elems * block_bytes)
            dtype, encoding = "uint8", gtype.name
        return TensorEntry(
            name=name,
            dtype=dtype,
            shape=shape,
            file=path,
            offset=offset,
            nbytes=nbytes,
            logical_shape=logical,
            encoding=encoding,
        )


def _join_split(paths: list[Path], parts: list[ModelContents]) -> ModelContents:
    """The parts of a split GGUF (llama.cpp's ``split.no``/``split.count``/``split.tensors.count``
    keys, written by ``gguf.GGUFWriter`` and ``gguf-split``) as one model: tensors in part
    order, the metadata of part 1 (the other parts carry only the split keys). Parts without
    split keys (written one by one) are taken in the order given."""
    count = len(parts)
    tensors: dict[str, TensorEntry] = {}
    for number, (path, part) in enumerate(zip(paths, parts, strict=True)):
        said_count = part.metadata.get(Keys.Split.LLM_KV_SPLIT_COUNT)
        if said_count is not None and said_count != count:
            raise errors.SplitMismatch(
                path, f"split.count is {said_count}, but the model has {count} parts"
            )
        said_number = part.metadata.get(Keys.Split.LLM_KV_SPLIT_NO)
        if said_number is not None and said_number != number:
            raise errors.SplitMismatch(
                path,
                f"split.no is {said_number}, but its file name makes it part {number + 1} of "
                f"{count} (split.no {number})",
            )
        for name, entry in part.tensors.items():
            if name in tensors:
                raise errors.DuplicateTensor(
                    path, f"also in part {tensors[name].file.name}", tensor=name
                )
            tensors[name] = entry
    first = parts[0].metadata
    said_total = first.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    if said_total is not None and said_total != len(tensors):
        raise errors.SplitMismatch(
            paths[0], f"split.tensors.count is {said_total}, but the parts hold {len(tensors)}"
        )
    return ModelContents(
        format=parts[0].format,
        tensors=tensors,
        metadata=first,
        # Each part aligns its own data; the smallest alignment holds for every tensor.
        alignment=min(p.alignment for p in parts),
    )


def _check_no_overlap(path: Path, entries: Any) -> None:
    """Tensors may leave padding between them but must not share bytes."""
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries if e.nbytes)
    for (_, prev_end, prev), (start, _, name) in itertools.pairwise(spans):
        if start < prev_end:
            raise errors.OverlappingTensors(
                path, f"starts at {start}, inside {prev!r} (which ends at {prev_end})", tensor=name
            )
