"""A node's fill cache: whole models copied from an origin (object storage, an upstream
weightserve) into a local directory on first use, then served from there like a local root.

Layout under the cache directory::

    data/NAME                       each file under its origin name ('/'-separated)
    data/DIR/.BASE.partial-RANDOM   a file being fetched, renamed to NAME once verified
    data/.revisions/COMMIT/ID/...   a past revision's copy, a model of its own to the cache
    state/QUOTED-ID.json            per model: each whole file's fill record
    history/QUOTED-ID.json          per model: the revisions filled (past_revisions.py)
    lock                            held by the one process that owns the directory

A file is visible under its name only once the origin verified it and it reached the disk
(fsync, then rename); the state file names a file only after its rename, so a restart reuses
exactly the files that are whole and removes everything else (partials, unrecorded files).
One lock guards the bookkeeping; fetches run outside it, one fill per model at a time.

A file's fill record is the truth about it: the origin's identity of it (size, version) and
the content digest (xxh3-128) of the bytes verified when it was filled. The node reports
that digest (ETags, revision, commit), never the bytes on its disk hashed again, and never
serves a file whose bytes no longer match it (``CacheDigests``; docs/origins.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import secrets
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable, Collection, Generator, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import watchfiles

from weightserve.client.errors import (
    CacheTooSmall,
    ModelNotFound,
    ModelUnavailable,
    OriginUnavailable,
    ResourceExhausted,
    WeightserveError,
)
from weightserve.service.sources.cache.patched_files import build_from_patches
from weightserve.service.sources.cache.stats import CacheStats
from weightserve.service.sources.files.stamps import FileStamp, file_stamp, sync_path
from weightserve.service.sources.layout import hub_repo_file, split_gguf_model
from weightserve.service.sources.revisions.content import DigestStore, FileChanged, hash_file

if TYPE_CHECKING:
    from weightserve.service.sources.origin.base import Origin, OriginFile

log = logging.getLogger("weightserve.node_cache")

# 2: each file's record holds its content digest and stamp. Files recorded by format 1
# have no digest to be checked against, so they are filled again.
STATE_FORMAT = 2
PARTIAL_MARK = ".partial-"
# How long a client refused for a full cache (every model in use) should wait: long enough
# for a stream to end, short enough that a freed cache is used soon.
FULL_RETRY_SECONDS = 5.0
# How soon a client refused for a cached file found corrupt should try again: the next
# request fills the file again from the origin.
REFILL_RETRY_SECONDS = 0.5
# Local disk errors: the cache, not the origin, is at fault, and the message says so.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
# A full file system (or quota): met by evicting idle models and writing the file again.
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# Without --cache-size the cache may take this share of its room: what it holds plus the
# file system's free space, read again before each fill.
DEFAULT_CACHE_FRACTION = 0.9
# Space never counted as room, whatever --cache-size says: 1% of the file system, at most
# 64 MiB, for the state files, the header images and whoever else writes there.
DISK_RESERVE_FRACTION = 0.01
DISK_RESERVE_MAX_BYTES = 64 << 20


# Why a model was evicted: the --cache-size bound, a full file system, an operator's evict.
class EvictionRefused(ResourceExhausted):
    """An operator's evict of a model streamed, being filled or pinned (server only: the admin
    route answers it 409 Conflict)."""


@dataclass(frozen=True)
class CacheRoom:
    """What the cache may hold, read again before each fill: the smaller of ``--cache-size``
    (or DEFAULT_CACHE_FRACTION of its room) and what its file system has room for, which is
    the bytes the cache holds there plus the free bytes, less the reserve."""

    bound: int
    disk_bound: int  # all the cache could hold if it evicted everything: held + free - reserve
    disk_free: int  # the file system's free bytes (as an unprivileged writer sees them)
    held: int  # the cache's bytes on that file system (whole files and partial ones)

    @property
    def by_disk(self) -> bool:
        """Whether the file system, not the configured size, sets the bound."""
        return self.bound == self.disk_bound


@dataclass(frozen=True)
class FillProgress:
    """How far a running fill is, so a server can keep its waiting clients alive."""

    model_id: str
    bytes_done: int
    bytes_total: int
    started: float  # time.monotonic() at its start


@dataclass(frozen=True)
class FillRecord:
    """One cached file as it was filled: the origin's identity of it (``size``, ``version``),
    the xxh3-128 ``digest`` of the bytes verified then (what the node reports and serves),
    and the file's ``stamp`` once in place (a file with another stamp is hashed again)."""

    size: int
    version: str
    digest: str
    stamp: FileStamp


@dataclass
class _ModelState:
    files: dict[str, FillRecord] = field(default_factory=dict)  # by file name
    complete: bool = False  # every file of the model's last listing is among ``files``
    last_used: float = 0.0  # time.time(); the state file's mtime across restarts

    @property
    def size(self) -> int:
        return sum(record.size for record in self.files.values())


@dataclass
class _Fill:
    total: int
    remaining: int  # bytes of this fill's files not yet renamed into place (reserved space)
    writing: int = 0  # bytes of the file being written now (allocated on disk up front)
    started: float = field(default_factory=time.monotonic)
    done_bytes: int = 0
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    landing: dict[str, LandedFile] = field(default_factory=dict)  # this fill's files, by name


