"""A model's original files into a directory (``RemoteModel.download``, ``weightserve pull``).

Every file of the model's repository (weights, index, config, tokenizer...) is written byte
for byte, each verified against the server's digest and renamed into place only when whole.
What arrived stays in ``NAME.partial``; the next run asks only for the rest, pinned to the
same file content (``.weightserve-pull.json`` in the directory remembers which). When the
model changes on the server mid-way, the pull lists it again and ends with the files of the new
revision: what is unchanged is kept or resumed, what changed is fetched again.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import xxhash

from weightserve.client._models import RemoteFile
from weightserve.client._retry import Backoff, OnWait, WaitsForServer, call_with_retry
from weightserve.client.errors import (
    DataCorruption,
    DestinationError,
    RevisionMismatch,
    RevisionNotFound,
    TransportError,
    WeightserveError,
)
from weightserve.client.transports.base import Transport
from weightserve.client.wire.digests import file_digest
from weightserve.client.wire.routes import ServerAddress, is_content_name, split_revision

STATE_FILE = ".weightserve-pull.json"  # which file content each .partial holds
PARTIAL_SUFFIX = ".partial"
_BLOCK = 1 << 20  # bytes per read from the server and per write
# A model that changes this often during one pull is being rewritten: wait for it to settle.
MAX_REVISIONS = 5

log = logging.getLogger("weightserve.client")


class ModelClient(WaitsForServer, Protocol):
    """What a download needs of the model's client (``Client`` is one)."""

    address: ServerAddress
    transport: Transport


class DownloadableModel(Protocol):
    """What a download needs of the model (``RemoteModel`` is one)."""

    id: str

    @property
    def client(self) -> ModelClient: ...
    def _retry_seconds(self) -> float: ...


@dataclass
class PlannedFile:
    """One listed file and what is already on disk for it."""

    file: RemoteFile
    target: Path
    have: int  # bytes here already: the whole file when kept, else a .partial's length
    keep: bool  # an identical file (same size and digest) is already in place

    @property
    def partial(self) -> Path:
        return self.target.with_name(self.target.name + PARTIAL_SUFFIX)


