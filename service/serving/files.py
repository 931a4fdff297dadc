"""A model's repository files as bytes: lookup by name, byte ranges, chunks from the mmap.

The files API (HTTP ``/v1/models/ID/-/files``, gRPC ``ListFiles``/``ReadFile``) and the
Hub-compatible routes share this: which model answers a listing or a file without a fill
where it can, which names a model serves (``Model.repo_files``), which bytes a ``Range`` asks
for, and the bytes themselves as views of the shared mapping, each checked against the
indexed file version before it is handed out.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from weightserve.client.errors import FileNotFound, RangeNotSatisfiable, RevisionMismatch
from weightserve.client.wire.hints import did_you_mean
from weightserve.service.serving.auth import Access
from weightserve.service.serving.state import ServiceState
from weightserve.service.sources.model import Model, RepoFile
from weightserve.service.sources.revisions.pinning import names_content

# Largest piece handed to a transport at once (a gRPC FileChunk; an HTTP write).
FILE_CHUNK_BYTES = 2 << 20


def listed_model(state: ServiceState, access: Access, model_id: str) -> Model:
    """The model a files listing names: a node cache's uncached model described from its
    header images, no fill, where the listing's commit and ETags are known before a fill (an
    upstream weightserve origin lists content digests). Elsewhere (object storage) the model
    is filled first: a pull and a lower tier verify each file against the ETag listed."""
    described = state.readable_metadata(access, model_id)
    return described if described.commit else state.readable_model(access, model_id)


def file_model(
    state: ServiceState, access: Access, model_id: str, name: str, revision: str | None
) -> Model:
    """The model that serves its file ``name``: a node cache fetches an uncached model's side
    file alone and fills the model for a checkpoint's bytes. A ``revision`` to check against
    needs the model's commit, which object storage tells once the model is filled."""
    described = state.readable_metadata(access, model_id, file=name)
    if revision and not described.commit:
        return state.readable_model(access, model_id)
    return described


def file_list(model: Model) -> dict:
    """The files API's listing: every file of the model's repository with size and ETag."""
    return {
        "id": model.id,
        "revision": model.revision,
        "commit": model.commit,
        "files": [
            {"name": f.name, "size": f.size, "etag": model.file_digest(f.path)}
            for f in model.repo_files.values()
        ],
    }


def repo_file(model: Model, name: str) -> RepoFile:
    """The file ``name`` (relative to the model, ``/``-separated), or FileNotFound."""
    files = model.repo_files
    found = files.get(name)
    if found is not None:
        return found
    message = f"No file {name!r} in model {model.id!r}.{did_you_mean(name, files)}"
    raise FileNotFound(message + " The model's files are listed at its files route.")


def check_revision(model: Model, revision: str | None) -> None:
    """RevisionMismatch unless ``revision`` (the revision, the commit or a prefix of them,
    ``names_content``) is what the model is now, so a resumed download never joins bytes of
    two versions."""
    if revision and not names_content(model, revision):
        raise RevisionMismatch(
            f"model {model.id!r} is at revision {model.revision} (commit {model.commit}), the "
            f"request names {revision}; download the file again from the start"
        )


@dataclass(frozen=True)
class ByteRange:
    start: int
    stop: int  # exclusive

    @property
    def length(self) -> int:
        return self.stop - self.start

    def content_range(self, size: int) -> str:
        return f"bytes {self.start}-{self.stop - 1}/{size}"


_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def parse_range(header: str | None, size: int) -> ByteRange | None:
    """The one byte range an HTTP ``Range`` header asks for (``a-b``, ``a-``, ``-n``), or None
    for the whole file: no header, several ranges or a malformed one (RFC 9110 lets a server
    ignore those and answer 200). RangeNotSatisfiable when it starts at or past the end."""
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip().replace(" ", ""))
    if match is None:
        return None
    first, last = match.groups()
    if not first:
        if not last:
            return None
        suffix = int(last)
        if suffix == 0:
            raise RangeNotSatisfiable(f"range {header!r}: an empty suffix of a {size}-byte file")
        return ByteRange(max(0, size - suffix), size)
    start = int(first)
    stop = min(int(last) + 1, size) if last else size
    if last and int(last) < start:
        return None  # invalid: ignored, as RFC 9110 says
    if start >= size:
        raise RangeNotSatisfiable(
            f"range {header!r} starts at byte {start}, the file has {size} bytes"
        )
    return ByteRange(start, stop)


def etag_matches(header: str | None, etag: str) -> bool:
    """Whether an ``If-None-Match`` list names ``etag`` (weak or strong, or ``*``)."""
    if not header:
        return False
    for candidate in header.split(","):
        candidate = candidate.strip()
        if candidate == "*" or candidate.removeprefix("W/").strip('"') == etag:
            return True
    return False


def file_range(model: Model, file: RepoFile, offset: int, length: int | None) -> ByteRange:
    """``length`` bytes from ``offset`` (None or past the end: to the end); RangeNotSatisfiable
    when ``offset`` is past the end (at the end is an empty range: a finished download)."""
    if offset < 0 or (length is not None and length < 0):
        raise RangeNotSatisfiable(f"offset {offset} and length {length} must be >= 0")
    if offset > file.size:
        raise RangeNotSatisfiable(
            f"offset {offset} is past the end of {file.name!r} of model {model.id!r} "
            f"({file.size} bytes)"
        )
    stop = file.size if length is None else min(file.size, offset + length)
    return ByteRange(offset, stop)


def pin_file(model: Model, file: RepoFile) -> None:
    """Map the file now (as a stream pins its files), so it is read as it is when the request
    is answered and a file replaced since indexing fails with a status, not mid-body."""
    model.pin([file.path])


def file_chunks(
    model: Model, file: RepoFile, byte_range: ByteRange, chunk_bytes: int = FILE_CHUNK_BYTES
) -> Iterator[memoryview]:
    """The range's bytes as views of the shared mapping, at most ``chunk_bytes`` each.

    Each piece is checked against the version the request started with before it is handed
    out (a truncated page read is SIGBUS; an in-place overwrite would mix two versions):
    ModelUnavailable then ends the transfer, and the client's digest check catches the rest.
    """
    mapped = model.mapped(file.path)
    whole = mapped.view()
    offset = byte_range.start
    while offset < byte_range.stop:
        end = min(offset + chunk_bytes, byte_range.stop)
        mapped.ensure_unchanged(end)
        yield whole[offset:end]
        offset = end
