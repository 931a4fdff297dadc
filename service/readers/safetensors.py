"""Reads safetensors checkpoints (one file or a set of shards) into a validated tensor index.

Only each file's 8-byte header length and JSON header are read, with plain reads; every rule
of the format is checked before any offset is trusted, and tensor data is never touched.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from weightserve.client.wire.dtypes import BY_SAFETENSORS_CODE, WireDType
from weightserve.service.readers.base import ModelContents, TensorEntry
from weightserve.service.readers.errors import (
    CountOverflow,
    DuplicateTensor,
    GapBetweenTensors,
    HeaderTooLarge,
    IndexMismatch,
    MalformedHeader,
    OffsetOutOfFile,
    OverlappingTensors,
    SizeMismatch,
    TruncatedFile,
    UnknownDType,
)

# The Rust safetensors library refuses headers above this size; so do we, before reading one.
MAX_HEADER_BYTES = 100_000_000
SHARD_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
# The index of a variant (model.safetensors.index.fp16.json) names that variant's shards.
VARIANT_INDEX = re.compile(r"\.safetensors\.index(?:\.[A-Za-z0-9_]+)?\.json$")
METADATA_KEY = "__metadata__"
# The reference reader computes numel x bits in 64-bit integers; a shape beyond that cannot
# come from a real writer, and capping it keeps the product of a crafted shape cheap.
_MAX_BITS = 2**64 - 1


class _JsonObject(dict):  # type: ignore[type-arg]
    """A JSON object that remembers the keys it held twice (``json`` keeps only the last)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.duplicates: list[str] = []
        if len(self) < len(pairs):  # rare, so only then find which keys repeat
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    self.duplicates.append(key)
                seen.add(key)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1


