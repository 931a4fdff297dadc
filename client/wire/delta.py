"""The delta stream's wire form (``GET /v1/models/ID/-/delta?since=A&revision=B``), both sides.

Per tensor of revision B, in the model's order: one JSON line (``DeltaHeader``), then its
payload: nothing (``same``), the whole tensor's bytes (``whole``: ``nbytes``), or a patch
(``patch``: ``positions_bytes`` of zstd-compressed gaps between changed elements, unsigned
integers of ``gap_bytes``, then ``values_bytes`` of the changed elements' new bytes,
zstd-compressed when ``values_codec`` says so). ``digest`` is the xxh3-128 of B's tensor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

SAME = "same"
PATCH = "patch"
WHOLE = "whole"
DELTA_MEDIA_TYPE = "application/x-weightserve-delta"


@dataclass(frozen=True)
class DeltaHeader:
    kind: str  # SAME, PATCH or WHOLE
    name: str
    dtype: str
    shape: list[int] = field(default_factory=list)
    nbytes: int = 0
    digest: str = ""
    count: int = 0  # changed elements (patch)
    element_bytes: int = 1
    gap_bytes: int = 4
    positions_bytes: int = 0
    values_bytes: int = 0
    values_raw_bytes: int = 0
    values_codec: str = ""

    @property
    def payload_bytes(self) -> int:
        if self.kind == WHOLE:
            return self.nbytes
        if self.kind == PATCH:
            return self.positions_bytes + self.values_bytes
        return 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> DeltaHeader:
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in body.items() if k in known})


@dataclass(frozen=True)
class TensorUpdate:
    """One tensor's part of an update: ``kind`` ``same`` (nothing to do), ``patch``
    (``positions``: the changed elements' indices, ``values``: their new bits as unsigned
    integers of the element's size) or ``whole`` (``data``: every byte)."""

    name: str
    kind: str
    header: DeltaHeader
    positions: np.ndarray | None = None
    values: np.ndarray | None = None
    data: bytes | None = None

    @property
    def wire_bytes(self) -> int:
        """What this tensor's update cost on the wire, its header line aside."""
        return self.header.payload_bytes


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def patch_positions(header: DeltaHeader, raw: bytes | memoryview) -> np.ndarray:
    """The changed elements' indices (int64) from a patch's positions."""
    gap_type = np.dtype(_UNSIGNED[header.gap_bytes])
    gaps = np.frombuffer(
        pa.decompress(raw, header.count * gap_type.itemsize, codec="zstd", asbytes=True),
        dtype=gap_type,
    )
    positions = gaps.astype(np.int64)
    return np.cumsum(positions, out=positions)  # widened first: summing in place is faster


def patch_values(header: DeltaHeader, raw: bytes | memoryview) -> np.ndarray:
    """The changed elements' new values, as unsigned integers of the element's size."""
    data = (
        pa.decompress(raw, header.values_raw_bytes, codec=header.values_codec, asbytes=True)
        if header.values_codec
        else raw
    )
    return np.frombuffer(data, dtype=_UNSIGNED[header.element_bytes])


def apply_patch(
    target: np.ndarray, header: DeltaHeader, positions: np.ndarray, values: np.ndarray
) -> None:
    """Write a patch into ``target``, the tensor's bytes (a writable uint8 array), in place."""
    usable = target.size - target.size % header.element_bytes
    elements = target[:usable].view(_UNSIGNED[header.element_bytes])
    elements[positions] = values
