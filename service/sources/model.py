"""A model as indexed: its files as they were, its tensors, its revision, and the one mapping
per file its streams read."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from weightserve.client.errors import ModelUnavailable, TensorNotFound
from weightserve.client.wire.hints import did_you_mean
from weightserve.service.readers.base import ModelContents, TensorEntry
from weightserve.service.sources.files.mapped import MappedFile
from weightserve.service.sources.files.stamps import FileStamp
from weightserve.service.sources.revisions.content import (
    COMMIT_CHARS,
    REVISION_CHARS,
    DigestStore,
    FileChanged,
    content_revision,
)

# Whether the caller may read the model an id names (``Access.may_read``): a suggestion for a
# mistyped id is only ever among ids it allows. None where a source is asked for no caller.
ReadCheck = Callable[[str], bool]


@dataclass(frozen=True)
class RepoFile:
    """One file of a model's repository, as the files API lists it."""

    name: str  # relative to the model directory, '/'-separated
    path: Path
    size: int


@dataclass
class Model:
    """One model as indexed: its files and their stamps then, its tensors, and one mapping
    per file shared by its streams. A changed file makes a new Model; old streams keep theirs."""

    id: str
    format: str
    path: Path  # the model's directory or file
    files: list[Path]
    contents: ModelContents
    stamps: dict[Path, FileStamp]  # the files as indexed
    digests: DigestStore = field(default_factory=DigestStore, repr=False)
    # The repository's other files (config, tokenizer, README, leftover checkpoints): served
    # as files, part of the revision, never read as tensors.
    side_files: list[Path] = field(default_factory=list, repr=False)
    checked_at: float = field(default_factory=time.monotonic, repr=False)
    _revision: str | None = field(default=None, repr=False)
    _revision_full: str | None = field(default=None, repr=False)
    _revision_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _maps: dict[Path, MappedFile] = field(default_factory=dict, repr=False)
    _maps_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def revision(self) -> str:
        """The content revision (see service/sources/revisions/content.py): computed on first use, from
        digests remembered per file version, so only a file never seen before is read."""
        if self._revision is None:
            self._revision = self._content_revision()
        return self._revision

    @property
    def revision_known(self) -> bool:
        return self._revision is not None

    @property
    def all_files(self) -> list[Path]:
        """Weights (and their index) first, then side files: every file of the repository."""
        return [*self.files, *(f for f in self.side_files if f not in self.files)]

    @property
    def repo_files(self) -> dict[str, RepoFile]:
        """Every file of the model's repository by its name relative to the model, as
        indexed: what the files API lists and serves."""
        return {
            (name := self._relative_name(f)): RepoFile(name, f, self.stamps[f].size)
            for f in self.all_files
        }

    def file_names(self) -> list[tuple[str, int]]:
        """(name relative to the model, size as indexed) of each file, in the model's order."""
        return [(f.name, f.size) for f in self.repo_files.values()]

    def file_digest(self, path: Path) -> str:
        """xxh3-128 (hex) of one file of this model as indexed (remembered per file version):
        its ETag. ModelUnavailable if the file changed since it was indexed."""
        try:
            return self.digests.digest(path, self.stamps[path])
        except (FileChanged, FileNotFoundError) as e:
            self.checked_at = float("-inf")
            raise ModelUnavailable(
                f"model {self.id!r}: {path.name} changed since it was indexed ({e}); "
                "it reloads on its next request"
            ) from None

    @property
    def commit(self) -> str:
        """The revision as a 40-hex commit id (what Hub clients expect); the revision is its
        first characters."""
        return self.revision_digest()[:COMMIT_CHARS]

    def _relative_name(self, file: Path) -> str:
        base = self.path if self.path.is_dir() else self.path.parent
        return file.relative_to(base).as_posix()

    def revision_digest(self) -> str:
        """The full content digest (64 hex) behind ``revision`` and ``commit``."""
        if self._revision_full is None:
            with self._revision_lock:
                if self._revision_full is None:
                    files = self.repo_files.values()
                    self.digests.prime((f.path, self.stamps[f.path]) for f in files)
                    self._revision_full = content_revision(
                        (f.name, f.size, self.file_digest(f.path)) for f in self.repo_files.values()
                    )
        return self._revision_full

    def _content_revision(self) -> str:
        return self.revision_digest()[:REVISION_CHARS]

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        return self.contents.tensors

    @property
    def metadata(self) -> dict:
        return self.contents.metadata

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())

    def tensor(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise TensorNotFound(missing_tensor_message(self.id, name, self.tensors)) from None

    def with_prefix(self, prefix: str) -> Iterator[TensorEntry]:
        """Tensors whose name starts with ``prefix`` (a raw string prefix, as MAX's items())."""
        for name, entry in self.tensors.items():
            if name.startswith(prefix):
                yield entry

    def mapped(self, file: Path) -> MappedFile:
        with self._maps_lock:
            mf = self._maps.get(file)
            if mf is None:
                mf = self._maps[file] = MappedFile(
                    file, self.stamps.get(file), check_content=self.digests.content_check(file)
                )
            return mf

    def pin(self, files: Iterable[Path]) -> None:
        """Map these files now (each once), before a stream sends anything: the stream then
        reads the files as they are at its start, whatever is renamed over them later, and a
        file replaced since indexing fails the request with a status instead of mid-stream."""
        try:
            for f in dict.fromkeys(files):
                mapped = self.mapped(f)
                mapped.view()
                mapped.ensure_unchanged()  # mapped by an earlier stream, overwritten since
        except ModelUnavailable:
            self.checked_at = float("-inf")  # recheck the files on the next request
            raise

    @contextlib.contextmanager
    def holding(self, files: Iterable[Path]) -> Iterator[None]:
        """Read these (mapped) files inside: each is held (``MappedFile.hold``) until the end."""
        held: list[MappedFile] = []
        try:
            for f in dict.fromkeys(files):
                mapped = self.mapped(f)
                mapped.view()
                mapped.hold()
                held.append(mapped)
            yield
        finally:
            for mapped in held:
                mapped.release()

    def raw_view(self, entry: TensorEntry) -> memoryview:
        """The bytes of a contiguous tensor as a view of the shared mmap (no copy)."""
        if not entry.contiguous:
            raise ValueError(f"tensor {entry.name!r} is a strided view; use its strides")
        mf = self.mapped(entry.file)
        if entry.offset + entry.nbytes > mf.size:
            raise ModelUnavailable(
                f"model {self.id!r}: file {entry.file.name} is shorter than when it was indexed"
            )
        return mf.view()[entry.offset : entry.offset + entry.nbytes]


def missing_tensor_message(model_id: str, name: str, names: Iterable[str]) -> str:
    return f"No weight named {name!r} in model {model_id!r}.{did_you_mean(name, names)}"
