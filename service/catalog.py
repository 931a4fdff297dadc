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

import difflib
import hashlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import xxhash

from weightserve.client.errors import (
    CheckpointError,
    InvalidRequest,
    ModelNotFound,
    ModelUnavailable,
    TensorNotFound,
)
from weightserve.service.readers.base import FormatReader, ModelContents, TensorEntry

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
class Problem:
    """A model the catalog found but refused: which file, which rule."""

    model: str
    file: str
    reason: str


FileStamp = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def file_stamp(st: os.stat_result) -> FileStamp:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


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
        self._digests: dict[tuple[int, int], int] = {}
        self._digest_lock = threading.Lock()

    def digest(self, start: int, data: memoryview) -> int:
        """xxh3-64 of ``data``, the mapped bytes from ``start``; computed once per range.

        A weight cache sends the same chunks to many clients; reading every byte again for
        its digest was a third of the server's CPU per load (docs/performance.md). The cache
        lives with this mapping, so a replaced file starts afresh. Only chunks of at least
        ``MIN_CACHED_CHUNK`` bytes are kept, within one budget for all mappings
        (``MAX_CACHED_DIGESTS``), so no request pattern can grow it without bound.
        """
        if len(data) < MIN_CACHED_CHUNK:
            return xxhash.xxh3_64_intdigest(data)
        key = (start, len(data))
        found = self._digests.get(key)
        if found is None:
            found = xxhash.xxh3_64_intdigest(data)
            with self._digest_lock:  # two streams may hash the same chunk at once
                if key not in self._digests and DIGEST_BUDGET.take():
                    self._digests[key] = found
        return found

    def __del__(self) -> None:
        DIGEST_BUDGET.give(len(getattr(self, "_digests", ())))

    def view(self) -> memoryview:
        with self._lock:
            if self._view is None:
                # The file stays open: ensure_covers() fstat()s it before data is touched, and
                # the open file pins this inode, so a later rename over it changes nothing here.
                f = open(self.path, "rb")  # noqa: SIM115
                try:
                    found = file_stamp(os.fstat(f.fileno()))
                    if self.stamp is not None and found != self.stamp:
                        # Replaced between indexing and first use: the index describes another
                        # file, so serving these bytes under the old revision would mix two.
                        raise ModelUnavailable(
                            f"{self.path.name} changed since it was indexed; the model reloads "
                            "on its next request"
                        )
                    self.size = found[2]
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

    def ensure_covers(self, end: int) -> None:
        """Refuse to touch mapped bytes past the file's current end.

        Reading a mapped page that a truncation removed raises SIGBUS and kills the process;
        checking the size (one fstat) before each chunk turns that into a clean error for
        the streams of this file only.
        """
        if self._file is not None and os.fstat(self._file.fileno()).st_size < end:
            raise ModelUnavailable(
                f"{self.path.name} was truncated while being served; the model reloads on "
                "its next request"
            )


@dataclass
class Model:
    id: str
    format: str
    path: Path  # the model's directory or file
    files: list[Path]
    revision: str
    contents: ModelContents
    checked_at: float = field(default_factory=time.monotonic, repr=False)
    stamps: dict[Path, FileStamp] = field(default_factory=dict, repr=False)  # as indexed
    _maps: dict[Path, MappedFile] = field(default_factory=dict, repr=False)
    _maps_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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
                self.mapped(f).view()
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


def file_revision(
    files: list[Path], root: Path, stamps: dict[Path, FileStamp] | None = None
) -> str:
    """A short digest of each file's identity: path, size, mtime, inode.

    It changes when any file is rewritten, replaced or renamed, without reading data.
    ``stamps`` gives the identities to use (taken earlier) instead of stat()ing now.
    """
    h = hashlib.sha256()
    for f in sorted(files):
        _, ino, size, mtime_ns = stamps[f] if stamps is not None else file_stamp(f.stat())
        h.update(f"{f.relative_to(root)}\0{size}\0{mtime_ns}\0{ino}\n".encode())
    return h.hexdigest()[:16]


