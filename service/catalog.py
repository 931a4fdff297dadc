"""The catalog: finds the models under a root directory, indexes them, maps each file once.

Start-up reads headers only (the readers never touch tensor data), so opening a root that
holds hundreds of GiB takes milliseconds. A model that fails validation is recorded in
``Catalog.problems`` with the file and the rule it breaks; every other model is served.

How a root is laid out (the model id is the path relative to the root, so ``org/name`` works):

- a directory below the root holding ``*.safetensors`` files is one model (all its shards,
  checked against ``model.safetensors.index.json`` when present);
- otherwise a directory holding PyTorch checkpoints (``*.bin``, ``*.pt``, ``*.pth``) is one
  model (checked against ``pytorch_model.bin.index.json`` when present); a directory with
  both formats is served from its safetensors files, as Hugging Face repositories intend;
- every ``*.gguf`` file is a model of its own (GGUF is a single-file format);
- a checkpoint file directly in the root is a model of its own, its id the file name.

Paths never leave the root: symlinks that resolve outside it are skipped and reported, and a
model directory with a shard (or shard index) that leaves the root is refused as a whole rather
than served in part. Symlinked files inside the root are served; symlinked directories are not
walked (a directory symlink that leaves the root is reported).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import xxhash

from weightserve.client._url import RESERVED_PART
from weightserve.client.errors import (
    CheckpointError,
    InvalidRequest,
    ModelNotFound,
    ModelUnavailable,
    TensorNotFound,
)
from weightserve.service.readers.base import FormatReader, ModelContents, TensorEntry
from weightserve.service.revisions import (
    REVISION_CHARS,
    DigestStore,
    FileChanged,
    FileStamp,
    content_revision,
    file_stamp,
)

log = logging.getLogger("weightserve.catalog")

SAFETENSORS_SUFFIXES = (".safetensors",)
PYTORCH_SUFFIXES = (".bin", ".pt", ".pth")
GGUF_SUFFIXES = (".gguf",)
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def default_readers() -> dict[str, FormatReader]:
    from weightserve.service.readers.gguf import GGUFReader
    from weightserve.service.readers.pytorch import PytorchReader
    from weightserve.service.readers.safetensors import SafetensorsReader

    return {"safetensors": SafetensorsReader(), "gguf": GGUFReader(), "pytorch": PytorchReader()}


@dataclass(frozen=True)
class RepoFile:
    """One file of a model's repository, as the files API lists it."""

    name: str  # relative to the model directory, '/'-separated
    path: Path
    size: int


# Side files larger than this are not served (weights and their leftovers are exempt): they
# are configs, tokenizers and templates, not bulk data.
SIDE_FILE_MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class Problem:
    """A model the catalog found but refused: which file, which rule."""

    model: str
    file: str
    reason: str


# Chunk digests kept across all mappings (~200 bytes each as a dict entry: ~50 MiB at most;
# 512 GiB of chunks at the default 2 MiB), and the smallest chunk worth keeping (hashing
# small chunks again is cheap, and tiny chunk sizes would otherwise fill the budget fast).
MAX_CACHED_DIGESTS = 1 << 18
MIN_CACHED_CHUNK = 256 << 10


class _DigestBudget:
    """How many digests all mappings may still keep; a dropped mapping gives its back."""

    def __init__(self) -> None:
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.used >= MAX_CACHED_DIGESTS:
                return False
            self.used += 1
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


DIGEST_BUDGET = _DigestBudget()


