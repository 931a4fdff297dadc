"""Another weightserve as an origin (``http(s)://``, an upstream tier): its files API, read in
parallel ranged parts, the announcements of its watch (followed by follow.py), and its delta
stream (a changed file built from the held copy, service/sources/cache/patched_files.py)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from weightserve.client.errors import (
    NotFound,
    OriginChanged,
    OriginUnavailable,
    PermissionDenied,
    ServerUnreachable,
    TransportError,
    Unauthenticated,
    WeightserveError,
)
from weightserve.client.remote import (
    FileSource,
    LineStream,
    TensorUpdate,
    TLSOptions,
    Transport,
    UpdateTarget,
    carries,
    connect,
)
from weightserve.client.wire.delta import DeltaCut, read_updates
from weightserve.client.wire.digests import file_digest
from weightserve.client.wire.routes import parse_url
from weightserve.client.wire.watch import WATCH_SILENCE, read_events
from weightserve.service.sources.layout import split_gguf_model
from weightserve.service.sources.origin.base import (
    DEFAULT_PLAN,
    LIST_CONCURRENCY,
    RECEIVE_BYTES,
    UPSTREAM_READ_TIMEOUT,
    FillPlan,
    OriginFile,
    OriginRequests,
    RetryPolicy,
    _redact_uri,
    _Retryable,
)
from weightserve.service.sources.origin.parts import (
    _fetch_checked,
    _pwrite_all,
)

log = logging.getLogger("weightserve.service")


T = TypeVar("T")


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
        self.transport: Transport = connect(address, token=token, tls=tls, timeout=timeout)
        # Origin file name -> (model id, file name) on the upstream, from the last listing.
        self._sources: dict[str, tuple[str, str]] = {}
        # Model id -> (revision, its files) as last listed.
        self._listed: dict[str, tuple[str, list[tuple[OriginFile, str, str]]]] = {}
        self._models_lock = threading.Lock()
        self._watching: LineStream | None = None  # the watch ``events`` reads, while open
        self.requests = OriginRequests()

    def _attempt(self, what: str, action: Callable[[], T]) -> T:
        """``action``, retried with backoff on transport failures and temporary refusals;
        not-found, refused tokens and other final answers are not retried."""
        last: Exception | None = None
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
        lines = self.requests.call("watch", lambda: self.transport.open_watch(None, None))
        silence = max(self.stall_seconds, WATCH_SILENCE)  # heartbeats come every few seconds
        self._watching = lines
        try:
            yield from read_events(lambda: lines.readline(silence=silence))
        finally:
            self._watching = None
            lines.close()

    def interrupt_events(self) -> None:
        """End the watch ``events`` reads now (from another thread: a node stopping), rather
        than at the upstream's next heartbeat."""
        watching = self._watching
        if watching is not None:
            watching.interrupt()

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

    @property
    def url(self) -> str:
        """The upstream's base URL (``http(s)://HOST:PORT``)."""
        return self.transport.address.url

    def revision_of(self, model: str) -> str | None:
        """The model's revision as last listed (None: not listed yet)."""
        with self._models_lock:
            listed = self._listed.get(model)
        return listed[0] if listed is not None and listed[0] else None

    def split_name(self, name: str) -> tuple[str, str]:
        """(model id, file name on the upstream) of an origin file name."""
        return self._split(name)

    def join_swarm(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        """The upstream's answer to a node joining a revision's swarm (``POST
        /v1/models/ID/-/swarm``, one attempt: a node that cannot join fills from the upstream
        alone). NotFound from an upstream without the route; only the HTTP API has it."""
        if not carries(self.transport, "join_swarm"):
            raise NotFound(f"origin {self.description}: peer fills need its HTTP API")
        return self.requests.call("swarm", lambda: self.transport.join_swarm(model, body))

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

    def _open_listed(
        self, file: OriginFile, where: tuple[str, str], offset: int, length: int
    ) -> FileSource:
        """``length`` bytes of ``file`` (at ``where``: ``_split``'s model and name) from
        ``offset``, of the version it names: OriginChanged (the answer closed) where the
        upstream holds another now."""
        model, name = where
        source = self.requests.call(
            "get", lambda: self.transport.open_file(model, name, offset, length)
        )
        if (source.etag, source.size) != (file.version, file.size):
            source.close()
            raise OriginChanged(
                f"origin {self.description}: {file.name} changed since it was listed "
                f"(size {file.size} -> {source.size}, etag {file.version} -> "
                f"{source.etag}); list it again"
            )
        return source

    def fetch(self, file: OriginFile, dest: Path, plan: FillPlan = DEFAULT_PLAN) -> str:
        where = self._split(file.name)

        def receive(fd: int, offset: int, length: int, landed: list[int]) -> None:
            """The part's bytes from ``landed[0]`` on: a retry resumes where the last attempt
            stopped, so progress counts each byte once."""
            offset, length = offset + landed[0], length - landed[0]
            source = self._open_listed(file, where, offset, length)
            try:
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
                    plan.landed(offset + done - got, got)
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
            dest, file.size, copy_part, plan, file.version,
            lambda digest: OriginChanged(
                f"origin {self.description}: {file.name} arrived with digest {digest}, not the "
                f"listed {file.version}; list it again"
            ),
        )  # fmt: skip

    def read_range(self, file: OriginFile, offset: int, length: int) -> bytes:
        where = self._split(file.name)

        def receive() -> bytes:
            source = self._open_listed(file, where, offset, length)
            try:
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
        return file_digest(path) == file.version

    def version_id(self, file: OriginFile) -> str | None:
        return None  # an upstream serves the revisions it holds: ask it for ID@R

    def delta_bytes(self, file: OriginFile, since: str, revision: str) -> int:
        """The bytes the delta stream of ``file``'s model from ``since`` to ``revision`` would
        send (``GET .../delta/size``, one attempt); NotFound from an upstream without it."""
        model, _ = self._split(file.name)
        if not carries(self.transport, "delta_size"):
            raise NotFound(f"origin {self.description}: the delta's size needs its HTTP API")
        answer = self.requests.call(
            "get", lambda: self.transport.delta_size(model, since, revision)
        )
        return int(answer["bytes"])

    def open_delta(
        self, file: OriginFile, since: str, revision: str
    ) -> tuple[UpdateTarget, DeltaUpdates]:
        """The upstream's delta stream (docs/protocol.md, "Delta updates") of the model
        ``file`` belongs to, from commit ``since`` to ``revision``; NotFound from an upstream
        too old to have the route."""
        model, _ = self._split(file.name)
        stream = self._attempt(
            f"open the update of {model}",
            lambda: self.requests.call(
                "get", lambda: self.transport.open_delta(model, since, revision)
            ),
        )
        target = UpdateTarget(
            commit=stream.header("x-weightserve-commit"),
            revision=stream.header("x-weightserve-revision"),
            base=stream.header("x-weightserve-delta-base"),
        )
        return target, DeltaUpdates(model, stream)

    def close(self) -> None:
        self.transport.close()


class DeltaUpdates(Iterator[TensorUpdate]):
    """A delta stream's updates, in the model's order; ``close`` closes its connection, read
    or not (a generator never started runs no ``finally``: its socket would be left to the
    collector, which warns)."""

    def __init__(self, model: str, stream: LineStream) -> None:
        self._model, self._stream = model, stream
        self._updates = read_updates(stream)

    def __next__(self) -> TensorUpdate:
        try:
            return next(self._updates)
        except (ServerUnreachable, DeltaCut) as e:
            self.close()
            raise ServerUnreachable(f"the update of {self._model!r} was cut off: {e}") from e
        except BaseException:  # the end, or a broken stream: done with its connection
            self.close()
            raise

    def close(self) -> None:
        self._stream.close()


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
