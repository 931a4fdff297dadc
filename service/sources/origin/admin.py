"""An operator's controls of a node cache: a model's state, prefetch, evict, verify."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Protocol

from weightserve.client.errors import (
    ModelFilling,
    ModelNotFound,
    OriginUnavailable,
)
from weightserve.client.wire.routes import split_revision, with_revision
from weightserve.service.sources.cache.room import EvictionRefused
from weightserve.service.sources.layout import (
    base_model_id,
    validate_model_id,
)
from weightserve.service.sources.model import Model, ReadCheck
from weightserve.service.sources.origin.announced import CatalogParts, _cached_id
from weightserve.service.sources.origin.base import OriginFile
from weightserve.service.sources.origin.listing import RemoteModel
from weightserve.service.sources.origin.past_copies import PastCopies
from weightserve.service.sources.origin.past_revisions import (
    PastRevision,
)

log = logging.getLogger("weightserve.service")


class AdministeredCatalog(CatalogParts, Protocol):
    """What the controls ask of the node cache's catalog (``OriginCatalog``)."""

    origin_error: OriginUnavailable | None
    past: PastCopies

    def get(self, model_id: str, may_read: ReadCheck | None = None) -> Model: ...

    def describe(
        self, model_id: str, may_read: ReadCheck | None = None, file: str | None = None
    ) -> Model: ...

    def state_of(self, model_id: str) -> str: ...

    def current(self, base: str, remote: RemoteModel) -> bool: ...

    def ensured(self, model_id: str) -> tuple[OriginFile, ...] | None: ...

    def fill_error(self, model_id: str) -> BaseException | None: ...

    def evicted(self, model_id: str) -> None: ...

    def fill(
        self, model_id: str, files: tuple[OriginFile, ...] | None, wait: float | None = None
    ) -> None: ...