@dataclass
class FilePull:
    """A faithful pull of one model into ``dest``: ``plan()`` looks at what is there,
    ``run()`` fetches what is missing. ``download_files`` does both."""

    model: DownloadableModel
    dest: Path
    force: bool = False
    revision: str = ""
    files: list[PlannedFile] | None = None

    @property
    def total(self) -> int:
        return sum(p.file.size for p in self.files or ())

    @property
    def already(self) -> int:
        """Bytes that need no transfer: kept files and resumable .partial prefixes."""
        return sum(p.have for p in self.files or ())

    def plan(self, replaceable: frozenset[Path] = frozenset()) -> FilePull:
        """List the model's files and look at what is here; ``replaceable``: files this pull
        wrote, which a newer revision may overwrite without ``force``."""
        client = self.model.client
        listing = call_with_retry(
            lambda: client.transport.list_files(self.model.id),
            client.retry_seconds,
            f"{client.address.url} files of {self.model.id!r}",
            client.on_wait,
        )
        self.revision = str(listing["revision"])
        remote = [RemoteFile.from_json(f) for f in listing["files"]]
        dest = prepare_destination(self.dest)
        state = _read_state(dest, self.model.id)
        planned, conflicts = [], []
        for f in remote:
            target = dest / _safe_relative(f.name, self.model.id)
            if not target.resolve().is_relative_to(dest.resolve()):
                raise DestinationError(
                    f"{target} would be written outside {dest} (a symlink inside it points "
                    "elsewhere); remove that link or choose another --out"
                )
            p = PlannedFile(f, target, 0, False)
            if target.is_dir():
                raise DestinationError(
                    f"{target} is a directory, where the model has a file {f.name!r}; move it "
                    "away or choose another --out"
                )
            if target.exists():
                if target.stat().st_size == f.size and file_digest(target) == f.etag:
                    p.keep, p.have = True, f.size
                elif target not in replaceable:
                    conflicts.append(target)
            if not p.keep and state.get(f.name) == f.etag and p.partial.is_file():
                have = p.partial.stat().st_size
                p.have = have if have <= f.size else 0
            planned.append(p)
        if conflicts and not self.force:
            more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
            raise DestinationError(
                f"{conflicts[0]}{more} exists and differs from the server's file; pass --force "
                "(force=True) to overwrite"
            )
        self.files = planned
        return self

    def run(
        self,
        on_bytes: Callable[[int], None] | None = None,
        on_wait: OnWait | None = None,
        on_plan: Callable[[int, int], None] | None = None,
    ) -> Path:
        """Fetch what the plan lacks. ``on_plan(total, already)`` is told when the model
        changed mid-way and the pull goes on with its new revision: the bytes it now needs in
        all and those already here, which bytes counted by ``on_bytes`` before no longer are
        (a changed file is fetched again from its start)."""
        if self.files is None:
            self.plan()
        assert self.files is not None
        dest = self.dest
        written: set[Path] = set()  # put in place by this pull, of an earlier revision maybe
        for _ in range(MAX_REVISIONS):
            todo = [p for p in self.files if not p.keep]
            # Written before any byte: the next run resumes a .partial only for the same content.
            _write_state(dest, self.model.id, {p.file.name: p.file.etag for p in todo})
            try:
                for p in todo:
                    self._fetch(p, on_bytes, on_wait or self.model.client.on_wait)
                    written.add(p.target)
            except RevisionMismatch as e:
                self._follow_new_revision(e, written)
                if on_plan is not None:
                    on_plan(self.total, self.already)
                continue
            except TransportError as e:  # an outage longer than the retry budget
                again = copy.copy(e)  # the same class, the next step added
                again.args = (f"{e}; run the pull again: it goes on where it stopped",)
                raise again from e
            self._check_complete()
            with contextlib.suppress(FileNotFoundError):
                (dest / STATE_FILE).unlink()
            return dest
        raise RevisionMismatch(
            f"model {self.model.id!r} changed {MAX_REVISIONS} times during the pull; run the "
            "pull again once it is no longer being rewritten: it keeps what is already here"
        )

    def _follow_new_revision(self, changed: RevisionMismatch, written: set[Path]) -> None:
        """List the model again after it changed mid-way: unchanged files are kept (or
        resumed from their .partial), changed ones fetched again, and the files of the old
        revision that the new one lacks removed, so the pull ends with one revision."""
        before = self.files or []
        old = self.revision
        self.plan(replaceable=frozenset(written))
        assert self.files is not None
        now = {p.target for p in self.files}
        lost = [p.file.name for p in before if p.target not in now]
        pinned = split_revision(self.model.id)[1]
        if lost and pinned is not None and is_content_name(pinned):
            # A commit named in the id does not lose files (a ref such as main may move): its
            # copy on the server is being removed (retention) or was damaged. Never end
            # "done" with part of it.
            raise RevisionNotFound(
                f"model {self.model.id!r} now lists {len(self.files)} files where it listed "
                f"{len(before)}: {_names(lost)} are gone from the server (the revision is being "
                "removed?); pull a revision the server holds whole"
            )
        for p in before:
            if p.target not in now:
                with contextlib.suppress(FileNotFoundError):
                    p.partial.unlink()
                if p.target in written:
                    with contextlib.suppress(FileNotFoundError):
                        p.target.unlink()
        log.warning(
            "model %r changed during the pull (%s); going on with revision %s (was %s)",
            self.model.id, changed, self.revision, old,
        )  # fmt: skip

    def _check_complete(self) -> None:
        """Every listed file is in place with its listed size (each was checked against its
        digest when fetched or kept): a pull never ends with part of a revision."""
        missing = []
        for p in self.files or ():
            try:
                whole = p.target.stat().st_size == p.file.size
            except OSError:
                whole = False
            if not whole:
                missing.append(p.file.name)
        if missing:
            raise DataCorruption(
                f"the pull of model {self.model.id!r} wrote {len(self.files or ()) - len(missing)}"
                f" of its {len(self.files or ())} files: {_names(missing)} missing or of another "
                f"size in {self.dest} (changed while the pull ran?); run the pull again"
            )

    def _fetch(
        self,
        p: PlannedFile,
        on_bytes: Callable[[int], None] | None,
        on_wait: OnWait | None,
    ) -> None:
        transport = self.model.client.transport
        size, partial = p.file.size, p.partial
        try:
            partial.parent.mkdir(parents=True, exist_ok=True)
            f = open(partial, "r+b" if p.have else "wb")  # noqa: SIM115 - closed below
        except OSError as e:
            raise destination_error(e, partial) from e
        hasher = xxhash.xxh3_128()
        offset = 0
        with f:
            try:
                # The bytes already here count in the digest: read them back once.
                while offset < p.have and (block := f.read(min(8 * _BLOCK, p.have - offset))):
                    hasher.update(block)
                    offset += len(block)
                f.truncate(offset)
                backoff = Backoff(self.model._retry_seconds())
                buffer = memoryview(bytearray(_BLOCK))
                while offset < size:
                    source = None
                    try:
                        source = transport.open_file(
                            self.model.id, p.file.name, offset=offset, revision=self.revision
                        )
                        while offset < size:
                            view = buffer[: min(_BLOCK, size - offset)]
                            n = source.readinto(view)
                            if n <= 0:
                                raise TransportError(
                                    f"file {p.file.name!r} ended at byte {offset} of {size}"
                                )
                            f.write(view[:n])
                            hasher.update(view[:n])
                            offset += n
                            backoff.reset()  # data flows: a later outage gets the whole budget
                            if on_bytes is not None:
                                on_bytes(n)
                    except WeightserveError as e:
                        backoff.sleep(*backoff.retry_wait(e), on_wait)
                    finally:
                        if source is not None:
                            source.close()
                f.flush()
                os.fsync(f.fileno())  # whole on disk before it gets its final name
            except OSError as e:
                raise destination_error(e, partial, size - offset) from e
        if hasher.hexdigest() != p.file.etag:
            partial.unlink()
            raise DataCorruption(
                f"file {p.file.name!r} of model {self.model.id!r}: the {size} bytes received "
                f"do not match the server's digest {p.file.etag}; the partial file was "
                "removed, run the pull again"
            )
        try:
            os.replace(partial, p.target)  # a half-written file never has the final name
        except OSError as e:
            raise destination_error(e, p.target) from e