class LandedFile:
    """One file of a running fill as far as its bytes have landed, for a reader that streams
    it before the fill ends (``follow``). What is readable is the contiguous prefix written so
    far, less its last byte until the file is whole, verified and in place: a file that fails
    its final check never reaches a reader whole."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._path: Path | None = None  # the partial being written, then the file in place
        self._prefix = 0
        self._by_start: dict[int, int] = {}  # spans landed past the prefix, start -> end
        self._by_end: dict[int, int] = {}
        self._whole = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    def _started(self, partial: Path) -> None:
        with self._changed:  # a file written again starts from nothing
            self._path, self._prefix, self._by_start, self._by_end = partial, 0, {}, {}
            self._changed.notify_all()

    def _landed(self, offset: int, length: int) -> None:
        start, end = offset, offset + length
        with self._changed:
            if start in self._by_end:  # join the spans this one touches
                start = self._by_end.pop(start)
                del self._by_start[start]
            if end in self._by_start:
                end_of_next = self._by_start.pop(end)
                del self._by_end[end_of_next]
                end = end_of_next
            if start <= self._prefix:
                self._prefix = max(self._prefix, end)
                self._changed.notify_all()
            else:
                self._by_start[start], self._by_end[end] = end, start

    def _placed(self, target: Path) -> None:
        with self._changed:
            self._path, self._prefix, self._whole = target, self.size, True
            self._changed.notify_all()

    def _failed(self, error: BaseException) -> None:
        with self._changed:
            if not self._whole:
                self._error = error
                self._changed.notify_all()

    def _readable(self) -> int:
        return self._prefix if self._whole else min(self._prefix, self.size - 1)

    def follow(
        self, start: int, stop: int, idle: float, piece: int = 1 << 20
    ) -> Generator[bytes, None, None]:
        """The bytes ``[start, stop)`` as they land, ``piece`` at most at a time; ``b""``
        after each ``idle`` seconds with nothing new (the caller's turn to look at its
        client). Raises the fill's error once it fails."""
        fd, opened = -1, None

        def news() -> bool:
            return self._error is not None or self._readable() > start

        try:
            while start < stop:
                with self._changed:
                    self._changed.wait_for(news, idle)
                    if self._error is not None:
                        raise self._error
                    readable, path = self._readable(), self._path
                if readable <= start or path is None:
                    yield b""
                    continue
                if path != opened:  # the partial renamed into place, or written again
                    try:
                        new_fd = os.open(path, os.O_RDONLY)
                    except FileNotFoundError:
                        continue  # renamed meanwhile: the new path is known now
                    if fd >= 0:
                        os.close(fd)
                    fd, opened = new_fd, path
                data = os.pread(fd, min(start + piece, readable, stop) - start, start)
                if not data:
                    raise OSError(f"{path.name} ended at byte {start} while being followed")
                start += len(data)
                yield data
        finally:
            if fd >= 0:
                os.close(fd)


