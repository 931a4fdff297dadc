"""Past revisions of a node cache's models served from copies filled from the object versions
recorded when the revision was filled (origin/past_revisions.py keeps that history)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from weightserve.client.wire.routes import MAIN_REVISION, split_revision, with_revision
from weightserve.service.sources.cache.integrity import CacheDigests
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.layout import (
    base_model_id,
    validate_model_id,
)
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.sources.model import Model, ReadCheck
from weightserve.service.sources.origin.base import OriginFile
from weightserve.service.sources.origin.past_revisions import (
    PAST_COPIES,
    PastFile,
    PastRevision,
    RevisionHistory,
    revision_of,
)

log = logging.getLogger("weightserve.service")


class PastCopies:
    """Past revisions this node filled with the object version of each file recorded (a
    versioned bucket): ``ID@R`` served from a copy of R (``.revisions/COMMIT`` in the cache's
    data directory), filled from those versions on first use by ``fill`` (the catalog's one
    fill per model), then evicted like a model."""

    def __init__(
        self,
        cache: NodeCache,
        history: RevisionHistory,
        recheck_seconds: float,
        fill: Callable[[str, tuple[OriginFile, ...]], None],
    ) -> None:
        self.cache = cache
        self.origin = cache.origin
        self.history = history
        self.recheck_seconds = recheck_seconds
        self._fill = fill
        self._catalogs: dict[str, Catalog] = {}  # the copies of each revision, by commit
        self._lock = threading.Lock()
        for held in cache.cached_models():
            self.remember(held)

    def scan(self) -> None:
        """Index every past revision's copies again (after evictions: their mappings are let
        go)."""
        with self._lock:
            catalogs = list(self._catalogs.values())
        for catalog in catalogs:
            catalog.scan()

    def remember(self, model_id: str) -> None:
        """Record the revision of the model held whole now in the history, with the object
        version each file was read at (where the origin keeps versions)."""
        held = self.held_files(model_id)
        if held and not model_id.startswith(PAST_COPIES + "/"):  # a copy was recorded before
            self.history.record(model_id, held)

    def held_files(self, model_id: str) -> list[PastFile]:
        """The files of the model held whole, as filled (none when it is not held whole)."""
        return [
            PastFile(name, r.size, r.version, r.digest, self.origin.version_id(
                OriginFile(name, r.size, r.version)))
            for name, r in self.cache.records(model_id).items()
        ]  # fmt: skip

    def serve(
        self, plain: str, base: str, revision: str | None, may_read: ReadCheck | None
    ) -> Model | None:
        """``ID@R`` from a copy of R, where R is a revision this node filled with the object
        version of each file recorded (a versioned bucket) and not the copy held as the
        newest: the copy is filled from those versions on first use (each file verified
        against R's digest), then served, and evicted like a model. None where R is
        answered otherwise (the copy held, or RevisionNotFound naming what is held)."""
        past = self.named(base, revision)
        if past is None:
            return None
        copy, files = past.copy_id, past.copies()
        self.cache.check(copy)
        if copy in self.cache.cached_models():
            self.cache.ensure(copy, list(files))  # a hit: counted, marked used
        else:
            self._fill(copy, files)
        catalog = self.catalog(past.commit)
        if base not in catalog.models:
            catalog.scan()
        # Named by its commit, so that a stream of it holds the copy (``using``).
        return replace(catalog.get(plain, may_read), id=with_revision(plain, past.commit))

    def named(self, base: str, revision: str | None) -> PastRevision | None:
        """The past revision R names that a copy serves (``_past``): recorded with every
        object version, and not the copy held as the newest."""
        if revision is None or revision == MAIN_REVISION:
            return None
        past = self.history.find(base, revision)
        if past is None or not past.versioned:
            return None
        held = self.held_files(base)
        if held and revision_of(base, held).digest == past.digest:
            return None  # the copy held as the newest is R: served as it is
        return past

    def named_by_operator(self, model_id: str) -> PastRevision | None:
        """The past revision an operator's ``ID@R`` names, served from a copy."""
        plain, revision = split_revision(validate_model_id(model_id))
        return self.named(base_model_id(plain), revision)

    def serving(self, model_id: str) -> PastRevision | None:
        """The past revision whose copy serves ``model_id`` (``ID@COMMIT``, as ``_past``
        names the models it gives), else None."""
        plain, revision = split_revision(model_id)
        past = self.history.find(base_model_id(plain), revision) if revision else None
        return past if past is not None and past.commit == revision else None

    def catalog(self, commit: str) -> Catalog:
        """The catalog of the copies of revision ``commit`` (``.revisions/COMMIT`` in the
        cache's data directory), serving the copies held whole."""
        prefix = f"{PAST_COPIES}/{commit}/"

        def whole() -> list[str]:
            return [
                m.removeprefix(prefix) for m in self.cache.cached_models() if m.startswith(prefix)
            ]

        with self._lock:
            catalog = self._catalogs.get(commit)
            if catalog is None:
                catalog = Catalog(
                    self.cache.data_dir / prefix,
                    recheck_seconds=self.recheck_seconds,
                    digests=CacheDigests(self.cache),
                    whole_models=whole,
                )
                self._catalogs[commit] = catalog
        return catalog
