"""The one seam between the client and a server: the ``Transport`` protocol.

Every transport (``http.py``, ``grpc.py``; Arrow Flight and the same-node handoff carry bulk
bytes beside them) answers the same few questions — which models, what is in one, which files,
"open a tensor stream" — the last as a ``readinto``-able source of Arrow IPC stream bytes or a
chunk reader, so the receiver can read tensor data straight into its final buffers. Foreign
errors (socket, http.client, grpc) are translated inside each transport into weightserve
errors. This module holds the protocol and what the transports share.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from weightserve.client.wire.errors import WireError
from weightserve.client.wire.routes import ServerAddress
from weightserve.client.wire.schema import ChunkHeader

DEFAULT_READ_TIMEOUT = 60.0  # longest silence tolerated inside a stream


@dataclass(frozen=True)
class StreamParams:
    """A tensor request as the client sends it (mirrors the server's TensorRequest)."""

    names: tuple[str, ...] | None = None
    prefix: str | None = None
    shard: tuple[int, int] | None = None  # (index, count)
    axis: int = 0
    resume_tensor: str | None = None
    resume_offset: int = 0
    chunk_bytes: int | None = None
    revision: str | None = None


class ByteSource(Protocol):
    def readinto(self, view: memoryview) -> int: ...
    def close(self) -> None: ...


class FileSource(ByteSource, Protocol):
    """One file's bytes (``Transport.open_file``): ``readinto`` returns 0 at the end of the
    range asked for. What the server said about the file comes with it."""

    size: int  # of the whole file
    etag: str  # the file's content digest (xxh3-128, hex), as ``list_files`` lists it
    revision: str  # the model's revision the bytes belong to
    offset: int  # first byte of the range
    length: int  # bytes this source delivers


class ChunkReader(Protocol):
    """One tensor stream, chunk by chunk (``ArrowChunkReader``, ``FlightChunkReader``)."""

    def read_schema(self) -> Any: ...
    def next_chunk(
        self, destination: Callable[[ChunkHeader], memoryview]
    ) -> ChunkHeader | None: ...
    def close(self) -> None: ...


class Transport(Protocol):
    """What the client asks of a server. Metadata answers are the JSON objects of the HTTP
    API (docs/protocol.md), whichever wire carried them."""

    address: ServerAddress

    def list_models(self) -> dict[str, Any]:
        """``{models: [{id, format, revision, tensor_count, total_bytes, state}],
        problems: [{model, file, reason}]}``."""
        ...

    def model_info(self, model: str) -> dict[str, Any]:
        """``{id, format, revision, alignment, metadata, tensors: [{name, dtype, shape,
        logical_shape, encoding, nbytes}]}``."""
        ...

    def server_info(self) -> dict[str, Any]:
        """The server's data planes (``{version, instance, http_port, flight_port, uds}``);
        {} from a server that predates them."""
        ...

    def open_stream(self, model: str, params: StreamParams) -> ByteSource: ...
    def open_chunks(self, model: str, params: StreamParams) -> ChunkReader: ...
    def list_files(self, model: str) -> dict[str, Any]:
        """``{id, revision, commit, files: [{name, size, etag}]}``: the model's repository."""
        ...

    def open_file(
        self,
        model: str,
        name: str,
        offset: int = 0,
        length: int | None = None,
        revision: str | None = None,
    ) -> FileSource: ...
    def receiving(self, nbytes: int) -> AbstractContextManager[None]:
        """Around a load of ``nbytes``: what the transport prepares for it."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TLSOptions:
    ca_file: str | None = None  # trust this CA (PEM) instead of the system store
    cert_file: str | None = None  # client certificate, for mutual TLS
    key_file: str | None = None


def bearer_token(token: str | None) -> str | None:
    """The token given, else ``WEIGHTSERVE_TOKEN``, else None."""
    return token if token is not None else os.environ.get("WEIGHTSERVE_TOKEN") or None


def wire_error_from_json(fields: object, older_class_key: str) -> WireError | None:
    """The error in a JSON error object (Flight's ``extra_info``, a handoff error frame), or
    None when it holds none."""
    found = WireError.from_json(fields)
    # Servers from before the one error shape named the class under another key ("error" in
    # Flight's extra_info, "class" in handoff frames): still read, so that a client newer
    # than its server raises the same class.
    if found is None and isinstance(fields, Mapping) and older_class_key in fields:
        found = WireError.from_json({**fields, "type": fields[older_class_key]})
    return found
