"""Published revisions: new weights a trainer sends, stored as ordinary checkpoint files in
the Hugging Face hub cache's layout, under a local root or in the bucket a node serves
(service/sources/revisions/stores.py), which the catalogs already serve.

``models--ORG--NAME/snapshots/COMMIT/`` holds each revision's files (served as
``ORG/NAME@COMMIT``), ``refs/main`` names the newest (served as ``ORG/NAME``), and
``.revisions/COMMIT.json`` records its parent, time, size, message and metadata. An upload is
written aside (a staging directory the catalog skips), read by the same strict readers as any
checkpoint, named by its content commit and stored; ``refs/main`` is replaced last, whole. So
a publish that fails, is refused or is cut off leaves nothing behind and ``main`` where it
was. Files a revision keeps from its base are hard links, and no published file is ever
rewritten: their bytes are safe to share zero-copy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from weightserve.client.errors import (
    CheckpointError,
    InvalidRequest,
    MainMoved,
    PublishConflict,
    RevisionNotFound,
)
from weightserve.client.wire.file_patch import SourceEnded, copy_range
from weightserve.client.wire.routes import MAIN_REVISION, REVISION_SEPARATOR, split_revision
from weightserve.client.wire.safetensors_layout import LayoutEntry, safetensors_header
from weightserve.service.readers.base import TensorEntry
from weightserve.service.readers.safetensors import SafetensorsReader
from weightserve.service.sources.base import ModelSource
from weightserve.service.sources.files.stamps import FileStamp, file_stamp
from weightserve.service.sources.layout import INDEX_NAME, validate_model_id
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.sources.model import Model
from weightserve.service.sources.publishing.holds import Holds
from weightserve.service.sources.publishing.intake import (
    UPLOAD_BODY_TIMEOUT,
    UPLOAD_IDLE_SECONDS,
    Intake,
)
from weightserve.service.sources.publishing.names import repo_folder, upload_file_name
from weightserve.service.sources.publishing.patched_tensors import ENDED_EARLY, apply_patch_file
from weightserve.service.sources.publishing.uploads import (
    MODEL_PART,
    PATCH_PART,
    TENSORS_PART,
    Upload,
)
from weightserve.service.sources.revisions.announcements import (
    MainHistory,
    StoredHistories,
    missed_records,
)
from weightserve.service.sources.revisions.content import DigestStore
from weightserve.service.sources.revisions.pinning import MIN_PREFIX_CHARS
from weightserve.service.sources.revisions.stores import (
    INCOMING_PREFIX,
    RevisionStore,
    revision_record,
    write_atomically,
)

log = logging.getLogger("weightserve.publish")

TENSORS_NAME = "model.safetensors"  # where ``tensors`` go in a revision without a base
DEFAULT_KEEP_REVISIONS = 4


class Publisher(Intake):
    """Receives uploads (``Intake``: their parts, limits and expiry) and commits them as
    revisions under ``catalog.root``."""

    def __init__(
        self,
        catalog: ModelSource,
        store: RevisionStore,
        max_upload_bytes: int,
        keep_revisions: int = DEFAULT_KEEP_REVISIONS,
        on_published: Callable[[str, dict[str, Any]], None] | None = None,
        on_removed: Callable[[str, str], None] | None = None,
        digests: DigestStore | None = None,
        streamed: Callable[[Path], bool] | None = None,
        body_timeout: float = UPLOAD_BODY_TIMEOUT,
        idle_seconds: float = UPLOAD_IDLE_SECONDS,
    ) -> None:
        """``digests``: the local root's digest store (renamed files keep their identity, so
        the root's catalog hashes none of them again); ``streamed``: whether a revision's
        directory is being streamed now (kept from retention until a later publish);
        ``body_timeout``, ``idle_seconds``: see ``Intake``."""
        super().__init__(max_upload_bytes, body_timeout, idle_seconds)
        self.catalog = catalog
        self.store = store
        self.digests = digests if digests is not None else DigestStore()
        self.streamed = streamed
        self.keep_revisions = keep_revisions
        self.on_published = on_published
        self.on_removed = on_removed
        self._lock = threading.Lock()
        self._commit_locks: dict[str, threading.Lock] = {}
        self.histories = StoredHistories(store)
        self.holds = Holds(store)  # kept in the store: across restarts, and shared by a bucket
        self._remove_leftovers()

    # -- uploads ------------------------------------------------------------------------------

    def begin(
        self, model_id: str, base: str | None, message: str, metadata: dict[str, Any]
    ) -> Upload:
        """A new upload of ``model_id``; ``base`` (a revision of it) supplies what the upload
        does not. A model served from plain files under the root cannot be published to."""
        folder = repo_folder(model_id)
        started_main = self.store.main(folder)
        published = self.store.written(folder)
        if not published and (
            self.store.exists(folder)
            or model_id in self.catalog.models
            or model_id in self.catalog.listed
        ):
            # Only a repository with a .revisions/ record is ours: a Hugging Face cache's
            # snapshots are another tool's, and retention would orphan their blobs.
            raise InvalidRequest(
                f"model {model_id!r} is served from files weightserve did not write (a "
                "Hugging Face cache or plain files, with no revision record of a publish): "
                "publish to another model id"
            )
        base_model = None
        if base is not None:
            if not published:
                raise RevisionNotFound(
                    f"model {model_id!r} has no published revision to use as base {base!r}"
                )
            base_model = self.catalog.get(f"{model_id}{REVISION_SEPARATOR}{base}")
        directory = self.store.staging(folder)
        upload_id = directory.name.removeprefix(INCOMING_PREFIX)
        (directory / MODEL_PART).mkdir(parents=True)
        upload = Upload(
            upload_id, model_id, folder, directory, base_model, message, metadata, started_main
        )
        self._track(upload)
        return upload

    def target(self, upload: Upload, name: str | None) -> Path:
        """Where a file (``name``) or the tensors (None) of the upload are written."""
        if name is None:
            return upload.directory / "tensors.safetensors"
        return upload.model_dir / upload_file_name(name, upload.taken_names())

    def received(
        self,
        upload: Upload,
        name: str | None,
        path: Path,
        size: int,
        written: tuple[FileStamp, str] | None = None,
    ) -> None:
        """A part arrived whole; ``written``: the file's identity after its last write and
        the digest of the bytes written, which the commit then takes as they are."""
        if written is not None:
            self.digests.record(*written)
        if name is None:
            upload.tensors = path
        self.settle_part(upload, TENSORS_PART if name is None else f"files/{name.strip('/')}", size)

    def patch_target(self, upload: Upload) -> Path:
        """Where the upload's patch against its base is received."""
        if upload.base is None:
            raise InvalidRequest(
                f"a patch of {upload.model_id!r} needs a base: begin the upload with one"
            )
        self._tensors_base(upload, upload.base)
        if upload.tensors is not None:
            raise InvalidRequest("an upload takes tensors or a patch, not both")
        return upload.directory / "patch.delta"

    def apply_patch(self, upload: Upload, patch: Path) -> None:
        """The received patch applied onto the base's tensors: the tensors it changes become
        the upload's tensors, placed as a tensors upload's are at commit. A patch that is
        malformed or does not lead to its digests discards the whole upload."""
        assert upload.base is not None
        output = self.target(upload, None)
        try:
            with _base_kept(upload, "its patch arrived"):
                changed = apply_patch_file(upload.base, patch, output)
            self.end_part(upload, PATCH_PART)  # the patch's bytes go: its tensors count now
            if changed:
                size = output.stat().st_size
                self._check_limit(upload, size)
                self.received(upload, None, output, size)
        except BaseException:
            self.abort(upload.id, "its patch was refused")
            raise
        finally:
            self.end_part(upload, PATCH_PART)
            patch.unlink(missing_ok=True)

    # -- commit -------------------------------------------------------------------------------

    def commit(self, upload: Upload) -> dict[str, Any]:
        """Check the upload as a checkpoint, name it by its content and make it ``main``.
        Refused (CheckpointError naming the file and the rule) leaves nothing behind."""
        self._untrack(upload)
        lock = self._commit_locks.setdefault(upload.model_id, threading.Lock())
        try:
            with lock:
                return self._commit(upload)
        finally:
            shutil.rmtree(upload.directory, ignore_errors=True)

    def _commit(self, upload: Upload) -> dict[str, Any]:
        self._check_unmoved(upload)
        with _base_kept(upload, "it was committed"):  # another node over the bucket, say
            if upload.tensors is not None:
                self._place_tensors(upload)
            if upload.base is not None:
                self._keep_base_files(upload)
        model = self._check(upload)
        commit = model.commit
        parent = upload.started_main
        if commit == parent:
            # The same bytes as main: nothing is published, main and its record stay (the
            # commit names the content; a message cannot be added to a revision).
            kept = self.store.record(upload.folder, commit) or revision_record(commit)
            log.info("publish of %r unchanged: the same bytes as main %s",
                     upload.model_id, commit[:16])  # fmt: skip
            return {**kept, "unchanged": True}
        if upload.base is not None:
            parent = upload.base.commit
        record = revision_record(
            commit,
            parent=parent,
            created=time.time(),
            size=sum(f.size for f in model.repo_files.values()),
            message=upload.message,
            metadata=upload.metadata,
        )
        if self.store.holds(upload.folder, commit):  # the same content again: main moves to it
            record = self.store.record(upload.folder, commit) or record
        else:
            self.store.put(upload.folder, commit, upload.model_dir, record)
        self.store.set_main(upload.folder, commit)
        sequence = self.histories.moved(upload.folder, commit)
        self._retain(upload.model_id, upload.folder)
        self.catalog.scan()
        log.info(
            "published %r revision %s (%d bytes, parent %s)",
            upload.model_id, commit[:16], record["bytes"], (parent or "none")[:16],
        )  # fmt: skip
        if self.on_published is not None and sequence is not None:  # main moved: announced
            self.on_published(upload.model_id, {**record, "sequence": sequence})
        return record

    def _check_unmoved(self, upload: Upload) -> None:
        """Compare-and-set: ``main`` must be where it was when the upload began (else this
        commit would silently drop the revision published meanwhile), and its base still
        held."""
        main = self.store.main(upload.folder)
        if main != upload.started_main:
            began = (upload.started_main or "no revision")[:16]
            raise MainMoved(
                f"main of {upload.model_id!r} moved to {(main or 'nothing')[:16]} since this "
                f"upload began (on {began}): another publish committed first. Nothing was "
                f"committed; publish again on main ({main})"
            )
        if upload.base is not None and not self.store.holds(upload.folder, upload.base.commit):
            raise _base_removed(upload, "the upload was in progress")

    def _check(self, upload: Upload) -> Model:
        """The upload indexed as any root's model is: every file through the strict readers."""
        checked = Catalog(upload.directory, recheck_seconds=0, digests=self.digests)
        problem = checked.problems.get(MODEL_PART)
        if problem is None:
            problem = next(iter(checked.problems.values()), None)
        if problem is not None:
            raise CheckpointError(
                problem.file.removeprefix(MODEL_PART + "/"),
                f"the publish of {upload.model_id!r} is refused: {problem.reason}",
            )
        model = checked.models.get(MODEL_PART)
        if model is None:
            raise InvalidRequest(_no_weights(upload.model_id, list(checked.models)))
        return model

    def _place_tensors(self, upload: Upload) -> None:
        """The uploaded tensors become the revision's safetensors weights: as they are without
        a base; with one, merged into the base's files (replaced tensors, new ones added)."""
        assert upload.tensors is not None
        given = SafetensorsReader().read([upload.tensors]).tensors
        base = upload.base
        if base is None:
            target = upload.model_dir / TENSORS_NAME
            if target.exists():
                raise InvalidRequest(f"{TENSORS_NAME} is uploaded both as a file and as tensors")
            before = file_stamp(upload.tensors.stat())
            os.rename(upload.tensors, target)
            self.digests.renamed(before, file_stamp(target.stat()))
            return
        self._tensors_base(upload, base)
        by_file: dict[Path, list[TensorEntry]] = {}
        for entry in base.contents.tensors.values():
            by_file.setdefault(entry.file, []).append(entry)
        weight_files = [f for f in base.files if f.name.endswith(".safetensors")]
        added = [e for name, e in given.items() if name not in base.contents.tensors]
        last = weight_files[-1]
        for file in weight_files:
            entries = by_file.get(file, [])
            replaced = [given.get(e.name, e) for e in entries]
            extra = added if file == last else []
            if not extra and all(r is e for r, e in zip(replaced, entries, strict=True)):
                continue  # unchanged: linked from the base below
            name = file.relative_to(base.path).as_posix()
            _write_safetensors(upload.model_dir / name, [*replaced, *extra])
            upload.files.setdefault(name, 0)
        if added and len(weight_files) > 1:
            self._extend_index(upload, base, [e.name for e in added], last)

    @staticmethod
    def _tensors_base(upload: Upload, base: Model) -> None:
        if base.format != "safetensors":
            raise InvalidRequest(
                f"tensors can be published onto a safetensors revision only; base "
                f"{base.commit[:16]} of {upload.model_id!r} is {base.format}: publish its files"
            )

    def _extend_index(self, upload: Upload, base: Model, names: list[str], shard: Path) -> None:
        index = next((f for f in base.files if f.name == INDEX_NAME), None)
        if index is None:
            return
        data = json.loads(index.read_text())
        shard_name = shard.relative_to(base.path).as_posix()
        data.setdefault("weight_map", {}).update(dict.fromkeys(names, shard_name))
        target = upload.model_dir / index.relative_to(base.path)
        write_atomically(target, json.dumps(data, indent=2))
        upload.files.setdefault(index.relative_to(base.path).as_posix(), 0)

    def _keep_base_files(self, upload: Upload) -> None:
        """Every file of the base the upload does not replace, hard-linked (copied where the
        file system cannot link)."""
        assert upload.base is not None
        for f in upload.base.repo_files.values():
            if f.name in upload.files:
                continue
            target = upload.model_dir / f.name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f.path, target)
            except OSError:
                shutil.copyfile(f.path, target)

    # -- records ------------------------------------------------------------------------------

    def revisions(self, model_id: str) -> list[dict[str, Any]]:
        """The model's revisions, ``main`` first, then newest first: every published one still
        held, or for a model not published, the one it is."""
        plain = split_revision(validate_model_id(model_id))[0]
        folder = None
        with contextlib.suppress(InvalidRequest):
            folder = repo_folder(plain)
        found = []
        if folder is not None:
            for commit in self.store.commits(folder):
                record = self.store.record(folder, commit)
                if record is not None:
                    found.append(record)
        if not found:
            model = self.catalog.get(plain)
            return [
                revision_record(
                    model.commit,
                    created=max((s.mtime_ns for s in model.stamps.values()), default=0) / 1e9,
                    size=sum(f.size for f in model.repo_files.values()),
                )
            ]
        main = self.store.main(folder) if folder is not None else None
        found.sort(key=lambda r: (r["commit"] == main, r.get("created", 0)), reverse=True)
        return found

    def revisions_after(
        self, model_id: str, since: str | None, after: int | None = None
    ) -> list[dict[str, Any]]:
        """What a watcher at ``since`` (a commit) or ``after`` (a sequence) missed: the
        changes of main since, each revision with its ``sequence``, oldest first
        (service/sources/revisions/announcements.py)."""
        plain = split_revision(validate_model_id(model_id))[0]
        current = self.revisions(plain)[0]
        folder = self._published_folder(plain)
        if folder is None:  # plain files: no history, only what they are now
            return missed_records(MainHistory(), current, since, after, lambda c: None)
        history = self.histories.read(folder)
        return missed_records(
            history, current, since, after, lambda c: self.store.record(folder, c)
        )

    def sequence(self, model_id: str) -> int:
        """The sequence of the change that made the current main (0: none known)."""
        folder = self._published_folder(split_revision(validate_model_id(model_id))[0])
        if folder is None:
            return 0
        last = self.histories.read(folder).last
        return last.sequence if last is not None and last.commit == self.store.main(folder) else 0

    def _published_folder(self, model_id: str) -> str | None:
        with contextlib.suppress(InvalidRequest):
            folder = repo_folder(model_id)
            return folder if self.store.written(folder) else None
        return None

    # -- retention ----------------------------------------------------------------------------

    def hold(self, model_id: str, commit: str, seconds: float, holder: str) -> dict[str, Any]:
        """``holder``'s hold of a published revision against retention, ``seconds`` from now
        (a lease a worker renews while it computes with it; 0 releases it); the revision is
        kept while any holder's hold runs (service/sources/publishing/holds.py)."""
        plain = split_revision(validate_model_id(model_id))[0]
        folder = self._published_folder(plain)
        wanted = commit.lower()
        if folder is not None and wanted == MAIN_REVISION:
            wanted = self.store.main(folder) or wanted
        found = [c for c in self.store.commits(folder) if c.startswith(wanted)] if folder else []
        if len(wanted) < MIN_PREFIX_CHARS or len(found) != 1:
            raise RevisionNotFound(
                f"model {plain!r} has no published revision {commit!r} to hold: give a commit "
                "(or a prefix of one) that its revisions list"
            )
        until = self.holds.hold(folder or "", found[0], holder, seconds)
        return {"commit": found[0], "held_until": until}

    def _retain(self, model_id: str, folder: str) -> None:
        """Remove the oldest revisions beyond ``keep_revisions``; ``main`` and held ones stay.
        A stream reading a removed revision keeps its open files (and resumes fail over to
        RevisionNotFound)."""
        if self.keep_revisions <= 0:
            return
        revisions = self.revisions(model_id)
        keep = {r["commit"] for r in revisions[: self.keep_revisions]} | self.holds.held(folder)
        keep.add(self.store.main(folder) or "")
        streamed = self.streamed
        for r in revisions[self.keep_revisions :]:
            commit = r["commit"]
            if commit in keep or not self.store.written(folder, commit):
                continue  # held, or a snapshot weightserve did not write: not ours to remove
            if streamed is not None and streamed(self.catalog.root / folder / "snapshots" / commit):
                log.info("revision %s of %r is streamed: kept until a later publish",
                         commit[:16], model_id)  # fmt: skip
                continue
            self.store.remove(folder, commit)
            log.info("removed revision %s of %r (--keep-revisions %d)",
                     commit[:16], model_id, self.keep_revisions)  # fmt: skip
            if self.on_removed is not None:
                self.on_removed(model_id, commit)

    # -- housekeeping -------------------------------------------------------------------------

    def _remove_leftovers(self) -> None:
        """Uploads and removals a previous process left half done (killed mid-publish or
        mid-retention): removed, with every snapshot partly removed (``store.repair``)."""
        for incoming in self.store.leftovers():
            shutil.rmtree(incoming, ignore_errors=True)
            log.info("removed an unfinished upload left by a previous run: %s", incoming.name)
        if self.store.repair():
            self.catalog.scan()  # the catalog may have indexed a partly removed snapshot


