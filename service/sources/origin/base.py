"""What a node cache asks of an origin it fills from (``Origin``), the files it lists, and the
requests it counts. The origins:  object storage through ``pyarrow.fs`` (``s3://``, ``gs://``,
``file://``; objects.py) or another weightserve (``http(s)://``, an upstream tier; upstream.py), listed file by file and
fetched with parallel ranged reads (parts.py); ``open_origin`` (opening.py) opens one by URI.

    origin = open_origin("s3://bucket/models?endpoint_override=127.0.0.1:8333&scheme=http")
    for file in origin.list_files():          # OriginFile(name, size, version)
        origin.fetch(file, tmp_path)           # the caller renames tmp_path when it returns

Every request an origin makes is counted by kind (``list``, ``head``, ``get``) and outcome in
its ``requests`` (OriginRequests), for the server's metrics, with the bytes taken by what they
were for (``fill``, ``header``, ``file``).

Failures are translated here, at this one boundary: OriginUnavailable (the origin cannot be
reached or keeps failing, after bounded retries with backoff) and OriginChanged (the object
changed or vanished while it was fetched). Neither message carries credentials.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from weightserve.client.wire.backoff import Delays

T = TypeVar("T")
DEFAULT_CONCURRENCY = 8


DEFAULT_PART_BYTES = 16 << 20
# An upstream's answer is received in pieces of this size: memory per worker stays bounded
# whatever the part size.
RECEIVE_BYTES = 1 << 20
# HEADs (new or changed objects) or model listings (revision changed) in flight while listing.
LIST_CONCURRENCY = 16
# Longest silence tolerated from an upstream weightserve before a read is abandoned and
# retried (--origin-stall-seconds).
UPSTREAM_READ_TIMEOUT = 30.0


@dataclass(frozen=True)
class FillPlan:
    """How one fetch runs: on ``concurrency`` threads, in ranged parts of ``part_bytes``;
    ``on_bytes(n)`` hears of every byte received, ``on_landed(offset, length)`` of each span
    written, so a reader can follow the bytes as they land."""

    concurrency: int = DEFAULT_CONCURRENCY
    part_bytes: int = DEFAULT_PART_BYTES
    on_bytes: Callable[[int], None] | None = None
    on_landed: Callable[[int, int], None] | None = None

    def landed(self, offset: int, length: int) -> None:
        """Tell both listeners of ``length`` bytes written at ``offset``."""
        if self.on_bytes is not None:
            self.on_bytes(length)
        if self.on_landed is not None:
            self.on_landed(offset, length)


# The plan of a fetch that asks for nothing particular.
DEFAULT_PLAN = FillPlan()


@dataclass(frozen=True)
class OriginFile:
    name: str  # path below the origin's prefix, '/'-separated
    size: int
    # Changes whenever the object changes: the S3 ETag where the store gives one, else
    # size and mtime; an upstream weightserve's ETag (xxh3-128 of the content).
    version: str


@dataclass(frozen=True)
class ObjectVersion(OriginFile):
    """An object as it was when a past revision was filled: fetched into ``name`` (where the
    node keeps the copy) from the object ``source`` (its name below the prefix) at the
    store's ``version_id``, and refused unless its bytes hash to ``digest`` (xxh3-128)."""

    source: str = ""
    version_id: str = ""
    digest: str = ""


# watch: a follower's connection; swarm: a node joining a revision's swarm (peer fills)
ORIGIN_REQUEST_KINDS = ("list", "head", "get", "watch", "swarm")
# What bytes taken from the origin were for: a model's fill, the header reads that describe a
# model not cached (service/sources/origin/headers.py), a side file fetched alone, an upstream's
# delta stream and new headers a changed file was built from (service/sources/cache/patched_files.py).
ORIGIN_BYTE_KINDS = ("fill", "header", "file", "patch")


class OriginRequests:
    """Requests made to an origin, by (kind, outcome): kind ``list``, ``head``, ``get`` or
    ``watch`` (a follower's connection to an upstream's announcements),
    outcome ``ok`` or ``error``; and the bytes taken for headers and side files (``received``;
    a fill's bytes are the node cache's own count). Thread-safe; ``call`` counts one request
    as it ends."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def received(self, kind: str, n: int) -> None:
        """Count ``n`` bytes taken from the origin for ``kind`` (ORIGIN_BYTE_KINDS)."""
        with self._lock:
            self._bytes[kind] = self._bytes.get(kind, 0) + n

    def bytes_received(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes)

    def call(self, kind: str, action: Callable[[], T]) -> T:
        outcome = "error"
        try:
            result = action()
            outcome = "ok"
            return result
        finally:
            with self._lock:
                self._counts[kind, outcome] = self._counts.get((kind, outcome), 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: ``attempts`` tries in all, waiting ``first_wait`` seconds after the
    first failure, doubled after each further one up to ``longest_wait`` (jittered)."""

    attempts: int = 4
    first_wait: float = 0.2
    longest_wait: float = 2.0

    def waits(self) -> Iterator[float]:
        delays = Delays(self.first_wait, self.longest_wait)  # the project's one backoff
        for _ in range(self.attempts - 1):
            yield delays.next()


class Origin(Protocol):
    description: str  # for errors and logs, no credentials
    # Whether each file's version is its xxh3-128 content digest, as weightserve names files
    # (an upstream weightserve): revisions are then known before a fill.
    lists_content_digests: bool
    requests: OriginRequests

    def list_files(self) -> list[OriginFile]: ...

    def read_range(self, file: OriginFile, offset: int, length: int) -> bytes:
        """``length`` bytes of the file from ``offset`` (fewer at its end), of the version
        ``file`` names: OriginChanged once it changed. For headers: one request per call."""
        ...

    def matches(self, file: OriginFile, path: Path) -> bool | None:
        """Whether ``path`` holds the file's bytes, where its version tells (a content digest);
        None where it does not (then only the size can be compared)."""
        ...

    def fetch(self, file: OriginFile, dest: Path, plan: FillPlan = DEFAULT_PLAN) -> str | None:
        """Write ``file``'s bytes to ``dest`` as ``plan`` says; the xxh3-128 (hex) of what was
        written where the origin computed it anyway, else None (the node cache hashes the file
        itself)."""
        ...

    def version_id(self, file: OriginFile) -> str | None:
        """The object store's version id of the bytes this origin last read as ``file`` (its
        version), to fetch them again as an ``ObjectVersion`` once the object changed; None
        where the store keeps no versions or they were not read."""
        ...

    def close(self) -> None:
        """Let go of the origin's connections; its owner (an ``OriginCatalog``) calls it once
        it is done with it."""
        ...


class _Retryable(Exception):
    """A failure worth trying again (network, a server error); wraps the cause."""


def _redact_uri(uri: str) -> str:
    """``uri`` without user info or query (where credentials may be written)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"
