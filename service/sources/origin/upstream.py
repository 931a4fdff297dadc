"""Origins a node cache fills from: object storage through ``pyarrow.fs`` (``s3://``, ``gs://``,
``file://``) or another weightserve (``http(s)://``, an upstream tier), listed file by file and
fetched with parallel ranged reads.

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

import concurrent.futures
import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import pyarrow.fs as pafs
import xxhash

from weightserve.client._update import TensorUpdate, UpdateTarget, iter_updates
from weightserve.client.errors import (
    NotFound,
    OriginChanged,
    OriginUnavailable,
    PermissionDenied,
    RevisionNotFound,
    TransportError,
    Unauthenticated,
    WeightserveError,
)
from weightserve.client.transports.base import TLSOptions
from weightserve.client.transports.http import HttpTransport
from weightserve.client.wire.routes import parse_url
from weightserve.service.sources.layout import split_gguf_model

log = logging.getLogger("weightserve.service")

T = TypeVar("T")
DEFAULT_CONCURRENCY = 8
DEFAULT_PART_BYTES = 16 << 20
# An upstream's answer is received in pieces of this size: memory per worker stays bounded
# whatever the part size.
RECEIVE_BYTES = 1 << 20
# HEADs (new or changed objects) or model listings (revision changed) in flight while listing.
LIST_CONCURRENCY = 16
GCS_RETRY_SECONDS = 20  # how long the GCS client retries unless the URI says otherwise
# Longest silence tolerated from an upstream weightserve before a read is abandoned and
# retried (--origin-stall-seconds).
UPSTREAM_READ_TIMEOUT = 30.0
# Silence on the upstream's watch after which it is taken for dead (it sends a line every 5 s).
WATCH_HEARTBEAT_TIMEOUT = 20.0
# An S3 ETag of a single-part upload: the MD5 of the object's bytes (a multipart one has "-N").
_MD5_ETAG = re.compile(r"[0-9a-f]{32}")


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


ORIGIN_REQUEST_KINDS = ("list", "head", "get", "watch")  # watch: a follower's connection
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
        wait = self.first_wait
        for _ in range(self.attempts - 1):
            yield wait * random.uniform(0.5, 1.0)
            wait = min(wait * 2, self.longest_wait)


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

    def fetch(
        self,
        file: OriginFile,
        dest: Path,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        part_bytes: int = DEFAULT_PART_BYTES,
        on_bytes: Callable[[int], None] | None = None,
        on_landed: Callable[[int, int], None] | None = None,
    ) -> str | None:
        """Write ``file``'s bytes to ``dest``; the xxh3-128 (hex) of what was written where the
        origin computed it anyway, else None (the node cache hashes the file itself).
        ``on_landed(offset, length)`` hears of each span written, so a reader can follow the
        bytes as they land."""
        ...

    def version_id(self, file: OriginFile) -> str | None:
        """The object store's version id of the bytes this origin last read as ``file`` (its
        version), to fetch them again as an ``ObjectVersion`` once the object changed; None
        where the store keeps no versions or they were not read."""
        ...


class _Retryable(Exception):
    """A failure worth trying again (network, a server error); wraps the cause."""


def open_origin(
    uri: str,
    *,
    token: str | None = None,
    tls: TLSOptions | None = None,
    retry: RetryPolicy | None = None,
    stall_seconds: float = UPSTREAM_READ_TIMEOUT,
) -> Origin:
    """The origin ``uri`` names:

    - ``s3://bucket/prefix?endpoint_override=HOST:PORT&scheme=http&region=...`` and
      ``gs://bucket/prefix``: ``pyarrow.fs.FileSystem.from_uri`` syntax and query options;
      credentials are found the way pyarrow finds them (environment, profiles, instance or
      workload identity).
    - ``file:///absolute/dir``.
    - ``http(s)://HOST:PORT``: another weightserve, read through its files API with
      ``token`` and ``tls``; file names are ``MODEL_ID/FILE_NAME``. ``retry`` bounds its
      retries, ``stall_seconds`` the silence after which a read is abandoned and retried; an
      object store's own client retries with backoff (bounded) instead.
    """
    scheme = urlsplit(uri).scheme
    if scheme in ("http", "https"):
        return UpstreamOrigin(
            uri, token=token, tls=tls, retry=retry or RetryPolicy(), timeout=stall_seconds
        )
    if scheme in ("s3", "gs", "gcs", "file"):
        return FileSystemOrigin(uri, retry=retry or RetryPolicy(), stall_seconds=stall_seconds)
    raise ValueError(
        f"unsupported origin {_redact_uri(uri)!r}: use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, "
        "file:///ABSOLUTE/DIR or http(s)://HOST:PORT of another weightserve"
    )


def _redact_uri(uri: str) -> str:
    """``uri`` without user info or query (where credentials may be written)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"