def validate_model_id(model_id: str) -> str:
    """Refuse ids that could name something outside the root."""
    if not model_id or model_id.startswith("/") or "\\" in model_id or "\0" in model_id:
        raise InvalidRequest(f"invalid model id {model_id!r}")
    if any(part in ("", ".", "..") for part in model_id.split("/")):
        raise InvalidRequest(f"invalid model id {model_id!r}: empty, '.' or '..' path parts")
    return model_id


class Catalog:
    """Every model under ``root``, indexed by id."""

    def __init__(
        self,
        root: str | os.PathLike,
        readers: dict[str, FormatReader] | None = None,
        recheck_seconds: float = 1.0,
    ):
        self.root = Path(root).resolve()
        self.recheck_seconds = recheck_seconds
        if not self.root.is_dir():
            raise FileNotFoundError(f"model root {self.root} is not a directory")
        self.readers = readers if readers is not None else default_readers()
        self.models: dict[str, Model] = {}
        self.problems: dict[str, Problem] = {}
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
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            directory = Path(dirpath)
            at_root = directory == self.root
            model_id = None if at_root else directory.relative_to(self.root).as_posix()
            # Symlinked directories are never walked; one that leaves the root is reported.
            kept = []
            for name in sorted(d for d in dirnames if not d.startswith(".")):
                sub = directory / name
                if sub.is_symlink() and not self._inside_root(sub):
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

    def _load(self, model_id: str, fmt: str, path: Path, files: list[Path]) -> Model:
        stamps = {f: file_stamp(f.stat()) for f in files}  # before reading: see MappedFile.view
        contents = self.readers[fmt].read(files)
        return Model(
            id=model_id,
            format=fmt,
            path=path,
            files=files,
            revision=file_revision(files, self.root, stamps),  # the files the index is of
            contents=contents,
            stamps=stamps,
        )

    def _relative(self, text: str) -> str:
        """Problems go to clients: name files relative to the root, never by server paths."""
        return text.replace(f"{self.root}{os.sep}", "").replace(str(self.root), ".")

    def scan(self) -> None:
        """(Re)discover models. Unchanged models keep their index and mappings."""
        started = time.perf_counter()
        with self._lock:
            self.problems = {}
            found = self.discover()
            models: dict[str, Model] = {}
            for model_id, (fmt, path, files) in found.items():
                try:
                    revision = file_revision(files, self.root)
                    old = self.models.get(model_id)
                    if old is not None and old.revision == revision:
                        models[model_id] = old
                        continue
                    models[model_id] = self._load(model_id, fmt, path, files)
                except CheckpointError as e:
                    self.problems[model_id] = Problem(
                        model_id, self._relative(e.file), self._relative(str(e))
                    )
                    log.warning("model %s refused: %s", model_id, e)
                except OSError as e:
                    self.problems[model_id] = Problem(
                        model_id, self._relative(str(e.filename or path)), self._relative(str(e))
                    )
                    log.warning("model %s unreadable: %s", model_id, e)
            self.models = models
        log.info(
            "catalog: %d models, %d refused, in %.3f s",
            len(self.models),
            len(self.problems),
            time.perf_counter() - started,
        )

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
            revision = file_revision(model.files, self.root)
        except OSError:
            revision = None
        if revision == model.revision:
            return model
        self.scan()
        if model.id in self.models:
            return self.models[model.id]
        problem = self.problems.get(model.id)
        reason = problem.reason if problem else "its files are gone"
        raise ModelUnavailable(f"model {model.id!r} changed on disk and is refused: {reason}")

    def get(self, model_id: str) -> Model:
        validate_model_id(model_id)
        model = self.models.get(model_id)
        if model is not None:
            return self._fresh(model)
        problem = self.problems.get(model_id)
        if problem is not None:
            raise ModelUnavailable(f"model {model_id!r} is refused: {problem.reason}")
        msg = f"No model {model_id!r} under the model root."
        close = difflib.get_close_matches(model_id, list(self.models), n=1)
        if close:
            msg += f" Did you mean {close[0]!r}?"
        raise ModelNotFound(msg)
