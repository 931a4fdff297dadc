"""The node cache's files as their fill records say: each record's digest is what the node
reports (ETags, revision, commit) and the only bytes it serves (``CacheDigests``;
docs/origins.md, "Verification")."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import watchfiles

from weightserve.client.errors import (
    ModelUnavailable,
)
from weightserve.service.sources.cache.records import CacheBook, FillRecord
from weightserve.service.sources.files.stamps import FileStamp, file_stamp
from weightserve.service.sources.revisions.content import DigestStore, FileChanged, hash_file

if TYPE_CHECKING:
    pass

log = logging.getLogger("weightserve.node_cache")


# How soon a client refused for a cached file found corrupt should try again: the next
# request fills the file again from the origin.
REFILL_RETRY_SECONDS = 0.5


class Integrity:
    """Cached files checked against their fill records: at each request and rescan (one
    ``stat``; a changed stamp means hashing again), before a new mapping is served, and as the
    kernel reports changes (``start_watching``). A file that does not match is dropped, so the
    model is filled again, and never served."""

    def __init__(self, book: CacheBook, origin_description: str) -> None:
        self.book = book
        self.origin_description = origin_description
        self._stop_watching = threading.Event()

    def start_watching(self) -> None:
        """Check the files changed on disk as the kernel reports them, until ``stop``."""
        threading.Thread(target=self._watch, name="weightserve-cache-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop_watching.set()

    def check(self, model_id: str, *, full: bool = False) -> None:
        """Drop the model's cached files that no longer match their fill record (one ``stat``
        each; a file whose stamp changed is hashed again; with ``full`` every file is hashed,
        which also finds bytes changed under an unchanged stamp), so its next use fills them
        again. Nothing is checked while the model is being filled."""
        with self.book.lock:
            state = self.book.states.get(model_id)
            if state is None or model_id in self.book.fills:
                return
            records = list(state.files.items())
        for name, record in records:
            self.verify(model_id, name, record, full=full)

    def check_all(self) -> None:
        """``check`` every cached model (a rescan)."""
        with self.book.lock:
            model_ids = list(self.book.states)
        for model_id in model_ids:
            self.check(model_id)

    def corruption(self, model_id: str) -> str | None:
        """Why a file of the model was dropped as corrupt, until the model is filled again."""
        with self.book.lock:
            return self.book.corruptions.get(model_id)

    def recorded_digest(self, path: Path, stamp: FileStamp) -> str:
        """The content digest a cached file was filled with, for the file as of ``stamp``.

        The fill record answers, never the bytes on disk: a file whose stamp is not the
        recorded one is hashed only to tell whether it still matches; one that does not is
        dropped (ModelUnavailable, the client retries and the model is filled again).
        FileChanged when ``path`` is no longer that file (the caller re-indexes).
        """
        model_id, name, record = self._recorded(path)
        if record.stamp != stamp:
            if not self.verify(model_id, name, record):
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
        with self.book.lock:
            if (name, stamp) in self.book.verified and record.stamp == stamp:
                return
        if record.stamp != stamp:
            if not self.verify(model_id, name, record):
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
        with self.book.lock:
            self.book.verified.add((name, stamp))

    def _watch(self) -> None:
        """Check each cached file the kernel reports changed (inotify through watchfiles) until
        ``close``: one written in place is dropped once the writes settle, before a request
        asks for it. Unrecorded names (partials) and models being filled are skipped; the
        checks at each request and rescan remain where events are missed."""
        try:
            for changes in watchfiles.watch(
                self.book.data_dir,
                stop_event=self._stop_watching,
                debounce=500,
                rust_timeout=1000,
                yield_on_timeout=False,
                raise_interrupt=False,
            ):
                for _, changed in changes:
                    try:
                        name = Path(changed).relative_to(self.book.data_dir).as_posix()
                    except ValueError:
                        continue
                    with self.book.lock:
                        found = [
                            (model_id, state.files[name])
                            for model_id, state in self.book.states.items()
                            if name in state.files and model_id not in self.book.fills
                        ]
                    for model_id, record in found:
                        self.verify(model_id, name, record)
        except Exception as e:  # e.g. the inotify watch limit: requests and rescans still check
            log.warning("watching the node cache %s stopped: %s", self.book.data_dir, e)

    def _recorded(self, path: Path) -> tuple[str, str, FillRecord]:
        """(model id, file name, fill record) of a file under the data directory."""
        try:
            name = path.relative_to(self.book.data_real).as_posix()
        except ValueError:
            name = path.relative_to(self.book.data_dir).as_posix()
        with self.book.lock:
            for model_id, state in self.book.states.items():
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

    def verify(self, model_id: str, name: str, record: FillRecord, *, full: bool = False) -> bool:
        """Whether a cached file still is what its record says: one ``stat`` while its stamp
        is the recorded one (unless ``full``), else its bytes hashed again (a match is
        recorded with the new stamp). A file that does not match is dropped, logged and
        counted."""
        path = self.book.data_dir / name
        try:
            stamp = file_stamp(path.stat())
        except OSError:
            self.drop(model_id, name, record)  # gone: filled again, nothing was served
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
                    with self.book.lock:
                        state = self.book.states.get(model_id)
                        if state is not None and state.files.get(name) is record:
                            state.files[name] = replace(record, stamp=stamp)
                            self.book.save(model_id)
                        self.book.verified.add((name, stamp))
                    return True
                found = f"xxh3-128 {digest}"
        self._drop_corrupt(model_id, name, record, found)
        return False

    def _drop_corrupt(self, model_id: str, name: str, record: FillRecord, found: str) -> None:
        message = (
            f"{name} in the node cache does not match what was filled from "
            f"{self.origin_description} (expected {record.size} bytes with xxh3-128 "
            f"{record.digest}, found {found})"
        )
        if self.drop(model_id, name, record, message):
            log.warning("%s; it is not served and is filled again", message)

    def drop(
        self, model_id: str, name: str, record: FillRecord, corruption: str | None = None
    ) -> bool:
        """Forget one file of the model and remove it (the model is no longer whole); False
        when it was refilled or dropped meanwhile."""
        with self.book.lock:
            state = self.book.states.get(model_id)
            if state is None or state.files.get(name) is not record:
                return False
            del state.files[name]
            state.complete = False
            self.book.save(model_id)
            self.book.remove_data(name)
            if corruption is not None:
                self.book.stats.corrupt_files += 1
                self.book.corruptions[model_id] = corruption
            return True


class FillRecords(Protocol):
    """What answers for the cache's files by their fill records (``Integrity``, or the
    ``NodeCache`` in front of it)."""

    def recorded_digest(self, path: Path, stamp: FileStamp) -> str: ...

    def check_mapped(self, path: Path, stamp: FileStamp) -> None: ...


class CacheDigests(DigestStore):
    """The content digests a catalog of the cache's data directory reports: the fill
    records' (````recorded_digest````), so every node caching the same origin content
    reports the origin's ETags, revision and commit; and each new mapping of a cached file is
    checked against them before its first byte is served (````check_mapped````)."""

    def __init__(self, cache: FillRecords) -> None:
        super().__init__()
        self.cache = cache

    def digest(self, path: Path, stamp: FileStamp) -> str:
        return self.cache.recorded_digest(path, stamp)

    def content_check(self, path: Path) -> Callable[[FileStamp], None] | None:
        return functools.partial(self.cache.check_mapped, path)
