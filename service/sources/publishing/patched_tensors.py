"""A publisher's patch against its base, applied on the server: the delta stream form
(client/wire/delta.py) read from the upload's file on disk and turned into a safetensors file of
the tensors it changes, each result checked against the digest the publisher sent.

Memory stays bounded whatever the model's size: base and whole tensors are copied file to file
in the kernel, patches are written into the mapped output one tensor at a time.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from weightserve.client.errors import CheckpointError, InvalidRequest, RevisionMismatch
from weightserve.client.wire.delta import (
    PATCH,
    SAME,
    WHOLE,
    DeltaCut,
    DeltaHeader,
    apply_patch,
    decode_patch,
    read_header,
)
from weightserve.client.wire.file_patch import SourceEnded, copy_range
from weightserve.client.wire.safetensors_layout import LayoutEntry, safetensors_header
from weightserve.service.readers.base import TensorEntry
from weightserve.service.sources.model import Model

MISMATCHES_NAMED = 8  # tensors named in a refusal; the rest counted
ENDED_EARLY = "a tensor's bytes end before the file says they do"


@dataclass(frozen=True)
class PatchPart:
    """One tensor of the patch: its header and where its payload starts in the patch file."""

    header: DeltaHeader
    offset: int


def apply_patch_file(base: Model, patch: Path, output: Path) -> bool:
    """Write into ``output`` (a safetensors file) every tensor ``patch`` changes from
    ``base``'s, and check every tensor it names against its digest; False when it changes
    none (no file written). A result that does not match its digest (the publisher's arrays
    were not ``base``) is refused with RevisionMismatch naming the tensors."""
    with open(patch, "rb") as source:
        parts = _read_parts(source, os.fstat(source.fileno()).st_size, base)
        changed = [p for p in parts if p.header.kind != SAME]
        wrong = [
            p.header.name for p in parts if p.header.kind == SAME and not _base_matches(base, p)
        ]
        if changed:
            data_start = _write_unpatched(base, source, changed, output)
            wrong += _patch_in_place(source, changed, output, data_start)
    if wrong:
        named = ", ".join(wrong[:MISMATCHES_NAMED])
        more = f" and {len(wrong) - MISMATCHES_NAMED} more" if len(wrong) > MISMATCHES_NAMED else ""
        raise RevisionMismatch(
            f"the patch does not lead to the digests it names for {named}{more}: the arrays "
            f"it was computed against are not revision {base.commit[:16]} (publish against "
            "the base you hold, or send the tensors whole)"
        )
    return bool(changed)


def _read_parts(source: BinaryIO, size: int, base: Model) -> list[PatchPart]:
    """Every tensor's header (the delta stream's strict reader), checked against the base,
    and where its payload lies."""
    parts: list[PatchPart] = []
    names: set[str] = set()
    while True:
        try:
            header = read_header(source, names)
        except DeltaCut:
            raise InvalidRequest("the patch holds a header line that is cut off") from None
        if header is None:
            return parts
        _check_against_base(header, base)
        offset = source.tell()
        if offset + header.payload_bytes > size:
            raise InvalidRequest(f"the patch ends inside tensor {header.name!r}'s bytes")
        parts.append(PatchPart(header, offset))
        source.seek(header.payload_bytes, os.SEEK_CUR)


def _check_against_base(header: DeltaHeader, base: Model) -> None:
    """A patched or unchanged tensor must be the base's, with its dtype and shape."""
    if header.kind == WHOLE:
        return
    entry = base.contents.tensors.get(header.name)
    if entry is None:
        raise InvalidRequest(
            f"tensor {header.name!r} is patched but base {base.commit[:16]} has no such tensor"
        )
    if (entry.dtype, list(entry.shape), entry.nbytes) != (
        header.dtype,
        list(header.shape),
        header.nbytes,
    ):
        raise InvalidRequest(
            f"tensor {header.name!r} is patched as {header.dtype}{list(header.shape)} but base "
            f"{base.commit[:16]} holds {entry.dtype}{list(entry.shape)}: send it whole"
        )


def _base_matches(base: Model, part: PatchPart) -> bool:
    entry = base.contents.tensors[part.header.name]
    view = base.mapped(entry.file).view()[entry.offset : entry.offset + entry.nbytes]
    return xxhash.xxh3_128_hexdigest(view) == part.header.digest


def _write_unpatched(base: Model, source: BinaryIO, changed: list[PatchPart], output: Path) -> int:
    """``output`` with the changed tensors' layout, a patched tensor holding the base's bytes
    and a whole one the patch's; the offset where its data starts."""
    try:
        header = safetensors_header(
            LayoutEntry(p.header.name, p.header.dtype, tuple(p.header.shape), p.header.nbytes)
            for p in changed
        )
    except (ValueError, KeyError) as e:
        raise InvalidRequest(f"the patch cannot be written as safetensors: {e}") from None
    need = len(header) + sum(p.header.nbytes for p in changed)
    free = shutil.disk_usage(output.parent).free
    if need > free:
        raise InvalidRequest(f"the patched tensors need {need} bytes: {free} are free")
    with open(output, "wb") as out:
        out.write(header)
        out.flush()
        at = len(header)
        for part in changed:
            if part.header.kind == WHOLE:
                try:
                    copy_range(source.fileno(), out.fileno(), part.offset, at, part.header.nbytes)
                except SourceEnded:
                    raise CheckpointError("patch", ENDED_EARLY) from None
            else:
                entry: TensorEntry = base.contents.tensors[part.header.name]
                with open(entry.file, "rb") as held:
                    try:
                        copy_range(held.fileno(), out.fileno(), entry.offset, at, entry.nbytes)
                    except SourceEnded:
                        raise CheckpointError(entry.file.name, ENDED_EARLY) from None
            at += part.header.nbytes
    return len(header)


def _patch_in_place(
    source: BinaryIO, changed: list[PatchPart], output: Path, data_start: int
) -> list[str]:
    """Apply every patch into ``output``'s mapping and check every changed tensor's digest;
    the names of those that do not match."""
    wrong = []
    mapped = np.memmap(output, dtype=np.uint8, mode="r+")
    try:
        start = data_start
        for part in changed:
            header = part.header
            tensor = mapped[start : start + header.nbytes]
            start += header.nbytes
            if header.kind == PATCH:
                positions, values = _decode(source, part)
                apply_patch(tensor, header, positions, values)
            if xxhash.xxh3_128_hexdigest(tensor.data) != header.digest:
                wrong.append(header.name)
        mapped.flush()
    finally:
        del mapped
    return wrong


def _decode(source: BinaryIO, part: PatchPart) -> tuple[np.ndarray, np.ndarray]:
    """A patch's positions and values, checked to lie inside the tensor."""
    header = part.header
    source.seek(part.offset)
    return decode_patch(
        header, source.read(header.positions_bytes), source.read(header.values_bytes)
    )
