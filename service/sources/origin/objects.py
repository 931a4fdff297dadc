"""Objects below a prefix of a ``pyarrow.fs`` file system (``s3://``, ``gs://``, ``file://``) as
an origin: listed with their ETags (or size and mtime), fetched in parallel ranged reads, a past
object version fetched by its version id (S3)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import pyarrow.fs as pafs

from weightserve.client.errors import (
    OriginChanged,
    OriginUnavailable,
    RevisionNotFound,
)
from weightserve.client.wire.digests import file_digest
from weightserve.service.sources.origin.base import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PLAN,
    LIST_CONCURRENCY,
    RECEIVE_BYTES,
    UPSTREAM_READ_TIMEOUT,
    FillPlan,
    ObjectVersion,
    OriginFile,
    OriginRequests,
    RetryPolicy,
    _redact_uri,
)
from weightserve.service.sources.origin.parts import (
    _fetch_checked,
    _fetch_parts,
    _pwrite_all,
    _remove,
)

log = logging.getLogger("weightserve.service")


T = TypeVar("T")
GCS_RETRY_SECONDS = 20  # how long the GCS client retries unless the URI says otherwise


# An S3 ETag of a single-part upload: the MD5 of the object's bytes (a multipart one has "-N").
_MD5_ETAG = re.compile(r"[0-9a-f]{32}")


def _secrets_of(uri: str) -> list[str]:
    parts = urlsplit(uri)
    found = [unquote(s) for s in (parts.username, parts.password) if s]
    for key, values in parse_qs(parts.query).items():
        if any(word in key.lower() for word in ("key", "secret", "token", "password")):
            found += values
    return [s for s in found if s]


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

    def fetch(self, file: OriginFile, dest: Path, plan: FillPlan = DEFAULT_PLAN) -> str | None:
        if isinstance(file, ObjectVersion):
            return self._fetch_version(file, dest, plan)
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
            plan.landed(offset, length)

        try:
            idle.put(open_checked("since it was listed"))
            _fetch_parts(dest, file.size, copy_part, plan)
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
        return file_digest(path, hashlib.md5(usedforsecurity=False)) == file.version

    def close(self) -> None:
        """pyarrow's file system has nothing to close; botocore's client (of object versions,
        made on first use) holds a connection pool."""
        with self._known_lock:
            client, self._versions_client = self._versions_client, None
        if client is not None:
            client.close()

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
        plan: FillPlan,
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
                    plan.landed(offset + done, len(piece))
                    done += len(piece)
            finally:
                body.close()
            if done != length:
                raise OriginUnavailable(
                    f"origin {self.description}: {what} ended at byte {offset + done} of its "
                    f"{file.size}; try again"
                )

        return _fetch_checked(
            dest, file.size, copy_part, plan, file.digest,
            lambda digest: RevisionNotFound(
                f"origin {self.description}: {what} has xxh3-128 {digest}, not the "
                f"{file.digest} recorded when this revision was filled: it cannot be filled again"
            ),
        )  # fmt: skip
