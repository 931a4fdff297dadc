"""``weightserve pull --since R``: a directory holding revision R's files brought to the model's
target revision in place. A changed safetensors file whose tensor layout is unchanged is
patched from the delta stream (client/_update.py); every other changed file is fetched whole
(client/_download.py). Each file is verified against its digest and renamed into place alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from weightserve.client._download import (
    PARTIAL_SUFFIX,
    DownloadableModel,
    FilePull,
    PlannedFile,
    _safe_relative,
    destination_error,
)
from weightserve.client._models import RemoteFile
from weightserve.client._retry import OnWait, call_with_retry
from weightserve.client._update import TensorUpdate, iter_updates
from weightserve.client.errors import RevisionNotFound, WeightserveError
from weightserve.client.transports.base import carries
from weightserve.client.wire.digests import file_digest
from weightserve.client.wire.file_patch import PatchedCopy, Places, apply_to_files, patched_copy
from weightserve.client.wire.routes import split_revision, with_revision

log = logging.getLogger("weightserve.client")


@dataclass
class PullSinceReport:
    """What ``pull --since`` did: files by outcome, and the bytes that travelled (delta
    payloads and header lines, safetensors headers, whole files)."""

    kept: int = 0
    patched: int = 0
    whole: int = 0
    removed: int = 0
    wire_bytes: int = 0
    model_bytes: int = 0  # the target revision's files in all

    def as_counts(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Patched:
    """One file being patched: its plan entry and its copy."""

    planned: PlannedFile
    copy: PatchedCopy


class PullSince:
    """A pull of ``model`` into ``dest``, which holds revision ``since`` as a previous pull
    wrote it: ``plan()`` looks at what is there and which files can be patched, ``run()``
    patches them from one delta stream, fetches the other changed files whole and removes
    the files the target revision no longer has."""

    def __init__(self, model: DownloadableModel, dest: Path, since: str) -> None:
        self.model = model
        self.dest = Path(dest)
        self.since = since
        self.pull = FilePull(model, self.dest, force=True)  # the files are R's: replaced
        self.patchable: list[_Patched] = []
        self.stale: list[Path] = []  # R's files the target lacks
        self.report = PullSinceReport()
        self._on_bytes: Callable[[int], None] | None = None

    @property
    def changed_bytes(self) -> int:
        """What a plain pull would move: the files that are not kept as they are."""
        return sum(p.file.size for p in self.pull.files or () if not p.keep)

    def plan(self, on_bytes: Callable[[int], None] | None = None) -> PullSince:
        self._on_bytes = on_bytes
        self.pull.plan()
        assert self.pull.files is not None
        self.report.model_bytes = self.pull.total
        before = self._files_of_since()
        if before is None:
            log.warning(
                "the server does not hold revision %s of %r: the changed files are fetched "
                "whole and no file is removed",
                self.since, self.model.id,
            )  # fmt: skip
            return self
        names = {p.file.name for p in self.pull.files}
        self.stale = [
            self.dest / _safe_relative(name, self.model.id) for name in before if name not in names
        ]
        if not carries(self.model.client.transport, "open_delta"):
            return self  # no delta stream over this transport (gRPC): changed files come whole
        for p in self.pull.files:
            found = self._patchable(p)
            if found is not None:
                self.patchable.append(found)
        return self

    def run(
        self, on_bytes: Callable[[int], None] | None = None, on_wait: OnWait | None = None
    ) -> Path:
        if self.pull.files is None:
            self.plan(on_bytes)
        assert self.pull.files is not None
        self._on_bytes = on_bytes
        self.report.kept = sum(p.keep for p in self.pull.files)
        if self.patchable:
            self._patch(on_wait)
        for path in self.stale:
            for gone in (path, path.with_name(path.name + PARTIAL_SUFFIX)):
                with contextlib.suppress(FileNotFoundError):
                    gone.unlink()
                    self.report.removed += gone == path
        self.report.whole = sum(not p.keep for p in self.pull.files)
        self.pull.run(self._count, on_wait)
        return self.dest

    def _count(self, n: int) -> None:
        self.report.wire_bytes += n
        if self._on_bytes is not None:
            self._on_bytes(n)

    def _files_of_since(self) -> list[str] | None:
        """The names of revision ``since``'s files, or None when the server does not hold it."""
        client = self.model.client
        old_id = with_revision(split_revision(self.model.id)[0], self.since)
        try:
            listing = call_with_retry(
                lambda: client.transport.list_files(old_id),
                client.retry_seconds,
                f"{client.address.url} files of {old_id!r}",
                client.on_wait,
            )
        except RevisionNotFound:
            return None
        return [RemoteFile.from_json(f).name for f in listing["files"]]

    def _patchable(self, p: PlannedFile) -> _Patched | None:
        """A changed safetensors file whose local copy has the target's tensor layout."""
        if p.keep or p.have:
            return None
        copy = patched_copy(
            p.target, p.partial, p.file.size, lambda at, n: self._read_range(p.file.name, at, n)
        )
        return None if copy is None else _Patched(p, copy)

    def _read_range(self, name: str, offset: int, length: int) -> bytes:
        client = self.model.client

        def read() -> bytes:
            source = client.transport.open_file(
                self.model.id, name, offset=offset, length=length, revision=self.pull.revision
            )
            try:
                data = bytearray(length)
                view, got = memoryview(data), 0
                while got < length and (n := source.readinto(view[got:])) > 0:
                    got += n
                return bytes(data[:got])
            finally:
                source.close()

        data = call_with_retry(
            read, client.retry_seconds, f"{client.address.url} file {name!r}", client.on_wait
        )
        self._count(len(data))
        return data

    def _patch(self, on_wait: OnWait | None) -> None:
        """Copy each patchable file to its ``.partial`` locally, apply the delta stream to
        the copies, and put each one whose digest then matches in place; the others stay in
        the plan, to be fetched whole."""
        client = self.model.client
        plain = split_revision(self.model.id)[0]
        try:
            target, updates = call_with_retry(
                lambda: iter_updates(client.transport, plain, self.since, self.pull.revision),
                client.retry_seconds,
                f"{client.address.url} update of {plain!r}",
                on_wait or client.on_wait,
            )
        except WeightserveError as e:  # e.g. the listed revision is gone: the pull follows
            log.warning("no update of %r (%s); fetching the changed files whole", plain, e)
            return
        if not target.base or not target.commit.startswith(self.pull.revision):
            # No base to patch (the server no longer holds ``since``), or the model moved on
            # since it was listed: every changed file is fetched whole, pinned as listed.
            updates.close()
            return
        try:
            places = self._open_copies()
            try:
                self._apply(updates, places)
            except WeightserveError as e:  # the stream was cut: what it did not reach is whole
                log.warning("the update of %r stopped (%s); fetching the rest whole", plain, e)
            finally:
                updates.close()
                places.clear()  # no view of a mapping outlives it: each closes below
            for patched in self.patchable:
                self._finish(patched)
        except BaseException:
            for patched in self.patchable:
                patched.copy.discard()
            raise

    def _open_copies(self) -> Places:
        """Each file's ``.partial``, started from the local file (``open_patched_copy``);
        the tensors' places in them by name."""
        places: Places = {}
        for patched in self.patchable:
            try:
                patched.copy.open_into(places)
            except OSError as e:
                raise destination_error(e, patched.copy.partial) from e
        return places

    def _apply(self, updates: Iterator[TensorUpdate], places: Places) -> None:
        apply_to_files(updates, places, self._count)

    def _finish(self, patched: _Patched) -> None:
        p = patched.planned
        patched.copy.close()
        try:
            with open(p.partial, "rb+") as f:
                os.fsync(f.fileno())  # whole on disk before it gets its final name
        except OSError as e:
            raise destination_error(e, p.partial) from e
        if not patched.copy.complete or file_digest(p.partial) != p.file.etag:
            # A local file that was not revision ``since``'s, or a cut stream.
            log.warning(
                "%s does not match the server's %s after patching; fetching it whole",
                p.target, p.file.etag,
            )  # fmt: skip
            p.partial.unlink(missing_ok=True)
            return
        try:
            os.replace(p.partial, p.target)
        except OSError as e:
            raise destination_error(e, p.target) from e
        p.keep, p.have = True, p.file.size
        self.report.patched += 1


def pull_since(
    model: DownloadableModel,
    dest: Path,
    since: str,
    *,
    on_bytes: Callable[[int], None] | None = None,
    on_wait: OnWait | None = None,
) -> PullSinceReport:
    """Bring ``dest``, holding revision ``since``'s files, to ``model``'s revision in place;
    see ``RemoteModel.download``."""
    pull = PullSince(model, dest, since).plan(on_bytes)
    pull.run(on_bytes, on_wait)
    return pull.report