class NodeCache:
    """Whole models of ``origin`` kept in ``cache_dir`` within ``size_limit_bytes`` (None:
    DEFAULT_CACHE_FRACTION of its room) and within what its file system has free (``room``).

    A model is the set of origin files the caller names for an id: the id is the model's path
    below the origin's prefix, and each file is the id itself (a single-file model) or lies
    under ``ID/`` (the parts of a split GGUF lie beside it). Models are filled whole on first
    use, evicted whole, least recently used first; never while in use (``using``), being
    filled, or pinned. A fill that finds the file system full (ENOSPC, EDQUOT) evicts idle
    models and writes the file again.
    """

    def __init__(
        self,
        origin: Origin,
        cache_dir: str | os.PathLike[str],
        size_limit_bytes: int | None,
        *,
        concurrency: int = 8,
        part_bytes: int = 16 << 20,
        pins: Iterable[str] = (),
        watch: bool = False,
    ) -> None:
        if size_limit_bytes is not None and size_limit_bytes <= 0:
            raise ValueError(f"the cache size must be positive, not {size_limit_bytes} bytes")
        self.origin = origin
        self.directory = Path(cache_dir)
        self.data_dir = self.directory / "data"
        self._state_dir = self.directory / "state"
        self.size_limit_bytes = size_limit_bytes
        self.concurrency = concurrency
        self.part_bytes = part_bytes
        self.pins = frozenset(_checked_name(pin, "pinned model id") for pin in pins)
        self.stats = CacheStats()
        # Called (outside the lock) after models were evicted, before their space is counted
        # on: whoever maps cached files lets go of the evicted ones, or the space stays used.
        self.on_evict: Callable[[], None] | None = None
        self._evicted_unreleased = False
        self._lock = threading.Lock()
        self._states: dict[str, _ModelState] = {}
        self._fills: dict[str, _Fill] = {}
        self._holds: dict[str, int] = {}
        # Why a model's file was dropped, until it is filled again (for a clear refusal).
        self._corruptions: dict[str, str] = {}
        # Files whose bytes this process hashed at this stamp (filled, or checked since).
        self._verified: set[tuple[str, FileStamp]] = set()
        for directory in (self.data_dir, self._state_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self._data_real = self.data_dir.resolve()  # catalogs name files by resolved paths
        self._lock_file = _lock_directory(self.directory)
        self._load()
        self._stop_watching = threading.Event()
        if watch:  # the files changed on disk are checked as the kernel reports them
            threading.Thread(
                target=self._watch, name="weightserve-cache-watch", daemon=True
            ).start()

    # -- public API --------------------------------------------------------------------------

    def model_path(self, model_id: str) -> Path:
        """Where the model lies in the cache: its directory, or its file for a one-file model."""
        return self.data_dir / _checked_name(model_id, "model id")

    def ensure(self, model_id: str, files: list[OriginFile] | None = None) -> Path:
        """The model's path in the cache, filled first if any of its files is missing or stale.

        ``files`` is the origin's current listing of the model: files whose version or size
        differ from the cached ones are fetched again, the others kept. ``None`` means the
        listing is not at hand (the origin could not be listed): a cached model is returned as
        it is, an uncached one is listed and filled. Concurrent calls for one model run one
        fill; the others wait for it and see its error if it fails.
        """
        model_path = self.model_path(model_id)
        if files is not None:
            _check_files(model_id, files)
            if not files:
                raise ModelNotFound(
                    f"model {model_id!r}: the listing given for it names no file; list the "
                    f"origin {self.origin.description} again"
                )
        waited = False
        while True:
            stale: list[OriginFile] | None = None  # None: the listing is needed first
            with self._lock:
                fill = self._fills.get(model_id)
                if fill is None:
                    state = self._states.get(model_id)
                    if files is not None:
                        stale = self._stale(state, files)
                    elif state is not None and state.complete:
                        stale = []
                    if stale == []:
                        if files is not None:
                            self._record_whole(model_id, files)
                        self._count_use(model_id, hit=not waited)
                    elif stale is not None:
                        assert files is not None
                        fill = self._start_fill(model_id, files, stale)
                        break
            if stale == []:
                self.touch(model_id)
                return model_path
            if fill is None:
                files = self._list_model(model_id)
                continue
            # Another thread fills this model: wait for it, then look again (a hit now).
            fill.finished.wait()
            if fill.error is not None:
                raise fill.error
            waited = True
        assert files is not None and stale
        self._run_fill(model_id, files, stale, fill)
        return model_path

    @contextlib.contextmanager
    def using(self, model_id: str, files: list[OriginFile] | None = None) -> Iterator[Path]:
        """``ensure`` the model and keep it from eviction until the block ends (a stream)."""
        with self._lock:
            self._holds[model_id] = self._holds.get(model_id, 0) + 1
        try:
            yield self.ensure(model_id, files)
        finally:
            with self._lock:
                self._holds[model_id] -= 1
                if not self._holds[model_id]:
                    del self._holds[model_id]
            self.touch(model_id)

    def touch(self, model_id: str) -> None:
        """Mark the model used now (least-recently-used order survives a restart)."""
        with self._lock:
            state = self._states.get(model_id)
            if state is None:
                return
            state.last_used = time.time()
        with contextlib.suppress(OSError):
            os.utime(self._state_path(model_id), (state.last_used, state.last_used))

    def warm(self, listing: list[OriginFile] | None = None) -> None:
        """Fill the pinned models (at start). Without a ``listing`` the origin is listed once;
        if that fails, pinned models already cached are kept as they are."""
        if not self.pins:
            return
        if listing is None:
            with contextlib.suppress(OriginUnavailable):
                listing = self._list_origin()
        for pin in sorted(self.pins):
            files = None if listing is None else _model_files(pin, listing)
            if files == []:
                raise ModelNotFound(
                    f"pinned model {pin!r}: the origin {self.origin.description} holds no file "
                    f"named {pin!r} or under {pin + '/'!r}"
                )
            self.ensure(pin, files)

    def landed(self, model_id: str, name: str) -> LandedFile | None:
        """The file ``name`` of the model's running fill, to follow as it lands; None when no
        fill runs or this one does not fetch that file (it is held already)."""
        with self._lock:
            fill = self._fills.get(model_id)
            return fill.landing.get(name) if fill is not None else None

    def progress(self, model_id: str) -> FillProgress | None:
        """The running fill of the model, or None when none runs."""
        with self._lock:
            fill = self._fills.get(model_id)
            if fill is None:
                return None
            return FillProgress(model_id, fill.done_bytes, fill.total, fill.started)

    def evict(self, model_id: str) -> int:
        """Remove the whole model now (an operator's evict): the bytes freed. EvictionRefused
        while it is streamed, being filled or pinned; ModelNotFound when it is not held."""
        with self._lock:
            holds = self._holds.get(model_id, 0)
            refusal = (
                "is pinned (--pin): pinned models are never evicted"
                if model_id in self.pins
                else "is being filled; evict it once the fill ends"
                if model_id in self._fills
                else f"is in use by {holds} stream(s); evict it when they end"
                if holds
                else None
            )
            if refusal is not None:
                temporary = model_id not in self.pins
                raise EvictionRefused(
                    f"model {model_id!r} {refusal}",
                    retry_after=FULL_RETRY_SECONDS if temporary else None,
                )
            if model_id not in self._states:
                raise ModelNotFound(f"model {model_id!r} is not in this node's cache")
            freed = self._evict(model_id, "operator")
        self._release_evicted()
        return freed

    def cached_models(self) -> list[str]:
        """Ids of the models held whole (servable even while the origin is down)."""
        with self._lock:
            return sorted(m for m, state in self._states.items() if state.complete)

    def holds(self, model_id: str, files: Collection[OriginFile]) -> bool:
        """Whether the model is held whole as ``files`` (the origin's listing of it) name it:
        by its fill records, each file of the listed size and version and no other file."""
        with self._lock:
            state = self._states.get(model_id)
            if state is None or not state.complete:
                return False
            recorded = {name: (r.size, r.version) for name, r in state.files.items()}
        return recorded == {f.name: (f.size, f.version) for f in files}

    def records(self, model_id: str) -> dict[str, FillRecord]:
        """The fill records of the model held whole, by file name ({} when it is not)."""
        with self._lock:
            state = self._states.get(model_id)
            return dict(state.files) if state is not None and state.complete else {}

    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes_used()

    def room(self) -> CacheRoom:
        """The bound the next fill meets, with the file system's free space, read now."""
        with self._lock:
            return self._room()

    def snapshot(self) -> CacheStats:
        """A consistent copy of the counters, with the gauges filled in."""
        with self._lock:
            models = sum(state.complete for state in self._states.values())
            room = self._room()
            return replace(
                self.stats,
                bytes_used=self._bytes_used(),
                models_cached=models,
                origin_requests=self.origin.requests.snapshot(),
                evictions_by_reason=dict(self.stats.evictions_by_reason),
                evicted_bytes_by_reason=dict(self.stats.evicted_bytes_by_reason),
                bound_bytes=room.bound,
                disk_free_bytes=room.disk_free,
                origin_bytes_by_kind={
                    **self.origin.requests.bytes_received(),
                    "fill": self.stats.origin_bytes,
                },
            )

    def close(self) -> None:
        """Release the cache directory for another process (a restarted server)."""
        self._stop_watching.set()
        self._lock_file.close()

    def __enter__(self) -> NodeCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- verification ------------------------------------------------------------------------

    def check(self, model_id: str, *, full: bool = False) -> None:
        """Drop the model's cached files that no longer match their fill record (one ``stat``
        each; a file whose stamp changed is hashed again; with ``full`` every file is hashed,
        which also finds bytes changed under an unchanged stamp), so its next use fills them
        again. Nothing is checked while the model is being filled."""
        with self._lock:
            state = self._states.get(model_id)
            if state is None or model_id in self._fills:
                return
            records = list(state.files.items())
        for name, record in records:
            self._verify(model_id, name, record, full=full)

    def check_all(self) -> None:
        """``check`` every cached model (a rescan)."""
        with self._lock:
            model_ids = list(self._states)
        for model_id in model_ids:
            self.check(model_id)

    def corruption(self, model_id: str) -> str | None:
        """Why a file of the model was dropped as corrupt, until the model is filled again."""
        with self._lock:
            return self._corruptions.get(model_id)

    def recorded_digest(self, path: Path, stamp: FileStamp) -> str:
        """The content digest a cached file was filled with, for the file as of ``stamp``.

        The fill record answers, never the bytes on disk: a file whose stamp is not the
        recorded one is hashed only to tell whether it still matches; one that does not is
        dropped (ModelUnavailable, the client retries and the model is filled again).
        FileChanged when ``path`` is no longer that file (the caller re-indexes).
        """
        model_id, name, record = self._recorded(path)
        if record.stamp != stamp:
            if not self._verify(model_id, name, record):
                raise self._refusal(model_id)
            model_id, name, record = self._recorded(path)
            if record.stamp != stamp:
                raise FileChanged(f"{path.name} changed since it was indexed")
        return record.digest

    def check_mapped(self, path: Path, stamp: FileStamp) -> None:
        """Before a cached file's first bytes are served from a new mapping: its bytes must
        hash to the fill record's digest (once per file version and process), so chunk
        digests are only ever computed from verified bytes. ModelUnavailable if they do not
        (the file is dropped and filled again on the next request)."""
        try:
            model_id, name, record = self._recorded(path)
        except FileChanged as e:
            raise ModelUnavailable(
                f"{e}; the model reloads on its next request", retry_after=REFILL_RETRY_SECONDS
            ) from None
        with self._lock:
            if (name, stamp) in self._verified and record.stamp == stamp:
                return
        if record.stamp != stamp:
            if not self._verify(model_id, name, record):
                raise self._refusal(model_id)
            return
        try:
            digest = hash_file(path, stamp)
        except (FileChanged, OSError) as e:
            raise ModelUnavailable(
                f"{path.name} changed since it was indexed ({e}); the model reloads on its "
                "next request",
                retry_after=REFILL_RETRY_SECONDS,
            ) from None
        if digest != record.digest:
            self._drop_corrupt(model_id, name, record, f"xxh3-128 {digest}")
            raise self._refusal(model_id)
        with self._lock:
            self._verified.add((name, stamp))

    def _watch(self) -> None:
        """Check each cached file the kernel reports changed (inotify through watchfiles) until
        ``close``: one written in place is dropped once the writes settle, before a request
        asks for it. Unrecorded names (partials) and models being filled are skipped; the
        checks at each request and rescan remain where events are missed."""
        try:
            for changes in watchfiles.watch(
                self.data_dir,
                stop_event=self._stop_watching,
                debounce=500,
                rust_timeout=1000,
                yield_on_timeout=False,
                raise_interrupt=False,
            ):
                for _, changed in changes:
                    try:
                        name = Path(changed).relative_to(self.data_dir).as_posix()
                    except ValueError:
                        continue
                    with self._lock:
                        found = [
                            (model_id, state.files[name])
                            for model_id, state in self._states.items()
                            if name in state.files and model_id not in self._fills
                        ]
                    for model_id, record in found:
                        self._verify(model_id, name, record)
        except Exception as e:  # e.g. the inotify watch limit: requests and rescans still check
            log.warning("watching the node cache %s stopped: %s", self.data_dir, e)

    def _recorded(self, path: Path) -> tuple[str, str, FillRecord]:
        """(model id, file name, fill record) of a file under the data directory."""
        try:
            name = path.relative_to(self._data_real).as_posix()
        except ValueError:
            name = path.relative_to(self.data_dir).as_posix()
        with self._lock:
            for model_id, state in self._states.items():
                record = state.files.get(name)
                if record is not None:
                    return model_id, name, record
        raise FileChanged(f"{path.name} is no longer a whole file of the node cache")

    def _refusal(self, model_id: str) -> ModelUnavailable:
        reason = self.corruption(model_id) or "a file of it no longer matches its fill record"
        return ModelUnavailable(
            f"model {model_id!r}: {reason}; it is filled again from the origin on its next request",
            retry_after=REFILL_RETRY_SECONDS,
        )

    def _verify(self, model_id: str, name: str, record: FillRecord, *, full: bool = False) -> bool:
        """Whether a cached file still is what its record says: one ``stat`` while its stamp
        is the recorded one (unless ``full``), else its bytes hashed again (a match is
        recorded with the new stamp). A file that does not match is dropped, logged and
        counted."""
        path = self.data_dir / name
        try:
            stamp = file_stamp(path.stat())
        except OSError:
            self._drop(model_id, name, record)  # gone: filled again, nothing was served
            return False
        if stamp == record.stamp and not full:
            return True
        if stamp.size != record.size:
            found = f"{stamp.size} bytes"
        else:
            try:
                digest = hash_file(path, stamp)
            except (FileChanged, OSError) as e:
                found = f"a file changing while it was read ({e})"
            else:
                if digest == record.digest:
                    with self._lock:
                        state = self._states.get(model_id)
                        if state is not None and state.files.get(name) is record:
                            state.files[name] = replace(record, stamp=stamp)
                            self._save(model_id)
                        self._verified.add((name, stamp))
                    return True
                found = f"xxh3-128 {digest}"
        self._drop_corrupt(model_id, name, record, found)
        return False

    def _drop_corrupt(self, model_id: str, name: str, record: FillRecord, found: str) -> None:
        message = (
            f"{name} in the node cache does not match what was filled from "
            f"{self.origin.description} (expected {record.size} bytes with xxh3-128 "
            f"{record.digest}, found {found})"
        )
        if self._drop(model_id, name, record, message):
            log.warning("%s; it is not served and is filled again", message)

    def _drop(
        self, model_id: str, name: str, record: FillRecord, corruption: str | None = None
    ) -> bool:
        """Forget one file of the model and remove it (the model is no longer whole); False
        when it was refilled or dropped meanwhile."""
        with self._lock:
            state = self._states.get(model_id)
            if state is None or state.files.get(name) is not record:
                return False
            del state.files[name]
            state.complete = False
            self._save(model_id)
            self._remove_data(name)
            if corruption is not None:
                self.stats.corrupt_files += 1
                self._corruptions[model_id] = corruption
            return True

    # -- filling -----------------------------------------------------------------------------

    def _list_origin(self) -> list[OriginFile]:
        try:
            return self.origin.list_files()
        except BaseException:
            with self._lock:
                self.stats.origin_failures += 1
            raise

    def _list_model(self, model_id: str) -> list[OriginFile]:
        files = _model_files(model_id, self._list_origin())
        if not files:
            raise ModelNotFound(
                f"model {model_id!r}: the origin {self.origin.description} holds no file named "
                f"{model_id!r} or under {model_id + '/'!r}"
            )
        return files

    def _stale(self, state: _ModelState | None, files: list[OriginFile]) -> list[OriginFile]:
        """The files that must be fetched: absent, of another version, or not whole on disk."""
        recorded = state.files if state is not None else {}
        stale = []
        for file in files:
            record = recorded.get(file.name)
            if record is None or (record.size, record.version) != (file.size, file.version):
                stale.append(file)
                continue
            try:
                whole = (self.data_dir / file.name).stat().st_size == file.size
            except OSError:
                whole = False
            if not whole:
                stale.append(file)
        return stale

    def _start_fill(self, model_id: str, files: list[OriginFile], stale: list[OriginFile]) -> _Fill:
        """Make room (under the lock) and register the fill that this thread will run."""
        total = sum(f.size for f in files)
        room = self._room()
        if total > room.bound and room.by_disk:
            raise CacheTooSmall(
                f"model {model_id!r} is {_bytes(total)}, more than the node cache "
                f"{self.directory} can hold on its file system: {_bytes(room.held)} held by the "
                f"cache and {_bytes(room.disk_free)} free, less "
                f"{_bytes(room.held + room.disk_free - room.disk_bound)} kept free; free space "
                "there, give the cache a larger --cache-dir, or serve this model from another "
                "server"
            )
        if total > room.bound:
            raise CacheTooSmall(
                f"model {model_id!r} is {_bytes(total)}, larger than the whole node cache "
                f"({_bytes(room.bound)}, {self._bound_name()}): give the cache more room "
                "or serve this model from another server"
            )
        self._evict_for(model_id, total, room)
        fill = _Fill(total=sum(f.size for f in stale), remaining=sum(f.size for f in stale))
        fill.landing = {f.name: LandedFile(f.size) for f in stale}
        self._fills[model_id] = fill
        self._states.setdefault(model_id, _ModelState(last_used=time.time()))
        self.stats.fills += 1
        self.stats.misses += 1
        return fill

    def _run_fill(
        self, model_id: str, files: list[OriginFile], stale: list[OriginFile], fill: _Fill
    ) -> None:
        try:
            self._release_evicted()  # the room made for this fill, freed before it is written
            built = self._build_patched(model_id, files, stale)
            try:
                for file in sorted(stale, key=lambda f: f.name):
                    self._fetch_file(model_id, file, fill, built.pop(file.name, None))
            finally:
                for partial, _ in built.values():  # a fill that failed before placing them
                    partial.unlink(missing_ok=True)
            self._finish(model_id, files)
        except BaseException as e:
            fill.error = e
            for landing in fill.landing.values():
                landing._failed(e)
            with self._lock:
                self.stats.fill_failures += 1
            log.warning("filling model %r from %s failed: %s", model_id, self.origin.description, e)
            raise
        finally:
            with self._lock:
                del self._fills[model_id]
                self.stats.fill_seconds += time.monotonic() - fill.started
            fill.finished.set()

    def _partial(self, file: OriginFile) -> Path:
        target = self.data_dir / file.name
        return target.with_name(f".{target.name}{PARTIAL_MARK}{secrets.token_hex(6)}")

    def _build_patched(
        self, model_id: str, files: list[OriginFile], stale: list[OriginFile]
    ) -> dict[str, tuple[Path, str]]:
        """The stale files built here from the held copy and the upstream's patch (a whole
        copy held, an upstream weightserve): by name, the built file and its digest."""
        with self._lock:
            state = self._states.get(model_id)
            if state is None or not state.complete:
                return {}
            held = [(name, r.size, r.version) for name, r in state.files.items()]
        return build_from_patches(
            self.origin, model_id, held, files, stale, self.data_dir, self._partial
        )

    def _fetch_file(
        self, model_id: str, file: OriginFile, fill: _Fill, built: tuple[Path, str] | None = None
    ) -> None:
        """Fetch ``file`` and put it in place with its fill record; ``built``: its bytes are
        already here (a file built from a patch, and its digest), only to be put in place."""
        target = self.data_dir / file.name
        partial = built[0] if built is not None else self._partial(file)

        landed = 0  # this file's bytes counted in the fill's progress

        def on_bytes(n: int) -> None:
            nonlocal landed
            with self._lock:
                fill.done_bytes += n
                landed += n
                self.stats.origin_bytes += n

        digest: str | None = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if built is not None:
                digest = built[1]
                with self._lock:  # progress counts the file; origin_bytes only what was fetched
                    fill.done_bytes += file.size
            while built is None:
                with self._lock:
                    fill.writing = file.size
                landing = fill.landing.get(file.name)
                if landing is not None:
                    landing._started(partial)
                try:
                    digest = self.origin.fetch(
                        file,
                        partial,
                        concurrency=self.concurrency,
                        part_bytes=self.part_bytes,
                        on_bytes=on_bytes,
                        on_landed=landing._landed if landing is not None else None,
                    )
                    break
                except OSError as e:
                    if e.errno not in _DISK_FULL_ERRNOS:
                        with self._lock:
                            self.stats.origin_failures += 1
                        raise
                    # This file is written again from its start (the files before it stay):
                    # its bytes so far no longer count as progress.
                    partial.unlink(missing_ok=True)
                    with self._lock:
                        fill.writing, fill.done_bytes, landed = 0, fill.done_bytes - landed, 0
                    log.warning(
                        "the node cache %s is full writing %s (%s); evicting idle models",
                        self.directory, file.name, e.strerror,
                    )  # fmt: skip
                    self._make_disk_room(model_id, file, e)
                except BaseException:
                    with self._lock:
                        self.stats.origin_failures += 1
                    raise
            size = partial.stat().st_size
            if size != file.size:
                raise OriginUnavailable(
                    f"{self.origin.description}: {file.name} arrived with {size} bytes where "
                    f"the listing said {file.size}; the object may be changing, try again"
                )
            if digest is None:  # the origin did not hash what it wrote: the record needs it
                digest = hash_file(partial, file_stamp(partial.stat()))
            sync_path(partial)
            with self._lock:
                state = self._states[model_id]
                # Forget the old version before its bytes are replaced: a crash in between
                # must not leave the new bytes recorded as the old version, nor the model as
                # whole while it mixes versions.
                if state.files.pop(file.name, None) is not None or state.complete:
                    state.complete = False
                    self._save(model_id)
                os.replace(partial, target)
                if (landing := fill.landing.get(file.name)) is not None:
                    landing._placed(target)
                stamp = file_stamp(target.stat())
                state.files[file.name] = FillRecord(file.size, file.version, digest, stamp)
                self._verified.add((file.name, stamp))
                fill.remaining -= file.size
                fill.writing = 0
                self._save(model_id)
        except WeightserveError:
            raise
        except OSError as e:
            if e.errno in _DISK_ERRNOS:
                raise ModelUnavailable(
                    f"model {model_id!r}: the node cache {self.directory} could not store "
                    f"{file.name}: {e.strerror}; free space or give the cache another directory"
                ) from e
            raise OriginUnavailable(
                f"{self.origin.description}: fetching {file.name} failed: {e}"
            ) from e
        except Exception as e:
            raise OriginUnavailable(
                f"{self.origin.description}: fetching {file.name} failed: {type(e).__name__}: {e}"
            ) from e
        finally:
            partial.unlink(missing_ok=True)

    def _finish(self, model_id: str, files: list[OriginFile]) -> None:
        with self._lock:
            self._record_whole(model_id, files)
            self._corruptions.pop(model_id, None)

    def _record_whole(self, model_id: str, files: list[OriginFile]) -> None:
        """Record the model whole (under the lock); drop files its listing no longer has."""
        state = self._states[model_id]
        names = {f.name for f in files}
        gone = [name for name in state.files if name not in names]
        if state.complete and not gone:
            return
        for name in gone:
            del state.files[name]
            self._remove_data(name)
        state.complete = True
        self._save(model_id)

    # -- eviction ----------------------------------------------------------------------------

    def _bytes_used(self) -> int:
        used = 0
        for model_id, state in self._states.items():
            fill = self._fills.get(model_id)
            used += state.size + (fill.remaining if fill else 0)
        return used

    def _bytes_on_disk(self) -> int:
        """The cache's bytes on its file system now: whole files and the files being written
        (allocated whole before their first byte)."""
        held = sum(state.size for state in self._states.values())
        return held + sum(fill.writing for fill in self._fills.values())

    def _room(self) -> CacheRoom:
        """The bound as of now (under the lock): statvfs is read again on every call, so the
        bound follows the file system as others write to it or free it."""
        usage = shutil.disk_usage(self.directory)
        held = self._bytes_on_disk()
        disk_bound = max(0, held + usage.free - _disk_reserve(usage.total))
        configured = (
            self.size_limit_bytes
            if self.size_limit_bytes is not None
            else int((held + usage.free) * DEFAULT_CACHE_FRACTION)
        )
        return CacheRoom(min(configured, disk_bound), disk_bound, usage.free, held)

    def _bound_name(self) -> str:
        if self.size_limit_bytes is not None:
            return "--cache-size"
        return f"{DEFAULT_CACHE_FRACTION:.0%} of its file system's room, without --cache-size"

    def _evictable(self, model_id: str) -> list[tuple[float, str]]:
        """(last used, id) of the models that may be evicted to make room for ``model_id``."""
        return [
            (state.last_used, victim)
            for victim, state in self._states.items()
            if victim != model_id
            and victim not in self.pins
            and victim not in self._holds
            and victim not in self._fills
        ]

    def _kept(self, model_id: str) -> tuple[str, bool]:
        """Which held models cannot be evicted for ``model_id`` and why, and whether that
        passes by itself (streams and fills end; pins stay)."""
        reasons, temporary = [], False
        for held, state in sorted(self._states.items()):
            if held == model_id or not state.files and held not in self._fills:
                continue
            if held in self.pins:
                why = "pinned (--pin)"
            elif held in self._fills:
                why, temporary = "being filled", True
            elif held in self._holds:
                streams = self._holds[held]
                why = f"being streamed by {streams} stream{'s' * (streams != 1)}"
                temporary = True
            else:
                continue
            reasons.append(f"{held!r} ({_bytes(state.size)}, {why})")
        return (", ".join(reasons) or "none"), temporary

    def _evict_for(self, model_id: str, total: int, room: CacheRoom) -> None:
        """Evict least-recently-used models until ``total`` bytes of ``model_id`` fit in
        ``room.bound`` (under the lock)."""
        others = self._bytes_used() - (
            self._states[model_id].size if model_id in self._states else 0
        )
        reason = "disk_full" if room.by_disk else "size"
        while others + total > room.bound:
            candidates = self._evictable(model_id)
            if not candidates:
                kept, temporary = self._kept(model_id)
                where = (
                    f"the file system of the node cache {self.directory} has room for "
                    f"{_bytes(room.bound)} of the cache ({_bytes(room.disk_free)} free)"
                    if room.by_disk
                    else f"the node cache {self.directory} ({_bytes(room.bound)}, "
                    f"{self._bound_name()})"
                )
                raise ResourceExhausted(
                    f"{where}: no room for model {model_id!r} ({_bytes(total)}); "
                    f"{_bytes(others)} are held by models that cannot be evicted: {kept}; "
                    + (
                        "try again shortly"
                        if temporary
                        else "unpin some or give the cache more room"
                    ),
                    retry_after=FULL_RETRY_SECONDS if temporary else None,
                )
            _, victim = min(candidates)
            others -= self._evict(victim, reason)

    def _make_disk_room(self, model_id: str, file: OriginFile, error: OSError) -> None:
        """The file system was full writing ``file``: evict least-recently-used idle models
        until it has room for the file, so that it can be written again; a clear refusal
        when nothing can be evicted."""
        with self._lock:
            usage = shutil.disk_usage(self.directory)
            short = file.size + _disk_reserve(usage.total) - usage.free
            evicted = 0
            # At least one model's bytes: the write failed whatever statvfs says (a quota,
            # space still mapped by a stream that just ended).
            while evicted == 0 or evicted < short:
                candidates = self._evictable(model_id)
                if not candidates:
                    break
                evicted += self._evict(min(candidates)[1], "disk_full")
            if not evicted:
                kept, temporary = self._kept(model_id)
                message = (
                    f"model {model_id!r}: the node cache {self.directory} ran out of disk "
                    f"space writing {file.name} ({error.strerror}): it needs "
                    f"{_bytes(file.size)} and its file system has {_bytes(usage.free)} free; "
                    f"nothing more could be evicted (models held that cannot be: {kept}); "
                )
                if temporary:
                    raise ResourceExhausted(
                        message + "try again shortly", retry_after=FULL_RETRY_SECONDS
                    ) from error
                raise CacheTooSmall(
                    message + "free space on that file system or give the cache another "
                    "directory (--cache-dir)"
                ) from error
        self._release_evicted()

    def _evict(self, model_id: str, reason: str) -> int:
        # The state file goes first: a crash midway leaves unrecorded files, removed at start.
        state = self._states.pop(model_id)
        self._state_path(model_id).unlink(missing_ok=True)
        for name in state.files:
            self._remove_data(name)
        self.stats.evictions += 1
        self.stats.evicted_bytes += state.size
        counts, sizes = self.stats.evictions_by_reason, self.stats.evicted_bytes_by_reason
        counts[reason] = counts.get(reason, 0) + 1
        sizes[reason] = sizes.get(reason, 0) + state.size
        self._evicted_unreleased = True
        log.info(
            "evicted model %r (%s) from the node cache (%s)", model_id, _bytes(state.size), reason
        )
        return state.size

    def _release_evicted(self) -> None:
        """Tell ``on_evict`` (outside the lock) that models were evicted: their files' space
        is freed only once nothing maps them any more."""
        with self._lock:
            evicted, self._evicted_unreleased = self._evicted_unreleased, False
        if evicted and self.on_evict is not None:
            self.on_evict()

    def _remove_data(self, name: str) -> None:
        path = self.data_dir / name
        path.unlink(missing_ok=True)
        # Empty directories left behind would shadow nothing but clutter listings.
        for parent in path.parents:
            if parent == self.data_dir or not parent.is_relative_to(self.data_dir):
                break
            try:
                parent.rmdir()
            except OSError:
                break

    # -- state files -------------------------------------------------------------------------

    def _count_use(self, model_id: str, *, hit: bool) -> None:
        if hit:
            self.stats.hits += 1
        else:
            self.stats.misses += 1  # waited for another caller's fill

    def _state_path(self, model_id: str) -> Path:
        return self._state_dir / (urllib.parse.quote(model_id, safe="") + ".json")

    def _save(self, model_id: str) -> None:
        state = self._states[model_id]
        document = {
            "format": STATE_FORMAT,
            "model": model_id,
            "complete": state.complete,
            "files": {
                name: {
                    "size": record.size,
                    "version": record.version,
                    "digest": record.digest,
                    "stamp": list(record.stamp),
                }
                for name, record in sorted(state.files.items())
            },
        }
        path = self._state_path(model_id)
        temporary = path.with_name(f".{path.name}{PARTIAL_MARK}{secrets.token_hex(6)}")
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)

    def _load(self) -> None:
        """Read the state files; drop files that no longer match their fill record (a stat
        each; one whose stamp changed is hashed again); remove partials and files no whole
        model records."""
        for path in sorted(self._state_dir.iterdir()):
            if PARTIAL_MARK in path.name or path.suffix != ".json":
                path.unlink(missing_ok=True)
                continue
            try:
                document = json.loads(path.read_text(encoding="utf-8"))
                model_id = _checked_name(document["model"], "model id")
                if document.get("format") == 1:
                    # No digest to check the files against: they are filled again.
                    log.info("node cache state %s has no fill digests; refilling", path)
                    files: dict[str, FillRecord] = {}
                elif document.get("format") != STATE_FORMAT:
                    raise ValueError(f"unknown format {document.get('format')!r}")
                else:
                    files = {
                        _checked_name(name, "file name"): FillRecord(
                            int(entry["size"]),
                            str(entry["version"]),
                            str(entry["digest"]),
                            FileStamp(*(int(n) for n in entry["stamp"])),
                        )
                        for name, entry in document["files"].items()
                    }
                complete = bool(document["complete"]) and bool(files)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                log.warning("ignoring unreadable node cache state %s: %s", path, e)
                path.unlink(missing_ok=True)
                continue
            self._states[model_id] = _ModelState(
                dict(files), complete, last_used=path.stat().st_mtime
            )
            for name, record in files.items():
                self._verify(model_id, name, record)
        recorded = {name for state in self._states.values() for name in state.files}
        for root, _, names in os.walk(self.data_dir):
            for name in names:
                path = Path(root, name)
                if path.relative_to(self.data_dir).as_posix() not in recorded:
                    log.info("removing %s from the node cache: no whole model records it", path)
                    self._remove_data(path.relative_to(self.data_dir).as_posix())