class CacheAdmin:
    """An operator's controls of a node cache (``CacheControls``; the admin routes,
    service/transports/http/admin.py) over its catalog: each answers JSON-ready."""

    def __init__(self, catalog: AdministeredCatalog) -> None:
        self.catalog = catalog

    def cache_state(self, model_id: str) -> dict[str, Any]:
        """The model's state in the cache: ``cached``, ``filling`` (bytes done of total) or
        ``remote``, whether it is pinned, and why its last fill failed (``error``). ``ID@R``
        of a past revision served from a copy (``PastCopies.serve``) is that copy's state."""
        past = self.catalog.past.named_by_operator(model_id)
        if past is not None:
            return self._copy_state(past)
        base = _cached_id(model_id)
        remote = self.catalog.remote.get(base)
        if remote is None and base not in self.catalog.cache.cached_models():
            raise ModelNotFound(
                f"No model {base!r} at the origin {self.catalog.origin.description}."
            )
        progress = self.catalog.cache.progress(base)
        state = self.catalog.state_of(base)
        total = remote.total_bytes if remote is not None else 0
        body: dict[str, Any] = {
            "id": base,
            "state": state,
            "bytes_total": progress.bytes_total if progress is not None else total,
            "bytes_done": progress.bytes_done
            if progress is not None
            else (total if state == "cached" else 0),
            "pinned": base in self.catalog.cache.pins,
        }
        error = self.catalog.fill_error(base)
        if error is not None and progress is None:
            body["error"] = f"{type(error).__name__}: {error}"
        return body

    def prefetch(self, model_id: str) -> dict[str, Any]:
        """Start the model's fill unless the cache holds it as listed (the one fill requests
        join; nobody waits for it), and say its state. What a request would be refused
        before a fill (not found, refused, origin down) is raised here; so is
        RevisionNotFound for ``ID@R`` where the origin lists content digests (elsewhere the
        fill is what the origin holds now, and a load of R checks it). A past revision
        served from a copy (``PastCopies.serve``) has that copy filled."""
        plain, revision = split_revision(validate_model_id(model_id))
        base = base_model_id(plain)
        past = self.catalog.past.named(base, revision)
        if past is not None:
            if past.copy_id in self.catalog.cache.cached_models():
                self.catalog.cache.touch(past.copy_id)
            else:
                with contextlib.suppress(ModelFilling):
                    self.catalog.fill(past.copy_id, past.copies(), wait=0.5)
            return self._copy_state(past)
        remote = self.catalog.remote.get(base)
        if (
            revision is not None
            and remote is not None
            and self.catalog.origin.lists_content_digests
        ):
            self.catalog.describe(model_id)
        if remote is None or self.catalog.origin_error is not None:
            self.catalog.get(plain)  # a cached model, or the refusal a request gets
        elif self.catalog.current(base, remote):
            self.catalog.cache.touch(base)
        else:
            with contextlib.suppress(ModelFilling):
                self.catalog.fill(base, remote.files, wait=0.5)  # a quick refusal (too large) shows
        return self.cache_state(base)

    def evict(self, model_id: str) -> dict[str, Any]:
        """Remove the model from the cache now; EvictionRefused while it is streamed, being
        filled or pinned, ModelNotFound when the cache does not hold it. ``ID@R`` of a past
        revision served from a copy (``PastCopies.serve``) evicts that copy."""
        past = self.catalog.past.named_by_operator(model_id)
        if past is not None:
            freed = self.catalog.cache.evict(past.copy_id)
            return {**self._copy_state(past), "evicted_bytes": freed}
        base = _cached_id(model_id)
        freed = self.catalog.cache.evict(base)
        self.catalog.evicted(base)
        return {"id": base, "state": self.catalog.state_of(base), "evicted_bytes": freed}

    def verify(self, model_id: str) -> dict[str, Any]:
        """Re-check each cached file of the model, every byte read again: against its fill
        record (``NodeCache.check``, which drops a file that no longer matches), then against
        the origin's listing: present, of the listed size, and (where the origin's version is
        a content digest) of the listed content. A model that fails is evicted, so the next
        request fills it again."""
        base = _cached_id(model_id)
        if base not in self.catalog.cache.cached_models():
            raise ModelNotFound(
                f"model {base!r} is not in this node's cache: nothing to verify (prefetch it)"
            )
        self.catalog.cache.check(base, full=True)
        remote = self.catalog.remote.get(base)
        if remote is None:
            raise ModelNotFound(
                f"the origin {self.catalog.origin.description} no longer lists model {base!r}: evict it"
            )
        current = self.catalog.ensured(base) == remote.files
        files = [self._check_file(base, f, current) for f in remote.files]
        body: dict[str, Any] = {"id": base, "ok": all(f["status"] in _GOOD for f in files)}
        body.update(files=files, evicted=False)
        if not body["ok"]:
            log.warning(
                "model %r differs from the origin %s", base, self.catalog.origin.description
            )
            try:
                self.evict(base)
                body["evicted"] = True
            except EvictionRefused as e:
                body["note"] = str(e)
        return body

    def _check_file(self, base: str, file: OriginFile, current: bool) -> dict[str, Any]:
        path = self.catalog.cache.data_dir / file.name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            dropped = self.catalog.cache.corruption(base)  # by the fill-record check just now
            if dropped is not None:
                return {"name": file.name, "status": "corrupt", "detail": dropped}
            return {"name": file.name, "status": "missing"}
        if size != file.size:
            detail = f"{size} bytes, the origin lists {file.size}"
            return {"name": file.name, "status": "corrupt", "detail": detail}
        matches = self.catalog.origin.matches(file, path)
        if matches is None:
            return {"name": file.name, "status": "unchecked", "detail": "size only: the "
                    "origin's version is no content digest"}  # fmt: skip
        if matches:
            return {"name": file.name, "status": "ok"}
        # Filled from an older listing: the origin moved on, the bytes may be whole.
        status = "corrupt" if current else "changed"
        return {"name": file.name, "status": status, "detail": f"origin version {file.version}"}

    def _copy_state(self, past: PastRevision) -> dict[str, Any]:
        """``cache_state`` of a past revision's copy, named ``ID@COMMIT``."""
        copy = past.copy_id
        progress = self.catalog.cache.progress(copy)
        held = copy in self.catalog.cache.cached_models()
        total = sum(f.size for f in past.files)
        body: dict[str, Any] = {
            "id": with_revision(past.model_id, past.commit),
            "state": "filling" if progress is not None else "cached" if held else "remote",
            "bytes_total": progress.bytes_total if progress is not None else total,
            "bytes_done": progress.bytes_done if progress is not None else total if held else 0,
            "pinned": False,
        }
        error = self.catalog.fill_error(copy)
        if error is not None and progress is None and not held:
            body["error"] = f"{type(error).__name__}: {error}"
        return body


_GOOD = ("ok", "unchecked")  # a file that passed what could be checked