class MappedFile:
    """One read-only mmap of one file, shared by every request.

    The mapping is made on first use, not at start-up. A replaced file (new inode) gets a new
    MappedFile; the old mapping lives on while any stream still holds a view of it.
    """

    def __init__(self, path: Path, stamp: FileStamp | None = None) -> None:
        self.path = path
        self.stamp = stamp  # the file as it was indexed; another file under its name is refused
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self.size = stamp[2] if stamp is not None else path.stat().st_size
        self._mapped_stamp: FileStamp | None = None  # the file as mapped, checked per chunk
        self._mapped_nlink = 0
        self._digests: dict[tuple[int, int], int] = {}
        self._digest_lock = threading.Lock()

    def digest(self, start: int, data: memoryview) -> int:
        """xxh3-64 of ``data``, the mapped bytes from ``start``; computed once per range.

        A weight cache sends the same chunks to many clients; reading every byte again for
        its digest was a third of the server's CPU per load (docs/performance.md). The cache
        lives with this mapping, so a replaced file starts afresh. Only chunks of at least
        ``MIN_CACHED_CHUNK`` bytes are kept, within one budget for all mappings
        (``MAX_CACHED_DIGESTS``), so no request pattern can grow it without bound.

        The file is checked unchanged *after* hashing (``ensure_unchanged``): a write updates
        the file's times before it copies data, so bytes hashed before an unchanged check
        are bytes of the indexed version. A digest is kept only once that holds, and the
        client compares it with what it received: a chunk torn by a later overwrite fails
        there, and an overwrite before the check cuts the stream here. No mixed data passes.
        """
        end = start + len(data)
        if len(data) < MIN_CACHED_CHUNK:
            small = xxhash.xxh3_64_intdigest(data)
            self.ensure_unchanged(end)
            return small
        key = (start, len(data))
        found = self._digests.get(key)
        if found is None:
            found = xxhash.xxh3_64_intdigest(data)
            self.ensure_unchanged(end)
            with self._digest_lock:  # two streams may hash the same chunk at once
                if key not in self._digests and DIGEST_BUDGET.take():
                    self._digests[key] = found
        return found

    def __del__(self) -> None:
        DIGEST_BUDGET.give(len(getattr(self, "_digests", ())))

    def view(self) -> memoryview:
        with self._lock:
            if self._view is None:
                # The file stays open: ensure_unchanged() fstat()s it before data is touched, and
                # the open file pins this inode, so a later rename over it changes nothing here.
                f = open(self.path, "rb")  # noqa: SIM115
                try:
                    st = os.fstat(f.fileno())
                    found = file_stamp(st)
                    if self.stamp is not None and found != self.stamp:
                        # Replaced between indexing and first use: the index describes another
                        # file, so serving these bytes under the old revision would mix two.
                        raise ModelUnavailable(
                            f"{self.path.name} changed since it was indexed; the model reloads "
                            "on its next request"
                        )
                    self.size = found[2]
                    self._mapped_stamp, self._mapped_nlink = found, st.st_nlink
                    if self.size == 0:
                        f.close()
                        self._view = memoryview(b"")
                    else:
                        self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                        self._file, self._view = f, memoryview(self._map)
                except BaseException:
                    if self._file is not f:
                        f.close()
                    raise
            return self._view

    def _only_relinked(self, st: os.stat_result, now: FileStamp) -> bool:
        """A rename over the file, a delete or a new hard link changes its ctime (the link
        count changed) but not one byte: streams of the old version read on."""
        assert self._mapped_stamp is not None
        return now[:4] == self._mapped_stamp[:4] and st.st_nlink != self._mapped_nlink

    def ensure_unchanged(self, end: int = 0) -> None:
        """Refuse to go on if the file is not the version the stream started with.

        One fstat: a size below ``end`` means a truncation (reading a mapped page it removed
        raises SIGBUS and kills the process), a changed size, mtime or ctime means the file
        was overwritten in place (``cp`` over it, not a rename): its bytes may now be a mix
        of two versions, so the streams of this file end with a clear error instead.
        """
        if self._file is None:
            return
        st = os.fstat(self._file.fileno())
        now = file_stamp(st)
        if now[2] < end:
            raise ModelUnavailable(
                f"{self.path.name} was truncated while being served; the model reloads on "
                "its next request"
            )
        if now != self._mapped_stamp and not self._only_relinked(st, now):
            raise ModelUnavailable(
                f"{self.path.name} was overwritten in place while being served; the stream "
                "is cut so no bytes of two versions mix; the model reloads on its next "
                "request (replace files by renaming a new file over them)"
            )