def _secrets_of(uri: str) -> list[str]:
    parts = urlsplit(uri)
    found = [unquote(s) for s in (parts.username, parts.password) if s]
    for key, values in parse_qs(parts.query).items():
        if any(word in key.lower() for word in ("key", "secret", "token", "password")):
            found += values
    return [s for s in found if s]


# ------------------------------------------------------------------------ object storage


class FileSystemOrigin:
    """Objects below a prefix of a ``pyarrow.fs`` file system (S3, GCS, local)."""

    lists_content_digests = False  # ETags (MD5 at best) or size and mtime
    # How old an object's mtime must be before its size and mtime stand for its ETag.
    settle_seconds = 60.0

    def __init__(
        self,
        uri: str,
        *,
        retry: RetryPolicy | None = None,
        stall_seconds: float = UPSTREAM_READ_TIMEOUT,
    ) -> None:
        self._secrets = _secrets_of(uri)
        self._uri = uri  # the S3 client of object versions is configured from it
        self._retry = retry or RetryPolicy()
        self._stall_seconds = stall_seconds
        parts = urlsplit(uri)
        if parts.scheme in ("gs", "gcs") and "retry_limit_seconds" not in parse_qs(parts.query):
            # The GCS client's own default retries for minutes: bound it.
            uri += ("&" if parts.query else "?") + f"retry_limit_seconds={GCS_RETRY_SECONDS}"
        endpoint = parse_qs(parts.query).get("endpoint_override", [""])[0]
        self.description = _redact_uri(uri).rstrip("/")
        if endpoint:
            endpoint_scheme = parse_qs(parts.query).get("scheme", ["https"])[0]
            self.description += f" (endpoint {endpoint_scheme}://{endpoint})"
        try:
            self.fs, path = pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError) as e:  # ArrowInvalid is a ValueError
            raise ValueError(f"origin {self.description}: {self._scrub(str(e))}") from e
        self.prefix = path.rstrip("/")
        self._local = self.fs.type_name == "local"
        self.requests = OriginRequests()
        # Object key -> (size, mtime_ns, version) as last listed (see list_files).
        self._known: dict[str, tuple[int, int | None, str]] = {}
        self._known_lock = threading.Lock()
        # (object key, version) -> the store's version id, from each HEAD's answer.
        self._version_ids: dict[tuple[str, str], str] = {}
        self._versions_client: Any = None  # botocore's S3 client, made on first use

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _attempt(self, what: str, action: Callable[[], T]) -> T:
        """``action``, its I/O errors as OriginUnavailable; a missing object stays
        FileNotFoundError. Not retried here: the store's own client already retries with
        backoff (the AWS SDK gives up on a refused connection after about 6 s; GCS after
        ``retry_limit_seconds``), and retrying that again would multiply the wait."""
        try:
            return action()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise OriginUnavailable(
                f"origin {self.description} failed to {what}: {self._scrub(str(e))}; models "
                "already cached are still served, check that the origin is reachable and its "
                "credentials"
            ) from e

    def _version(self, info: pafs.FileInfo, source: pafs.NativeFile | None) -> str:
        """The object's ETag where the store gives one (an S3 HEAD), else size and mtime."""
        if source is not None:
            etag = (source.metadata() or {}).get("ETag")
            if etag:
                return etag.decode().removeprefix("W/").strip('"')
        return f"{info.size}-{info.mtime_ns}"

    def _open(self, key: str) -> pafs.NativeFile:
        return self.requests.call("head", lambda: self.fs.open_input_file(key))

    def _stat(self, key: str, source: pafs.NativeFile | None = None) -> tuple[int, str]:
        """(size, version) of one object as the store says now; from ``source``, an open
        object, where that tells (an S3 object opened is a HEAD answered)."""
        if self._local:
            info = self.requests.call("head", lambda: self.fs.get_file_info(key))
            if info.type != pafs.FileType.File:
                raise FileNotFoundError(key)
            return info.size, self._version(info, None)
        if source is not None:
            return source.size(), self._noted(key, source)
        with self._open(key) as opened:
            return opened.size(), self._noted(key, opened)

    def _noted(self, key: str, source: pafs.NativeFile) -> str:
        """The open object's version; the store's version id of it is remembered beside it
        (``version_id``)."""
        version = self._version(pafs.FileInfo(key), source)
        version_id = (source.metadata() or {}).get("VersionId", b"").decode()
        if version_id and version_id != "null":  # "null": written while versioning was off
            with self._known_lock:
                self._version_ids[key, version] = version_id
        return version

    def version_id(self, file: OriginFile) -> str | None:
        with self._known_lock:
            return self._version_ids.get((self._key(file.name), file.version))

    def list_files(self) -> list[OriginFile]:
        selector = pafs.FileSelector(self.prefix, recursive=True)
        try:
            infos = self._attempt(
                "list its objects",
                lambda: self.requests.call("list", lambda: self.fs.get_file_info(selector)),
            )
        except FileNotFoundError as e:
            raise OriginUnavailable(
                f"origin {self.description}: the prefix does not exist ({self._scrub(str(e))}); "
                "check the bucket and prefix"
            ) from e
        objects = [i for i in infos if i.type == pafs.FileType.File]
        start = len(self.prefix) + 1 if self.prefix else 0
        # pyarrow's LIST tells size and mtime but no ETag: an object listed with the size and
        # mtime it had when its ETag was read keeps that ETag, so a rescan HEADs only objects
        # new, changed, or written too recently for the mtime (whole seconds, the store's
        # clock) to tell a rewrite.
        settled_before = time.time_ns() - int(self.settle_seconds * 1e9)
        with self._known_lock:
            known = dict(self._known)

        def describe(info: pafs.FileInfo) -> tuple[OriginFile, tuple[int, int | None, str]] | None:
            name = info.path[start:]
            listed = (info.size, info.mtime_ns)
            if self._local:
                version = self._version(info, None)
            elif (
                (seen := known.get(info.path)) is not None
                and seen[:2] == listed
                and info.mtime_ns is not None
                and info.mtime_ns < settled_before
            ):
                version = seen[2]
            else:
                try:
                    size, version = self._attempt(
                        f"read {name}'s ETag", lambda: self._stat(info.path)
                    )
                except FileNotFoundError:
                    return None  # deleted since it was listed
                if size != info.size:  # rewritten since the LIST: not one to remember
                    return OriginFile(name, size, version), (-1, None, version)
            return OriginFile(name, info.size, version), (*listed, version)

        if self._local:
            found = [describe(i) for i in objects]
        else:
            with concurrent.futures.ThreadPoolExecutor(LIST_CONCURRENCY) as pool:
                found = list(pool.map(describe, objects))
        with self._known_lock:
            self._known = {
                self._key(file.name): seen for file, seen in filter(None, found) if seen[0] >= 0
            }
        return sorted((file for file, _ in filter(None, found)), key=lambda f: f.name)

    def fetch(
        self,
        file: OriginFile,
        dest: Path,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        part_bytes: int = DEFAULT_PART_BYTES,
        on_bytes: Callable[[int], None] | None = None,
        on_landed: Callable[[int, int], None] | None = None,
    ) -> str | None:
        if isinstance(file, ObjectVersion):
            return self._fetch_version(file, dest, concurrency, part_bytes, on_bytes, on_landed)
        key = self._key(file.name)

        def check_unchanged(when: str, source: pafs.NativeFile | None = None) -> None:
            try:
                size, version = self._attempt(
                    f"read {file.name}'s ETag", lambda: self._stat(key, source)
                )
            except FileNotFoundError as e:
                raise OriginChanged(
                    f"origin {self.description}: {file.name} vanished {when}; list it again"
                ) from e
            if (size, version) != (file.size, file.version):
                raise OriginChanged(
                    f"origin {self.description}: {file.name} changed {when} (size {file.size} -> "
                    f"{size}, version {file.version} -> {version}); list it again"
                )

        # Each thread reads through a handle of its own (seek, then read_buffer: the bytes
        # land in one Arrow buffer, no further copy); a handle opened is a HEAD on S3, so
        # every one checks the version too.
        idle: queue.SimpleQueue[pafs.NativeFile] = queue.SimpleQueue()
        opened: list[pafs.NativeFile] = []

        def open_checked(when: str) -> pafs.NativeFile:
            try:
                source = self._attempt(f"open {file.name}", lambda: self._open(key))
            except FileNotFoundError as e:
                raise OriginChanged(
                    f"origin {self.description}: {file.name} vanished {when}; list it again"
                ) from e
            opened.append(source)
            check_unchanged(when, source)
            return source

        def copy_part(fd: int, offset: int, length: int) -> None:
            try:
                source = idle.get_nowait()
            except queue.Empty:
                source = open_checked("while it was fetched")

            def read() -> pafs.Buffer:
                source.seek(offset)
                return self.requests.call("get", lambda: source.read_buffer(length))

            try:
                buffer = self._attempt(
                    f"read bytes {offset}-{offset + length - 1} of {file.name}", read
                )
            finally:
                idle.put(source)
            if buffer.size != length:
                raise OriginChanged(
                    f"origin {self.description}: {file.name} ended at {offset + buffer.size}, "
                    f"before its listed size {file.size}; list it again"
                )
            _pwrite_all(fd, memoryview(buffer), offset)
            if on_bytes is not None:
                on_bytes(length)
            if on_landed is not None:
                on_landed(offset, length)

        try:
            idle.put(open_checked("since it was listed"))
            _fetch_parts(dest, file.size, copy_part, concurrency, part_bytes)
        finally:
            for source in opened:
                source.close()
        try:
            # Ranged GETs do not pin the object's version: check it did not change meanwhile.
            check_unchanged("while it was fetched")
        except BaseException:
            _remove(dest)
            raise
        return None  # the node cache hashes what was written

    def read_range(self, file: OriginFile, offset: int, length: int) -> bytes:
        key = self._key(file.name)

        def read() -> bytes:
            with self._open(key) as source:  # on S3 a HEAD: the version
                if self._stat(key, source) != (file.size, file.version):
                    raise OriginChanged(
                        f"origin {self.description}: {file.name} changed since it was listed; "
                        "list it again"
                    )
                source.seek(offset)
                return bytes(self.requests.call("get", lambda: source.read(length)))

        try:
            return self._attempt(f"read bytes {offset}-{offset + length - 1} of {file.name}", read)
        except FileNotFoundError as e:
            raise OriginChanged(
                f"origin {self.description}: {file.name} vanished; list it again"
            ) from e

    def matches(self, file: OriginFile, path: Path) -> bool | None:
        if self._local or not _MD5_ETAG.fullmatch(file.version):
            return None
        return _file_digest(path, hashlib.md5(usedforsecurity=False)) == file.version

    # -- object versions: what pyarrow.fs cannot ask for (a HEAD or GET of a VersionId) ------

    def _s3_client(self) -> Any:
        """botocore's S3 client, configured as the URI configures pyarrow: the same endpoint
        and scheme (path-style addressing there, as pyarrow uses, so no other host is asked),
        region, TLS options and credentials (the URI's, else the SDK's usual chain); its
        retries are ``RetryPolicy.attempts`` and a read without a byte for ``stall_seconds``
        is abandoned."""
        with self._known_lock:
            if self._versions_client is not None:
                return self._versions_client
            if self.fs.type_name != "s3":
                raise RevisionNotFound(
                    f"origin {self.description} keeps no object versions to fill a past "
                    "revision from"
                )
            # Imported on first use: only a fill of a past revision needs it.
            import botocore.config
            import botocore.session

            parts = urlsplit(self._uri)
            query = {key: values[0] for key, values in parse_qs(parts.query).items()}
            endpoint = query.get("endpoint_override")
            virtual = query.get("force_virtual_addressing", "").lower() == "true"
            verify: bool | str | None = None
            if query.get("tls_verify_certificates", "").lower() in ("false", "0"):
                verify = False
            elif query.get("tls_ca_file_path"):
                verify = query["tls_ca_file_path"]
            config = botocore.config.Config(
                s3={"addressing_style": "virtual" if virtual or not endpoint else "path"},
                retries={"total_max_attempts": self._retry.attempts, "mode": "standard"},
                connect_timeout=self._stall_seconds,
                read_timeout=self._stall_seconds,
                max_pool_connections=2 * DEFAULT_CONCURRENCY,
            )
            self._versions_client = botocore.session.Session().create_client(
                "s3",
                region_name=query.get("region"),
                endpoint_url=f"{query.get('scheme', 'https')}://{endpoint}" if endpoint else None,
                verify=verify,
                aws_access_key_id=unquote(parts.username) if parts.username else None,
                aws_secret_access_key=unquote(parts.password) if parts.password else None,
                config=config,
            )
            return self._versions_client

    def _fetch_version(
        self,
        file: ObjectVersion,
        dest: Path,
        concurrency: int,
        part_bytes: int,
        on_bytes: Callable[[int], None] | None,
        on_landed: Callable[[int, int], None] | None,
    ) -> str:
        """``file.source`` at ``file.version_id`` into ``dest``, checked against the size and
        digest recorded: RevisionNotFound naming the object and version where the store no
        longer has it or its bytes are not those."""
        import botocore.exceptions

        client = self._s3_client()
        bucket, _, key = self._key(file.source).partition("/")
        what = f"{file.source} version {file.version_id}"

        def call(kind: str, request: Callable[[], T]) -> T:
            try:
                return self.requests.call(kind, request)
            except botocore.exceptions.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 404 or code in ("NoSuchVersion", "NoSuchKey", "InvalidArgument"):
                    raise RevisionNotFound(
                        f"origin {self.description} no longer has {what} ({code or status}), "
                        "which this revision was filled from: it cannot be filled again"
                    ) from None
                raise OriginUnavailable(
                    f"origin {self.description} failed to read {what}: "
                    f"{self._scrub(str(e))}; check that the origin is reachable and its credentials"
                ) from e
            except botocore.exceptions.BotoCoreError as e:
                raise OriginUnavailable(
                    f"origin {self.description} failed to read {what}: {self._scrub(str(e))}; "
                    "check that the origin is reachable"
                ) from e

        head = call(
            "head", lambda: client.head_object(Bucket=bucket, Key=key, VersionId=file.version_id)
        )
        if head.get("ContentLength") != file.size:
            raise RevisionNotFound(
                f"origin {self.description}: {what} has {head.get('ContentLength')} bytes, not the "
                f"{file.size} recorded when this revision was filled"
            )

        def copy_part(fd: int, offset: int, length: int) -> None:
            answer = call(
                "get",
                lambda: client.get_object(
                    Bucket=bucket,
                    Key=key,
                    VersionId=file.version_id,
                    Range=f"bytes={offset}-{offset + length - 1}",
                ),
            )
            body, done = answer["Body"], 0
            try:
                while done < length and (piece := body.read(min(RECEIVE_BYTES, length - done))):
                    _pwrite_all(fd, memoryview(piece), offset + done)
                    if on_bytes is not None:
                        on_bytes(len(piece))
                    if on_landed is not None:
                        on_landed(offset + done, len(piece))
                    done += len(piece)
            finally:
                body.close()
            if done != length:
                raise OriginUnavailable(
                    f"origin {self.description}: {what} ended at byte {offset + done} of its "
                    f"{file.size}; try again"
                )

        return _fetch_checked(
            dest, file.size, copy_part, concurrency, part_bytes, file.digest,
            lambda digest: RevisionNotFound(
                f"origin {self.description}: {what} has xxh3-128 {digest}, not the "
                f"{file.digest} recorded when this revision was filled: it cannot be filled again"
            ),
        )  # fmt: skip