class CacheDigests(DigestStore):
    """The content digests a catalog of the cache's data directory reports: the fill
    records' (``NodeCache.recorded_digest``), so every node caching the same origin content
    reports the origin's ETags, revision and commit; and each new mapping of a cached file is
    checked against them before its first byte is served (``NodeCache.check_mapped``)."""

    def __init__(self, cache: NodeCache) -> None:
        super().__init__()
        self.cache = cache

    def digest(self, path: Path, stamp: FileStamp) -> str:
        return self.cache.recorded_digest(path, stamp)

    def content_check(self, path: Path) -> Callable[[FileStamp], None] | None:
        return functools.partial(self.cache.check_mapped, path)


def _belongs(model_id: str, name: str) -> bool:
    """Whether the file ``name`` is part of the model: the id itself, a file under ``ID/``,
    or, for a split GGUF ``DIR/NAME.gguf``, one of its parts ``DIR/NAME-00001-of-00003.gguf``
    beside it (where a local root has them too), or a file of its hub cache repository
    (``[DIR/]models--ORG--NAME/...``: revisions published into a bucket)."""
    if name == model_id or name.startswith(model_id + "/") or split_gguf_model(name) == model_id:
        return True
    repository = hub_repo_file(name)
    return repository is not None and repository.model_id == model_id


