"""Metadata of a node cache's uncached models without a fill: each weight file as a sparse
image of its size holding only the byte ranges its reader parses (fetched with ranged reads),
a shard index fetched whole, other files as empty images of their size until one is asked
for (then fetched alone, whole and verified as a fill verifies it). The images lie apart from
the cache's data and a local catalog indexes them with the unchanged readers; nothing is
served from them but metadata and the side files fetched whole.

What is read per format: safetensors, the 8-byte length and the JSON header; GGUF, a prefix
that grows (doubling) until the header ends inside it; PyTorch zip, the first bytes, the
central directory, the pickle member and each storage record's local header.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import os
import shutil
import struct
import threading
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from weightserve.client.errors import ModelUnavailable
from weightserve.service.readers.gguf import MAX_HEADER_BYTES as GGUF_MAX_HEADER_BYTES
from weightserve.service.readers.safetensors import MAX_HEADER_BYTES as ST_MAX_HEADER_BYTES
from weightserve.service.sources.files.mapped import MappedFile
from weightserve.service.sources.files.stamps import FileStamp, file_stamp
from weightserve.service.sources.layout import INDEX_NAME, checkpoint_format, hub_repo_file
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.sources.local.discovery import MAX_INDEX_BYTES
from weightserve.service.sources.model import Model, ReadCheck
from weightserve.service.sources.origin.base import FillPlan, Origin, OriginFile
from weightserve.service.sources.revisions.content import (
    REVISION_CHARS,
    DigestStore,
    FileChanged,
    hash_file,
)

# The first read of a safetensors file: the whole header of a small checkpoint; a larger one
# costs a second read of exactly the rest (its length is in the first 8 bytes).
SAFETENSORS_PROBE_BYTES = 4 << 10
# The first prefix of a GGUF file; a tokenizer's vocabulary can make its key-values MBs.
GGUF_PROBE_BYTES = 1 << 20
# The smallest ranged read of a PyTorch zip (its records' headers are a few dozen bytes).
ZIP_READ_BYTES = 4 << 10
RANGE_CONCURRENCY = 8  # ranged reads in flight for one file's scattered headers

ReadRange = Callable[[int, int], bytes]  # (offset, length) -> the bytes there


@dataclass
class HeaderModel(Model):
    """A model as its headers describe it before a fill: index, metadata, files and sizes. Its
    revision, commit and file digests are known only where the origin lists content digests
    (an upstream weightserve); otherwise they are "" until the model is filled. Only the side
    files in ``whole`` (fetched alone, verified) are ever read from it: its weight files are
    mostly holes."""

    digests_known: bool = False
    whole: frozenset[Path] = frozenset()
    # Where the digests are not listed, the commit the origin names otherwise (a published
    # repository's refs/main), "" where none does.
    listed_commit: str = ""

    @property
    def revision(self) -> str:
        return super().revision if self.digests_known else self.listed_commit[:REVISION_CHARS]

    @property
    def revision_known(self) -> bool:
        return True

    @property
    def commit(self) -> str:
        return super().commit if self.digests_known else self.listed_commit

    def revision_digest(self) -> str:
        # Without listed digests the files' digests are unknown: only the listed commit is.
        return super().revision_digest() if self.digests_known else self.listed_commit

    def file_digest(self, path: Path) -> str:
        # A side file fetched whole has its digest, from the origin or from its bytes.
        return super().file_digest(path) if self.digests_known or path in self.whole else ""

    def mapped(self, file: Path) -> MappedFile:
        if file in self.whole:
            return super().mapped(file)
        raise ModelUnavailable(
            f"model {self.id!r}: only its headers are on this node; its bytes are served once "
            "it is filled"
        )


class ListedDigests(DigestStore):
    """The content digests the origin lists (or a side file's, once fetched whole), by image
    path: an image's own bytes are holes."""

    def __init__(self) -> None:
        super().__init__()
        self.listed: dict[Path, str] = {}

    def digest(self, path: Path, stamp: FileStamp) -> str:
        found = self.listed.get(path)
        if found is None:
            raise FileChanged(f"{path.name}: no content digest is known before a fill")
        return found


class HeaderImages:
    """Header images of an origin's models in ``directory`` (emptied at start), indexed by a
    local catalog of that directory; what they cost the origin is counted in its requests
    (``header`` and ``file`` bytes)."""

    def __init__(self, origin: Origin, directory: Path) -> None:
        self.origin = origin
        self.directory = directory
        shutil.rmtree(directory, ignore_errors=True)  # images are cheap to fetch again
        directory.mkdir(parents=True)
        self.directory = directory.resolve()  # as the catalog names its files
        self._digests = ListedDigests()
        self._made: dict[str, tuple[OriginFile, ...]] = {}  # model id -> files it shows
        self._whole: set[Path] = set()  # side files' images that hold every byte, verified
        self._lock = threading.Lock()
        self._catalog = Catalog(self.directory, digests=self._digests, whole_models=self._made.keys)

    def model(
        self,
        model_id: str,
        base: str,
        files: tuple[OriginFile, ...],
        may_read: ReadCheck | None = None,
        side_file: str | None = None,
    ) -> HeaderModel:
        """``model_id`` (of the directory or file model ``base``, whose origin files are
        ``files``) as its headers describe it; images are made once per listing. With
        ``side_file`` (a name relative to the model; never a checkpoint), that file is
        fetched whole first, so it can be served."""
        with self._lock:
            if self._made.get(base) != files:
                self._make(base, files)
            model = self._catalog.get(model_id, may_read)
            wanted = model.repo_files.get(side_file) if side_file is not None else None
            if wanted is not None and wanted.path not in self._whole:
                if checkpoint_format(wanted.name) is not None:
                    raise ValueError(f"{wanted.name} is a checkpoint: its bytes need a fill")
                by_path = {self.directory / f.name: f for f in files}
                self._fetch_whole(by_path[wanted.path], wanted.path)
                self._catalog.scan()
                model = self._catalog.get(model_id, may_read)
        fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(Model)}
        fields = {k: v for k, v in fields.items() if not k.startswith("_")}
        whole = frozenset(self._whole.intersection(model.all_files))
        return HeaderModel(**fields, digests_known=self.origin.lists_content_digests, whole=whole)

    def describes(self, base: str) -> bool:
        """Whether the model's images are made (for its current or an earlier listing)."""
        return base in self._made

    def _fetch_whole(self, file: OriginFile, path: Path) -> None:
        """One file fetched alone and verified as a fill verifies it, renamed over its image;
        its digest is what a fill records: the origin's, or (object storage) its bytes'."""
        partial = path.with_name(f".{path.name}.partial")
        counted = self.origin.requests
        digest = self.origin.fetch(
            file, partial, FillPlan(on_bytes=lambda n: counted.received("file", n))
        )
        if digest is None:
            digest = hash_file(partial, file_stamp(os.stat(partial)))
        self._digests.listed[path] = digest
        os.replace(partial, path)
        self._whole.add(path)

    def _make(self, base: str, files: tuple[OriginFile, ...]) -> None:
        """Write the images of one model's files (under the lock) and index them; GGUF
        prefixes grow (doubling) until each header ends inside what was fetched."""
        self._made.pop(base, None)
        gguf: dict[OriginFile, bytes] = {}  # each GGUF file's prefix fetched so far
        for file in files:
            _checked(file.name)
            path = self.directory / file.name
            if self.origin.lists_content_digests:
                self._digests.listed[path] = file.version
            else:
                self._digests.listed.pop(path, None)  # known once fetched whole
            pieces = self._pieces(file)
            self._whole.discard(path)  # a new listing: a side file is fetched again
            if checkpoint_format(file.name) == "gguf":
                gguf[file] = pieces[0][1] if pieces else b""
            write_image(path, file.size, pieces)
        self._made[base] = files
        while True:
            self._catalog.scan()
            grow = [
                f for f, head in gguf.items()
                if len(head) < min(f.size, GGUF_MAX_HEADER_BYTES)
                and not self._header_inside(base, self.directory / f.name, len(head))
            ]  # fmt: skip
            if not grow:
                return
            for file in grow:
                head = gguf[file]
                end = min(file.size, 2 * len(head))
                gguf[file] = head + self._read(file)(len(head), end - len(head))
                write_image(self.directory / file.name, file.size, [(0, gguf[file])])

    def _header_inside(self, base: str, path: Path, fetched: int) -> bool:
        """Whether the indexed GGUF file's tensor data begins within its fetched prefix, so
        every header byte the reader parsed was a fetched one (not a hole)."""
        models = [m for i, m in self._catalog.models.items() if i == base]
        offsets = [e.offset for m in models for e in m.tensors.values() if e.file == path]
        return bool(offsets) and min(offsets) <= fetched

    def _read(self, file: OriginFile) -> ReadRange:
        def read(offset: int, length: int) -> bytes:
            if length <= 0:
                return b""
            data = self.origin.read_range(file, offset, length)
            self.origin.requests.received("header", len(data))
            return data

        return read

    def _pieces(self, file: OriginFile) -> list[tuple[int, bytes]]:
        """What the image of one file holds: (offset, bytes) fetched from the origin."""
        read = self._read(file)
        fmt = checkpoint_format(file.name)
        repository = hub_repo_file(file.name)
        if repository is not None and repository.rest.startswith("refs/") and file.size <= 256:
            return [(0, read(0, file.size))]  # a published repository's ref names its snapshot
        if INDEX_NAME.fullmatch(PurePosixPath(file.name).name):
            return [(0, read(0, file.size))] if file.size <= MAX_INDEX_BYTES else []
        if fmt == "safetensors":
            return [(0, safetensors_header(read, file.size))]
        if fmt == "gguf":
            return [(0, read(0, min(file.size, GGUF_PROBE_BYTES)))]
        if fmt == "pytorch":
            return zip_headers(read, file.size)
        return []  # a side file: its name and size are all metadata needs


