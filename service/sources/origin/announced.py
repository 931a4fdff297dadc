"""What a node cache tells its watchers: the revision it holds of each model, once held."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from weightserve.client.errors import (
    ModelNotFound,
)
from weightserve.client.wire.routes import split_revision
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.layout import (
    base_model_id,
    validate_model_id,
)
from weightserve.service.sources.model import Model
from weightserve.service.sources.origin.base import Origin
from weightserve.service.sources.origin.listing import RemoteModel
from weightserve.service.sources.revisions.announcements import MainHistory, missed_records
from weightserve.service.sources.revisions.content import (
    COMMIT_CHARS,
)
from weightserve.service.sources.revisions.stores import revision_record

log = logging.getLogger("weightserve.service")

# The upstream's records a node keeps (for the parent, message and metadata it passes on):
# the newest few per model, and of the models it does not hold, the few heard of last. A node
# that follows a busy upstream must not keep every record it was ever told (they carry up to
# MAX_METADATA_BYTES of metadata each).
UPSTREAM_RECORDS_PER_MODEL = 4
UPSTREAM_MODELS_NOT_HELD = 8


class CatalogParts(Protocol):
    """What the node cache's catalog (``OriginCatalog``) shows each of its parts: its cache,
    origin, and the origin's models as last listed."""

    cache: NodeCache
    origin: Origin
    remote: dict[str, RemoteModel]


class HeldModels(CatalogParts, Protocol):
    """What the log reads of the node cache's catalog (``OriginCatalog``)."""

    @property
    def models(self) -> dict[str, Model]: ...

    def listed_revision(self, remote: RemoteModel) -> str: ...


class HeldRevisions:
    """The revisions a node cache announces to its watchers (a ``RevisionLog``): the one it
    holds of each model (a node keeps its newest), told to ``on_revision`` once its bytes are
    here, with the upstream's record (parent, message, metadata) where it announced that
    commit."""

    def __init__(
        self,
        catalog: HeldModels,
        on_revision: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.on_revision = on_revision
        self._histories: dict[str, MainHistory] = {}  # model id -> the changes announced
        # model id -> commit -> the upstream's record, least recently heard first
        self._upstream: OrderedDict[str, OrderedDict[str, dict[str, Any]]] = OrderedDict()

    def heard(self, model_id: str, record: dict[str, Any] | None) -> None:
        """The upstream announced ``record`` of the model: kept, to announce it as it said,
        within the bounds above."""
        if record is None or not record.get("commit"):
            return
        kept = self._upstream.setdefault(model_id, OrderedDict())
        kept[record["commit"]] = record
        kept.move_to_end(record["commit"])
        while len(kept) > UPSTREAM_RECORDS_PER_MODEL:
            kept.popitem(last=False)
        self._upstream.move_to_end(model_id)
        held = set(self.catalog.cache.cached_models())
        not_held = [m for m in self._upstream if m not in held]
        for forgotten in not_held[: max(0, len(not_held) - UPSTREAM_MODELS_NOT_HELD)]:
            del self._upstream[forgotten]

    def upstream_records(self) -> int:
        """How many of the upstream's records the node keeps now."""
        return sum(len(kept) for kept in self._upstream.values())

    def revisions(self, model_id: str) -> list[dict[str, Any]]:
        """The revision the node holds of the model (a node keeps its newest), or for one not
        held yet, the revision the origin lists (where it lists one)."""
        base = _cached_id(model_id)
        held = self.catalog.models.get(base) if base in self.catalog.cache.cached_models() else None
        if held is not None:
            return [self.record(base, held.commit, sum(f.size for f in held.repo_files.values()))]
        remote = self.catalog.remote.get(base)
        if remote is None:
            raise ModelNotFound(
                f"No model {base!r} at the origin {self.catalog.origin.description}."
            )
        commit = self.catalog.listed_revision(remote)[:COMMIT_CHARS]
        return [self.record(base, commit, remote.total_bytes)]

    def revisions_after(
        self, model_id: str, since: str | None, after: int | None = None
    ) -> list[dict[str, Any]]:
        """The revision held now, unless the watcher is at it: a node keeps no older
        revision, so the changes it missed come down to that one (flagged ``history_cut``
        when this node never announced the point the watcher names)."""
        current = self.revisions(model_id)[0]
        history = self._histories.get(_cached_id(model_id), MainHistory())
        return missed_records(history, current, since, after, lambda commit: None)

    def sequence(self, model_id: str) -> int:
        """The sequence of the change this node announced for its current revision."""
        last = self._histories.get(_cached_id(model_id), MainHistory()).last
        current = self.revisions(model_id)[0]["commit"]
        return last.sequence if last is not None and last.commit == current else 0

    def announce(self, model_id: str) -> None:
        """Tell the watchers once the node holds a revision of the model other than the one
        it announced last (a rollback to an earlier one included)."""
        held = self.catalog.models.get(model_id)
        if self.on_revision is None or held is None:
            return
        change = self._histories.setdefault(model_id, MainHistory()).moved(held.commit)
        if change is None:
            return
        size = sum(f.size for f in held.repo_files.values())
        record = self.record(model_id, held.commit, size)
        self.on_revision(model_id, {**record, "sequence": change.sequence})

    def record(self, model_id: str, commit: str, size: int) -> dict[str, Any]:
        """A revision record: the upstream's (parent, message, metadata) where it announced
        this commit, else one with just what the node knows."""
        kept = self._upstream.get(model_id)
        upstream = kept.get(commit) if kept is not None else None
        record = revision_record(commit, size=size)
        if upstream is not None:
            record.update({k: upstream[k] for k in record if k in upstream and k != "bytes"})
        return record


def _cached_id(model_id: str) -> str:
    """The model the cache holds for ``model_id``: ``org/name`` for ``org/name@R:fp16`` (a
    node holds the files of one revision of a directory model)."""
    return base_model_id(split_revision(validate_model_id(model_id))[0])
