"""A node's fill cache: whole models copied from an origin (object storage, an upstream
weightserve) into a local directory on first use, then served from there like a local root.

Layout under the cache directory::

    data/NAME                       each file under its origin name ('/'-separated)
    data/DIR/.BASE.partial-RANDOM   a file being fetched, renamed to NAME once verified
    data/.revisions/COMMIT/ID/...   a past revision's copy, a model of its own to the cache
    state/QUOTED-ID.json            per model: each whole file's fill record
    history/QUOTED-ID.json          per model: the revisions filled (origin/past_revisions.py)
    lock                            held by the one process that owns the directory

``NodeCache`` is the façade over its parts, which share one book (records.py: fill records,
state files, what runs, under one lock): fills (fills.py), room and eviction (room.py),
integrity checks (integrity.py); a running fill's progress and landing bytes (landing.py),
its counters (stats.py). A file is visible under its name only once the origin verified it
and it reached the disk; a restart reuses exactly the files that are whole.

A file's fill record is the truth about it: the origin's identity of it (size, version) and
the content digest (xxh3-128) of the bytes verified when it was filled. The node reports
that digest (ETags, revision, commit), never the bytes on its disk hashed again, and never
serves a file whose bytes no longer match it (``CacheDigests``; docs/origins.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from weightserve.client.errors import ModelUnavailable
from weightserve.service.sources.cache.fills import Fills
from weightserve.service.sources.cache.integrity import Integrity
from weightserve.service.sources.cache.landing import FillProgress, LandedFile
from weightserve.service.sources.cache.records import CacheBook, FillRecord, _checked_name
from weightserve.service.sources.cache.room import CacheRoom, Room
from weightserve.service.sources.cache.stats import CacheStats
from weightserve.service.sources.files.stamps import FileStamp
from weightserve.service.sources.origin.base import FillPlan

if TYPE_CHECKING:
    from weightserve.service.sources.origin.base import Origin, OriginFile
    from weightserve.service.sources.swarm.node import PeerFills


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
        on_evict: Callable[[], None] | None = None,
        peers: PeerFills | None = None,
    ) -> None:
        if size_limit_bytes is not None and size_limit_bytes <= 0:
            raise ValueError(f"the cache size must be positive, not {size_limit_bytes} bytes")
        self.origin = origin
        self.directory = Path(cache_dir)
        self.size_limit_bytes = size_limit_bytes
        self.pins = frozenset(_checked_name(pin, "pinned model id") for pin in pins)
        self.book = CacheBook(self.directory, self.pins)
        self.data_dir = self.book.data_dir
        self.stats = self.book.stats
        # Called (outside the lock) after models were evicted (``Room.on_evict``).
        self.space = Room(self.book, size_limit_bytes, on_evict)
        self.integrity = Integrity(self.book, origin.description)
        self.fills = Fills(
            self.book, self.space, origin, FillPlan(concurrency, part_bytes), peers=peers
        )
        self.peers = peers
        if peers is not None:  # an evicted model is seeded no more before its files go
            self.space.before_evict = peers.stop
        self._lock_file = _lock_directory(self.directory)
        # Files that no longer match their fill record are dropped (a stat each; one whose
        # stamp changed is hashed again), then what no whole model records is removed.
        for model_id, name, record in self.book.load():
            self.integrity.verify(model_id, name, record)
        self.book.remove_unrecorded()
        if watch:  # the files changed on disk are checked as the kernel reports them
            self.integrity.start_watching()
        if peers is not None:  # what the node held before a restart is seeded again
            threading.Thread(target=self._seed_held, name="swarm-seed-held", daemon=True).start()

    def _seed_held(self) -> None:
        assert self.peers is not None
        for model_id in self.book.cached_models():
            held = {
                name: (self.data_dir / name, record.digest)
                for name, record in self.book.records(model_id).items()
            }
            if held:
                self.peers.seed(model_id, held)

    # -- filling -----------------------------------------------------------------------------

    def model_path(self, model_id: str) -> Path:
        """Where the model lies in the cache: its directory, or its file for a one-file model."""
        return self.book.model_path(model_id)

    def ensure(self, model_id: str, files: list[OriginFile] | None = None) -> Path:
        """The model's path in the cache, filled first if any of its files is missing or stale
        (``Fills.ensure``)."""
        return self.fills.ensure(model_id, files)

    @contextlib.contextmanager
    def using(self, model_id: str, files: list[OriginFile] | None = None) -> Iterator[Path]:
        """``ensure`` the model and keep it from eviction until the block ends (a stream)."""
        with self.book.lock:
            self.book.holds[model_id] = self.book.holds.get(model_id, 0) + 1
        try:
            yield self.ensure(model_id, files)
        finally:
            with self.book.lock:
                self.book.holds[model_id] -= 1
                if not self.book.holds[model_id]:
                    del self.book.holds[model_id]
            self.book.touch(model_id)

    def touch(self, model_id: str) -> None:
        """Mark the model used now (least-recently-used order survives a restart)."""
        self.book.touch(model_id)

    def warm(self, listing: list[OriginFile] | None = None) -> None:
        """Fill the pinned models (at start; ``Fills.warm``)."""
        self.fills.warm(listing)

    def landed(self, model_id: str, name: str) -> LandedFile | None:
        """The file ``name`` of the model's running fill, to follow as it lands."""
        return self.fills.landed(model_id, name)

    def progress(self, model_id: str) -> FillProgress | None:
        """The running fill of the model, or None when none runs."""
        return self.fills.progress(model_id)

    # -- what it holds -----------------------------------------------------------------------

    def evict(self, model_id: str) -> int:
        """Remove the whole model now (an operator's evict): the bytes freed (``Room``)."""
        return self.space.evict_now(model_id)

    def cached_models(self) -> list[str]:
        """Ids of the models held whole (servable even while the origin is down)."""
        return self.book.cached_models()

    def holds(self, model_id: str, files: Collection[OriginFile]) -> bool:
        """Whether the model is held whole as ``files`` (the origin's listing of it) name it."""
        return self.book.holds_whole(model_id, files)

    def records(self, model_id: str) -> dict[str, FillRecord]:
        """The fill records of the model held whole, by file name ({} when it is not)."""
        return self.book.records(model_id)

    def bytes_used(self) -> int:
        with self.book.lock:
            return self.book.bytes_used()

    def room(self) -> CacheRoom:
        """The bound the next fill meets, with the file system's free space, read now."""
        with self.book.lock:
            return self.space.now()

    def snapshot(self) -> CacheStats:
        """A consistent copy of the counters, with the gauges filled in."""
        with self.book.lock:
            models = sum(state.complete for state in self.book.states.values())
            room = self.space.now()
            return replace(
                self.stats,
                bytes_used=self.book.bytes_used(),
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

    # -- verification (integrity.py) ---------------------------------------------------------

    def check(self, model_id: str, *, full: bool = False) -> None:
        """Drop the model's cached files that no longer match their fill record."""
        self.integrity.check(model_id, full=full)

    def check_all(self) -> None:
        """``check`` every cached model (a rescan)."""
        self.integrity.check_all()

    def corruption(self, model_id: str) -> str | None:
        """Why a file of the model was dropped as corrupt, until the model is filled again."""
        return self.integrity.corruption(model_id)

    def recorded_digest(self, path: Path, stamp: FileStamp) -> str:
        """The content digest a cached file was filled with (``Integrity.recorded_digest``)."""
        return self.integrity.recorded_digest(path, stamp)

    def check_mapped(self, path: Path, stamp: FileStamp) -> None:
        """A new mapping's file checked against its record (``Integrity.check_mapped``)."""
        self.integrity.check_mapped(path, stamp)

    def close(self) -> None:
        """Release the cache directory for another process (a restarted server)."""
        self.integrity.stop()
        if self.peers is not None:
            self.peers.engine.close()
        self._lock_file.close()

    def __enter__(self) -> NodeCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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
