"""The one seam between the client and a server: the ``Transport`` protocol, in two halves.

``DataTransport``: which models, what is in one, which files, "open a tensor stream" — the
last as a ``readinto``-able source of Arrow IPC stream bytes or a chunk reader, so the receiver
can read tensor data straight into its final buffers. ``ControlTransport``: revisions and their
traffic (publishing uploads, watches, holds, the delta stream). Every transport implements
what it carries and refuses the rest with ``WrongTransport`` naming what the call needs
(``RefusesControl``), so nothing above this seam asks which transport it holds. Foreign errors
(socket, http.client, grpc) are translated inside each transport, in one place, into
weightserve errors; what comes up is typed answers and iterators, never a foreign object.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from weightserve.client.errors import WrongTransport
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


@dataclass(frozen=True)
class FileSpan:
    """Which bytes of a file ``open_file`` reads: from ``offset``, ``length`` bytes (None: to
    the end), of ``revision`` (None: whichever the model is at)."""

    offset: int = 0
    length: int | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        if self.offset < 0 or (self.length is not None and self.length < 0):
            raise ValueError(f"offset ({self.offset}) and length ({self.length}) must be >= 0")


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


class LineStream(Protocol):
    """A long answer read line by line (an NDJSON watch), or as lines each followed by a
    payload (the delta stream), on a connection of its own. Errors come mapped: a connection
    cut, or silent for longer than ``silence`` seconds, is ``ServerUnreachable``."""

    def header(self, name: str) -> str:
        """One header of the answer ("" when it has none)."""
        ...

    def readline(self, limit: int = -1, /, *, silence: float | None = None) -> bytes:
        """The next line with its newline (at most ``limit`` bytes of it, when given, as
        ``io`` readers do); b"" once the server ended the answer."""
        ...

    def read(self, n: int = -1, /) -> bytes:
        """Up to ``n`` bytes (fewer only at the end; all that is left when negative)."""
        ...

    def close(self) -> None: ...

    def interrupt(self) -> None:
        """End a read blocked in another thread now (the connection is shut down: the reader
        sees it cut, and closes it as it would any)."""
        ...


class DataTransport(Protocol):
    """What the client asks of a server to load a model. Metadata answers are the JSON
    objects of the HTTP API (docs/protocol.md), whichever wire carried them."""

    address: ServerAddress
    # The chunk a bulk load asks for where the caller sets none (None: the server's default):
    # a transport whose chunks land in their final buffers gains from fewer, larger ones; one
    # that holds each message whole in memory does not.
    bulk_chunk_bytes: int | None = None

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
    ) -> FileSource:
        """The bytes of one file of the model from ``offset`` (``length`` bytes, None: to
        the end); ``revision`` fails the read with RevisionMismatch once the model is at
        another one. Said once here: each transport opens the ``FileSpan`` (``open_span``)."""
        return self.open_span(model, name, FileSpan(offset, length, revision))

    def open_span(self, model: str, name: str, span: FileSpan) -> FileSource:
        """The bytes ``span`` names of one file of the model."""
        ...

    def receiving(self, nbytes: int) -> AbstractContextManager[None]:
        """Around a load of ``nbytes``: what the transport prepares for it."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class UploadPart:
    """One part of upload ``upload`` of ``model``: ``part`` is ``tensors``, ``patch`` or
    ``files/NAME``, its ``length`` bytes come from ``chunks``."""

    model: str
    upload: str
    part: str
    chunks: Iterable[bytes | memoryview]
    length: int


# The control verbs by name, as ``ControlTransport.control_verbs`` lists those it carries.
CONTROL_VERBS = frozenset(
    {
        "start_upload",
        "upload",
        "commit_upload",
        "discard_upload",
        "list_revisions",
        "watch_revisions",
        "open_watch",
        "hold",
        "open_delta",
        "delta_size",
        "join_swarm",
    }
)


