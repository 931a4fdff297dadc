"""The delta stream's wire form (``GET /v1/models/ID/-/delta?since=A&revision=B``), both sides.

Per tensor of revision B, in the model's order: one JSON line (``DeltaHeader``), then its
payload: nothing (``same``), the whole tensor's bytes (``whole``: ``nbytes``), or a patch
(``patch``: ``positions_bytes`` of zstd-compressed gaps between changed elements, unsigned
integers of ``gap_bytes``, then ``values_bytes`` of the changed elements' new bytes,
zstd-compressed when ``values_codec`` says so). ``digest`` is the xxh3-128 of B's tensor.

Every side reads it with the one strict reader below (``read_updates``, or ``read_header`` and
``decode_patch`` where the payloads are read apart): a header is checked whole, and a patch's
declared sizes against its tensor's before anything is decompressed or allocated, so a short
malformed stream can never make its reader allocate more than the tensor it names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from weightserve.client.errors import InvalidRequest
from weightserve.client.wire.dtypes import DTYPES

SAME = "same"
PATCH = "patch"
WHOLE = "whole"
DELTA_MEDIA_TYPE = "application/x-weightserve-delta"
KINDS = (SAME, PATCH, WHOLE)
MAX_HEADER_LINE = 1 << 20  # one tensor's JSON line; longer is not a delta stream
CODECS = ("", "zstd")
ELEMENT_SIZES = (1, 2, 4, 8)


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
    """The changed elements' indices (int64) from a patch's positions (a header that
    ``check_header`` passed: the size decompressed is bounded by the tensor's)."""
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


class DeltaCut(EOFError):
    """The delta stream ended inside a tensor's header line or payload: cut off, not
    malformed (a reader over a network retries or fetches the rest whole)."""


class DeltaSource(Protocol):
    """What the delta stream is read from: an HTTP response, a file, bytes in memory."""

    def readline(self, limit: int = -1, /) -> bytes: ...
    def read(self, n: int = -1, /) -> bytes: ...


def parse_header(line: bytes) -> DeltaHeader:
    """One tensor's header line, checked whole (``check_header``); InvalidRequest naming
    what is wrong."""
    try:
        body: Any = json.loads(line)
        header = DeltaHeader.from_json(body) if isinstance(body, dict) else None
    except (ValueError, TypeError) as e:
        raise InvalidRequest(
            f"the delta stream holds a header that is not a tensor's: {e}"
        ) from None
    except RecursionError:  # JSON nested deeper than the parser's stack: never a header
        raise InvalidRequest(
            "the delta stream holds a header that is not a tensor's: JSON nested too deeply"
        ) from None
    if header is None or not isinstance(header.name, str) or not header.name:
        raise InvalidRequest("the delta stream holds a header that is not a tensor's")
    check_header(header)
    return header


def check_header(header: DeltaHeader) -> None:
    """Refuse a header whose fields do not describe a payload of its tensor: unknown kind,
    sizes that are not counts, a patch's element encoding, or a patch declaring more changed
    elements, or more bytes, than its tensor holds (checked before anything is decompressed:
    what decoding allocates is then bounded by the tensor's size)."""
    name = header.name
    numbers = (header.nbytes, header.count, header.positions_bytes, header.values_bytes,
               header.values_raw_bytes, header.element_bytes, header.gap_bytes)  # fmt: skip
    if (
        header.kind not in KINDS
        or not isinstance(header.dtype, str)
        or not isinstance(header.shape, list)
        or not isinstance(header.digest, str)
        or not isinstance(header.values_codec, str)
        or any(type(n) is not int or n < 0 for n in (*numbers, *header.shape))
    ):
        raise InvalidRequest(f"tensor {name!r}: the delta stream's header is malformed")
    known = DTYPES.get(header.dtype)
    if known is not None and known.nbytes(math.prod(header.shape)) != header.nbytes:
        raise InvalidRequest(
            f"tensor {name!r}: {header.nbytes} bytes declared for {header.dtype}"
            f"{header.shape}, which holds {known.nbytes(math.prod(header.shape))}"
        )
    if header.kind != PATCH:
        return
    if (
        header.element_bytes not in ELEMENT_SIZES
        or header.gap_bytes not in ELEMENT_SIZES
        or header.values_codec not in CODECS
        or header.values_raw_bytes != header.count * header.element_bytes
        or (not header.values_codec and header.values_bytes != header.values_raw_bytes)
    ):
        raise InvalidRequest(f"tensor {name!r}: the patch's element encoding is malformed")
    if header.count > header.nbytes // header.element_bytes:
        raise InvalidRequest(
            f"tensor {name!r}: the patch changes {header.count} elements of a tensor of "
            f"{header.nbytes // header.element_bytes}"
        )
    values_bound = (
        compressed_bound(header.values_raw_bytes) if header.values_codec else header.values_bytes
    )
    if (
        header.positions_bytes > compressed_bound(header.count * header.gap_bytes)
        or header.values_bytes > values_bound
    ):
        raise InvalidRequest(
            f"tensor {name!r}: the patch declares more bytes than {header.count} changes take"
        )


def compressed_bound(raw_bytes: int) -> int:
    """The most bytes zstd makes of ``raw_bytes`` (its ZSTD_COMPRESSBOUND, with room to
    spare): a declared payload above it is no compression of what it claims to hold."""
    return raw_bytes + (raw_bytes >> 8) + 1024


def decode_patch(
    header: DeltaHeader, positions_raw: bytes | memoryview, values_raw: bytes | memoryview
) -> tuple[np.ndarray, np.ndarray]:
    """A patch's positions and values (its header checked), refused unless they decode to
    its declared count and every position lies inside the tensor."""
    check_header(header)
    try:
        positions = patch_positions(header, positions_raw)
        values = patch_values(header, values_raw)
    except (pa.ArrowException, OSError, ValueError) as e:  # pyarrow reports bad zstd as OSError
        raise InvalidRequest(f"tensor {header.name!r}: the patch cannot be decoded: {e}") from None
    elements = header.nbytes // header.element_bytes
    if (
        positions.size != header.count
        or values.size != header.count
        or (positions.size and (int(positions.min()) < 0 or int(positions.max()) >= elements))
    ):
        raise InvalidRequest(f"tensor {header.name!r}: the patch's positions lie outside it")
    return positions, values


def read_header(source: DeltaSource, names: set[str]) -> DeltaHeader | None:
    """The next tensor's header (None at the stream's end), a name already in ``names``
    refused (and the name added to them)."""
    line = source.readline(MAX_HEADER_LINE)
    if not line:
        return None
    if not line.endswith(b"\n"):
        if len(line) >= MAX_HEADER_LINE:
            raise InvalidRequest("the delta stream holds a header line that is too long")
        raise DeltaCut("the delta stream ends inside a header line")
    header = parse_header(line)
    if header.name in names:
        raise InvalidRequest(f"the delta stream names tensor {header.name!r} twice")
    names.add(header.name)
    return header


def read_updates(source: DeltaSource) -> Iterator[TensorUpdate]:
    """The delta stream's tensors, read and decoded one by one, every rule checked."""
    names: set[str] = set()
    while (header := read_header(source, names)) is not None:
        payload = _read_exactly(source, header)
        if header.kind == PATCH:
            raw = memoryview(payload)  # sliced without copies
            positions, values = decode_patch(
                header, raw[: header.positions_bytes], raw[header.positions_bytes :]
            )
            yield TensorUpdate(header.name, PATCH, header, positions=positions, values=values)
        elif header.kind == WHOLE:
            yield TensorUpdate(header.name, WHOLE, header, data=payload)
        else:
            yield TensorUpdate(header.name, SAME, header)


def _read_exactly(source: DeltaSource, header: DeltaHeader) -> bytes:
    n = header.payload_bytes
    data = source.read(n) if n else b""
    if len(data) != n:
        raise DeltaCut(f"the delta stream ends inside tensor {header.name!r}'s bytes")
    return data


def apply_patch(
    target: np.ndarray, header: DeltaHeader, positions: np.ndarray, values: np.ndarray
) -> None:
    """Write a patch into ``target``, the tensor's bytes (a writable uint8 array), in place."""
    usable = target.size - target.size % header.element_bytes
    elements = target[:usable].view(_UNSIGNED[header.element_bytes])
    elements[positions] = values
