"""``weightserve pull``: a model's original files into a directory, or its tensors converted
into one safetensors file.

The faithful pull (``download_files``) writes every file of the model's repository (weights,
index, config, tokenizer...) byte for byte, each verified against the server's digest and
renamed into place only when whole. What arrived stays in ``NAME.partial``; the next run
asks only for the rest, pinned to the same file content (``.weightserve-pull.json`` in the
directory remembers which).

The conversion (``pull_to_safetensors``) writes the file's header first from the model
index, then receives every chunk straight into its place in the memory-mapped output file:
memory stays flat whatever the model's size, and the result opens with
``safetensors.safe_open``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import xxhash

from weightserve.client._client import RemoteModel
from weightserve.client._models import RemoteFile
from weightserve.client._retry import Backoff, OnWait, call_with_retry, retry_reason
from weightserve.client.errors import DataCorruption, TransportError, WeightserveError
from weightserve.client.wire.dtypes import wire_dtype
from weightserve.client.wire.schema import ChunkHeader

_ALIGN = 8  # safetensors pads the header so tensor data starts 8-byte aligned
STATE_FILE = ".weightserve-pull.json"  # which file content each .partial holds
PARTIAL_SUFFIX = ".partial"
_BLOCK = 1 << 20  # bytes per read from the server and per write


class DestinationError(WeightserveError):
    """The pull's destination cannot take the files: not a directory, not writable, full,
    or holding different files of the same names (overwrite with ``force``)."""


class ConversionRefused(WeightserveError):
    """A model whose format does not convert to safetensors faithfully (GGUF)."""


def source_metadata(model: RemoteModel) -> dict[str, str]:
    """The ``__metadata__`` a converted file keeps: a safetensors source's own, exactly
    (``format: pt`` included, which transformers requires); ``format: pt`` for PyTorch."""
    fmt = model.info.format
    if fmt == "safetensors":
        return {str(k): str(v) for k, v in model.info.metadata.items()}
    if fmt == "pytorch":
        return {"format": "pt"}
    raise ConversionRefused(
        f"model {model.id!r} is {fmt}: its {fmt} metadata and block types do not fit a "
        "safetensors file; pull its original files instead (without --to)"
    )


def safetensors_header(model: RemoteModel, names: list[str]) -> tuple[bytes, dict[str, int]]:
    """The header bytes (length prefix included) and each tensor's offset in the file."""
    header: dict[str, object] = {}
    offsets: dict[str, int] = {}
    position = 0
    for name in names:
        t = model.tensors[name]
        code = wire_dtype(t.dtype).safetensors
        if code is None:
            raise ConversionRefused(
                f"tensor {name!r}: dtype {t.dtype} has no safetensors code; pull the original "
                "files instead (without --to)"
            )
        header[name] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [position, position + t.nbytes],
        }
        offsets[name] = position
        position += t.nbytes
    header["__metadata__"] = source_metadata(model)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    data_start = 8 + len(raw)
    return len(raw).to_bytes(8, "little") + raw, {n: data_start + o for n, o in offsets.items()}


def pull_to_safetensors(
    model: RemoteModel,
    out: Path,
    prefix: str = "",
    on_bytes: Callable[[int], None] | None = None,
    on_wait: OnWait | None = None,
    force: bool = False,
) -> Path:
    """The model's tensors under ``prefix`` as one safetensors file ``out``, keeping the
    source's metadata (``source_metadata``); GGUF models are refused."""
    source_metadata(model)  # refuses a format that does not convert, before any file
    names = model.names(prefix)
    if not names:
        raise ValueError(f"model {model.id!r} has no tensor whose name starts with {prefix!r}")
    header, offsets = safetensors_header(model, names)
    total = len(header) + sum(model.tensors[n].nbytes for n in names)
    _prepare_destination(out.parent)
    if out.exists() and not force:
        raise DestinationError(f"{out} exists; pass --force (force=True) to overwrite it")
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    try:
        _convert_into(model, names, header, offsets, total, partial, on_bytes, on_wait)
        os.replace(partial, out)  # a half-written pull never looks like a finished one
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise _destination_error(e, partial) from e
    except BaseException:
        # Tensors land anywhere in the file: a broken conversion has nothing to resume.
        partial.unlink(missing_ok=True)
        raise
    return out