def _no_weights(model_id: str, found: list[str]) -> str:
    """Why a publish without weights at its top level is refused: what the catalog would
    serve instead (each GGUF file, each sub-folder of weights is a model of its own)."""
    inside = sorted(m.removeprefix(MODEL_PART + "/") for m in found if m != MODEL_PART)
    if not inside:
        return (
            f"the publish of {model_id!r} holds no weights (a safetensors, GGUF or PyTorch "
            "checkpoint file, or tensors): nothing to serve"
        )
    served = ", ".join(f"{model_id}/{m}" for m in inside[:3]) + (" ..." if len(inside) > 3 else "")
    if all(m.endswith(".gguf") for m in inside):
        return (
            f"the publish of {model_id!r} holds only GGUF files, and a GGUF file is served as a "
            f"model of its own ({served}), not as {model_id}: publish safetensors or PyTorch "
            "weights, or tensors"
        )
    return (
        f"the publish of {model_id!r} holds no weights at its top level: its weights lie in "
        f"sub-folders, each served as a model of its own ({served}), not as {model_id}: put "
        "the weights at the top of the directory, or publish each sub-folder as its own model"
    )


def _write_safetensors(path: Path, entries: list[TensorEntry]) -> None:
    """A safetensors file of ``entries``, their bytes copied file to file in the kernel."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = safetensors_header(LayoutEntry(e.name, e.dtype, e.shape, e.nbytes) for e in entries)
    with open(path, "wb") as out:
        out.write(header)
        out.flush()
        sources: dict[Path, int] = {}
        at = len(header)
        try:
            for e in entries:
                if e.file not in sources:
                    sources[e.file] = os.open(e.file, os.O_RDONLY)
                try:
                    copy_range(sources[e.file], out.fileno(), e.offset, at, e.nbytes)
                except SourceEnded:
                    raise CheckpointError(e.file.name, ENDED_EARLY) from None
                at += e.nbytes
        finally:
            for fd in sources.values():
                os.close(fd)
        os.fsync(out.fileno())


def _base_removed(upload: Upload, during: str) -> PublishConflict:
    """The refusal of an upload whose base was removed (retention, --keep-revisions, here or
    by another node over the bucket) ``during`` a step of it: nothing is committed."""
    base = upload.base.commit[:16] if upload.base is not None else "?"
    return PublishConflict(
        f"base {base} of the upload of {upload.model_id!r} was removed (retention, "
        f"--keep-revisions) while {during}. Nothing was committed; publish again on main"
    )


@contextlib.contextmanager
def _base_kept(upload: Upload, during: str) -> Iterator[None]:
    """Reading the base's files: one gone means the base was removed meanwhile."""
    try:
        yield
    except FileNotFoundError:
        raise _base_removed(upload, during) from None
