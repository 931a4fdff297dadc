"""What a client asks for: one ``TensorRequest``, decoded here from every wire form.

Each transport calls one decoder: ``from_http`` (a stream route's query string or JSON body),
``from_proto`` (gRPC's message; Flight's ticket through ``from_ticket``) and ``from_handoff``
(a handoff frame). The rules hold alike on all of them: a request names tensors or gives a
prefix, never both (docs/protocol.md, "Requests").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from weightserve.client.errors import InvalidRequest
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client.wire.schema import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES

# Requests are a few names or a prefix; a Flight ticket this large is not a tensor request.
MAX_TICKET_BYTES = 16 << 20


@dataclass(frozen=True)
class Shard:
    """Part ``index`` of ``count`` along ``axis`` (numpy.array_split semantics)."""

    index: int
    count: int
    axis: int = 0

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise InvalidRequest(f"shard {self.index}/{self.count}: need 0 <= index < count")
        if self.axis < 0:
            raise InvalidRequest(f"shard axis must be >= 0, got {self.axis}")

    def bounds(self, length: int) -> tuple[int, int]:
        base, extra = divmod(length, self.count)
        start = self.index * base + min(self.index, extra)
        return start, start + base + (1 if self.index < extra else 0)


@dataclass(frozen=True)
class TensorRequest:
    """What a client asked for: tensor names or a prefix (exactly one of them), a shard, a
    resume point, a chunk size and the revision it pins."""

    names: tuple[str, ...] | None = None
    prefix: str | None = None
    shard: Shard | None = None
    resume_tensor: str | None = None
    resume_offset: int = 0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    revision: str | None = None

    def __post_init__(self) -> None:
        if self.names is not None and self.prefix is not None:
            # Refused, not one of them dropped: whichever was meant, the other was sent too.
            raise InvalidRequest(
                f"the request names {len(self.names)} tensors and also gives the prefix "
                f"{self.prefix!r}; send one or the other: tensor names, or a prefix"
            )
        if self.names is None and self.prefix is None:
            raise InvalidRequest("ask for either a list of tensor names or a prefix")
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidRequest(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}")
        if self.resume_offset < 0:
            raise InvalidRequest("resume_offset must be >= 0")


def parse_shard(shard: str | None, axis: int = 0) -> Shard | None:
    """HTTP's ``shard=k/n`` (with ``axis``); None when not given."""
    if not shard:
        return None
    try:
        index, count = (int(x) for x in shard.split("/"))
    except ValueError:
        raise InvalidRequest(f"shard must look like 'k/n' (e.g. 0/4), got {shard!r}") from None
    return Shard(index, count, axis)


def from_http(
    names: Sequence[str] | None = None,
    prefix: str | None = None,
    shard: str | None = None,
    axis: int = 0,
    resume_tensor: str | None = None,
    resume_offset: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    revision: str | None = None,
) -> TensorRequest:
    """A stream route's request: its query string (``name`` repeated, as ``names``) or its
    JSON body, which have the same fields."""
    return TensorRequest(
        names=tuple(names) if names is not None else None,
        prefix=prefix,
        shard=parse_shard(shard, axis),
        resume_tensor=resume_tensor,
        resume_offset=resume_offset,
        chunk_bytes=chunk_bytes,
        revision=revision or None,
    )


def from_proto(
    msg: pb.TensorRequest, default_chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> TensorRequest:
    """The request a ``weightserve.v1.TensorRequest`` message asks for (StreamTensors,
    GetTensor, a Flight ticket); ``default_chunk_bytes`` when it names no chunk size.

    ``use_prefix`` makes ``prefix`` count (an empty prefix is every tensor). A prefix sent
    without it is refused rather than dropped, so a forgotten flag is an error, not an empty
    stream; names with a prefix are refused as on every transport.
    """
    if not msg.use_prefix and msg.prefix and not msg.names:
        raise InvalidRequest(
            f"the request has prefix {msg.prefix!r} but use_prefix is false, which selects "
            "by names only; set use_prefix to true to stream the tensors under the prefix"
        )
    shard = None
    if msg.shard_count > 1:
        shard = Shard(msg.shard_index, msg.shard_count, msg.shard_axis)
    return TensorRequest(
        names=tuple(msg.names) if msg.names or not msg.use_prefix else None,
        prefix=msg.prefix if msg.use_prefix or msg.prefix else None,
        shard=shard,
        resume_tensor=msg.resume_tensor or None,
        resume_offset=msg.resume_offset,
        chunk_bytes=msg.chunk_bytes or default_chunk_bytes,
        revision=msg.revision or None,
    )


def from_ticket(ticket: bytes) -> pb.TensorRequest:
    """The ``weightserve.v1.TensorRequest`` a Flight ticket holds (``from_proto`` reads it)."""
    if len(ticket) > MAX_TICKET_BYTES:
        raise InvalidRequest(f"ticket of {len(ticket)} bytes is too large")
    try:
        return pb.TensorRequest.FromString(ticket)
    except DecodeError:
        raise InvalidRequest("the ticket is not a weightserve.v1.TensorRequest") from None


def from_handoff(message: Mapping[str, Any]) -> TensorRequest:
    """The request of a handoff ``open`` frame: ``names`` or ``prefix``, ``shard`` as
    ``[index, count]`` with ``axis``, ``revision``."""
    names = message.get("names")
    prefix = message.get("prefix")
    shard = message.get("shard")
    if names is not None and (
        not isinstance(names, list) or not all(isinstance(n, str) for n in names)
    ):
        raise InvalidRequest("names must be a list of strings")
    if prefix is not None and not isinstance(prefix, str):
        raise InvalidRequest("prefix must be a string")
    if shard is not None:
        if not (isinstance(shard, list) and len(shard) == 2 and all(type(x) is int for x in shard)):
            raise InvalidRequest("shard must be [index, count]")
        axis = message.get("axis", 0)
        if type(axis) is not int:
            raise InvalidRequest("axis must be an integer")
        shard = Shard(shard[0], shard[1], axis)
    revision = message.get("revision")
    return TensorRequest(
        names=tuple(names) if names is not None else None,
        prefix=prefix,
        shard=shard,
        revision=revision if isinstance(revision, str) and revision else None,
    )