def download_files(
    model: DownloadableModel,
    dest: Path,
    *,
    force: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    on_wait: OnWait | None = None,
) -> Path:
    """Write every file of the model's repository under ``dest``, byte-identical and
    verified; see ``RemoteModel.download``."""
    return FilePull(model, Path(dest), force).plan().run(on_bytes, on_wait)


def _names(names: list[str], shown: int = 5) -> str:
    """A few file names, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(n) for n in names[:shown]) + more


def _safe_relative(name: str, model_id: str) -> PurePosixPath:
    """A file name from the server as a relative path that cannot leave the destination."""
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or "\0" in name
        or any(part in ("", ".", "..") for part in parts)
        or parts[0] == STATE_FILE
    ):
        raise WeightserveError(
            f"the server listed a file {name!r} for model {model_id!r}, which is no plain "
            "relative name inside a directory; refusing to write it (ask the server's operator "
            "to rename that file)"
        )
    return PurePosixPath(*parts)


def prepare_destination(dest: Path) -> Path:
    if dest.exists() and not dest.is_dir():
        raise DestinationError(
            f"{dest} exists and is not a directory; give --out a directory (created when missing)"
        )
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise destination_error(e, dest) from e
    if not os.access(dest, os.W_OK | os.X_OK):
        raise DestinationError(f"{dest} is not writable; choose another --out or fix its mode")
    return dest


def destination_error(e: OSError, path: Path, missing: int | None = None) -> DestinationError:
    if e.errno == errno.ENOSPC:
        left = f" ({missing} bytes still to come)" if missing else ""
        return DestinationError(
            f"no space left on the device writing {path}{left}; free space and run the pull "
            "again: it goes on where it stopped"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DestinationError(f"cannot write {path}: {e.strerror}; choose another --out")
    return DestinationError(
        f"cannot write {path}: {e.strerror or e}; fix that and run the pull again: it goes on "
        "where it stopped"
    )


def _read_state(dest: Path, model_id: str) -> dict[str, str]:
    """{file name: etag} of the .partial files a previous pull of this model left."""
    try:
        state: Any = json.loads((dest / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(state, dict) or state.get("model") != model_id:
        return {}
    files = state.get("files")
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def _write_state(dest: Path, model_id: str, files: dict[str, str]) -> None:
    path = dest / STATE_FILE
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary.write_text(json.dumps({"model": model_id, "files": files}, indent=1))
        os.replace(temporary, path)
    except OSError as e:
        raise destination_error(e, path) from e