# ------------------------------------------------------------------ an upstream weightserve


class UpstreamOrigin:
    """The files of every model of another weightserve, through its files API (HTTP Range
    requests); names are ``MODEL_ID/FILE_NAME``, versions the files' ETags (xxh3-128)."""

    lists_content_digests = True

    def __init__(
        self,
        uri: str,
        *,
        token: str | None = None,
        tls: TLSOptions | None = None,
        retry: RetryPolicy,
        timeout: float = UPSTREAM_READ_TIMEOUT,
    ) -> None:
        address, model = parse_url(uri)
        if model is not None:
            raise ValueError(
                f"an upstream origin is a server address, http(s)://HOST:PORT, not a model URL: "
                f"{_redact_uri(uri)!r}"
            )
        self.description = f"weightserve at {address.url}"
        self.retry = retry
        self.stall_seconds = timeout
        self.transport = HttpTransport(address, token=token, tls=tls, timeout=timeout)
        # Origin file name -> (model id, file name) on the upstream, from the last listing.
        self._sources: dict[str, tuple[str, str]] = {}
        # Model id -> (revision, its files) as last listed.
        self._listed: dict[str, tuple[str, list[tuple[OriginFile, str, str]]]] = {}
        self._models_lock = threading.Lock()
        self.requests = OriginRequests()

    def _attempt(self, what: str, action: Callable[[], T]) -> T:
        """``action``, retried with backoff on transport failures and temporary refusals;
        not-found, refused tokens and other final answers are not retried."""
        last: WeightserveError | None = None
        for wait in [*self.retry.waits(), None]:
            try:
                return action()
            except (Unauthenticated, PermissionDenied) as e:
                raise OriginUnavailable(
                    f"origin {self.description} refused to {what}: {e}; check the token the "
                    "node uses for its upstream"
                ) from e
            except (NotFound, OriginChanged):
                raise
            except (TransportError, _Retryable) as e:
                last = e
            except WeightserveError as e:
                if e.retry_after is None:
                    raise OriginUnavailable(
                        f"origin {self.description} failed to {what}: {e}"
                    ) from e
                last = e
            if wait is None:
                break
            log.info(
                "origin %s: %s failed (%s); again in %.2f s", self.description, what, last, wait
            )
            time.sleep(wait)
        raise OriginUnavailable(
            f"origin {self.description} failed to {what} after {self.retry.attempts} attempts "
            f"(each abandoned after {self.stall_seconds:g} s without a byte, "
            f"--origin-stall-seconds): {last}; models already cached are still served, check "
            "that the upstream is reachable"
        ) from last

    def events(self) -> Iterator[dict[str, Any]]:
        """The upstream's announcements of new revisions of every model (``GET /v1/watch``),
        one connection, until it ends or breaks (service/sources/origin/follow.py reconnects)."""
        conn, resp = self.requests.call("watch", lambda: self.transport.open_lines("/v1/watch"))
        try:
            while True:
                if conn.sock is not None:  # heartbeats come every few seconds
                    conn.sock.settimeout(max(self.stall_seconds, WATCH_HEARTBEAT_TIMEOUT))
                line = resp.readline()
                if not line:
                    return
                yield json.loads(line)
        finally:
            conn.close()

    def list_files(self) -> list[OriginFile]:
        listing = self._attempt(
            "list its models", lambda: self.requests.call("list", self.transport.list_models)
        )
        revisions = {m["id"]: m.get("revision") or "" for m in listing.get("models", [])}
        # A model whose revision (a digest of its files) is what it was is not listed again:
        # a rescan of an unchanged upstream is one request.
        with self._models_lock:
            known = {
                model: files
                for model, (revision, files) in self._listed.items()
                if revision and revisions.get(model) == revision
            }
        changed = sorted(set(revisions) - set(known))

        def files_of(model: str) -> list[tuple[OriginFile, str, str]]:
            try:
                files = self._attempt(
                    f"list the files of {model}",
                    lambda: self.requests.call("list", lambda: self.transport.list_files(model)),
                )
            except NotFound:
                return []  # removed since it was listed
            names = [f["name"] for f in files["files"]]
            # A file model (``dir/x.gguf``, split parts ``dir/x-00001-of-00002.gguf`` ...) lists
            # its files relative to its directory: they go beside the id, as in the upstream's
            # root, so the node gives the model the same id.
            directory = _file_model_directory(model, names)
            return [
                (
                    OriginFile(
                        f"{directory}{f['name']}"
                        if directory is not None
                        else f"{model}/{f['name']}",
                        f["size"],
                        f["etag"],
                    ),
                    model,
                    f["name"],
                )
                for f in files["files"]
            ]

        with concurrent.futures.ThreadPoolExecutor(LIST_CONCURRENCY) as pool:
            listed = dict(zip(changed, pool.map(files_of, changed), strict=True))
        found = [f for files in (*known.values(), *listed.values()) for f in files]
        with self._models_lock:
            self._listed = {
                model: (revisions[model], known[model] if model in known else listed[model])
                for model in revisions
            }
            self._sources = {file.name: (model, name) for file, model, name in found}
        return sorted((file for file, _, _ in found), key=lambda f: f.name)

    def _split(self, name: str) -> tuple[str, str]:
        """(model id, file name on the upstream) of an origin file name, as last listed."""
        for refresh in (False, True):
            if refresh:
                self.list_files()
            with self._models_lock:
                source = self._sources.get(name)
            if source is not None:
                return source
        raise OriginChanged(
            f"origin {self.description} holds no model that {name} belongs to any more; "
            "list it again"
        )

    def fetch(
        self,
        file: OriginFile,
        dest: Path,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        part_bytes: int = DEFAULT_PART_BYTES,
        on_bytes: Callable[[int], None] | None = None,
        on_landed: Callable[[int, int], None] | None = None,
    ) -> str:
        model, name = self._split(file.name)

        def receive(fd: int, offset: int, length: int, landed: list[int]) -> None:
            """The part's bytes from ``landed[0]`` on: a retry resumes where the last attempt
            stopped, so progress counts each byte once."""
            offset, length = offset + landed[0], length - landed[0]
            source = self.requests.call(
                "get", lambda: self.transport.open_file(model, name, offset, length)
            )
            try:
                if (source.etag, source.size) != (file.version, file.size):
                    raise OriginChanged(
                        f"origin {self.description}: {file.name} changed since it was listed "
                        f"(size {file.size} -> {source.size}, etag {file.version} -> "
                        f"{source.etag}); list it again"
                    )
                buffer = memoryview(bytearray(min(RECEIVE_BYTES, length)))
                done = 0
                while done < length:
                    got = source.readinto(buffer[: length - done])
                    if got == 0:
                        raise _Retryable(
                            f"{file.name}: the answer ended after {done} of {length} bytes"
                        )
                    _pwrite_all(fd, buffer[:got], offset + done)
                    done += got
                    landed[0] += got
                    if on_bytes is not None:
                        on_bytes(got)
                    if on_landed is not None:
                        on_landed(offset + done - got, got)
            finally:
                source.close()

        def copy_part(fd: int, offset: int, length: int) -> None:
            landed = [0]
            try:
                self._attempt(
                    f"read bytes {offset}-{offset + length - 1} of {file.name}",
                    lambda: receive(fd, offset, length, landed),
                )
            except NotFound as e:
                raise OriginChanged(
                    f"origin {self.description}: {file.name} vanished; list it again"
                ) from e

        # Every part came with the listed ETag; the whole file must hash to it too.
        return _fetch_checked(
            dest, file.size, copy_part, concurrency, part_bytes, file.version,
            lambda digest: OriginChanged(
                f"origin {self.description}: {file.name} arrived with digest {digest}, not the "
                f"listed {file.version}; list it again"
            ),
        )  # fmt: skip

    def read_range(self, file: OriginFile, offset: int, length: int) -> bytes:
        model, name = self._split(file.name)

        def receive() -> bytes:
            source = self.requests.call(
                "get", lambda: self.transport.open_file(model, name, offset, length)
            )
            try:
                if (source.etag, source.size) != (file.version, file.size):
                    raise OriginChanged(
                        f"origin {self.description}: {file.name} changed since it was listed; "
                        "list it again"
                    )
                buffer = memoryview(bytearray(length))
                done = 0
                while done < length and (got := source.readinto(buffer[done:])):
                    done += got
                return bytes(buffer[:done])
            finally:
                source.close()

        try:
            what = f"read bytes {offset}-{offset + length - 1} of {file.name}"
            return self._attempt(what, receive)
        except NotFound as e:
            raise OriginChanged(
                f"origin {self.description}: {file.name} vanished; list it again"
            ) from e

    def matches(self, file: OriginFile, path: Path) -> bool | None:
        return _file_digest(path, xxhash.xxh3_128()) == file.version

    def version_id(self, file: OriginFile) -> str | None:
        return None  # an upstream serves the revisions it holds: ask it for ID@R

    def open_delta(
        self, file: OriginFile, since: str, revision: str
    ) -> tuple[UpdateTarget, Iterator[TensorUpdate]]:
        """The upstream's delta stream (docs/protocol.md, "Delta updates") of the model
        ``file`` belongs to, from commit ``since`` to ``revision``; NotFound from an upstream
        too old to have the route."""
        model, _ = self._split(file.name)
        return self._attempt(
            f"open the update of {model}",
            lambda: self.requests.call(
                "get", lambda: iter_updates(self.transport, model, since, revision)
            ),
        )

    def close(self) -> None:
        self.transport.close()


