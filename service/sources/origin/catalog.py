"""A catalog whose models come from an origin (object storage, an upstream weightserve) through
the node's fill cache (service/sources/cache/node_cache.py).

The origin's listing names the models, by the local root's rules applied to file names alone:
a directory holding weight files (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``) is a model
with every file below it except sub-directories that are models themselves; each ``*.gguf``
file is a model (the parts of a split GGUF, ``NAME-00001-of-00002.gguf`` ..., are one,
``NAME.gguf``); weight files directly under the prefix are models named by their file. A
model is filled on its first request, then the cache's data directory is indexed exactly as a
local root (index files, variants, side files), so a filled model is served like a local one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import difflib
import logging
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from weightserve.client.errors import (
    ModelFilling,
    ModelNotFound,
    ModelUnavailable,
    OriginChanged,
    OriginUnavailable,
    RevisionNotFound,
    WeightserveError,
)
from weightserve.client.wire.routes import MAIN_REVISION, split_revision, with_revision
from weightserve.service.sources.base import Problem
from weightserve.service.sources.cache.integrity import CacheDigests
from weightserve.service.sources.cache.landing import LandedFile
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.cache.room import EvictionRefused
from weightserve.service.sources.layout import (
    base_model_id,
    checkpoint_format,
    gguf_models,
    hub_repo_file,
    is_served_name,
    is_weight_file,
    validate_model_id,
    weight_format,
)
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.sources.model import Model
from weightserve.service.sources.origin.base import Origin, OriginFile
from weightserve.service.sources.origin.headers import HeaderImages
from weightserve.service.sources.origin.past_revisions import (
    PAST_COPIES,
    PastFile,
    PastRevision,
    RevisionHistory,
    model_file_name,
    revision_of,
)
from weightserve.service.sources.revisions.content import (
    COMMIT_CHARS,
    REVISION_CHARS,
    content_revision,
)
from weightserve.service.sources.revisions.pinning import pick_revision
from weightserve.service.sources.revisions.stores import revision_record

log = logging.getLogger("weightserve.service")

# How long a request waits for the fill it triggered or joined before it is answered 503
# with the fill's progress and a Retry-After: a handler thread is not held for a whole fill,
# and the client's retry budget covers the rest.
FILL_WAIT_SECONDS = 10.0
FILL_RETRY_AFTER_SECONDS = 2.0
# Set by a caller that cannot be held for a fill (a Hub client's timeouts are shorter than a
# fill) and follows it instead: the fill is started and handed over at once (FillInProgress).
_FOLLOW_FILLS: contextvars.ContextVar[bool] = contextvars.ContextVar("follow_fills", default=False)


@contextlib.contextmanager
def following_fills() -> Iterator[None]:
    """Within the block, a request that needs a fill raises ``FillInProgress`` at once."""
    token = _FOLLOW_FILLS.set(True)
    try:
        yield
    finally:
        _FOLLOW_FILLS.reset(token)


class FillInProgress(ModelFilling):
    """ModelFilling raised at once where fills are followed (``following_fills``): the model's
    fill runs, its files (the origin's listing) and their bytes can be followed as they land."""

    def __init__(
        self,
        message: str,
        cache: NodeCache,
        model_id: str,
        files: tuple[OriginFile, ...],
        pending: concurrent.futures.Future[None],
    ) -> None:
        super().__init__(message, retry_after=FILL_RETRY_AFTER_SECONDS)
        self.cache = cache
        self.model_id = model_id
        self.files = files
        self._pending = pending

    def origin_file(self, name: str) -> OriginFile | None:
        """The listed file a model-relative ``name`` is: ``ID/name``, or the file of a file
        model (or a split GGUF's part) beside it."""
        for file in self.files:
            inside = file.name.startswith(self.model_id + "/")
            if file.name == f"{self.model_id}/{name}" or (
                not inside and file.name.rpartition("/")[2] == name
            ):
                return file
        return None

    def landed(self, name: str) -> LandedFile | None:
        """The file's bytes as the fill lands them; None where this fill does not fetch it."""
        file = self.origin_file(name)
        return self.cache.landed(self.model_id, file.name) if file is not None else None

    def wait(self, timeout: float | None) -> bool:
        """Whether the fill ended within ``timeout`` seconds; raises its error if it failed."""
        try:
            self._pending.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True


@dataclass(frozen=True)
class RemoteModel:
    """A model of the origin's listing, by name alone (not indexed until it is filled)."""

    id: str
    files: tuple[OriginFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def format(self) -> str:
        formats = {checkpoint_format(f.name) for f in self.files}
        return next((f for f in ("safetensors", "gguf", "pytorch") if f in formats), "")


def hub_repo_models(
    files: list[OriginFile], read_ref: Callable[[OriginFile], str] | None
) -> tuple[dict[str, list[OriginFile]], set[str]]:
    """Repositories in the hub cache's layout (revisions published into a bucket,
    service/sources/publishing/publisher.py): each is its model id with ``refs/main`` and the files of
    the snapshot it names (so the node's copy is laid out as the local catalog reads a hub
    cache), offered only once that snapshot is listed: the pointer is written last. Also
    every name inside such a repository, taken out of the other rules."""
    repos: dict[str, tuple[str, dict[str, OriginFile], dict[str, list[OriginFile]]]] = {}
    taken: set[str] = set()
    for f in files:
        found = hub_repo_file(f.name)
        if found is None:
            continue
        taken.add(f.name)
        _, refs, snapshots = repos.setdefault(found.folder, (found.model_id, {}, {}))
        if found.rest == "refs/main":
            refs["main"] = f
        elif found.rest.startswith("snapshots/"):
            commit, _, inner = found.rest.removeprefix("snapshots/").partition("/")
            if inner:
                snapshots.setdefault(commit, []).append(f)
    models: dict[str, list[OriginFile]] = {}
    for model_id, refs, snapshots in repos.values():
        pointer = refs.get("main")
        if pointer is None or read_ref is None:
            continue
        snapshot = snapshots.get(read_ref(pointer))
        if snapshot:
            models[model_id] = [pointer, *snapshot]
    return models, taken


def group_models(
    listing: list[OriginFile], read_ref: Callable[[OriginFile], str] | None = None
) -> tuple[dict[str, RemoteModel], dict[str, Problem]]:
    """Model id -> its files, from the origin's file names (the rules in the module docstring),
    and the models refused: a split GGUF (``NAME-00001-of-00002.gguf`` ...) is one model,
    ``NAME.gguf``, offered only when every part is listed, as from a local root. Hub cache
    repositories (``models--ORG--NAME``) are read with ``read_ref`` (``hub_repo_models``)."""
    files = [f for f in listing if is_served_name(f.name)]
    published, taken = hub_repo_models(files, read_ref)
    files = [f for f in files if f.name not in taken]
    weight_dirs = {
        directory
        for f in files
        if (directory := f.name.rpartition("/")[0]) and is_weight_file(f.name)
    }
    grouped: dict[str, list[OriginFile]] = {}
    plain, splits = gguf_models((f.name, f) for f in files)
    for name, f in plain:
        grouped[name] = [f]
    for f in files:
        directory, _, base = f.name.rpartition("/")
        if checkpoint_format(base) == "gguf":
            continue
        if not directory:
            if weight_format(base) is not None:
                grouped[f.name] = [f]
            continue
        parts = directory.split("/")
        for depth in range(len(parts), 0, -1):  # the deepest model directory holds the file
            owner = "/".join(parts[:depth])
            if owner in weight_dirs:
                grouped.setdefault(owner, []).append(f)
                break
    problems: dict[str, Problem] = {}
    for split in splits:
        if not split.whole:
            first = split.parts[min(split.parts)]
            problems[split.model] = Problem(
                split.model, first.name, split.refusal(" at the origin")
            )
        elif split.model not in grouped:  # a plain NAME.gguf beside the parts keeps its id
            grouped[split.model] = split.ordered()
    grouped.update(published)
    models = {model_id: RemoteModel(model_id, tuple(fs)) for model_id, fs in grouped.items()}
    return models, problems


class OriginCatalog:
    """The models of ``cache.origin``, a ``ModelSource``: cached ones indexed from
    ``cache.data_dir`` by a local catalog of the cache (``local``, which serves only whole
    models), the others filled on their first request.

    Cached files are what their fill records say (``CacheDigests``): the revisions, commits
    and ETags reported are the records' digests, and a file that no longer matches its record
    is dropped (at each request and rescan, and before a new mapping is served) and filled
    again.
    """

    watch_files = False  # the cache changes only by its own fills and evictions

    def __init__(
        self,
        cache: NodeCache,
        recheck_seconds: float = 1.0,
        fill_wait_seconds: float = FILL_WAIT_SECONDS,
        on_refused: Callable[[Problem], None] | None = None,
        on_revision: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.cache = cache
        self._on_refused = on_refused
        self.origin: Origin = cache.origin
        self.fill_wait_seconds = fill_wait_seconds
        self.remote: dict[str, RemoteModel] = {}
        self.remote_problems: dict[str, Problem] = {}  # refused by the origin's listing
        self.origin_error: OriginUnavailable | None = None  # the last listing's failure
        self._fills: dict[str, concurrent.futures.Future[None]] = {}
        self._fills_lock = threading.Lock()
        self._ensured: dict[str, tuple[OriginFile, ...]] = {}  # the listing each fill matched
        self._fill_errors: dict[str, BaseException] = {}  # why each model's last fill failed
        self._refs: dict[tuple[str, str], str] = {}  # (refs/main object, version) -> commit
        # Watchers are told of a model's revision once the node holds it (RevisionLog).
        self.on_revision = on_revision
        self._announced: dict[str, str] = {}  # model id -> the commit last announced
        self._upstream_records: dict[tuple[str, str], dict[str, Any]] = {}
        self._list_origin()
        # Metadata of models not cached, from their headers (describe), beside the cache's data.
        self.headers = HeaderImages(self.origin, cache.directory / "headers")
        # The revisions filled here with their object versions (past_revisions.py), across
        # restarts, and the catalogs of past revisions' copies by commit.
        self.history = RevisionHistory(cache.directory / "history")
        self._past_catalogs: dict[str, Catalog] = {}
        for held in cache.cached_models():
            self._remember(held)
        self.local = Catalog(
            cache.data_dir,
            recheck_seconds=recheck_seconds,
            digests=CacheDigests(cache),
            whole_models=cache.cached_models,
            on_refused=on_refused,
        )
        # An evicted model's mappings are let go at once: until then its space stays used.
        cache.on_evict = self._let_go_evicted

    # -- what the local catalog of the cache answers -----------------------------------------

    @property
    def root(self) -> Path:
        return self.local.root

    @property
    def models(self) -> dict[str, Model]:
        return self.local.models

    @property
    def problems(self) -> dict[str, Problem]:
        """The cache's refusals, then the origin listing's (a split GGUF missing parts)."""
        problems = self.local.problems
        if not self.remote_problems:
            return problems
        return {**problems, **{i: p for i, p in self.remote_problems.items() if i not in problems}}

    @property
    def variants(self) -> dict[str, tuple[str, Path, list[Path]]]:
        return self.local.variants

    @property
    def pending_revisions(self) -> int:
        return self.local.pending_revisions

    def warm_revisions(self) -> None:
        self.local.warm_revisions()

    def answers_now(self, model_id: str | None = None) -> bool:
        """Never: ``get`` may fill from the origin and takes the cache's lock."""
        return False

    # -- the origin --------------------------------------------------------------------------

    @property
    def description(self) -> str:
        return self.origin.description

    @property
    def listed(self) -> Collection[str]:
        return self.remote.keys()

    def close(self) -> None:
        self.cache.close()  # a restarted server may take the directory over

    # -- scanning ----------------------------------------------------------------------------

    def scan(self) -> None:
        """List the origin again, then index the cache. An origin that cannot be listed keeps
        the last listing (cached models are served all the same) and is logged. A held model
        published into the origin (a hub cache repository) whose ``refs/main`` moved is
        followed at once: filled to the new revision, then announced."""
        self._list_origin()
        self.cache.check_all()
        self.local.scan()
        for model_id in self.cache.cached_models():
            remote = self.remote.get(model_id)
            if remote is not None and hub_repo_file(remote.files[0].name) is not None:
                self.follow(model_id, relist=False)

    def _list_origin(self) -> None:
        try:
            listing = self.origin.list_files()
        except OriginUnavailable as e:
            if self.origin_error is None:
                log.warning("origin %s cannot be listed: %s", self.origin.description, e)
            self.origin_error = e
        else:
            remote, problems = group_models(listing, self._read_ref)
            told, self.remote, self.remote_problems = self.remote_problems, remote, problems
            if self._on_refused is not None:  # counted once, as the cache's refusals are
                for model_id, problem in problems.items():
                    if told.get(model_id) != problem:
                        self._on_refused(problem)
            if self.origin_error is not None:
                log.info("origin %s can be listed again", self.origin.description)
            self.origin_error = None

    # -- lookup ------------------------------------------------------------------------------

    def _read_ref(self, pointer: OriginFile) -> str:
        """The commit a published repository's ``refs/main`` object names (read once per
        version of it); "" when it cannot be read."""
        key = (pointer.name, pointer.version)
        found = self._refs.get(key)
        if found is None:
            try:
                found = self.origin.read_range(pointer, 0, 256).decode("ascii").strip()
            except (WeightserveError, OSError, UnicodeDecodeError) as e:
                log.warning("cannot read %s at the origin: %s", pointer.name, e)
                return ""
            self._refs[key] = found
        return found

    def state_of(self, model_id: str) -> str:
        """``filling``; ``cached`` (held as the origin lists it now, or as it was last listed
        while the origin cannot be listed); ``outdated`` (held, but the origin's files have
        changed since: the next load of the model fills them); ``remote`` (listed by the
        origin, not in the cache)."""
        if self.cache.progress(model_id) is not None:
            return "filling"
        if model_id not in self.models:
            return "remote"
        return "cached" if self._holds_listed(model_id) else "outdated"

    def _holds_listed(self, model_id: str) -> bool:
        """Whether the cache's copy is of the files the origin's last listing names (by its
        fill records: no byte read), or the origin does not list the model."""
        remote = self.remote.get(model_id)
        return remote is None or self.cache.holds(model_id, remote.files)

    def _listed_revision(self, remote: RemoteModel) -> str:
        """The full content digest of the model as the origin lists it now, where the
        listing's versions are content digests (an upstream weightserve): the revision and
        commit its fill will have. "" elsewhere (object storage: known once filled)."""
        if not self.origin.lists_content_digests:
            return ""
        return content_revision(
            (model_file_name(remote.id, f.name), f.size, f.version) for f in remote.files
        )

    def listing_fields(self, model: Model) -> dict[str, Any]:
        """The state of a cached model, and what its summary says of the revision: the
        revision and commit the origin lists now, with ``cached_revision`` the copy's. A copy
        the origin has changed since never reports its revision as current: the origin's
        stands in its place ("" where the listing does not tell it: object storage)."""
        fields: dict[str, Any] = {
            "state": self.state_of(model.id),
            "cached_revision": model.revision,
        }
        if not self._holds_listed(model.id):
            digest = self._listed_revision(self.remote[model.id])
            fields.update(revision=digest[:REVISION_CHARS], commit=digest[:COMMIT_CHARS])
        return fields

    def remote_summaries(self, may_read: Callable[[str], bool]) -> list[dict[str, Any]]:
        """The listed models not cached yet, as model summaries with their state and the
        revision and commit the origin lists (where its listing tells them)."""
        summaries = []
        for m in sorted(self.remote.values(), key=lambda m: m.id):
            if m.id in self.models or not may_read(m.id):
                continue
            digest = self._listed_revision(m)
            summaries.append(
                {
                    "id": m.id,
                    "format": m.format,
                    "revision": digest[:REVISION_CHARS],
                    "commit": digest[:COMMIT_CHARS],
                    "cached_revision": "",
                    "tensor_count": 0,
                    "total_bytes": m.total_bytes,
                    "state": self.state_of(m.id),
                }
            )
        return summaries

    def get(self, model_id: str, may_read: Callable[[str], bool] | None = None) -> Model:
        """The model, filled into the cache first if it is not there (see ``_fill``)."""
        plain, revision = split_revision(validate_model_id(model_id))
        base = base_model_id(plain)  # ID@R: the local catalog picks R
        past = self._past(plain, base, revision, may_read)
        if past is not None:
            return past
        remote = self.remote.get(base)
        self.cache.check(base)  # a file found corrupt is dropped here, and filled again below
        cached = base in self.cache.cached_models()
        corruption = None if cached else self.cache.corruption(base)
        if corruption is not None and self.origin_error is not None:
            raise ModelUnavailable(
                f"model {model_id!r} is refused: {corruption}, and the origin cannot be "
                f"listed to fill it again: {self.origin_error}"
            )
        if not cached and self.origin_error is not None:
            # Not tried again per request: the rescan lists the origin again.
            raise OriginUnavailable(
                f"model {model_id!r} is not in this node's cache and the origin cannot be "
                f"listed: {self.origin_error}"
            )
        refused = self.remote_problems.get(model_id)
        if remote is None and not cached and refused is not None:
            raise ModelUnavailable(f"model {model_id!r} is refused: {refused.reason}")
        if remote is None and not cached:
            msg = f"No model {model_id!r} at the origin {self.origin.description}."
            known = [*self.models, *self.remote]
            visible = [m for m in known if may_read is None or may_read(m)]
            close = difflib.get_close_matches(model_id, visible, n=1)
            if close:
                msg += f" Did you mean {close[0]!r}?"
            raise ModelNotFound(msg)
        files = remote.files if remote is not None else None
        if cached and (
            files is None
            or self._ensured.get(base) == files
            or self._serves_held(plain, base, revision)
        ):
            self.cache.ensure(base)  # a hit: counted, and marked used for eviction order
        else:
            self._fill(base, files)
        if base not in self.models and model_id not in self.variants:
            self.local.scan()
        return self.local.get(model_id, may_read)

    def _serves_held(self, plain: str, base: str, revision: str | None) -> bool:
        """Whether ``ID@R`` is answered by the copy the cache holds, as it is and with no fill:
        R names that copy even where the origin has moved on since. ``main`` (or no R) fills
        to the origin's newest; an R naming neither the copy nor the revision the origin
        lists is refused here, before a fill could replace the copy."""
        held = self.models.get(base)
        if revision is None or revision == MAIN_REVISION or held is None:
            return False
        try:
            pick_revision(plain, revision, {MAIN_REVISION: held})
        except RevisionNotFound as e:
            remote = self.remote.get(base)
            listed = self._listed_revision(remote) if remote is not None else ""
            if not listed or listed.startswith(revision.lower()):
                return False  # the origin's revision (or one known once filled): fill it
            raise RevisionNotFound(
                f"{e}; the origin {self.origin.description} lists commit "
                f"{listed[:COMMIT_CHARS]} of it now"
            ) from None
        return True

    # -- past revisions ----------------------------------------------------------------------

    def _remember(self, model_id: str) -> None:
        """Record the revision of the model held whole now in the history, with the object
        version each file was read at (where the origin keeps versions)."""
        held = self._held_files(model_id)
        if held and not model_id.startswith(PAST_COPIES + "/"):  # a copy was recorded before
            self.history.record(model_id, held)

    def _held_files(self, model_id: str) -> list[PastFile]:
        """The files of the model held whole, as filled (none when it is not held whole)."""
        return [
            PastFile(name, r.size, r.version, r.digest, self.origin.version_id(
                OriginFile(name, r.size, r.version)))
            for name, r in self.cache.records(model_id).items()
        ]  # fmt: skip

    def _past(
        self, plain: str, base: str, revision: str | None, may_read: Callable[[str], bool] | None
    ) -> Model | None:
        """``ID@R`` from a copy of R, where R is a revision this node filled with the object
        version of each file recorded (a versioned bucket) and not the copy held as the
        newest: the copy is filled from those versions on first use (each file verified
        against R's digest), then served, and evicted like a model. None where R is
        answered otherwise (the copy held, or RevisionNotFound naming what is held)."""
        past = self._past_named(base, revision)
        if past is None:
            return None
        copy, files = past.copy_id, past.copies()
        self.cache.check(copy)
        if copy in self.cache.cached_models():
            self.cache.ensure(copy, list(files))  # a hit: counted, marked used
        else:
            self._fill(copy, files)
        catalog = self._past_catalog(past.commit)
        if base not in catalog.models:
            catalog.scan()
        # Named by its commit, so that a stream of it holds the copy (``using``).
        return replace(catalog.get(plain, may_read), id=with_revision(plain, past.commit))

    def _past_named(self, base: str, revision: str | None) -> PastRevision | None:
        """The past revision R names that a copy serves (``_past``): recorded with every
        object version, and not the copy held as the newest."""
        if revision is None or revision == MAIN_REVISION:
            return None
        past = self.history.find(base, revision)
        if past is None or not past.versioned:
            return None
        held = self._held_files(base)
        if held and revision_of(base, held).digest == past.digest:
            return None  # the copy held as the newest is R: served as it is
        return past

    def _copy_state(self, past: PastRevision) -> dict[str, Any]:
        """``cache_state`` of a past revision's copy, named ``ID@COMMIT``."""
        copy = past.copy_id
        progress = self.cache.progress(copy)
        held = copy in self.cache.cached_models()
        total = sum(f.size for f in past.files)
        body: dict[str, Any] = {
            "id": with_revision(past.model_id, past.commit),
            "state": "filling" if progress is not None else "cached" if held else "remote",
            "bytes_total": progress.bytes_total if progress is not None else total,
            "bytes_done": progress.bytes_done if progress is not None else total if held else 0,
            "pinned": False,
        }
        error = self._fill_errors.get(copy)
        if error is not None and progress is None and not held:
            body["error"] = f"{type(error).__name__}: {error}"
        return body

    def _past_admin(self, model_id: str) -> PastRevision | None:
        """The past revision an operator's ``ID@R`` names, served from a copy."""
        plain, revision = split_revision(validate_model_id(model_id))
        return self._past_named(base_model_id(plain), revision)

    def _let_go_evicted(self) -> None:
        """Index the cache again (the data directory's models and the past revisions'
        copies), so the mappings of evicted files are let go."""
        self.local.scan()
        with self._fills_lock:
            catalogs = list(self._past_catalogs.values())
        for catalog in catalogs:
            catalog.scan()

    def _past_of(self, model_id: str) -> PastRevision | None:
        """The past revision whose copy serves ``model_id`` (``ID@COMMIT``, as ``_past``
        names the models it gives), else None."""
        plain, revision = split_revision(model_id)
        past = self.history.find(base_model_id(plain), revision) if revision else None
        return past if past is not None and past.commit == revision else None

    def _past_catalog(self, commit: str) -> Catalog:
        """The catalog of the copies of revision ``commit`` (``.revisions/COMMIT`` in the
        cache's data directory), serving the copies held whole."""
        prefix = f"{PAST_COPIES}/{commit}/"

        def whole() -> list[str]:
            return [
                m.removeprefix(prefix) for m in self.cache.cached_models() if m.startswith(prefix)
            ]

        with self._fills_lock:
            catalog = self._past_catalogs.get(commit)
            if catalog is None:
                catalog = Catalog(
                    self.cache.data_dir / prefix,
                    recheck_seconds=self.local.recheck_seconds,
                    digests=CacheDigests(self.cache),
                    whole_models=whole,
                )
                self._past_catalogs[commit] = catalog
        return catalog

    def describe(
        self,
        model_id: str,
        may_read: Callable[[str], bool] | None = None,
        file: str | None = None,
    ) -> Model:
        """The model's metadata: a model listed by the origin and not cached (or cached of
        files the origin changed since) is described from ranged reads of its headers
        (``HeaderImages``), without a fill; any other is what
        ``get`` answers (a cached model, or the error a request gets). ``ID@R`` is checked
        against the revision the origin lists, where it lists content digests. ``file``, a
        side file, is fetched alone to be served (its ETag the digest a fill would record)
        unless the answer needs a commit the origin tells only once filled (``ID@R`` over
        object storage); a checkpoint's bytes need the fill."""
        plain, revision = split_revision(validate_model_id(model_id))
        base = base_model_id(plain)
        remote = self.remote.get(base)
        # A copy the origin changed since answers only for a revision named (``get``); the
        # model as listed now is described from its headers, as an uncached one.
        cached = base in self.cache.cached_models() and (
            revision is not None or self._holds_listed(base)
        )
        alone = file is None or (
            checkpoint_format(file) is None
            and (self.origin.lists_content_digests or revision is None)
        )
        if remote is None or self.origin_error is not None or cached or not alone:
            return self.get(model_id, may_read)
        described = self.headers.model(plain, base, remote.files, may_read, file)
        if revision is None:
            return described
        if not described.commit:  # known once filled: the filled model answers for R
            return self.get(model_id, may_read)
        return pick_revision(plain, revision, {MAIN_REVISION: described})

    def _current(self, base: str, remote: RemoteModel) -> bool:
        """Whether the cache holds the model as the origin lists it now."""
        return base in self.cache.cached_models() and self._ensured.get(base) == remote.files

    def _fill(
        self, model_id: str, files: tuple[OriginFile, ...] | None, wait: float | None = None
    ) -> None:
        """Fill the model (one fill for every concurrent request, whatever its transport) and
        index it; a request waits ``fill_wait_seconds`` (or ``wait``) at most, then is told to
        retry with the fill's progress, while the fill goes on. Where fills are followed
        (``following_fills``) it is handed the fill at once (FillInProgress)."""
        with self._fills_lock:
            pending = self._fills.get(model_id)
            if pending is None:
                self._fill_errors.pop(model_id, None)
                pending = concurrent.futures.Future()
                self._fills[model_id] = pending
                threading.Thread(
                    target=self._run_fill,
                    args=(model_id, files, pending),
                    name=f"weightserve-fill-{model_id}",
                    daemon=True,
                ).start()
        follow = _FOLLOW_FILLS.get() and files is not None
        try:
            timeout = 0 if follow else self.fill_wait_seconds if wait is None else wait
            pending.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if follow:
                assert files is not None
                raise FillInProgress(
                    f"model {model_id!r} is being copied into this node's cache from "
                    f"{self.origin.description}",
                    self.cache,
                    model_id,
                    files,
                    pending,
                ) from None
            progress = self.cache.progress(model_id)
            done = (
                f"{progress.bytes_done} of {progress.bytes_total} bytes"
                if progress is not None
                else "nearly done"
            )
            raise ModelFilling(
                f"model {model_id!r} is being copied into this node's cache from "
                f"{self.origin.description} ({done}); retry shortly",
                retry_after=FILL_RETRY_AFTER_SECONDS,
            ) from None

    def _run_fill(
        self,
        model_id: str,
        files: tuple[OriginFile, ...] | None,
        pending: concurrent.futures.Future[None],
    ) -> None:
        try:
            try:
                self.cache.ensure(model_id, list(files) if files is not None else None)
            except OriginChanged as e:
                # An object changed since it was listed: list again, fill the new version.
                log.info("origin changed while filling %r (%s); listing it again", model_id, e)
                self.scan()
                remote = self.remote.get(model_id)
                files = remote.files if remote is not None else None
                self.cache.ensure(model_id, list(files) if files is not None else None)
            if files is not None:
                self._ensured[model_id] = files
            self._remember(model_id)
            self.local.scan()
            self._announce(model_id)
        except BaseException as e:
            self._fill_errors[model_id] = e  # for an operator's prefetch that nobody waits on
            pending.set_exception(e)
        else:
            pending.set_result(None)
        finally:
            with self._fills_lock:
                self._fills.pop(model_id, None)

    @contextlib.contextmanager
    def using(self, model_id: str) -> Iterator[None]:
        """Keep the model's files from eviction while a stream reads them. A model not
        cached whose side file is read from its header images holds nothing: holding it
        would fill it."""
        past = self._past_of(model_id)
        if past is not None:  # a past revision's copy (``_past``)
            with self.cache.using(past.copy_id, list(past.copies())):
                yield
            return
        base = base_model_id(model_id)
        if base not in self.cache.cached_models() and self.headers.describes(base):
            yield
            return
        with self.cache.using(base):
            yield

    # -- revisions announced to watchers (a RevisionLog; service/sources/origin/follow.py) -----------

    def revisions(self, model_id: str) -> list[dict[str, Any]]:
        """The revision the node holds of the model (a node keeps its newest), or for one not
        held yet, the revision the origin lists (where it lists one)."""
        base = _cached_id(model_id)
        held = self.models.get(base) if base in self.cache.cached_models() else None
        if held is not None:
            return [self._record(base, held.commit, sum(f.size for f in held.repo_files.values()))]
        remote = self.remote.get(base)
        if remote is None:
            raise ModelNotFound(f"No model {base!r} at the origin {self.origin.description}.")
        commit = self._listed_revision(remote)[:COMMIT_CHARS]
        return [self._record(base, commit, remote.total_bytes)]

    def catch_up(self) -> None:
        """List the origin again and follow each held model it has moved on from (a node's
        watch of its upstream reconnected: what was announced meanwhile is not missed)."""
        self._list_origin()
        for model_id in self.cache.cached_models():
            self.follow(model_id, relist=False)

    def revisions_after(self, model_id: str, since: str) -> list[dict[str, Any]]:
        """The revision held now, unless it is ``since``: a node keeps no history."""
        current = self.revisions(model_id)
        return [] if current[0]["commit"].startswith(since.lower()) else current

    def follow(
        self, model_id: str, record: dict[str, Any] | None = None, *, relist: bool = True
    ) -> None:
        """The upstream announced a new revision (``record``) of ``model_id``: a model the
        node holds is filled to it now (the files that changed; nobody waits), then
        announced to the node's watchers. Models not held are filled on request as ever."""
        if record is not None and record.get("commit"):
            self._upstream_records[(model_id, record["commit"])] = record
        if model_id not in self.cache.cached_models():
            return
        if relist:
            self._list_origin()
        remote = self.remote.get(model_id)
        if remote is None or self._holds_listed(model_id):
            return
        try:
            self._fill(model_id, remote.files, wait=0.0)
        except ModelFilling:
            pass  # filling; announced once its bytes are here
        except WeightserveError as e:
            log.warning("following the origin's new revision of %r failed: %s", model_id, e)

    def _announce(self, model_id: str) -> None:
        """Tell the watchers of the model's revision once the node holds it, if it is new."""
        held = self.models.get(model_id)
        if self.on_revision is None or held is None:
            return
        commit = held.commit
        if self._announced.get(model_id) == commit:
            return
        self._announced[model_id] = commit
        size = sum(f.size for f in held.repo_files.values())
        self.on_revision(model_id, self._record(model_id, commit, size))

    def _record(self, model_id: str, commit: str, size: int) -> dict[str, Any]:
        """A revision record: the upstream's (parent, message, metadata) where it announced
        this commit, else one with just what the node knows."""
        upstream = self._upstream_records.get((model_id, commit))
        record = revision_record(commit, size=size)
        if upstream is not None:
            record.update({k: upstream[k] for k in record if k in upstream and k != "bytes"})
        return record

    # -- operator controls (the admin routes, service/transports/http/admin.py) ---------------

    def cache_state(self, model_id: str) -> dict[str, Any]:
        """The model's state in the cache: ``cached``, ``filling`` (bytes done of total) or
        ``remote``, whether it is pinned, and why its last fill failed (``error``). ``ID@R``
        of a past revision served from a copy (``_past``) is that copy's state."""
        past = self._past_admin(model_id)
        if past is not None:
            return self._copy_state(past)
        base = _cached_id(model_id)
        remote = self.remote.get(base)
        if remote is None and base not in self.cache.cached_models():
            raise ModelNotFound(f"No model {base!r} at the origin {self.origin.description}.")
        progress = self.cache.progress(base)
        state = self.state_of(base)
        total = remote.total_bytes if remote is not None else 0
        body: dict[str, Any] = {
            "id": base,
            "state": state,
            "bytes_total": progress.bytes_total if progress is not None else total,
            "bytes_done": progress.bytes_done
            if progress is not None
            else (total if state == "cached" else 0),
            "pinned": base in self.cache.pins,
        }
        error = self._fill_errors.get(base)
        if error is not None and progress is None:
            body["error"] = f"{type(error).__name__}: {error}"
        return body

    def prefetch(self, model_id: str) -> dict[str, Any]:
        """Start the model's fill unless the cache holds it as listed (the one fill requests
        join; nobody waits for it), and say its state. What a request would be refused
        before a fill (not found, refused, origin down) is raised here; so is
        RevisionNotFound for ``ID@R`` where the origin lists content digests (elsewhere the
        fill is what the origin holds now, and a load of R checks it). A past revision
        served from a copy (``_past``) has that copy filled."""
        plain, revision = split_revision(validate_model_id(model_id))
        base = base_model_id(plain)
        past = self._past_named(base, revision)
        if past is not None:
            if past.copy_id in self.cache.cached_models():
                self.cache.touch(past.copy_id)
            else:
                with contextlib.suppress(ModelFilling):
                    self._fill(past.copy_id, past.copies(), wait=0.5)
            return self._copy_state(past)
        remote = self.remote.get(base)
        if revision is not None and remote is not None and self.origin.lists_content_digests:
            self.describe(model_id)
        if remote is None or self.origin_error is not None:
            self.get(plain)  # a cached model, or the refusal a request gets
        elif self._current(base, remote):
            self.cache.touch(base)
        else:
            with contextlib.suppress(ModelFilling):
                self._fill(base, remote.files, wait=0.5)  # a quick refusal (too large) shows
        return self.cache_state(base)

    def evict(self, model_id: str) -> dict[str, Any]:
        """Remove the model from the cache now; EvictionRefused while it is streamed, being
        filled or pinned, ModelNotFound when the cache does not hold it. ``ID@R`` of a past
        revision served from a copy (``_past``) evicts that copy."""
        past = self._past_admin(model_id)
        if past is not None:
            freed = self.cache.evict(past.copy_id)
            return {**self._copy_state(past), "evicted_bytes": freed}
        base = _cached_id(model_id)
        freed = self.cache.evict(base)
        self._ensured.pop(base, None)
        self.local.scan()
        return {"id": base, "state": self.state_of(base), "evicted_bytes": freed}

    def verify(self, model_id: str) -> dict[str, Any]:
        """Re-check each cached file of the model, every byte read again: against its fill
        record (``NodeCache.check``, which drops a file that no longer matches), then against
        the origin's listing: present, of the listed size, and (where the origin's version is
        a content digest) of the listed content. A model that fails is evicted, so the next
        request fills it again."""
        base = _cached_id(model_id)
        if base not in self.cache.cached_models():
            raise ModelNotFound(
                f"model {base!r} is not in this node's cache: nothing to verify (prefetch it)"
            )
        self.cache.check(base, full=True)
        remote = self.remote.get(base)
        if remote is None:
            raise ModelNotFound(
                f"the origin {self.origin.description} no longer lists model {base!r}: evict it"
            )
        current = self._ensured.get(base) == remote.files
        files = [self._check_file(base, f, current) for f in remote.files]
        body: dict[str, Any] = {"id": base, "ok": all(f["status"] in _GOOD for f in files)}
        body.update(files=files, evicted=False)
        if not body["ok"]:
            log.warning("model %r differs from the origin %s", base, self.origin.description)
            try:
                self.evict(base)
                body["evicted"] = True
            except EvictionRefused as e:
                body["note"] = str(e)
        return body

    def _check_file(self, base: str, file: OriginFile, current: bool) -> dict[str, Any]:
        path = self.cache.data_dir / file.name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            dropped = self.cache.corruption(base)  # by the fill-record check just now
            if dropped is not None:
                return {"name": file.name, "status": "corrupt", "detail": dropped}
            return {"name": file.name, "status": "missing"}
        if size != file.size:
            detail = f"{size} bytes, the origin lists {file.size}"
            return {"name": file.name, "status": "corrupt", "detail": detail}
        matches = self.origin.matches(file, path)
        if matches is None:
            return {"name": file.name, "status": "unchecked", "detail": "size only: the "
                    "origin's version is no content digest"}  # fmt: skip
        if matches:
            return {"name": file.name, "status": "ok"}
        # Filled from an older listing: the origin moved on, the bytes may be whole.
        status = "corrupt" if current else "changed"
        return {"name": file.name, "status": status, "detail": f"origin version {file.version}"}


_GOOD = ("ok", "unchecked")  # a file that passed what could be checked


def _cached_id(model_id: str) -> str:
    """The model the cache holds for ``model_id``: ``org/name`` for ``org/name@R:fp16`` (a
    node holds the files of one revision of a directory model)."""
    return base_model_id(split_revision(validate_model_id(model_id))[0])
