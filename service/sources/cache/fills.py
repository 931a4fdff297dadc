"""Filling the node cache: a model's files fetched from its origin into the data directory.

A file is visible under its name only once the origin verified it and it reached the disk
(fsync, then rename); the state file names a file only after its rename, so a restart reuses
exactly the files that are whole and removes everything else (partials, unrecorded files).
One lock guards the bookkeeping; fetches run outside it, one fill per model at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weightserve.client.errors import (
    CacheTooSmall,
    ModelNotFound,
    ModelUnavailable,
    OriginUnavailable,
    WeightserveError,
)
from weightserve.service.sources.cache.landing import Fill, FillProgress, LandedFile
from weightserve.service.sources.cache.patched_files import build_from_patches
from weightserve.service.sources.cache.records import (
    PARTIAL_MARK,
    CacheBook,
    FillRecord,
    ModelState,
    _checked_name,
)
from weightserve.service.sources.cache.room import Room, _bytes
from weightserve.service.sources.files.stamps import file_stamp, sync_path
from weightserve.service.sources.layout import hub_repo_file, split_gguf_model
from weightserve.service.sources.revisions.content import hash_file

if TYPE_CHECKING:
    from weightserve.service.sources.origin.base import FillPlan, Origin, OriginFile
    from weightserve.service.sources.swarm.node import PeerFills

log = logging.getLogger("weightserve.node_cache")


# Local disk errors: the cache, not the origin, is at fault, and the message says so.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
# A full file system (or quota): met by evicting idle models and writing the file again.
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


@dataclass
class Fills:
    """Models filled from ``origin``: one fill per model at a time (concurrent callers wait for
    it), only the files stale or missing, each fetched in parallel parts as ``plan`` says, made
    room for first (``room``), written again after evicting idle models when the file system is
    full, and put in place with its fill record once verified and on disk."""

    book: CacheBook
    room: Room
    origin: Origin
    plan: FillPlan
    # Other node caches of the cluster, through the revision's swarm (service/sources/swarm/):
    # tried first for the files no patch builds; what it cannot give comes from the origin.
    peers: PeerFills | None = None

    def ensure(self, model_id: str, files: list[OriginFile] | None = None) -> Path:
        """The model's path in the cache, filled first if any of its files is missing or stale.

        ``files`` is the origin's current listing of the model: files whose version or size
        differ from the cached ones are fetched again, the others kept. ``None`` means the
        listing is not at hand (the origin could not be listed): a cached model is returned as
        it is, an uncached one is listed and filled. Concurrent calls for one model run one
        fill; the others wait for it and see its error if it fails.
        """
        model_path = self.book.model_path(model_id)
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
            with self.book.lock:
                fill = self.book.fills.get(model_id)
                if fill is None:
                    state = self.book.states.get(model_id)
                    if files is not None:
                        stale = self._stale(state, files)
                    elif state is not None and state.complete:
                        stale = []
                    if stale == []:
                        if files is not None:
                            self._record_whole(model_id, files)
                        self.book.count_use(model_id, hit=not waited)
                    elif stale is not None:
                        assert files is not None
                        fill = self._start_fill(model_id, files, stale)
                        break
            if stale == []:
                self.book.touch(model_id)
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

    def warm(self, listing: list[OriginFile] | None = None) -> None:
        """Fill the pinned models (at start). Without a ``listing`` the origin is listed once;
        if that fails, pinned models already cached are kept as they are."""
        if not self.book.pins:
            return
        if listing is None:
            with contextlib.suppress(OriginUnavailable):
                listing = self._list_origin()
        for pin in sorted(self.book.pins):
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
        with self.book.lock:
            fill = self.book.fills.get(model_id)
            return fill.landing.get(name) if fill is not None else None

    def progress(self, model_id: str) -> FillProgress | None:
        """The running fill of the model, or None when none runs."""
        with self.book.lock:
            fill = self.book.fills.get(model_id)
            if fill is None:
                return None
            return FillProgress(model_id, fill.done_bytes, fill.total, fill.started)

    def _list_origin(self) -> list[OriginFile]:
        try:
            return self.origin.list_files()
        except BaseException:
            with self.book.lock:
                self.book.stats.origin_failures += 1
            raise

    def _list_model(self, model_id: str) -> list[OriginFile]:
        files = _model_files(model_id, self._list_origin())
        if not files:
            raise ModelNotFound(
                f"model {model_id!r}: the origin {self.origin.description} holds no file named "
                f"{model_id!r} or under {model_id + '/'!r}"
            )
        return files

    def _stale(self, state: ModelState | None, files: list[OriginFile]) -> list[OriginFile]:
        """The files that must be fetched: absent, of another version, or not whole on disk."""
        recorded = state.files if state is not None else {}
        stale = []
        for file in files:
            record = recorded.get(file.name)
            if record is None or (record.size, record.version) != (file.size, file.version):
                stale.append(file)
                continue
            try:
                whole = (self.book.data_dir / file.name).stat().st_size == file.size
            except OSError:
                whole = False
            if not whole:
                stale.append(file)
        return stale

    def _start_fill(self, model_id: str, files: list[OriginFile], stale: list[OriginFile]) -> Fill:
        """Make room (under the lock) and register the fill that this thread will run."""
        total = sum(f.size for f in files)
        room = self.room.now()
        if total > room.bound and room.by_disk:
            raise CacheTooSmall(
                f"model {model_id!r} is {_bytes(total)}, more than the node cache "
                f"{self.book.directory} can hold on its file system: {_bytes(room.held)} held by the "
                f"cache and {_bytes(room.disk_free)} free, less "
                f"{_bytes(room.held + room.disk_free - room.disk_bound)} kept free; free space "
                "there, give the cache a larger --cache-dir, or serve this model from another "
                "server"
            )
        if total > room.bound:
            raise CacheTooSmall(
                f"model {model_id!r} is {_bytes(total)}, larger than the whole node cache "
                f"({_bytes(room.bound)}, {self.room.bound_name()}): give the cache more room "
                "or serve this model from another server"
            )
        self.room.evict_for(model_id, total, room)
        fill = Fill(total=sum(f.size for f in stale), remaining=sum(f.size for f in stale))
        fill.landing = {f.name: LandedFile(f.size) for f in stale}
        self.book.fills[model_id] = fill
        self.book.states.setdefault(model_id, ModelState(last_used=time.time()))
        self.book.stats.fills += 1
        self.book.stats.misses += 1
        return fill

    def _run_fill(
        self, model_id: str, files: list[OriginFile], stale: list[OriginFile], fill: Fill
    ) -> None:
        try:
            self.room.release_evicted()  # the room made for this fill, freed before it is written
            if self.peers is not None:
                self.peers.stop(model_id)  # its files are about to change: no more seeding them
            built = self._build_patched(model_id, files, stale)
            try:
                built.update(self._from_peers(model_id, stale, built, fill))
                for file in sorted(stale, key=lambda f: f.name):
                    self._fetch_file(model_id, file, fill, built.pop(file.name, None))
            finally:
                for partial, _ in built.values():  # a fill that failed before placing them
                    partial.unlink(missing_ok=True)
            self._finish(model_id, files)
            if self.peers is not None:
                with self.book.lock:
                    records = dict(self.book.states[model_id].files)
                self.peers.seed(
                    model_id,
                    {f.name: (self.book.data_dir / f.name, records[f.name].digest) for f in files},
                )
        except BaseException as e:
            fill.error = e
            for landing in fill.landing.values():
                landing._failed(e)
            with self.book.lock:
                self.book.stats.fill_failures += 1
            log.warning("filling model %r from %s failed: %s", model_id, self.origin.description, e)
            raise
        finally:
            with self.book.lock:
                del self.book.fills[model_id]
                self.book.stats.fill_seconds += time.monotonic() - fill.started
            fill.finished.set()

    def _from_peers(
        self,
        model_id: str,
        stale: list[OriginFile],
        built: dict[str, tuple[Path, str]],
        fill: Fill,
    ) -> dict[str, tuple[Path, str]]:
        """The stale files no patch built, as the swarm gave them (verified, not in place).
        Their bytes count as progress while they arrive; placing them counts them again, so
        they are taken back out here."""
        if self.peers is None:
            return {}
        wanted = [f for f in stale if f.name not in built]
        arrived = 0

        def on_bytes(n: int) -> None:
            nonlocal arrived
            with self.book.lock:
                fill.done_bytes += n
                arrived += n

        def on_sources(from_peers: int, from_origin: int) -> None:
            with self.book.lock:
                self.book.stats.peer_bytes += from_peers
                self.book.stats.origin_bytes += from_origin

        try:
            got = self.peers.fetch(
                model_id, wanted, self.book.data_dir, self._partial, on_bytes, on_sources
            )
        finally:
            with self.book.lock:
                fill.done_bytes -= arrived
        return got

    def _partial(self, file: OriginFile) -> Path:
        target = self.book.data_dir / file.name
        return target.with_name(f".{target.name}{PARTIAL_MARK}{secrets.token_hex(6)}")

    def _build_patched(
        self, model_id: str, files: list[OriginFile], stale: list[OriginFile]
    ) -> dict[str, tuple[Path, str]]:
        """The stale files built here from the held copy and the upstream's patch (a whole
        copy held, an upstream weightserve): by name, the built file and its digest."""
        with self.book.lock:
            state = self.book.states.get(model_id)
            if state is None or not state.complete:
                return {}
            held = [(name, r.size, r.version) for name, r in state.files.items()]
        worth = None
        if self.peers is not None:
            peers = self.peers

            def worth(delta: int, whole: int) -> bool:
                return peers.patches_worth(model_id, stale, delta, whole)

        return build_from_patches(
            self.origin, model_id, held, files, stale, self.book.data_dir, self._partial, worth
        )

    def _fetch_file(
        self, model_id: str, file: OriginFile, fill: Fill, built: tuple[Path, str] | None = None
    ) -> None:
        """Fetch ``file`` and put it in place with its fill record; ``built``: its bytes are
        already here (a file built from a patch, and its digest), only to be put in place."""
        target = self.book.data_dir / file.name
        partial = built[0] if built is not None else self._partial(file)

        landed = 0  # this file's bytes counted in the fill's progress

        def on_bytes(n: int) -> None:
            nonlocal landed
            with self.book.lock:
                fill.done_bytes += n
                landed += n
                self.book.stats.origin_bytes += n

        digest: str | None = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if built is not None:
                digest = built[1]
                with self.book.lock:  # progress counts the file; origin_bytes only what was fetched
                    fill.done_bytes += file.size
            while built is None:
                with self.book.lock:
                    fill.writing = file.size
                landing = fill.landing.get(file.name)
                if landing is not None:
                    landing._started(partial)
                try:
                    digest = self.origin.fetch(
                        file,
                        partial,
                        dataclasses.replace(
                            self.plan,
                            on_bytes=on_bytes,
                            on_landed=landing._landed if landing is not None else None,
                        ),
                    )
                    break
                except OSError as e:
                    if e.errno not in _DISK_FULL_ERRNOS:
                        with self.book.lock:
                            self.book.stats.origin_failures += 1
                        raise
                    # This file is written again from its start (the files before it stay):
                    # its bytes so far no longer count as progress.
                    partial.unlink(missing_ok=True)
                    with self.book.lock:
                        fill.writing, fill.done_bytes, landed = 0, fill.done_bytes - landed, 0
                    log.warning(
                        "the node cache %s is full writing %s (%s); evicting idle models",
                        self.book.directory, file.name, e.strerror,
                    )  # fmt: skip
                    self.room.make_disk_room(model_id, file, e)
                except BaseException:
                    with self.book.lock:
                        self.book.stats.origin_failures += 1
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
            with self.book.lock:
                state = self.book.states[model_id]
                # Forget the old version before its bytes are replaced: a crash in between
                # must not leave the new bytes recorded as the old version, nor the model as
                # whole while it mixes versions.
                if state.files.pop(file.name, None) is not None or state.complete:
                    state.complete = False
                    self.book.save(model_id)
                os.replace(partial, target)
                if (landing := fill.landing.get(file.name)) is not None:
                    landing._placed(target)
                stamp = file_stamp(target.stat())
                state.files[file.name] = FillRecord(file.size, file.version, digest, stamp)
                self.book.verified.add((file.name, stamp))
                fill.remaining -= file.size
                fill.writing = 0
                self.book.save(model_id)
        except WeightserveError:
            raise
        except OSError as e:
            if e.errno in _DISK_ERRNOS:
                raise ModelUnavailable(
                    f"model {model_id!r}: the node cache {self.book.directory} could not store "
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
        with self.book.lock:
            self._record_whole(model_id, files)
            self.book.corruptions.pop(model_id, None)

    def _record_whole(self, model_id: str, files: list[OriginFile]) -> None:
        """Record the model whole (under the lock); drop files its listing no longer has."""
        state = self.book.states[model_id]
        names = {f.name for f in files}
        gone = [name for name in state.files if name not in names]
        if state.complete and not gone:
            return
        for name in gone:
            del state.files[name]
            self.book.remove_data(name)
        state.complete = True
        self.book.save(model_id)


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
