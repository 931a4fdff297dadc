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
import difflib
import logging
import threading
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, Protocol

from weightserve.client.errors import (
    ModelFilling,
    ModelNotFound,
    ModelUnavailable,
    OriginChanged,
    OriginUnavailable,
    RevisionNotFound,
    WeightserveError,
)
from weightserve.client.wire.routes import MAIN_REVISION, split_revision
from weightserve.service.sources.base import Problem
from weightserve.service.sources.cache.integrity import CacheDigests
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.layout import (
    base_model_id,
    checkpoint_format,
    hub_repo_file,
    validate_model_id,
)
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.sources.model import Model, ReadCheck
from weightserve.service.sources.origin.admin import CacheAdmin
from weightserve.service.sources.origin.announced import HeldRevisions
from weightserve.service.sources.origin.base import Origin, OriginFile
from weightserve.service.sources.origin.fill_wait import (
    _FOLLOW_FILLS,
    FILL_RETRY_AFTER_SECONDS,
    FILL_WAIT_SECONDS,
    FillInProgress,
)
from weightserve.service.sources.origin.headers import HeaderImages
from weightserve.service.sources.origin.listing import PublishedRefs, RemoteModel, group_models
from weightserve.service.sources.origin.past_copies import PastCopies
from weightserve.service.sources.origin.past_revisions import (
    RevisionHistory,
    model_file_name,
)
from weightserve.service.sources.revisions.content import (
    COMMIT_CHARS,
    REVISION_CHARS,
    content_revision,
)
from weightserve.service.sources.revisions.pinning import pick_revision

log = logging.getLogger("weightserve.service")