def _model_files(model_id: str, listing: list[OriginFile]) -> list[OriginFile]:
    return [f for f in listing if _belongs(model_id, f.name)]


def _check_files(model_id: str, files: list[OriginFile]) -> None:
    for file in files:
        _checked_name(file.name, "file name")
        if not _belongs(model_id, file.name):
            raise ValueError(
                f"file {file.name!r} is not part of model {model_id!r}: a model's files are "
                f"{model_id!r} itself, lie under {model_id + '/'!r}, or are its split GGUF parts"
            )


def _checked_name(name: str, what: str) -> str:
    """``name`` if it is a plain relative '/'-separated path, else a clear error: a name from
    an origin must never reach outside the cache directory or pass for a partial file."""
    parts = name.split("/")
    if (
        not name
        or "\\" in name
        or "\0" in name
        or any(part in ("", ".", "..") for part in parts)
        or PARTIAL_MARK in parts[-1]
    ):
        raise ModelUnavailable(
            f"{what} {name!r} cannot be kept in the node cache: it must be a relative path "
            f"with '/' between non-empty parts, no '.' or '..' part, and no {PARTIAL_MARK!r}"
        )
    return name


def _lock_directory(directory: Path) -> BinaryIO:
    lock = open(directory / "lock", "a+b")  # noqa: SIM115 - held for the cache's lifetime
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise ModelUnavailable(
            f"the node cache directory {directory} is in use by another process; give each "
            "server its own --cache-dir"
        ) from None
    return lock


def _disk_reserve(file_system_bytes: int) -> int:
    """The bytes of a file system never counted as the cache's room."""
    return min(DISK_RESERVE_MAX_BYTES, int(file_system_bytes * DISK_RESERVE_FRACTION))


def _bytes(n: int) -> str:
    """Bytes exactly, and in the largest binary unit that fits, for error messages."""
    scaled, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if scaled < 1024 or unit == "TiB":
            break
        scaled /= 1024
    return f"{n} bytes" if unit == "B" else f"{n} bytes ({scaled:.1f} {unit})"