def _convert_into(
    model: RemoteModel,
    names: list[str],
    header: bytes,
    offsets: dict[str, int],
    total: int,
    partial: Path,
    on_bytes: Callable[[int], None] | None,
    on_wait: OnWait | None,
) -> None:
    with open(partial, "w+b") as f:
        f.truncate(total)
        f.write(header)
        mapped = mmap.mmap(f.fileno(), total) if total else None

        def place(h: ChunkHeader) -> np.ndarray:
            assert mapped is not None
            start = offsets[h.name]
            return np.frombuffer(mapped, dtype=np.uint8, count=h.total_bytes, offset=start)

        try:
            model.fetch(
                names, on_bytes=on_bytes, allocate=place if mapped else None, on_wait=on_wait
            )
            if mapped is not None:
                mapped.flush()
        finally:
            if mapped is not None:
                # Views may still be alive; the map then closes when they go.
                with contextlib.suppress(BufferError):
                    mapped.close()


# ---------------------------------------------------------------------- faithful pull
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

    model: RemoteModel
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

    def plan(self) -> FilePull:
        client = self.model.client
        listing = call_with_retry(
            lambda: client.transport.list_files(self.model.id),
            client.retry_seconds,
            f"{client.address.url} files of {self.model.id!r}",
            client.on_wait,
        )
        self.revision = str(listing["revision"])
        remote = [RemoteFile.from_json(f) for f in listing["files"]]
        dest = _prepare_destination(self.dest)
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
                if target.stat().st_size == f.size and _file_digest(target) == f.etag:
                    p.keep, p.have = True, f.size
                else:
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
    ) -> Path:
        if self.files is None:
            self.plan()
        assert self.files is not None
        dest = self.dest
        todo = [p for p in self.files if not p.keep]
        # Written before any byte: the next run resumes a .partial only for the same content.
        _write_state(dest, self.model.id, {p.file.name: p.file.etag for p in todo})
        for p in todo:
            self._fetch(p, on_bytes, on_wait or self.model.client.on_wait)
        with contextlib.suppress(FileNotFoundError):
            (dest / STATE_FILE).unlink()
        return dest

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
            raise _destination_error(e, partial) from e
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
                        reason = retry_reason(e)
                        if reason is None:
                            raise
                        delay = backoff.wait_or_raise(e)
                        if on_wait is not None:
                            on_wait(reason, delay)
                        time.sleep(delay)
                    finally:
                        if source is not None:
                            source.close()
                f.flush()
                os.fsync(f.fileno())  # whole on disk before it gets its final name
            except OSError as e:
                raise _destination_error(e, partial, size - offset) from e
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
            raise _destination_error(e, p.target) from e


def download_files(
    model: RemoteModel,
    dest: Path,
    *,
    force: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    on_wait: OnWait | None = None,
) -> Path:
    """Write every file of the model's repository under ``dest``, byte-identical and
    verified; see ``RemoteModel.download``."""
    return FilePull(model, Path(dest), force).plan().run(on_bytes, on_wait)


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
            "relative name inside a directory; refusing to write it"
        )
    return PurePosixPath(*parts)


def _prepare_destination(dest: Path) -> Path:
    if dest.exists() and not dest.is_dir():
        raise DestinationError(
            f"{dest} exists and is not a directory; give --out a directory (created when missing)"
        )
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _destination_error(e, dest) from e
    if not os.access(dest, os.W_OK | os.X_OK):
        raise DestinationError(f"{dest} is not writable; choose another --out or fix its mode")
    return dest


def _destination_error(e: OSError, path: Path, missing: int | None = None) -> DestinationError:
    if e.errno == errno.ENOSPC:
        left = f" ({missing} bytes still to come)" if missing else ""
        return DestinationError(
            f"no space left on the device writing {path}{left}; free space and run the pull "
            "again: it goes on where it stopped"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DestinationError(f"cannot write {path}: {e.strerror}; choose another --out")
    return DestinationError(f"cannot write {path}: {e.strerror or e}")


def _file_digest(path: Path) -> str:
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(8 * _BLOCK):
            hasher.update(block)
    return hasher.hexdigest()


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
        raise _destination_error(e, path) from e