class OpensCache(Protocol):
    """Opens the node cache an ``OriginCatalog`` serves, telling ``on_evict`` of evictions:
    the catalog is built around it, so it hands over its own listener."""

    def __call__(self, *, on_evict: Callable[[], None]) -> NodeCache: ...


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
        open_cache: OpensCache,
        recheck_seconds: float = 1.0,
        fill_wait_seconds: float = FILL_WAIT_SECONDS,
        on_refused: Callable[[Problem], None] | None = None,
        on_revision: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        # An evicted model's mappings are let go at once: until then its space stays used.
        self.cache = cache = open_cache(on_evict=self._let_go_evicted)
        try:
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
            self.refs = PublishedRefs(self.origin)
            # Watchers are told of a model's revision once the node holds it (its RevisionLog).
            self.revision_log = HeldRevisions(self, on_revision)
            self._list_origin()
            # Metadata of models not cached, from their headers (describe), beside the cache's data.
            self.headers = HeaderImages(self.origin, cache.directory / "headers")
            # The revisions filled here with their object versions (past_revisions.py), across
            # restarts, and their copies served as ``ID@R``.
            self.past = PastCopies(
                cache, RevisionHistory(cache.directory / "history"), recheck_seconds, self.fill
            )
            self.local = Catalog(
                cache.data_dir,
                recheck_seconds=recheck_seconds,
                digests=CacheDigests(cache),
                whole_models=cache.cached_models,
                on_refused=on_refused,
            )
            self.admin = CacheAdmin(self)  # the operator's controls (CacheControls)
        except BaseException:
            cache.close()
            raise

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
        """Release the cache's directory (a restarted server may take it over), then close the
        origin, whose connections would otherwise be left to the garbage collector."""
        try:
            self.cache.close()
        finally:
            self.origin.close()

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
            remote, problems = group_models(listing, self.refs.read)
            told, self.remote, self.remote_problems = self.remote_problems, remote, problems
            if self._on_refused is not None:  # counted once, as the cache's refusals are
                for model_id, problem in problems.items():
                    if told.get(model_id) != problem:
                        self._on_refused(problem)
            if self.origin_error is not None:
                log.info("origin %s can be listed again", self.origin.description)
            self.origin_error = None

    # -- lookup ------------------------------------------------------------------------------

    def state_of(self, model_id: str) -> str:
        """``filling``; ``cached`` (held as the origin lists it now, or as it was last listed
        while the origin cannot be listed); ``outdated`` (held, but the origin's files have
        changed since: the next load of the model fills them); ``remote`` (listed by the
        origin, not in the cache)."""
        # Until the fill's thread has indexed the copy, not only while bytes arrive: between
        # the two the model is neither "remote" nor yet served.
        with self._fills_lock:
            indexing = model_id in self._fills
        if indexing or self.cache.progress(model_id) is not None:
            return "filling"
        if model_id not in self.models:
            return "remote"
        return "cached" if self._holds_listed(model_id) else "outdated"

    def _holds_listed(self, model_id: str) -> bool:
        """Whether the cache's copy is of the files the origin's last listing names (by its
        fill records: no byte read), or the origin does not list the model."""
        remote = self.remote.get(model_id)
        return remote is None or self.cache.holds(model_id, remote.files)

    def listed_revision(self, remote: RemoteModel) -> str:
        """The full content digest of the model as the origin lists it now, where the
        listing's versions are content digests (an upstream weightserve): the revision and
        commit its fill will have. "" elsewhere (object storage: known once filled)."""
        if not self.origin.lists_content_digests:
            return self._published_commit(remote)
        return content_revision(
            (model_file_name(remote.id, f.name), f.size, f.version) for f in remote.files
        )

    def _published_commit(self, remote: RemoteModel) -> str:
        """The commit a repository published into the origin has as main: its ``refs/main``
        names it (the publisher named the snapshot by its content, so a fill has that
        commit); "" for any other model."""
        pointer = remote.files[0] if remote.files else None
        found = hub_repo_file(pointer.name) if pointer is not None else None
        if pointer is None or found is None or found.rest != "refs/main":
            return ""
        return self.refs.read(pointer)

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
            digest = self.listed_revision(self.remote[model.id])
            fields.update(revision=digest[:REVISION_CHARS], commit=digest[:COMMIT_CHARS])
        return fields

    def remote_summaries(self, may_read: ReadCheck) -> list[dict[str, Any]]:
        """The listed models not cached yet, as model summaries with their state and the
        revision and commit the origin lists (where its listing tells them)."""
        summaries = []
        for m in sorted(self.remote.values(), key=lambda m: m.id):
            if m.id in self.models or not may_read(m.id):
                continue
            digest = self.listed_revision(m)
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

    def get(self, model_id: str, may_read: ReadCheck | None = None) -> Model:
        """The model, filled into the cache first if it is not there (see ``fill``)."""
        plain, revision = split_revision(validate_model_id(model_id))
        base = base_model_id(plain)  # ID@R: the local catalog picks R
        past = self.past.serve(plain, base, revision, may_read)
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
            self.fill(base, files)
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
            listed = self.listed_revision(remote) if remote is not None else ""
            if not listed or listed.startswith(revision.lower()):
                return False  # the origin's revision (or one known once filled): fill it
            raise RevisionNotFound(
                f"{e}; the origin {self.origin.description} lists commit "
                f"{listed[:COMMIT_CHARS]} of it now"
            ) from None
        return True

    def describe(
        self, model_id: str, may_read: ReadCheck | None = None, file: str | None = None
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
        described.listed_commit = self.listed_revision(remote)[:COMMIT_CHARS]
        if revision is None:
            return described
        if not described.commit:  # known once filled: the filled model answers for R
            return self.get(model_id, may_read)
        return pick_revision(plain, revision, {MAIN_REVISION: described})

    def current(self, base: str, remote: RemoteModel) -> bool:
        """Whether the cache holds the model as the origin lists it now."""
        return base in self.cache.cached_models() and self._ensured.get(base) == remote.files

    def ensured(self, model_id: str) -> tuple[OriginFile, ...] | None:
        """The listing the model's last fill matched (None before one)."""
        return self._ensured.get(model_id)

    def fill_error(self, model_id: str) -> BaseException | None:
        """Why the model's last fill failed (for an operator's prefetch nobody waits on)."""
        return self._fill_errors.get(model_id)

    def evicted(self, model_id: str) -> None:
        """The model was evicted (an operator's evict): forgotten, the cache indexed again."""
        self._ensured.pop(model_id, None)
        self.local.scan()

    def _let_go_evicted(self) -> None:
        """Index the cache again (the data directory's models and the past revisions'
        copies), so the mappings of evicted files are let go."""
        self.local.scan()
        self.past.scan()

    def fill(
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
                threading.Thread(target=self._run_fill, args=(model_id, files, pending),
                                 name=f"weightserve-fill-{model_id}", daemon=True).start()  # fmt: skip
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
            self.past.remember(model_id)
            self.local.scan()
            self.revision_log.announce(model_id)
        except BaseException as e:
            self._fill_errors[model_id] = e  # for an operator's prefetch that nobody waits on
            pending.set_exception(e)
        else:
            pending.set_result(None)
        finally:
            with self._fills_lock:
                self._fills.pop(model_id, None)
        if pending.exception() is None and not self._holds_listed(model_id):
            self.follow(model_id, relist=False)  # the origin moved on while this one filled

    @contextlib.contextmanager
    def using(self, model_id: str) -> Iterator[None]:
        """Keep the model's files from eviction while a stream reads them. A model not
        cached whose side file is read from its header images holds nothing: holding it
        would fill it."""
        past = self.past.serving(model_id)
        if past is not None:  # a past revision's copy (``PastCopies.serve``)
            with self.cache.using(past.copy_id, list(past.copies())):
                yield
            return
        base = base_model_id(model_id)
        if base not in self.cache.cached_models() and self.headers.describes(base):
            yield
            return
        with self.cache.using(base):
            yield

    # -- following the origin (service/sources/origin/follow.py) ------------------------------

    def catch_up(self) -> None:
        """List the origin again and follow each held model it has moved on from (a node's
        watch of its upstream reconnected: what was announced meanwhile is not missed)."""
        self._list_origin()
        for model_id in self.cache.cached_models():
            self.follow(model_id, relist=False)

    def follow(
        self, model_id: str, record: dict[str, Any] | None = None, *, relist: bool = True
    ) -> None:
        """The upstream announced a new revision (``record``) of ``model_id``: a model the
        node holds is filled to it now (the files that changed; nobody waits), then
        announced to the node's watchers. Models not held are filled on request as ever."""
        self.revision_log.heard(model_id, record)
        if model_id not in self.cache.cached_models():
            return
        if relist:
            self._list_origin()
        remote = self.remote.get(model_id)
        if remote is None or self._holds_listed(model_id):
            return
        try:
            self.fill(model_id, remote.files, wait=0.0)
        except ModelFilling:
            pass  # filling; announced once its bytes are here
        except WeightserveError as e:
            log.warning("following the origin's new revision of %r failed: %s", model_id, e)