class SafetensorsReader:
    """Index the tensors of one safetensors model.

    ``files`` may hold every file of the model's directory: names ending in ``.safetensors``
    are the shards, a name ending in ``.safetensors.index.json`` is the shard index, anything
    else (config.json, tokenizer files) is ignored. The index is taken only from ``files``,
    never looked up on disk, so what is validated is exactly what the caller listed; its
    ``weight_map`` values are file names of shards in the index's own directory.

    ``metadata`` is the union of every shard's ``__metadata__`` (str -> str); where shards
    disagree on a key, the first shard in name order wins. Tensors are ordered by name, as
    MAX's ``SafetensorWeights.items()`` lists them. ``OSError`` from the file system passes
    through; every broken rule of the format raises its ``CheckpointError`` subclass.
    """

    format: ClassVar[str] = "safetensors"

    def __init__(self, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self.max_header_bytes = max_header_bytes

    def read(self, files: Sequence[Path]) -> ModelContents:
        paths = [Path(f) for f in files]
        shards = sorted((p for p in paths if p.name.endswith(SHARD_SUFFIX)), key=str)
        indexes = sorted((p for p in paths if VARIANT_INDEX.search(p.name)), key=str)
        if not shards:
            raise ValueError(f"no {SHARD_SUFFIX} file among {[str(p) for p in paths]}")
        tensors: dict[str, TensorEntry] = {}
        metadata: dict[str, str] = {}
        for shard in shards:
            entries, shard_metadata = self._read_shard(shard)
            for entry in entries:
                if entry.name in tensors:
                    first = tensors[entry.name].file
                    raise DuplicateTensor(shard, f"also stored in {first}", tensor=entry.name)
                tensors[entry.name] = entry
            for key, value in shard_metadata.items():
                metadata.setdefault(key, value)
        if len(indexes) > 1:
            raise IndexMismatch(indexes[1], f"a second shard index besides {indexes[0]}")
        if indexes:
            self._check_index(indexes[0], tensors)
        return ModelContents(
            format=self.format,
            tensors={name: tensors[name] for name in sorted(tensors)},
            metadata=metadata,
        )

    def _read_shard(self, path: Path) -> tuple[list[TensorEntry], dict[str, str]]:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise TruncatedFile(path, f"{file_size} bytes, fewer than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > self.max_header_bytes:
                raise HeaderTooLarge(
                    path, f"header length {header_len} exceeds {self.max_header_bytes} bytes"
                )
            raw = f.read(header_len)
        if len(raw) < header_len:
            raise TruncatedFile(
                path, f"header length {header_len} but only {file_size - 8} bytes follow it"
            )
        header = self._parse_json(path, raw)
        data_start = 8 + header_len
        data_size = file_size - data_start

        metadata = header.pop(METADATA_KEY, None)
        metadata = {} if metadata is None else metadata  # null is allowed, as in Rust
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise MalformedHeader(path, f"{METADATA_KEY} must map strings to strings")

        spans: list[tuple[int, int, str]] = []
        entries: list[TensorEntry] = []
        for name, info in header.items():
            spec, shape, begin, end = _parse_entry(path, name, info, data_size)
            spans.append((begin, end, name))
            entries.append(
                TensorEntry(
                    name=name,
                    dtype=spec.name,
                    shape=shape,
                    file=path,
                    offset=data_start + begin,
                    nbytes=end - begin,
                    logical_shape=shape,
                )
            )
        _check_layout(path, spans, data_size)
        return entries, metadata

    def _parse_json(self, path: Path, raw: bytes) -> dict[str, Any]:
        # The spec says the header MUST begin with '{' (the Rust reader also lets leading
        # whitespace pass); trailing spaces are the writer's alignment padding and are allowed.
        if not raw.startswith(b"{"):
            raise MalformedHeader(path, f"header starts with {raw[:1]!r}, not '{{'")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_JsonObject)
        except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, absurd numbers
            raise MalformedHeader(path, f"header is not valid UTF-8 JSON: {exc}") from None
        if not isinstance(header, _JsonObject):  # every JSON object is one, see the hook
            raise MalformedHeader(path, "header is not a JSON object")
        if header.duplicates:
            # The Rust reader silently keeps the last of two equal tensor names; the file is
            # ambiguous, so we refuse it.
            raise DuplicateTensor(
                path, "the name appears twice in the header", tensor=header.duplicates[0]
            )
        return header

    def _check_index(self, index: Path, tensors: dict[str, TensorEntry]) -> None:
        if index.stat().st_size > self.max_header_bytes:
            raise HeaderTooLarge(index, f"index larger than {self.max_header_bytes} bytes")
        try:
            document = json.loads(index.read_bytes().decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise MalformedHeader(index, f"index is not valid UTF-8 JSON: {exc}") from None
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise MalformedHeader(index, "index needs a 'weight_map' of tensor name -> file name")
        for name, said in weight_map.items():
            entry = tensors.get(name)
            if entry is None:
                raise IndexMismatch(
                    index, f"index says {said!r}, but no shard holds it", tensor=name
                )
            if said != entry.file.name:
                raise IndexMismatch(
                    index, f"index says {said!r}, but it is in {entry.file.name!r}", tensor=name
                )
        for name, entry in tensors.items():
            if name not in weight_map:
                raise IndexMismatch(
                    index, f"index does not list it, but {entry.file.name!r} holds it", tensor=name
                )


def _parse_entry(
    path: Path, name: str, info: object, data_size: int
) -> tuple[WireDType, tuple[int, ...], int, int]:
    """Check one header entry's types, dtype, offsets and size; return what they mean."""
    # Unknown keys are ignored, as the Rust reader does, so newer writers stay readable.
    if not isinstance(info, dict):
        raise MalformedHeader(path, "entry is not a JSON object", tensor=name)
    if isinstance(info, _JsonObject) and info.duplicates:
        raise MalformedHeader(path, f"field {info.duplicates[0]!r} appears twice", tensor=name)
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str):
        raise MalformedHeader(path, f"'dtype' must be a string, got {code!r}", tensor=name)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise MalformedHeader(
            path, f"'shape' must be a list of non-negative integers, got {shape!r}", tensor=name
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise MalformedHeader(
            path,
            f"'data_offsets' must be [begin, end] with 0 <= begin <= end, got {offsets!r}",
            tensor=name,
        )
    spec = BY_SAFETENSORS_CODE.get(code)
    if spec is None:
        known = ", ".join(BY_SAFETENSORS_CODE)
        raise UnknownDType(path, f"dtype code {code!r}; known codes: {known}", tensor=name)
    begin, end = offsets
    if end > data_size:
        raise OffsetOutOfFile(
            path, f"data_offsets [{begin}, {end}] end past the {data_size} data bytes", tensor=name
        )
    numel = _numel(shape, spec.bits)
    if numel is None:
        raise CountOverflow(path, f"shape {shape} of {code} is more than 2**64 bits", tensor=name)
    if numel * spec.bits % 8:
        # Packed sub-byte tensors must end on a byte boundary, as the Rust reader requires.
        raise SizeMismatch(
            path,
            f"shape {shape} of {code} is {numel * spec.bits} bits, not whole bytes",
            tensor=name,
        )
    if end - begin != spec.nbytes(numel):
        raise SizeMismatch(
            path,
            f"data_offsets [{begin}, {end}] hold {end - begin} bytes, shape {shape} of "
            f"{code} needs {spec.nbytes(numel)}",
            tensor=name,
        )
    return spec, tuple(shape), begin, end


def _numel(shape: list[int], bits: int) -> int | None:
    """The element count, or None once numel x bits passes 64 bits.

    Checked as the product grows (left to right, as the Rust reader's checked multiply does),
    so a crafted shape never builds a huge integer.
    """
    numel = 1
    for dim in shape:
        numel *= dim
        if dim > _MAX_BITS or numel * bits > _MAX_BITS:
            return None
    return numel


def _check_layout(path: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """Tensors must tile the data region exactly: no overlap, no hole, nothing after them."""
    cursor, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin < cursor:
            raise OverlappingTensors(
                path,
                f"[{begin}, {end}] starts inside {previous!r}, which ends at {cursor}",
                tensor=name,
            )
        if begin > cursor:
            raise GapBetweenTensors(
                path,
                f"{begin - cursor} unused bytes before it, from {cursor} to {begin}",
                tensor=name,
            )
        cursor, previous = end, name
    # The Rust reader refuses bytes after the last tensor ("file not fully covered"); we match
    # it, so every file we serve is one the reference library also loads.
    if cursor != data_size:
        raise GapBetweenTensors(
            path,
            f"{data_size - cursor} unused bytes after the last tensor (from data offset "
            f"{cursor} to the end of the file)",
        )