def _checked(name: str) -> None:
    parts = name.split("/")
    if "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise ModelUnavailable(f"file name {name!r} from the origin is not a plain relative path")


def write_image(path: Path, size: int, pieces: Iterable[tuple[int, bytes]]) -> None:
    """A sparse file of ``size`` bytes holding ``pieces`` (offset, bytes), renamed into place
    whole (a hidden name until then, which discovery skips)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as f:
        f.truncate(size)
        for offset, data in pieces:
            f.seek(offset)
            f.write(data)
    os.replace(partial, path)


def safetensors_header(read: ReadRange, size: int) -> bytes:
    """The 8-byte length and the JSON header (or as much as the file has of them)."""
    head = read(0, min(size, SAFETENSORS_PROBE_BYTES))
    if len(head) < 8:
        return head
    (header_len,) = struct.unpack("<Q", head[:8])
    end = min(size, 8 + min(header_len, ST_MAX_HEADER_BYTES))
    if end > len(head):
        head += read(len(head), end - len(head))
    return head


class _RangeFile(io.RawIOBase):
    """A read-only file of ``size`` bytes whose reads are ranged reads, each remembered: what
    ``zipfile`` touches while it parses the archive's directory and pickle."""

    def __init__(self, read: ReadRange, size: int) -> None:
        self._read, self._size, self._pos = read, size, 0
        self.pieces: list[tuple[int, bytes]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = min(len(buffer), self._size - self._pos)
        if want <= 0:
            return 0
        data = self.fetch(self._pos, want)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def fetch(self, offset: int, length: int) -> bytes:
        for start, data in self.pieces:  # zipfile reads some places twice
            if start <= offset and offset + length <= start + len(data):
                return data[offset - start : offset - start + length]
        data = self._read(offset, max(length, min(ZIP_READ_BYTES, self._size - offset)))
        self.pieces.append((offset, data))
        return data[:length]


def zip_headers(read: ReadRange, size: int) -> list[tuple[int, bytes]]:
    """The ranges the PyTorch reader parses: the first 512 bytes, the end records and central
    directory, the small members (the pickle), and each storage record's local header. An
    archive zipfile cannot open keeps what was read: the reader then names the rule."""
    source = _RangeFile(read, size)
    source.fetch(0, min(size, 512))
    try:
        archive = zipfile.ZipFile(source)  # type: ignore[arg-type]
        members = archive.infolist()
        for info in members:
            if "/data/" not in f"/{info.filename}":
                with archive.open(info) as member:  # the pickle, version, byte order
                    member.read(MAX_INDEX_BYTES)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return source.pieces

    def local_header(info: zipfile.ZipInfo) -> tuple[int, bytes]:
        length = min(30 + len(info.orig_filename.encode()) + 64, size - info.header_offset)
        return info.header_offset, read(info.header_offset, max(0, length))

    records = [i for i in members if "/data/" in f"/{i.filename}"]
    with concurrent.futures.ThreadPoolExecutor(RANGE_CONCURRENCY) as pool:
        return [*source.pieces, *pool.map(local_header, records)]
