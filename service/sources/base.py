"""What the server asks of wherever its models come from (``ModelSource``), how a source
reports a model it refuses (``Problem``), and what only some sources do, each a protocol of its
own: fills on request (``FillsOnRequest``), an operator's cache controls (``CacheControls``),
revisions announced (``RevisionLog``; taken by service/sources/publishing/uploads.py's
``Publishing``). Code that needs one asks the
composed whole (service/sources/served.py) or checks the protocol, never probes attributes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from weightserve.client.errors import OriginUnavailable
from weightserve.service.sources.model import Model, ReadCheck


@dataclass(frozen=True)
class Problem:
    """A model the source found but refused: which file, which rule."""

    model: str
    file: str
    reason: str


class CacheControls(Protocol):
    """An operator's controls of a node cache (the admin routes): each answers JSON-ready."""

    def cache_state(self, model_id: str) -> dict[str, Any]:
        """``{id, state, bytes_done, bytes_total, pinned}``, ``error`` after a failed fill."""
        ...

    def prefetch(self, model_id: str) -> dict[str, Any]:
        """Start the model's fill without a load; its state."""
        ...

    def evict(self, model_id: str) -> dict[str, Any]:
        """Remove the model now, unless streamed, being filled or pinned."""
        ...

    def verify(self, model_id: str) -> dict[str, Any]:
        """Re-check its cached files against the origin; a model that fails is evicted."""
        ...


class RevisionLog(Protocol):
    """The revisions a server announces to watchers (the watch routes): a local root's
    published ones (service/sources/publishing/publisher.py), or the newest a node cache holds."""

    def revisions(self, model_id: str) -> list[dict[str, Any]]:
        """Records ``{commit, parent, created, bytes, message, metadata}``, ``main`` first."""
        ...

    def revisions_after(
        self, model_id: str, since: str | None, after: int | None = None
    ) -> list[dict[str, Any]]:
        """What a watcher that last saw commit ``since`` (or sequence ``after``) has missed:
        one record per change of main, with its ``sequence``, oldest first
        (service/sources/revisions/announcements.py)."""
        ...

    def sequence(self, model_id: str) -> int:
        """The sequence of the change of main that made the model's current main."""
        ...


class ModelSource(Protocol):
    """The models a server serves, by id: the one seam between sources and everything else.

    The local catalog (a directory) and the origin catalog (an origin filled into a node
    cache, served through a local catalog of the cache) implement it; callers ask it, never
    which source they hold. Refusals are told to the ``on_refused`` callback each source
    takes in its constructor. ``get("ID@R")`` answers revision R of a model from the revisions
    the source holds (service/sources/revisions/pinning.py): a source that keeps older revisions' files
    offers them there. ``describe`` answers metadata before a fill. Revisions are
    published (service/sources/publishing/uploads.py) and announced to watchers by a ``RevisionLog``.
    """

    @property
    def root(self) -> Path:
        """The local directory the served files are read from (the model root, or the node
        cache's data directory)."""
        ...

    @property
    def description(self) -> str:
        """Where the models come from, for messages and logs: the root, or the origin's
        address without credentials."""
        ...

    @property
    def models(self) -> Mapping[str, Model]:
        """The models indexed and served now, by id."""
        ...

    @property
    def problems(self) -> Mapping[str, Problem]:
        """The models found but refused, by id."""
        ...

    @property
    def variants(self) -> Collection[str]:
        """Ids of other weight sets of a model (``ID:fp16``), indexed on their first request."""
        ...

    @property
    def listed(self) -> Collection[str]:
        """Ids of every model the source offers, indexed here yet or not."""
        ...

    @property
    def watch_files(self) -> bool:
        """Whether files under ``root`` change by other hands than the source's own, so a file
        watcher should rescan when they do."""
        ...

    @property
    def pending_revisions(self) -> int:
        """How many models' content revisions are not computed yet."""
        ...

    def scan(self) -> None:
        """Find the models again; unchanged models keep their index and mappings."""
        ...

    def warm_revisions(self) -> None:
        """Compute every model's revision now, so requests find them known."""
        ...

    def answers_now(self, model_id: str | None = None) -> bool:
        """Whether ``get(model_id)`` (None: the model list) answers from memory right now,
        without touching a file or waiting on a lock."""
        ...

    def get(self, model_id: str, may_read: ReadCheck | None = None) -> Model:
        """The model as its files are now (``ID@R``: revision R of it, or RevisionNotFound
        naming those held), or ModelNotFound (a suggestion only among ids ``may_read``
        allows), ModelUnavailable, ModelFilling, OriginUnavailable."""
        ...

    def describe(
        self, model_id: str, may_read: ReadCheck | None = None, file: str | None = None
    ) -> Model:
        """The model's index, metadata and files, as ``get`` raises for it, without copying
        it: over a node cache an uncached model is described from its headers (no tensor
        byte is served from what this returns; ``get`` the model for that). With ``file``
        (a name in the model's repository), that file's bytes can be served from it: a side
        file is fetched alone, a checkpoint fills the model."""
        ...

    def using(self, model_id: str) -> AbstractContextManager[None]:
        """Hold the model while a stream reads it (a node cache keeps it from eviction)."""
        ...

    def close(self) -> None:
        """Let go of what the source holds (a node cache's directory lock)."""
        ...


@runtime_checkable
class FillsOnRequest(Protocol):
    """A source whose models are copied under its ``root`` on their first request (an origin
    through a node cache): listings tell each model's state, and the origin may be out of
    reach while cached models are served."""

    @property
    def origin_error(self) -> OriginUnavailable | None:
        """Why the origin could not be listed at the last scan; None when it was."""
        ...

    def remote_summaries(self, may_read: ReadCheck) -> list[dict[str, Any]]:
        """The models offered but not indexed here yet, as model summaries with their
        ``state``."""
        ...

    def listing_fields(self, model: Model) -> dict[str, Any]:
        """What a listing adds to (or puts in place of) the summary of a model indexed here:
        its ``state`` and the origin's current revision."""
        ...
