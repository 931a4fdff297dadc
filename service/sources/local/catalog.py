"""The local catalog: walks a root directory, finds its models by the layout rules
(service/sources/layout.py) and indexes them, keeping them current as files change.

Start-up reads headers only (the readers never touch tensor data), so opening a root costs
its headers, not its size. A model that fails validation is recorded in
``Catalog.problems`` with the file and the rule it breaks; every other model is served.

Where its models are is discovery.py's part: the layout rules are stated in its docstring
(README.md, "Model layouts", states them for users). The catalog indexes them (``scan``: a
model unchanged keeps its index and mappings) and looks them up (``get``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

from weightserve.client.errors import CheckpointError, ModelNotFound, ModelUnavailable
from weightserve.client.wire.hints import did_you_mean
from weightserve.client.wire.routes import MAIN_REVISION, split_revision
from weightserve.service.readers.base import FormatReader
from weightserve.service.sources.base import Problem
from weightserve.service.sources.files.stamps import FileStamp, current_stamps
from weightserve.service.sources.layout import (
    base_model_id,
    validate_model_id,
)
from weightserve.service.sources.local.discovery import Discovery
from weightserve.service.sources.model import Model, ReadCheck
from weightserve.service.sources.revisions.content import DigestStore
from weightserve.service.sources.revisions.pinning import pick_revision

log = logging.getLogger("weightserve.catalog")


# Model, RepoFile, Problem and validate_model_id live in model.py, base.py and layout.py;
# modules that import them from here still may.
def default_readers() -> dict[str, FormatReader]:
    from weightserve.service.readers.gguf import GGUFReader
    from weightserve.service.readers.pytorch import PytorchReader
    from weightserve.service.readers.safetensors import SafetensorsReader

    return {"safetensors": SafetensorsReader(), "gguf": GGUFReader(), "pytorch": PytorchReader()}


class Catalog:
    """Every model under ``root``, indexed by id: the ``ModelSource`` of a local directory.

    ``whole_models``, when given, names the directory models (ids without ``:VARIANT``) whose
    files are all in place, asked at each scan: only those are served. A node cache fills a
    model file by file, so the models of a fill in progress must not be.
    """

    watch_files = True  # files are put there by other hands: a watcher rescans sooner

    def __init__(
        self,
        root: str | os.PathLike,
        readers: dict[str, FormatReader] | None = None,
        recheck_seconds: float = 1.0,
        digests: DigestStore | None = None,
        whole_models: Callable[[], Iterable[str]] | None = None,
        on_refused: Callable[[Problem], None] | None = None,
    ):
        self.root = Path(root).resolve()
        self.recheck_seconds = recheck_seconds
        self.whole_models = whole_models
        if not self.root.is_dir():
            raise FileNotFoundError(f"model root {self.root} is not a directory")
        self.readers = readers if readers is not None else default_readers()
        self.digests = digests if digests is not None else DigestStore()
        self.models: dict[str, Model] = {}
        self.problems: dict[str, Problem] = {}
        # Refused models with their files as they were: not parsed (or logged) again until
        # a file changes, so a hostile 256 MiB pickle is walked once, not every rescan.
        self._refused: dict[str, tuple[dict[Path, FileStamp], Problem]] = {}
        self.on_refused = on_refused  # told of each new refusal (the metrics count them)
        # Other weight sets of a directory (``ID:VARIANT``): indexed on their first request.
        self.variants: dict[str, tuple[str, Path, list[Path]]] = {}
        self.discovery = Discovery(self.root)
        self._model_dirs: set[Path] = set()
        self._lock = threading.Lock()
        # Streams reading each model's directory (``using``): a published revision being
        # streamed is kept from retention (service/sources/publishing/publisher.py).
        self._streamed: dict[Path, int] = {}
        self._last_seen: tuple[frozenset[str], frozenset[str]] | None = None  # the last scan's
        self.scan()

    # -- indexing ----------------------------------------------------------------------------

    def _load(
        self,
        model_id: str,
        fmt: str,
        path: Path,
        files: list[Path],
        side: list[Path],
        stamps: dict[Path, FileStamp],
    ) -> Model:
        # ``stamps`` were taken before reading: see MappedFile.view.
        return Model(
            id=model_id,
            format=fmt,
            path=path,
            files=files,
            contents=self.readers[fmt].read(files),
            stamps=stamps,
            digests=self.digests,
            side_files=side,
        )

    def scan(self) -> None:
        """(Re)discover models. Unchanged models keep their index and mappings; unchanged
        refused models keep their refusal without being parsed again. Ids that name the same
        files (aliases, hub refs) share one Model's index and mappings."""
        started = time.perf_counter()
        with self._lock:
            found = self.discovery.discover()
            self.problems = dict(self.discovery.problems)
            # Swapped whole: ``get`` reads it unlocked.
            self.variants = self.discovery.variants
            models: dict[str, Model] = {}
            refused: dict[str, tuple[dict[Path, FileStamp], Problem]] = {}
            self._model_dirs = {
                path for _, path, _ in [*found.values(), *self.variants.values()] if path.is_dir()
            }
            # Variants are read on request (``get``); the ones asked for are kept up to date.
            asked = {
                model_id: entry
                for model_id, entry in self.variants.items()
                if model_id in self.models or model_id in self._refused
            }
            loaded: dict[tuple[str, Path, tuple[Path, ...]], Model] = {}
            for model_id, entry in [*found.items(), *asked.items()]:
                self._admit(model_id, entry, models, refused, loaded)
            self.models = models
            self._refused = refused
            if self.whole_models is not None:
                self._serve_only(set(self.whole_models()))
        # One line when what is served changed (and at the first scan); an idle rescan that
        # finds the same models says so at debug only.
        seen = (frozenset(self.models), frozenset(self.problems))
        changed, self._last_seen = seen != self._last_seen, seen
        log.log(
            logging.INFO if changed else logging.DEBUG,
            "catalog: %d models, %d refused, in %.3f s",
            len(self.models),
            len(self.problems),
            time.perf_counter() - started,
        )

    def _serve_only(self, whole: set[str]) -> None:
        """Drop the models, refusals and variants of directory models not in ``whole``."""
        self.models = {i: m for i, m in self.models.items() if base_model_id(i) in whole}
        self.problems = {i: p for i, p in self.problems.items() if base_model_id(i) in whole}
        self.variants = {i: v for i, v in self.variants.items() if base_model_id(i) in whole}

    def _admit(
        self,
        model_id: str,
        entry: tuple[str, Path, list[Path]],
        models: dict[str, Model],
        refused: dict[str, tuple[dict[Path, FileStamp], Problem]],
        loaded: dict[tuple[str, Path, tuple[Path, ...]], Model],
    ) -> None:
        """Index one discovered model into ``models``, or record why it is refused."""
        fmt, path, files = entry
        key = (fmt, path, tuple(files))
        side: list[Path] = []
        stamps: dict[Path, FileStamp] | None = None
        try:
            side = self.discovery.side_files(path, files, self._model_dirs)
            stamps = current_stamps([*files, *side])
            old = self.models.get(model_id)
            if old is not None and old.stamps == stamps:
                loaded.setdefault(key, old)
                models[model_id] = old
                return
            known = self._refused.get(model_id)
            if known is not None and known[0] == stamps:
                refused[model_id] = known
                self.problems[model_id] = known[1]
                return
            same = loaded.get(key)
            if same is not None and same.stamps == stamps:
                models[model_id] = dataclasses.replace(same, id=model_id)
                return
            models[model_id] = loaded[key] = self._load(model_id, fmt, path, files, side, stamps)
        except (CheckpointError, OSError) as e:
            if isinstance(e, CheckpointError):
                problem = Problem(
                    model_id, self.discovery.relative(e.file), self.discovery.relative(str(e))
                )
            else:
                where = str(e.filename or path)
                problem = Problem(
                    model_id, self.discovery.relative(where), self.discovery.relative(str(e))
                )
            self.problems[model_id] = problem
            # A refusal holds for the version it was read from (stamped before the read): a
            # file a copy finished meanwhile differs from it, so the next rescan reads it again.
            with contextlib.suppress(OSError):  # files vanished: looked at next time
                refused[model_id] = (stamps or current_stamps([*files, *side]), problem)
            log.warning("model %s refused: %s", model_id, problem.reason)
            if self.on_refused is not None:
                self.on_refused(problem)

    def _load_variant(self, model_id: str) -> Model | None:
        """A directory's other weight set (``ID:VARIANT``), indexed on its first request."""
        with self._lock:
            if model_id not in self.models and model_id in self.variants:
                loaded = {(m.format, m.path, tuple(m.files)): m for m in self.models.values()}
                self._admit(model_id, self.variants[model_id], self.models, self._refused, loaded)
            return self.models.get(model_id)

    def warm_revisions(self) -> None:
        """Compute every model's revision now (in the background after a scan), so the first
        request for a model finds it known; a model that changes meanwhile is skipped."""
        for model in list(self.models.values()):
            if not model.revision_known:
                try:
                    model.revision  # noqa: B018 - computed and remembered on first access
                except ModelUnavailable as e:
                    log.info("revision of %s not computed: %s", model.id, e)

    @property
    def pending_revisions(self) -> int:
        return sum(not m.revision_known for m in list(self.models.values()))

    # -- lookup ------------------------------------------------------------------------------

    def _fresh(self, model: Model) -> Model:
        """The model as its files are now: re-read if any changed (checked once a second).

        Streams already open keep the Model (and mappings) they started with, so a file
        replaced by an atomic rename serves old bytes to old streams, new bytes to new ones.
        """
        now = time.monotonic()
        if now - model.checked_at < self.recheck_seconds:
            return model
        model.checked_at = now
        try:
            unchanged = current_stamps(model.all_files) == model.stamps
        except OSError:
            unchanged = False
        if unchanged:
            return model
        self.scan()
        if model.id in self.models:
            return self.models[model.id]
        problem = self.problems.get(model.id)
        reason = problem.reason if problem else "its files are gone"
        raise ModelUnavailable(f"model {model.id!r} changed on disk and is refused: {reason}")

    def _pinned(self, model_id: str, revision: str, may_read: ReadCheck | None) -> Model:
        """Revision ``revision`` of ``model_id`` among those this root holds: the model's
        files as they are now (``main``) and a hub cache's other snapshots and refs
        (``ID@REF``), by ``pick_revision``'s rule; RevisionNotFound names them."""
        if revision == MAIN_REVISION:
            return self.get(model_id, may_read)

        def readable(some_id: str) -> bool:
            return may_read is None or may_read(some_id) or may_read(model_id)

        held: dict[str, Model] = {}
        if readable(model_id) and (model_id in self.models or model_id in self.variants):
            held[MAIN_REVISION] = self.get(model_id, may_read)
        for other in list(self.models):
            base, ref = split_revision(other)
            model = self.models.get(other)
            if base == model_id and ref is not None and model is not None and readable(other):
                with contextlib.suppress(ModelUnavailable):  # changed and refused: not held
                    held[ref] = self._fresh(model)
        if not held:
            return self.get(model_id, may_read)  # ModelNotFound, or why it is refused
        return pick_revision(model_id, revision, held)

    def describe(
        self, model_id: str, may_read: ReadCheck | None = None, file: str | None = None
    ) -> Model:
        """The model as ``get`` gives it: its files are all here."""
        return self.get(model_id, may_read)

    @contextlib.contextmanager
    def using(self, model_id: str) -> Iterator[None]:
        """Hold the model while a stream reads it: counted by its directory, so retention
        keeps a published revision that is streamed (a catalog over a node cache keeps the
        model from eviction)."""
        found = self.models.get(model_id)
        path = found.path if found is not None else None
        if path is None:
            yield
            return
        with self._lock:
            self._streamed[path] = self._streamed.get(path, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._streamed[path] -= 1
                if not self._streamed[path]:
                    del self._streamed[path]

    def streamed(self, path: Path) -> bool:
        """Whether a stream reads the model whose files are at ``path`` now."""
        with self._lock:
            return path.resolve() in self._streamed or path in self._streamed

    @property
    def description(self) -> str:
        return str(self.root)

    @property
    def listed(self) -> Collection[str]:
        return self.models.keys()

    def close(self) -> None:
        pass  # mappings close with their last stream

    def answers_now(self, model_id: str | None = None) -> bool:
        """Whether ``get(model_id)`` and the model's revision come from memory right now
        (None: every model's summary, ``/v1/models``): no file stat'ed, scanned or hashed,
        no lock a scan holds waited on. The HTTP server answers such requests on its event
        loop, the others on a worker thread."""
        if model_id is None:
            return self.pending_revisions == 0
        model = self.models.get(model_id)
        return (
            model is not None
            and model.revision_known
            and time.monotonic() - model.checked_at < self.recheck_seconds
        )

    def get(self, model_id: str, may_read: ReadCheck | None = None) -> Model:
        """The model, or ModelNotFound; ``ID@R`` is revision R of it (``_pinned``). ``may_read``
        limits the "did you mean" suggestion and the revisions offered to ids the caller may
        see: an error must not reveal what exists beyond a grant."""
        validate_model_id(model_id)
        model = self.models.get(model_id)
        if model is not None:
            return self._fresh(model)
        base, revision = split_revision(model_id)
        if revision is not None:
            return self._pinned(base, revision, may_read)
        if model_id in self.variants and model_id not in self.problems:
            model = self._load_variant(model_id)
            if model is not None:
                return model
        problem = self.problems.get(model_id)
        if problem is not None:
            raise ModelUnavailable(f"model {model_id!r} is refused: {problem.reason}")
        msg = f"No model {model_id!r} under the model root."
        visible = [m for m in self.models if may_read is None or may_read(m)]
        raise ModelNotFound(msg + did_you_mean(model_id, visible))
