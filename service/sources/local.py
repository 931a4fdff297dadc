"""The catalog: finds the models under a root directory, indexes them, maps each file once.

Start-up reads headers only (the readers never touch tensor data), so opening a root that
holds hundreds of GiB takes milliseconds. A model that fails validation is recorded in
``Catalog.problems`` with the file and the rule it breaks; every other model is served.

How a root is laid out: the model id is the path relative to the root, so ``org/name`` works.
These are the rules; README.md ("Model layouts") states them for users.

- A directory below the root holding weights is one model. Its weights form sets by format
  and variant (``model.fp16.safetensors``: variant ``fp16``; ``_weight_sets``); ``DIR`` serves
  the default set (plain safetensors, else plain PyTorch, else the only set), every other set
  is ``DIR:VARIANT`` (``:fp16``, ``:pytorch``, ``:pytorch.fp16``), indexed on first request.
- A shard index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``, a
  variant's ``model.safetensors.index.fp16.json``) decides which files form its set: files it
  does not name (Mistral's ``consolidated.safetensors``) are side files, not weights; a named
  file that is missing refuses the model.
- Every ``*.gguf`` file is a model; the parts of a split GGUF (``NAME-00001-of-00003.gguf``)
  are one model ``NAME.gguf``, served only whole. A checkpoint file directly in the root is a
  model of its own, its id the file name.
- The Hugging Face hub cache: ``models--ORG--NAME`` is ``ORG/NAME``, the snapshot ``refs/main``
  names (without refs, the only one); every snapshot is ``ORG/NAME@COMMIT`` and every other
  ref ``ORG/NAME@REF``. The snapshot's links into the cache's ``blobs/`` stay inside the root.
- A symlinked directory inside the root is an alias (its own ids, the same files); ids naming
  the same files share one Model index and one mapping per file.

Paths never leave the root: symlinks that resolve outside it are skipped and reported, and a
model directory with a shard (or shard index) that leaves the root is refused as a whole rather
than served in part. ``-`` as a path part, and ``@`` and ``:`` in names that form ids, are
reserved (routes, revisions, variants): such names are reported, never served, so no plain
directory's id can be read as a revision or a variant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fcntl
import json
import logging
import mmap
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
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
from weightserve.client.wire.routes import RESERVED_PART
from weightserve.service.readers.base import FormatReader, ModelContents, TensorEntry
from weightserve.service.sources.revisions import (
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
WEIGHT_SUFFIXES = SAFETENSORS_SUFFIXES + PYTORCH_SUFFIXES
# A shard index, plain or of a variant: model.safetensors.index.json,
# diffusion_pytorch_model.safetensors.index.fp16.json, pytorch_model.bin.index.json.
INDEX_NAME = re.compile(
    r"[^.]+\.(?P<suffix>safetensors|bin|pt|pth)\.index(?:\.(?P<variant>[A-Za-z0-9_]+))?\.json"
)
# A weight file of a variant, as transformers and diffusers name them: model.fp16.safetensors,
# model.fp16-00001-of-00002.safetensors, pytorch_model.fp16.bin. One dot-free stem, so
# llama-3.1-8b.safetensors is no variant.
WEIGHT_NAME = re.compile(
    r"[^.]+\.(?P<variant>[A-Za-z0-9_]+)(?:-\d+-of-\d+)?\.(?:safetensors|bin|pt|pth)"
)
# llama.cpp's split GGUF parts (gguf.GGUFWriter with split_max_*, gguf-split).
SPLIT_GGUF_NAME = re.compile(r"(?P<name>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf")
SPLIT_GGUF_FORMAT = "{}-{:05d}-of-{:05d}.gguf"
# Trainer artifacts beside the weights, never a weight set of their own.
TRAINER_FILES = frozenset({"training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})
MAX_INDEX_BYTES = 64 << 20
# Hub cache ref names served as ORG/NAME@REF; refs with a '/' (pr/1) are reachable by commit.
REF_NAME = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*")
HUB_REPO_DIR = re.compile(r"(?P<type>models|datasets|spaces)--(?P<id>.+)")
# ORG/NAME@REVISION names a snapshot of the hub cache, ID:VARIANT another weight set of a
# directory. Both characters are refused in the names that form ids (and '-' as a whole path
# part, for the routes), so no directory can be mistaken for a revision or a variant.
REVISION_SEPARATOR = "@"
VARIANT_SEPARATOR = ":"
ID_SEPARATORS = (REVISION_SEPARATOR, VARIANT_SEPARATOR)
OUTSIDE_ROOT = "symlink points outside the model root"
RESERVED_DIRECTORY = (
    f"a directory named {RESERVED_PART!r} is not served: that name is reserved in URLs "
    f"(/v1/models/ID/{RESERVED_PART}/stream); rename it"
)
RESERVED_CHARACTER = (
    f"not served: {REVISION_SEPARATOR!r} and {VARIANT_SEPARATOR!r} are reserved in model ids "
    f"(ORG/NAME{REVISION_SEPARATOR}REVISION, ID{VARIANT_SEPARATOR}VARIANT); rename it"
)


def _weight_format(path: Path) -> str | None:
    if path.suffix in SAFETENSORS_SUFFIXES:
        return "safetensors"
    return "pytorch" if path.suffix in PYTORCH_SUFFIXES else None


def _format_of_suffix(suffix: str) -> str:
    return "safetensors" if suffix == "safetensors" else "pytorch"


def _variant_name(fmt: str, variant: str) -> str:
    """How ``ID:VARIANT`` names a weight set: ``fp16`` (safetensors), ``pytorch`` or
    ``pytorch.fp16``."""
    return ".".join(p for p in ("pytorch" if fmt == "pytorch" else "", variant) if p)


def _hub_repo_id(directory_name: str) -> str | None:
    """``ORG/NAME`` of a hub cache folder (``models--ORG--NAME``, as huggingface_hub's
    ``repo_folder_name`` writes it), or None for any other name."""
    match = HUB_REPO_DIR.fullmatch(directory_name)
    if match is None:
        return None
    parts = match["id"].split("--")
    if any(p in ("", ".", "..", RESERVED_PART) or set(p) & set(ID_SEPARATORS) for p in parts):
        return None
    return "/".join(parts)


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


# The hint given with "changed since it was indexed": the next request re-indexes the model.
RELOAD_RETRY_AFTER = 0.5

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


_LEASES_REFUSED: set[Path] = set()  # files whose lease the kernel refused, logged once


def _take_read_lease(fd: int, path: Path) -> bool:
    """Take a read lease on ``fd`` (see ``MappedFile.hold``): True if held, False where the
    platform refuses leases; ModelUnavailable if the file is open for writing right now."""
    if not hasattr(fcntl, "F_SETLEASE"):
        return False
    try:
        # A lease break signals the lease's owner, SIGIO by default, whose default action
        # ends the process: send SIGURG instead (ignored by default) and clear the owner.
        fcntl.fcntl(fd, getattr(fcntl, "F_SETSIG", 10), signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, fcntl.F_SETOWN, 0)
        return True
    except BlockingIOError:
        raise ModelUnavailable(
            f"{path.name} is open for writing (being overwritten in place?); retry once the "
            "writer is done, and replace files by renaming a new file over them"
        ) from None
    except OSError as e:  # EACCES/EPERM: not the owner, no CAP_LEASE; EINVAL: no leases here
        if path not in _LEASES_REFUSED:
            _LEASES_REFUSED.add(path)
            log.info("no read lease on %s (%s): in-place truncation is not guarded", path, e)
        return False


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
        self._holds = 0  # streams reading this mapping now (see hold)
        self._leased = False
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
                            "on its next request",
                            retry_after=RELOAD_RETRY_AFTER,  # clients retry by themselves
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

    def fileno(self) -> int:
        """The open descriptor of the mapped file (``view()`` first): the same-node handoff
        passes it on, so clients map exactly the inode this mapping reads."""
        if self._file is None:
            raise ModelUnavailable(f"{self.path.name} is empty or not mapped; nothing to hand off")
        return self._file.fileno()

    def content_stamp(self) -> tuple[int, int]:
        """(size, mtime in ns) of the file as mapped: a holder of its descriptor who finds
        them changed knows it was written in place since (renames and links leave them)."""
        assert self._mapped_stamp is not None, "view() first"
        return self._mapped_stamp[2], self._mapped_stamp[3]

    def hold(self) -> None:
        """A stream starts reading this mapping: while any does, hold a read lease on the file.

        A truncation under a mapping makes the next read of a removed page SIGBUS, which kills
        the process (every stream, every model). With the lease, the kernel makes a writer's
        ``open`` (``cp`` over the file, ``truncate``) wait until we release it, and tells us a
        writer waits (``F_GETLEASE``, checked with each chunk in ``ensure_unchanged``): the
        streams of this file are cut at their next chunk, the last one releases the lease,
        and only then does the writer proceed. Leases need the file's owner or CAP_LEASE and
        a local file system; where they are refused, streams go unprotected (checked by
        ``fstat`` only) and this is logged once.
        """
        with self._lock:
            if self._holds == 0 and self._file is not None:
                self._leased = _take_read_lease(self._file.fileno(), self.path)
            self._holds += 1

    def release(self) -> None:
        with self._lock:
            self._holds -= 1
            if self._holds == 0 and self._leased:
                self._leased = False
                if self._file is not None:
                    with contextlib.suppress(OSError):
                        fcntl.fcntl(self._file.fileno(), fcntl.F_SETLEASE, fcntl.F_UNLCK)

    def _lease_broken(self, fd: int) -> bool:
        """A writer waits for our lease. Under the lock: the last stream may be releasing
        it right now, which is not a writer."""
        with self._lock:
            return self._leased and fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK

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
        fd = self._file.fileno()
        if self._lease_broken(fd):
            raise ModelUnavailable(
                f"{self.path.name} is being overwritten in place; the stream is cut before "
                "its bytes change; the model reloads on its next request (replace files by "
                "renaming a new file over them)"
            )
        st = os.fstat(fd)
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
        """The content revision (see service/sources/revisions.py): computed on first use, from
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
        # Other weight sets of a directory (``ID:VARIANT``): indexed on their first request.
        self.variants: dict[str, tuple[str, Path, list[Path]]] = {}
        self._found_variants: dict[str, tuple[str, Path, list[Path]]] = {}
        self._model_dirs: set[Path] = set()
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
        """model id -> (format, path, files), from the directory layout alone: the models
        served at once. A directory's other weight sets go to ``self.variants`` (served on
        request); refusals found on the way go to ``self.problems``."""
        found: dict[str, tuple[str, Path, list[Path]]] = {}
        self._found_variants = {}
        hub_repo = _hub_repo_id(self.root.name)
        if hub_repo is not None and (self.root / "snapshots").is_dir():
            self._discover_hub_repo(self.root, hub_repo, found, (self.root,))
        else:
            self._discover_tree(self.root, "", found, (self.root,))
        self.variants = self._found_variants  # swapped whole: ``get`` reads it unlocked
        return found

    def _refuse(self, key: str, file: str, reason: str) -> None:
        self.problems.setdefault(key, Problem(key, file, reason))

    def _add(
        self,
        found: dict[str, tuple[str, Path, list[Path]]],
        model_id: str,
        entry: tuple[str, Path, list[Path]],
    ) -> None:
        """One id, one model: a second layout giving a taken id is refused, named by its path."""
        taken = found.get(model_id, self._found_variants.get(model_id))
        if taken is None:
            found[model_id] = entry
        elif taken != entry:
            where = self._relative(str(entry[1]))
            self._refuse(
                where,
                where,
                f"its model id {model_id!r} is taken by {self._relative(str(taken[1]))}; "
                "rename one of them",
            )

    def _discover_tree(
        self,
        directory: Path,
        id_prefix: str,
        found: dict[str, tuple[str, Path, list[Path]]],
        visiting: tuple[Path, ...],
    ) -> None:
        """The models in ``directory`` (a real directory inside the root) and below it;
        ``id_prefix`` is its id ('' for the root), ``visiting`` the directories walked down
        to it (a symlink back to one of them is a loop)."""
        at_root = id_prefix == ""
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as e:
            log.info("%s not searched: %s", directory, e)
            return
        files: list[Path] = []
        escaped_shard = None
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                continue
            p = directory / name
            rel = f"{id_prefix}/{name}" if id_prefix else name
            is_link = entry.is_symlink()
            if is_link and not self._inside_root(p):
                if p.is_dir() or at_root or p.suffix in GGUF_SUFFIXES:  # a model of its own
                    self._refuse(rel, rel, OUTSIDE_ROOT)
                elif p.suffix in WEIGHT_SUFFIXES or INDEX_NAME.fullmatch(name):
                    escaped_shard = escaped_shard or rel  # never serve a model in part
                continue
            try:
                is_dir = p.is_dir()
            except OSError:
                continue
            if not is_dir:
                if p.is_file():
                    files.append(p)
                continue
            if name == RESERVED_PART:  # no model id may have this part (validate_model_id)
                self._refuse(rel, rel, RESERVED_DIRECTORY)
                continue
            if any(c in name for c in ID_SEPARATORS):
                self._refuse(rel, rel, RESERVED_CHARACTER)
                continue
            real = p.resolve() if is_link else p
            if real in visiting:
                self._refuse(rel, rel, "symlink loop: it points to a directory above it")
                continue
            hub_repo = _hub_repo_id(name)
            if hub_repo is not None and (real / "snapshots").is_dir():
                if name.startswith("models--"):  # datasets and spaces hold no models
                    repo_id = rel if is_link else f"{id_prefix}/{hub_repo}".lstrip("/")
                    self._discover_hub_repo(real, repo_id, found, (*visiting, real))
                continue
            # A symlinked directory inside the root is an alias: its own ids, same content.
            self._discover_tree(real, rel, found, (*visiting, real))

        self._discover_gguf(files, id_prefix, found)
        if at_root:
            for f in files:
                fmt = _weight_format(f)
                if fmt is None:
                    continue
                if any(c in f.name for c in ID_SEPARATORS):
                    self._refuse(f.name, f.name, RESERVED_CHARACTER)
                else:
                    self._add(found, f.name, (fmt, f, [f]))
            return
        if escaped_shard is not None:
            self._refuse(id_prefix, escaped_shard, OUTSIDE_ROOT)
            return
        sets, default = self._weight_sets(id_prefix, files)
        for key, set_files in sets.items():
            if key == default:
                self._add(found, id_prefix, (key[0], directory, set_files))
            else:
                variant_id = id_prefix + VARIANT_SEPARATOR + _variant_name(*key)
                self._add(self._found_variants, variant_id, (key[0], directory, set_files))

    def _discover_gguf(
        self, files: list[Path], id_prefix: str, found: dict[str, tuple[str, Path, list[Path]]]
    ) -> None:
        """Every ``.gguf`` file is a model; the parts of a split GGUF (``NAME-00001-of-00003.gguf``
        ...) are one model, ``NAME.gguf``, served only when every part is there."""
        splits: dict[tuple[str, int], dict[int, Path]] = {}
        for f in files:
            if f.suffix not in GGUF_SUFFIXES:
                continue
            part = SPLIT_GGUF_NAME.fullmatch(f.name)
            if part is not None:
                key = (part["name"], int(part["count"]))
                splits.setdefault(key, {})[int(part["number"])] = f
            else:
                self._add_file_model(found, id_prefix, f.name, ("gguf", f, [f]))
        for (name, count), parts in splits.items():
            model_name = name + ".gguf"
            missing = [n for n in range(1, count + 1) if n not in parts]
            if missing or count == 0:
                model_id = f"{id_prefix}/{model_name}".lstrip("/")
                shown = ", ".join(SPLIT_GGUF_FORMAT.format(name, n, count) for n in missing[:3])
                self._refuse(
                    model_id,
                    self._relative(str(next(iter(parts.values())))),
                    f"split GGUF {model_name} has {len(parts)} of its {count} parts; missing "
                    f"{shown}{' ...' if len(missing) > 3 else ''} (a split model is served "
                    "only whole)",
                )
                continue
            ordered = [parts[n] for n in sorted(parts)]
            self._add_file_model(found, id_prefix, model_name, ("gguf", ordered[0], ordered))

    def _add_file_model(
        self,
        found: dict[str, tuple[str, Path, list[Path]]],
        id_prefix: str,
        name: str,
        entry: tuple[str, Path, list[Path]],
    ) -> None:
        model_id = f"{id_prefix}/{name}".lstrip("/")
        if any(c in name for c in ID_SEPARATORS):
            self._refuse(model_id, self._relative(str(entry[1])), RESERVED_CHARACTER)
        else:
            self._add(found, model_id, entry)

    def _weight_sets(
        self, model_id: str, files: list[Path]
    ) -> tuple[dict[tuple[str, str], list[Path]], tuple[str, str] | None]:
        """A directory's weight sets, (format, variant) -> files, and the default one.

        A set is the format's files of one variant (``model.fp16.safetensors``,
        ``model.fp16-00001-of-00002.safetensors``: variant ``fp16``; '' for none) with its
        shard index (``model.safetensors.index.json``, ``model.safetensors.index.fp16.json``).
        With an index, the index decides: files it does not name are not weights (a leftover
        ``consolidated.safetensors``), and a file it names that is missing refuses the set.
        The default is the plain safetensors set, else the plain PyTorch set, else the only
        set there is.
        """
        sets: dict[tuple[str, str], list[Path]] = {}
        indexes: dict[tuple[str, str], list[Path]] = {}
        for f in files:
            index = INDEX_NAME.fullmatch(f.name)
            fmt = _weight_format(f)
            if index is not None:
                key = (_format_of_suffix(index["suffix"]), index["variant"] or "")
                indexes.setdefault(key, []).append(f)
            elif (
                fmt is not None
                and f.name not in TRAINER_FILES
                and not f.name.startswith("rng_state")
            ):
                weight = WEIGHT_NAME.fullmatch(f.name)
                sets.setdefault((fmt, (weight and weight["variant"]) or ""), []).append(f)
        chosen: dict[tuple[str, str], list[Path]] = {}
        refused: dict[tuple[str, str], tuple[str, str]] = {}  # key -> (file, reason)
        for key in sorted(sets.keys() | indexes.keys()):
            weights, key_indexes = sets.get(key, []), indexes.get(key, [])
            if len(key_indexes) == 1:
                named = self._index_shard_names(key_indexes[0])
                if named is not None:
                    same_format = {f.name: f for f in files if _weight_format(f) == key[0]}
                    missing = sorted(named - same_format.keys())
                    if missing:
                        refused[key] = (
                            self._relative(str(key_indexes[0])),
                            f"{key_indexes[0].name} names {', '.join(missing[:3])}"
                            f"{' ...' if len(missing) > 3 else ''}, not in the directory "
                            "(an incomplete copy? a model is served only whole)",
                        )
                        continue
                    weights = [same_format[n] for n in sorted(named)]
            if weights:
                chosen[key] = weights + key_indexes
        candidates = chosen.keys() | refused.keys()
        default = next(
            (k for k in (("safetensors", ""), ("pytorch", "")) if k in candidates),
            next(iter(candidates)) if len(candidates) == 1 else None,
        )
        for key, (file, reason) in refused.items():
            suffix = "" if key == default else VARIANT_SEPARATOR + _variant_name(*key)
            self._refuse(model_id + suffix, file, reason)
        return chosen, default

    def _index_shard_names(self, index: Path) -> set[str] | None:
        """The file names an index's ``weight_map`` names, or None when it is not a readable
        index (then the reader refuses it with the rule it breaks)."""
        try:
            if index.stat().st_size > MAX_INDEX_BYTES:
                return None
            weight_map = json.loads(index.read_bytes()).get("weight_map")
        except (OSError, ValueError, AttributeError, RecursionError):
            return None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v == Path(v).name and v not in ("", ".", "..")
            for v in weight_map.values()
        ):
            return None
        return set(weight_map.values())

    def _discover_hub_repo(
        self,
        repo_dir: Path,
        repo_id: str,
        found: dict[str, tuple[str, Path, list[Path]]],
        visiting: tuple[Path, ...],
    ) -> None:
        """A repository of the Hugging Face hub cache (``models--ORG--NAME``): ``ORG/NAME`` is
        the snapshot ``refs/main`` names (without refs, the only snapshot), ``ORG/NAME@REV``
        every snapshot by its commit and every other ref by its name."""
        refs_dir = repo_dir / "refs"
        refs: dict[str, str] = {}
        try:
            snapshots = {
                d.name: d.resolve()
                for d in sorted((repo_dir / "snapshots").iterdir())
                if not d.name.startswith(".") and d.is_dir() and self._inside_root(d)
            }
            for ref in sorted(refs_dir.rglob("*")) if refs_dir.is_dir() else []:
                name = ref.relative_to(refs_dir).as_posix()
                if ref.is_file() and REF_NAME.fullmatch(name) and ref.stat().st_size <= 256:
                    refs[name] = ref.read_text(errors="replace").strip()
        except OSError as e:
            self._refuse(repo_id, self._relative(str(repo_dir)), self._relative(str(e)))
            return
        main = refs.get("main")
        if main is not None and main not in snapshots:
            self._refuse(
                repo_id,
                self._relative(str(refs_dir / "main")),
                f"refs/main names commit {main[:40]!r}, which has no snapshot (an interrupted "
                "download?); download it again",
            )
            main = None
        elif main is None and "main" not in refs and len(snapshots) == 1:
            main = next(iter(snapshots))
        ids = {} if main is None else {repo_id: main}
        ids.update({f"{repo_id}{REVISION_SEPARATOR}{c}": c for c in snapshots})
        ids.update(
            {
                f"{repo_id}{REVISION_SEPARATOR}{ref}": commit
                for ref, commit in refs.items()
                if ref != "main" and commit in snapshots
            }
        )
        for model_id, commit in ids.items():
            snapshot = snapshots[commit]
            if snapshot not in visiting:
                self._discover_tree(snapshot, model_id, found, (*visiting, snapshot))

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
        refused models keep their refusal without being parsed again. Ids that name the same
        files (aliases, hub refs) share one Model's index and mappings."""
        started = time.perf_counter()
        with self._lock:
            self.problems = {}
            found = self.discover()
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
        log.info(
            "catalog: %d models, %d refused, in %.3f s",
            len(self.models),
            len(self.problems),
            time.perf_counter() - started,
        )

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
        try:
            side = self.side_files(path, files, self._model_dirs)
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

    @contextlib.contextmanager
    def using(self, model_id: str) -> Iterator[None]:
        """Hold the model while a stream reads it: nothing to do for a local root (a catalog
        over a node cache keeps the model from eviction)."""
        yield

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

    def get(self, model_id: str, may_read: Callable[[str], bool] | None = None) -> Model:
        """The model, or ModelNotFound. ``may_read`` limits the "did you mean" suggestion
        to ids the caller may see: an error must not reveal what exists beyond a grant."""
        validate_model_id(model_id)
        model = self.models.get(model_id)
        if model is not None:
            return self._fresh(model)
        if model_id in self.variants and model_id not in self.problems:
            model = self._load_variant(model_id)
            if model is not None:
                return model
        problem = self.problems.get(model_id)
        if problem is not None:
            raise ModelUnavailable(f"model {model_id!r} is refused: {problem.reason}")
        msg = f"No model {model_id!r} under the model root."
        visible = [m for m in self.models if may_read is None or may_read(m)]
        close = difflib.get_close_matches(model_id, visible, n=1)
        if close:
            msg += f" Did you mean {close[0]!r}?"
        raise ModelNotFound(msg)