@dataclass
class Model:
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
        """The content revision (see service/revisions.py): computed on first use, from
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
            (name := self._relative_name(f)): RepoFile(name, f, self.stamps[f][2])
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
        return self.revision_digest()[:40]

    def _relative_name(self, file: Path) -> str:
        base = self.path if self.path.is_dir() else self.path.parent
        return file.relative_to(base).as_posix()

    def revision_digest(self) -> str:
        """The full content digest (64 hex) behind ``revision`` and ``commit``."""
        if self._revision_full is None:
            with self._revision_lock:
                if self._revision_full is None:
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
                mf = self._maps[file] = MappedFile(file, self.stamps.get(file))
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
    msg = f"No weight named {name!r} in model {model_id!r}."
    close = difflib.get_close_matches(name, list(names), n=1)
    if close:
        msg += f" Did you mean {close[0]!r}?"
    return msg


def current_stamps(files: Iterable[Path]) -> dict[Path, FileStamp]:
    return {f: file_stamp(f.stat()) for f in files}


def validate_model_id(model_id: str) -> str:
    """Refuse ids that could name something outside the root."""
    if not model_id or model_id.startswith("/") or "\\" in model_id or "\0" in model_id:
        raise InvalidRequest(f"invalid model id {model_id!r}")
    if any(part in ("", ".", "..") for part in model_id.split("/")):
        raise InvalidRequest(f"invalid model id {model_id!r}: empty, '.' or '..' path parts")
    if RESERVED_PART in model_id.split("/"):
        raise InvalidRequest(
            f"invalid model id {model_id!r}: the path part {RESERVED_PART!r} is reserved for "
            f"the routes below a model (/v1/models/ID/{RESERVED_PART}/stream, "
            f"/v1/models/ID/{RESERVED_PART}/tensors/NAME)"
        )
    return model_id


class Catalog:
    """Every model under ``root``, indexed by id."""

    def __init__(
        self,
        root: str | os.PathLike,
        readers: dict[str, FormatReader] | None = None,
        recheck_seconds: float = 1.0,
        digests: DigestStore | None = None,
    ):
        self.root = Path(root).resolve()
        self.recheck_seconds = recheck_seconds
        if not self.root.is_dir():
            raise FileNotFoundError(f"model root {self.root} is not a directory")
        self.readers = readers if readers is not None else default_readers()
        self.digests = digests if digests is not None else DigestStore()
        self.models: dict[str, Model] = {}
        self.problems: dict[str, Problem] = {}
        # Refused models with their files as they were: not parsed (or logged) again until
        # a file changes, so a hostile 256 MiB pickle is walked once, not every rescan.
        self._refused: dict[str, tuple[dict[Path, FileStamp], Problem]] = {}
        self.on_refused: Callable[[Problem], None] | None = None  # metrics: a new refusal
        self._lock = threading.Lock()
        self.scan()

    # -- discovery ---------------------------------------------------------------------------

    def _inside_root(self, path: Path) -> bool:
        try:
            path.resolve().relative_to(self.root)
            return True
        except ValueError:
            return False

    def discover(self) -> dict[str, tuple[str, Path, list[Path]]]:
        """model id -> (format, path, files), from the directory layout alone."""
        found: dict[str, tuple[str, Path, list[Path]]] = {}
        outside = "symlink points outside the model root"
        reserved = (
            f"a directory named {RESERVED_PART!r} is not served: that name is reserved in URLs "
            f"(/v1/models/ID/{RESERVED_PART}/stream); rename it"
        )
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            directory = Path(dirpath)
            at_root = directory == self.root
            model_id = None if at_root else directory.relative_to(self.root).as_posix()
            # Symlinked directories are never walked; one that leaves the root is reported.
            kept = []
            for name in sorted(d for d in dirnames if not d.startswith(".")):
                sub = directory / name
                if name == RESERVED_PART:  # no model id may have this part (validate_model_id)
                    rel = sub.relative_to(self.root).as_posix()
                    self.problems[rel] = Problem(rel, rel, reserved)
                elif sub.is_symlink() and not self._inside_root(sub):
                    rel = sub.relative_to(self.root).as_posix()
                    self.problems[rel] = Problem(rel, rel, outside)
                else:
                    kept.append(name)
            dirnames[:] = kept
            files = []
            escaped_shard = None
            for name in sorted(filenames):
                p = directory / name
                if name.startswith("."):
                    continue
                if not self._inside_root(p):
                    rel = p.relative_to(self.root).as_posix()
                    if at_root or p.suffix in GGUF_SUFFIXES:  # a model of its own
                        self.problems[rel] = Problem(rel, rel, outside)
                    elif p.suffix in SAFETENSORS_SUFFIXES + PYTORCH_SUFFIXES or name in INDEX_FILES:
                        escaped_shard = escaped_shard or rel  # never serve a model in part
                    continue
                if p.is_file():
                    files.append(p)
            if model_id is not None and escaped_shard is not None:
                self.problems[model_id] = Problem(model_id, escaped_shard, outside)
            for f in files:
                if f.suffix in GGUF_SUFFIXES:
                    found[f.relative_to(self.root).as_posix()] = ("gguf", f, [f])
            st = [f for f in files if f.suffix in SAFETENSORS_SUFFIXES]
            pt = [f for f in files if f.suffix in PYTORCH_SUFFIXES]
            if at_root:
                for f in st:
                    found[f.name] = ("safetensors", f, [f])
                for f in pt:
                    found[f.name] = ("pytorch", f, [f])
                continue
            index = {f.name: f for f in files if f.name in INDEX_FILES}
            if model_id is None or model_id in self.problems:
                pass
            elif st:
                extra = [index[INDEX_FILES[0]]] if INDEX_FILES[0] in index else []
                found[model_id] = ("safetensors", directory, st + extra)
            elif pt:
                extra = [index[INDEX_FILES[1]]] if INDEX_FILES[1] in index else []
                found[model_id] = ("pytorch", directory, pt + extra)
        return found

    def side_files(self, path: Path, files: list[Path], model_dirs: set[Path]) -> list[Path]:
        """The other files of a directory model's repository: every regular file below it
        that stays inside the root, not hidden, not below another model's directory, and
        (unless a checkpoint) at most ``SIDE_FILE_MAX_BYTES``. A file model has none."""
        if not path.is_dir():
            return []
        weights = set(files)
        found: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
            directory = Path(dirpath)
            dirnames[:] = sorted(
                d
                for d in dirnames
                if not d.startswith(".") and (directory / d) not in model_dirs
                and not (directory / d).is_symlink()
            )  # fmt: skip
            for name in sorted(filenames):
                f = directory / name
                if name.startswith(".") or f in weights or not self._inside_root(f):
                    continue
                try:
                    if not f.is_file():
                        continue
                    checkpoint = f.suffix in SAFETENSORS_SUFFIXES + PYTORCH_SUFFIXES + GGUF_SUFFIXES
                    if not checkpoint and f.stat().st_size > SIDE_FILE_MAX_BYTES:
                        log.info("%s not served: larger than %d bytes", f, SIDE_FILE_MAX_BYTES)
                        continue
                except OSError:
                    continue
                found.append(f)
        return found

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

    def _relative(self, text: str) -> str:
        """Problems go to clients: name files relative to the root, never by server paths."""
        return text.replace(f"{self.root}{os.sep}", "").replace(str(self.root), ".")

    def scan(self) -> None:
        """(Re)discover models. Unchanged models keep their index and mappings; unchanged
        refused models keep their refusal without being parsed again."""
        started = time.perf_counter()
        with self._lock:
            self.problems = {}
            found = self.discover()
            models: dict[str, Model] = {}
            refused: dict[str, tuple[dict[Path, FileStamp], Problem]] = {}
            model_dirs = {path for _, path, _ in found.values() if path.is_dir()}
            for model_id, (fmt, path, files) in found.items():
                side: list[Path] = []
                try:
                    side = self.side_files(path, files, model_dirs)
                    stamps = current_stamps([*files, *side])
                    old = self.models.get(model_id)
                    if old is not None and old.stamps == stamps:
                        models[model_id] = old
                        continue
                    known = self._refused.get(model_id)
                    if known is not None and known[0] == stamps:
                        refused[model_id] = known
                        self.problems[model_id] = known[1]
                        continue
                    models[model_id] = self._load(model_id, fmt, path, files, side, stamps)
                except (CheckpointError, OSError) as e:
                    if isinstance(e, CheckpointError):
                        problem = Problem(model_id, self._relative(e.file), self._relative(str(e)))
                    else:
                        where = str(e.filename or path)
                        problem = Problem(model_id, self._relative(where), self._relative(str(e)))
                    self.problems[model_id] = problem
                    with contextlib.suppress(OSError):  # files vanished: looked at next time
                        refused[model_id] = (current_stamps([*files, *side]), problem)
                    log.warning("model %s refused: %s", model_id, problem.reason)
                    if self.on_refused is not None:
                        self.on_refused(problem)
            self.models = models
            self._refused = refused
        log.info(
            "catalog: %d models, %d refused, in %.3f s",
            len(self.models),
            len(self.problems),
            time.perf_counter() - started,
        )

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

    def get(self, model_id: str, may_read: Callable[[str], bool] | None = None) -> Model:
        """The model, or ModelNotFound. ``may_read`` limits the "did you mean" suggestion
        to ids the caller may see: an error must not reveal what exists beyond a grant."""
        validate_model_id(model_id)
        model = self.models.get(model_id)
        if model is not None:
            return self._fresh(model)
        problem = self.problems.get(model_id)
        if problem is not None:
            raise ModelUnavailable(f"model {model_id!r} is refused: {problem.reason}")
        msg = f"No model {model_id!r} under the model root."
        visible = [m for m in self.models if may_read is None or may_read(m)]
        close = difflib.get_close_matches(model_id, visible, n=1)
        if close:
            msg += f" Did you mean {close[0]!r}?"
        raise ModelNotFound(msg)