class ControlTransport(Protocol):
    """What the client asks of a server about revisions: publishing (an upload started,
    its parts, its commit or discard), the revisions held, watching for new ones, holds,
    and the delta stream between two. Answers are the HTTP API's JSON objects. A transport
    that does not carry a verb raises ``WrongTransport`` naming what it needs."""

    address: ServerAddress
    control_verbs: frozenset[str]  # the verbs this transport carries (CONTROL_VERBS)

    def start_upload(
        self, model: str, base: str | None, message: str, metadata: Mapping[str, Any]
    ) -> str:
        """A new upload of ``model`` (a revision on ``base``): its id."""
        ...

    def upload(
        self, part: UploadPart, on_bytes: Callable[[int], None] | None = None
    ) -> dict[str, Any]:
        """One part of an upload, streamed from its chunks, never held whole."""
        ...

    def commit_upload(self, model: str, upload: str) -> dict[str, Any]:
        """The revision the upload became (its record, as ``list_revisions`` lists it)."""
        ...

    def discard_upload(self, model: str, upload: str) -> None: ...

    def list_revisions(self, model: str) -> list[dict[str, Any]]:
        """The revisions held, ``main`` first, then newest first."""
        ...

    def watch_revisions(
        self, model: str, since: str | None, timeout: float | None, after: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """One watch connection's events (``{"event": "hello", "main"}``, ``{"event":
        "revision", ...}``, heartbeats), until it ends, breaks or ``timeout`` seconds pass
        (None: never); ``after``: the last sequence seen (with ``since``, its commit)."""
        ...

    def open_watch(
        self, model: str | None, since: str | None, after: int | None = None
    ) -> LineStream:
        """The NDJSON watch of one model, or of every model (``model`` None), raw."""
        ...

    def hold(self, model: str, commit: str, seconds: float) -> float | None:
        """Keep ``commit`` for ``seconds``: the time it is held until."""
        ...

    def open_delta(self, model: str, since: str, revision: str | None) -> LineStream:
        """The delta stream (docs/protocol.md, "Delta updates") from ``since`` to
        ``revision`` (None: ``main``); its headers name the target."""
        ...

    def delta_size(self, model: str, since: str, revision: str | None) -> dict[str, Any]:
        """``{base, commit, bytes, whole_bytes}``: what ``open_delta`` would send."""
        ...

    def join_swarm(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        """A node cache joining a revision's swarm (docs/origins.md, "Peer fills"): the
        torrent, the node's certificate and the peers."""
        ...


class Transport(DataTransport, ControlTransport, Protocol):
    """A server as the client holds it: its data plane and its control plane."""


class RefusesControl:
    """The control verbs a transport does not carry, each refused with ``WrongTransport``
    naming what it needs; a transport overrides those it carries and lists them in
    ``control_verbs``."""

    address: ServerAddress
    control_verbs: frozenset[str] = frozenset()

    def _refuse(self, what: str) -> WrongTransport:
        scheme = "https" if self.address.tls else "http"
        return WrongTransport(
            f"{what} needs an {scheme}:// server address (the server's HTTP port); "
            f"{self.address.url} is {self.address.transport}, which does not carry it"
        )

    def start_upload(
        self, model: str, base: str | None, message: str, metadata: Mapping[str, Any]
    ) -> str:
        raise self._refuse("publishing")

    def upload(self, *_: Any, **__: Any) -> dict[str, Any]:  # no upload starts here
        raise self._refuse("publishing")

    def commit_upload(self, model: str, upload: str) -> dict[str, Any]:
        raise self._refuse("publishing")

    def discard_upload(self, model: str, upload: str) -> None:
        raise self._refuse("publishing")

    def list_revisions(self, model: str) -> list[dict[str, Any]]:
        raise self._refuse("listing revisions")

    def watch_revisions(
        self, model: str, since: str | None, timeout: float | None, after: int | None = None
    ) -> Iterator[dict[str, Any]]:
        raise self._refuse("watching revisions")

    def open_watch(
        self, model: str | None, since: str | None, after: int | None = None
    ) -> LineStream:
        raise self._refuse("an NDJSON watch")

    def hold(self, model: str, commit: str, seconds: float) -> float | None:
        raise self._refuse("holding a revision")

    def open_delta(self, model: str, since: str, revision: str | None) -> LineStream:
        raise self._refuse("a delta update")

    def delta_size(self, model: str, since: str, revision: str | None) -> dict[str, Any]:
        raise self._refuse("the size of a delta update")

    def join_swarm(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        raise self._refuse("joining a revision's swarm")


def carries(transport: ControlTransport, verb: str) -> bool:
    """Whether ``transport`` carries control verb ``verb`` (a name in CONTROL_VERBS)."""
    assert verb in CONTROL_VERBS, verb
    return verb in transport.control_verbs


@dataclass(frozen=True)
class TLSOptions:
    ca_file: str | None = None  # trust this CA (PEM) instead of the system store
    cert_file: str | None = None  # client certificate, for mutual TLS
    key_file: str | None = None


@dataclass(frozen=True)
class Connection:
    """How a client reaches its server, as ``Client(url, token=..., ...)`` was given it: the
    transports, ``make_transport`` and the data planes take this one object."""

    token: str | None = None  # None: ``WEIGHTSERVE_TOKEN`` (``bearer_token``)
    tls: TLSOptions | None = None
    timeout: float = DEFAULT_READ_TIMEOUT  # longest silence on a connection
    flight: bool | None = None  # gRPC bulk data over Arrow Flight (None: when offered)
    retry_seconds: float | None = None  # None: ``WEIGHTSERVE_RETRY_SECONDS``, else 60

    @property
    def bearer(self) -> str | None:
        """The token to send: the one given, else ``WEIGHTSERVE_TOKEN``."""
        return bearer_token(self.token)


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