def _file_model_directory(model: str, names: list[str]) -> str | None:
    """``DIR/`` (or ``""`` at the top) when ``model`` is a file model of the upstream: its
    files are the id's last part itself or that GGUF's split parts, named without a folder.
    None for a directory model, whose files go under ``model/``."""
    directory, _, base = model.rpartition("/")
    if not names or any("/" in n for n in names):
        return None
    if any(name != base and split_gguf_model(name) != base for name in names):
        return None
    return directory + "/" if directory else ""


# ------------------------------------------------------------------------- parallel parts


def _fetch_parts(
    dest: Path,
    size: int,
    copy_part: Callable[[int, int, int], None],
    concurrency: int,
    part_bytes: int,
) -> None:
    """Preallocate ``dest`` to ``size`` bytes and run ``copy_part(fd, offset, length)`` for
    every part on ``concurrency`` threads. On any failure the other parts stop and ``dest``
    is removed, so nothing half-written is left behind."""
    if concurrency < 1 or part_bytes < 1:
        raise ValueError(f"concurrency ({concurrency}) and part_bytes ({part_bytes}) must be >= 1")
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _preallocate(fd, size)
        parts = [(offset, min(part_bytes, size - offset)) for offset in range(0, size, part_bytes)]
        failed = threading.Event()

        def run(offset: int, length: int) -> None:
            if not failed.is_set():  # a part already failed: the file is lost anyway
                try:
                    copy_part(fd, offset, length)
                except BaseException:
                    failed.set()
                    raise

        with concurrent.futures.ThreadPoolExecutor(max(1, min(concurrency, len(parts)))) as pool:
            futures = [pool.submit(run, offset, length) for offset, length in parts]
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            for future in futures:
                future.cancel()
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
    except BaseException:
        os.close(fd)
        _remove(dest)
        raise
    os.close(fd)


def _fetch_checked(
    dest: Path,
    size: int,
    copy_part: Callable[[int, int, int], None],
    concurrency: int,
    part_bytes: int,
    expected: str,
    mismatch: Callable[[str], WeightserveError],
) -> str:
    """``_fetch_parts``, then the whole file's xxh3-128 (returned), which must be
    ``expected``: else ``dest`` is removed and ``mismatch(digest)`` raised."""
    _fetch_parts(dest, size, copy_part, concurrency, part_bytes)
    digest = _xxh3_128_file(dest)
    if digest != expected:
        _remove(dest)
        raise mismatch(digest)
    return digest


def _preallocate(fd: int, size: int) -> None:
    """Reserve the blocks now: a full disk fails here, not after half the download."""
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a file system without fallocate: a sparse file


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _xxh3_128_file(path: Path) -> str:
    return _file_digest(path, xxhash.xxh3_128())


def _file_digest(path: Path, h: Any) -> str:
    """The hex digest of the file's bytes by ``h`` (a hashlib or xxhash object)."""
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return str(h.hexdigest())


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
