"""Where published revisions are kept, in the Hugging Face hub cache's layout: a local root
(``DirectoryStore``) or an object-store bucket (``BucketStore``), the durable source of truth
every node over it follows.

A repository folder (``models--ORG--NAME``) holds ``snapshots/COMMIT/`` (the revision's
files), ``.revisions/COMMIT.json`` (its record) and ``refs/main`` (the commit that is main).
Writes go in that order, ``refs/main`` last and whole (a rename on a disk; one PUT in a
bucket, which S3 applies atomically), so a reader never sees main name an incomplete revision.
Under a local root, ``.revisions/deltas/BASE..TARGET.delta`` keeps the delta stream's patches
between two revisions (``KeptDeltas``), computed once and bounded by the revisions they join.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import shutil
import struct
import time
import uuid
from pathlib import Path
from typing import IO, Any, Protocol

import pyarrow.fs as pafs
import xxhash

from weightserve.client.errors import InvalidRequest
from weightserve.client.wire.delta import PATCH, parse_header
from weightserve.client.wire.delta_plan import DeltaEntry, header_line
from weightserve.service.sources.files.stamps import sync_path
from weightserve.service.sources.model import Model

log = logging.getLogger("weightserve.publish")

INCOMING_PREFIX = ".incoming-"
# A snapshot being removed is first renamed to this (hidden: never listed or served), then
# deleted; what a killed process left so is deleted at the next start.
REMOVING_PREFIX = ".removing-"
# Tests only: seconds to wait after each file a removal deletes, so that a test can kill the
# server in the middle of one. Never set in a deployment.
REMOVAL_PAUSE_VARIABLE = "WEIGHTSERVE_TEST_REMOVAL_PAUSE"
RECORDS_DIR = ".revisions"
COPY_BLOCK = 8 << 20
DELTAS_DIR = "deltas"  # under RECORDS_DIR: BASE..TARGET.delta, one file per pair
DELTA_SUFFIX = ".delta"
DELTA_FORMAT = "weightserve-kept-delta/1"
FOOTER_SIZE = "<Q"  # the file ends with its last line's length, so it is found from the end


class RevisionStore(Protocol):
    description: str

    def staging(self, folder: str) -> Path:
        """A local directory for one upload, on the file system its revision will live on
        where that is local (a rename then moves it into place)."""
        ...

    def leftovers(self) -> list[Path]:
        """What uploads of a previous process left behind (it was killed mid-publish)."""
        ...

    def holds(self, folder: str, commit: str) -> bool: ...

    def written(self, folder: str, commit: str | None = None) -> bool:
        """Whether weightserve wrote the repository (any revision of it: its ``.revisions/``
        record), or the revision ``commit`` of it. A repository it did not write (a Hugging
        Face cache) is never published into nor trimmed by retention."""
        ...

    def exists(self, folder: str) -> bool:
        """Whether the repository folder holds anything (a ref or a snapshot)."""
        ...

    def put(self, folder: str, commit: str, files: Path, record: dict[str, Any]) -> None:
        """Store the revision's files (the directory ``files``) and its record."""
        ...

    def set_main(self, folder: str, commit: str) -> None: ...

    def main(self, folder: str) -> str | None: ...

    def commits(self, folder: str) -> list[str]:
        """Every revision the repository holds."""
        ...

    def record(self, folder: str, commit: str) -> dict[str, Any] | None: ...

    def remove(self, folder: str, commit: str) -> None:
        """Stop listing and serving the revision at once, then delete its files: a process
        killed in between leaves nothing served (``repair`` finishes the job)."""
        ...

    def repair(self) -> list[tuple[str, str]]:
        """At startup: delete what a killed removal left, and every snapshot (but ``main``)
        that holds fewer bytes than its record says (partly removed by an older version);
        the (folder, commit) pairs so removed."""
        ...

    def read_note(self, folder: str, name: str) -> str | None:
        """``.revisions/NAME`` of the repository (a small state file), None when absent."""
        ...

    def write_note(self, folder: str, name: str, text: str) -> None:
        """Replace ``.revisions/NAME`` whole."""
        ...


class DirectoryStore:
    """Revisions under a local root, served by the root's catalog as a hub cache."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.description = str(root)
        self.deltas = KeptDeltas(root)

    def staging(self, folder: str) -> Path:
        return self.root / folder / "snapshots" / f"{INCOMING_PREFIX}{uuid.uuid4().hex}"

    def leftovers(self) -> list[Path]:
        return list(self.root.glob(f"**/models--*/snapshots/{INCOMING_PREFIX}*"))

    def holds(self, folder: str, commit: str) -> bool:
        return (self.root / folder / "snapshots" / commit).is_dir()

    def written(self, folder: str, commit: str | None = None) -> bool:
        records = self.root / folder / RECORDS_DIR
        if commit is not None:
            return (records / f"{commit}.json").is_file()
        return records.is_dir() and any(records.glob("*.json"))

    def exists(self, folder: str) -> bool:
        # Hidden entries (an upload's staging, a removal under way) are weightserve's own
        # work in progress, not another tool's snapshots.
        if (self.root / folder / "refs").exists():
            return True
        snapshots = self.root / folder / "snapshots"
        return snapshots.is_dir() and any(
            not entry.name.startswith(".") for entry in snapshots.iterdir()
        )

    def put(self, folder: str, commit: str, files: Path, record: dict[str, Any]) -> None:
        # The files were synced as they were written; their directory entries (renamed and
        # linked files among them) are made durable before the snapshot's rename, and the
        # rename before the record and refs/main name it.
        for directory, _, _ in sorted(os.walk(files), key=lambda d: -len(d[0])):
            sync_path(Path(directory))
        os.rename(files, self.root / folder / "snapshots" / commit)
        sync_path(self.root / folder / "snapshots")
        write_atomically(self.root / folder / RECORDS_DIR / f"{commit}.json", json.dumps(record))

    def set_main(self, folder: str, commit: str) -> None:
        write_atomically(self.root / folder / "refs" / "main", commit)

    def main(self, folder: str) -> str | None:
        with contextlib.suppress(OSError):
            return (self.root / folder / "refs" / "main").read_text().strip() or None
        return None

    def commits(self, folder: str) -> list[str]:
        snapshots = self.root / folder / "snapshots"
        if not snapshots.is_dir():
            return []
        return [d.name for d in snapshots.iterdir() if not d.name.startswith(".")]

    def record(self, folder: str, commit: str) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            found = json.loads((self.root / folder / RECORDS_DIR / f"{commit}.json").read_text())
            return found if isinstance(found, dict) else None
        with contextlib.suppress(OSError):  # a snapshot without a record: what is known
            created = (self.root / folder / "snapshots" / commit).stat().st_mtime
            return revision_record(commit, created=created)
        return None

    def remove(self, folder: str, commit: str) -> None:
        snapshot = self.root / folder / "snapshots" / commit
        doomed = snapshot.with_name(f"{REMOVING_PREFIX}{commit}-{uuid.uuid4().hex}")
        try:
            os.rename(snapshot, doomed)  # one step: served whole before, never after
            sync_path(snapshot.parent)
        except FileNotFoundError:
            doomed = snapshot  # nothing there (removed already)
        with contextlib.suppress(FileNotFoundError):
            (self.root / folder / RECORDS_DIR / f"{commit}.json").unlink()
        self.deltas.remove(self.root / folder, commit)
        delete_tree(doomed)

    def repair(self) -> list[tuple[str, str]]:
        for leftover in self.root.glob(f"**/models--*/snapshots/{REMOVING_PREFIX}*"):
            delete_tree(leftover)
            log.info("finished a removal a previous run left unfinished: %s", leftover.name)
        removed = []
        for records in self.root.glob(f"**/models--*/{RECORDS_DIR}"):
            folder = records.parent.relative_to(self.root).as_posix()
            main = self.main(folder)
            for commit in self.commits(folder):
                if commit != main and self._partly_removed(folder, commit):
                    log.warning(
                        "revision %s of %s holds fewer bytes than its record: partly removed "
                        "by a previous run, removed now", commit[:16], folder,
                    )  # fmt: skip
                    self.remove(folder, commit)
                    removed.append((folder, commit))
        return removed

    def _partly_removed(self, folder: str, commit: str) -> bool:
        """Fewer bytes on disk than the record counted (its files' sizes): a file is gone. A
        snapshot without a record is not one weightserve wrote, and is left as it is."""
        try:
            record = json.loads((self.root / folder / RECORDS_DIR / f"{commit}.json").read_text())
            recorded = int(record["bytes"])
        except (OSError, ValueError, TypeError, KeyError):
            return False
        here = 0
        for dirpath, _, filenames in os.walk(self.root / folder / "snapshots" / commit):
            for name in filenames:
                with contextlib.suppress(OSError):
                    here += os.stat(os.path.join(dirpath, name)).st_size
        return here < recorded

    def read_note(self, folder: str, name: str) -> str | None:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            return (self.root / folder / RECORDS_DIR / name).read_text()
        return None

    def write_note(self, folder: str, name: str, text: str) -> None:
        write_atomically(self.root / folder / RECORDS_DIR / name, text)


class BucketStore:
    """Revisions written into the bucket a node cache serves (``pyarrow.fs``: S3, GCS): the
    upload is checked in a local staging directory, then its objects are put, the record,
    and ``refs/main`` last. Every node over the bucket (this one included) serves the
    revision once its rescan sees the pointer name it (``origin.hub_repo_models``)."""

    def __init__(self, fs: pafs.FileSystem, prefix: str, staging: Path, description: str) -> None:
        self.fs = fs
        self.prefix = prefix.rstrip("/")
        self._staging = staging
        self.description = description

    def _key(self, folder: str, *rest: str) -> str:
        return "/".join(p for p in (self.prefix, folder, *rest) if p)

    def staging(self, folder: str) -> Path:
        return self._staging / f"{INCOMING_PREFIX}{uuid.uuid4().hex}"

    def leftovers(self) -> list[Path]:
        return list(self._staging.glob(f"{INCOMING_PREFIX}*")) if self._staging.is_dir() else []

    def holds(self, folder: str, commit: str) -> bool:
        return commit in self.commits(folder)

    def written(self, folder: str, commit: str | None = None) -> bool:
        commits = self.commits(folder)  # a bucket's revisions are listed by their records
        return bool(commits) if commit is None else commit in commits

    def exists(self, folder: str) -> bool:
        if self.main(folder) is not None:
            return True
        selector = pafs.FileSelector(self._key(folder, "snapshots"), allow_not_found=True)
        return bool(self.fs.get_file_info(selector))

    def put(self, folder: str, commit: str, files: Path, record: dict[str, Any]) -> None:
        for path in sorted(p for p in files.rglob("*") if p.is_file()):
            key = self._key(folder, "snapshots", commit, path.relative_to(files).as_posix())
            with open(path, "rb") as source, self.fs.open_output_stream(key) as out:
                while block := source.read(COPY_BLOCK):
                    out.write(block)
        self._put_text(self._key(folder, RECORDS_DIR, f"{commit}.json"), json.dumps(record))

    def set_main(self, folder: str, commit: str) -> None:
        self._put_text(self._key(folder, "refs", "main"), commit)

    def _put_text(self, key: str, text: str) -> None:
        with self.fs.open_output_stream(key) as out:
            out.write(text.encode())

    def _get_text(self, key: str) -> str | None:
        with contextlib.suppress(OSError), self.fs.open_input_stream(key) as source:
            return bytes(source.read()).decode()  # FileNotFoundError (an OSError): None
        return None

    def main(self, folder: str) -> str | None:
        found = self._get_text(self._key(folder, "refs", "main"))
        return found.strip() or None if found is not None else None

    def commits(self, folder: str) -> list[str]:
        selector = pafs.FileSelector(self._key(folder, RECORDS_DIR), allow_not_found=True)
        return [
            info.base_name.removesuffix(".json")
            for info in self.fs.get_file_info(selector)
            if info.base_name.endswith(".json")
        ]

    def record(self, folder: str, commit: str) -> dict[str, Any] | None:
        text = self._get_text(self._key(folder, RECORDS_DIR, f"{commit}.json"))
        with contextlib.suppress(ValueError):
            found = json.loads(text) if text is not None else None
            return found if isinstance(found, dict) else None
        return None

    def remove(self, folder: str, commit: str) -> None:
        # The record first: revisions are listed by their records, so the revision is gone
        # from every listing before any of its objects is.
        with contextlib.suppress(OSError):
            self.fs.delete_file(self._key(folder, RECORDS_DIR, f"{commit}.json"))
        with contextlib.suppress(OSError):
            self.fs.delete_dir(self._key(folder, "snapshots", commit))

    def repair(self) -> list[tuple[str, str]]:
        return []  # a removal deletes the record first: a killed one leaves nothing listed

    def read_note(self, folder: str, name: str) -> str | None:
        with contextlib.suppress(UnicodeDecodeError):
            return self._get_text(self._key(folder, RECORDS_DIR, name))
        return None

    def write_note(self, folder: str, name: str, text: str) -> None:
        self._put_text(self._key(folder, RECORDS_DIR, name), text)


class KeptDeltas:
    """The delta stream's patches between two published revisions of a local root, kept beside
    them so that a restarted server serves them without diffing again.

    One file per (base, target) pair, ``REPO/.revisions/deltas/BASE..TARGET.delta``: a first
    line naming the format and the pair, then per tensor of the target its delta header line
    and, for a patch, its positions and values (a whole tensor's bytes are the target's own
    file: its header only), then a last line with the tensor count, the bytes before it and
    their xxh3-128, and that line's length (8 bytes, little-endian). Written aside and renamed
    whole; one that does not check out is removed (and computed again). The files into one
    revision together take at most that revision's bytes (the least recently used dropped
    first), and a revision's retention removes the files from and to it: deltas never take
    more disk than the revisions they join.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._remove_leftovers()

    def pair(self, base: Model, target: Model) -> Path | None:
        """Where the pair's file is kept: None unless both are published revisions of one
        repository under the root (a plain model's patches are kept in memory only)."""
        snapshots = target.path.parent
        if (
            snapshots.name != "snapshots"
            or base.path.parent != snapshots
            or snapshots.parent.parent != self.root
            or target.path.name != target.commit
            or base.path.name != base.commit
            or base.commit == target.commit
        ):
            return None
        records = snapshots.parent / RECORDS_DIR
        if not all((records / f"{c}.json").is_file() for c in (base.commit, target.commit)):
            return None
        return records / DELTAS_DIR / f"{base.commit}..{target.commit}{DELTA_SUFFIX}"

    def load(self, path: Path) -> tuple[tuple[int, int], dict[str, DeltaEntry]] | None:
        """The pair's entries by tensor name, their payloads views of the file's mapping, with
        the file's identity (inode, size); None when it is not kept. A file that does not
        check out (cut short, changed, another pair's) is removed: the pair is computed again."""
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                mapping = (
                    mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if stat.st_size else None
                )
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("kept delta %s cannot be read (%s): computed again", path.name, e)
            return None
        try:
            if mapping is None:
                raise ValueError("the file is empty")
            entries = _parse_kept(mapping, path.name.removesuffix(DELTA_SUFFIX).split(".."))
        except (ValueError, KeyError, TypeError, AttributeError, struct.error, InvalidRequest) as e:
            log.warning("kept delta %s removed, computed again: %s", path.name, e)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: the bound drops the least recently used first
        return (stat.st_ino, stat.st_size), entries

    def writer(self, path: Path) -> KeptDeltaWriter:
        path.parent.mkdir(parents=True, exist_ok=True)
        return KeptDeltaWriter(path)

    def keep(self, writer: KeptDeltaWriter, limit_bytes: int) -> None:
        """Finish the pair's file and put it in place; then hold the files into its target to
        ``limit_bytes``. A file whose revisions went meanwhile (retention) goes too."""
        path = writer.finish()
        base, target = path.name.removesuffix(DELTA_SUFFIX).split("..")
        snapshots = path.parent.parent.parent / "snapshots"
        if not ((snapshots / base).is_dir() and (snapshots / target).is_dir()):
            path.unlink(missing_ok=True)
            return
        kept = []
        for other in path.parent.glob(f"*..{target}{DELTA_SUFFIX}"):
            with contextlib.suppress(OSError):
                stat = other.stat()
                kept.append((stat.st_mtime_ns, stat.st_size, other))
        total = sum(size for _, size, _ in kept)
        for _, size, other in sorted(kept, key=lambda k: (k[0], k[2] == path)):
            if total <= limit_bytes:
                break
            other.unlink(missing_ok=True)
            total -= size
            log.info("kept delta %s dropped: the deltas into %s are held to its %d bytes",
                     other.name, target[:16], limit_bytes)  # fmt: skip

    def remove(self, repository: Path, commit: str) -> None:
        """The files from and to ``commit`` (retention removed it)."""
        deltas = repository / RECORDS_DIR / DELTAS_DIR
        for pattern in (f"{commit}..*{DELTA_SUFFIX}", f"*..{commit}{DELTA_SUFFIX}"):
            for path in deltas.glob(pattern):
                path.unlink(missing_ok=True)

    def _remove_leftovers(self) -> None:
        """Files a killed process was writing, and pairs whose revisions are gone."""
        for deltas in self.root.glob(f"models--*/{RECORDS_DIR}/{DELTAS_DIR}"):
            snapshots = deltas.parent.parent / "snapshots"
            for path in deltas.iterdir():
                pair = path.name.removesuffix(DELTA_SUFFIX).split("..")
                if path.name.startswith(".") or not all((snapshots / c).is_dir() for c in pair):
                    path.unlink(missing_ok=True)


class KeptDeltaWriter:
    """One pair's file being written, entry by entry as the delta stream serves them, aside
    (a hidden name beside it) until ``finish`` renames it into place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        # Open across the stream's tensors: closed by finish or discard.
        self._file: IO[bytes] = open(self.temporary, "wb")  # noqa: SIM115
        self._digest = xxhash.xxh3_128()
        self._written = 0
        self._tensors = 0
        base, target = path.name.removesuffix(DELTA_SUFFIX).split("..")
        self._write(_json_line({"format": DELTA_FORMAT, "base": base, "target": target}))

    def _write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._digest.update(data)
        self._written += len(data)

    def add(self, entry: DeltaEntry) -> None:
        self._write(header_line(entry.header))
        if entry.header.kind == PATCH:
            for part in entry.payload:
                self._write(part)
        self._tensors += 1

    def finish(self) -> Path:
        footer = {"tensors": self._tensors, "bytes": self._written}
        line = _json_line({**footer, "xxh3": self._digest.hexdigest()})
        self._file.write(line + struct.pack(FOOTER_SIZE, len(line)))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.temporary, self.path)
        sync_path(self.path.parent)
        return self.path

    def discard(self) -> None:
        self._file.close()
        self.temporary.unlink(missing_ok=True)


def _json_line(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def _parse_kept(mapping: mmap.mmap, pair: list[str]) -> dict[str, DeltaEntry]:
    """A kept pair's entries, checked: its digest, its pair, every payload inside the file."""
    footer_at = len(mapping) - struct.calcsize(FOOTER_SIZE)
    if footer_at < 0:
        raise ValueError("cut short")
    (footer_size,) = struct.unpack_from(FOOTER_SIZE, mapping, footer_at)
    body_end = footer_at - footer_size
    if body_end < 0:
        raise ValueError("cut short")
    footer = json.loads(mapping[body_end:footer_at])
    view = memoryview(mapping)
    if footer["bytes"] != body_end or xxhash.xxh3_128_hexdigest(view[:body_end]) != footer["xxh3"]:
        raise ValueError("its bytes do not match its digest")
    position = mapping.find(b"\n") + 1
    first = json.loads(mapping[:position])
    if first.get("format") != DELTA_FORMAT or [first["base"], first["target"]] != pair:
        raise ValueError(f"not a {DELTA_FORMAT} file of this pair")
    entries: dict[str, DeltaEntry] = {}
    while position < body_end:
        line_end = mapping.find(b"\n", position, body_end) + 1
        if line_end <= 0:
            raise ValueError("an entry is cut short")
        header = parse_header(mapping[position:line_end])  # the delta stream's strict rules
        position = line_end
        payload: tuple[memoryview, ...] = ()
        if header.kind == PATCH:
            values_at = position + header.positions_bytes
            position = values_at + header.values_bytes
            payload = (view[line_end:values_at], view[values_at:position])
        if position > body_end:
            raise ValueError(f"the patch of {header.name!r} runs past the file")
        entries[header.name] = DeltaEntry(header, payload)
    if len(entries) != footer["tensors"]:
        raise ValueError(f"{len(entries)} entries where {footer['tensors']} were written")
    return entries


def revision_record(
    commit: str,
    *,
    parent: str | None = None,
    created: float = 0.0,
    size: int = 0,
    message: str = "",
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A revision's record, as ``.revisions/COMMIT.json`` holds it and the revisions routes and
    watches list it: what is not known stays at its empty value."""
    return {
        "commit": commit,
        "parent": parent,
        "created": created,
        "bytes": size,
        "message": message,
        "metadata": {} if metadata is None else metadata,
    }


def delete_tree(path: Path) -> None:
    """Delete a directory tree, as ``shutil.rmtree`` does (errors ignored), file by file when
    the tests' pause is set."""
    pause = float(os.environ.get(REMOVAL_PAUSE_VARIABLE) or 0)
    if pause <= 0:
        shutil.rmtree(path, ignore_errors=True)
        return
    for dirpath, _, filenames in os.walk(path, topdown=False):
        for name in filenames:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(dirpath, name))
            time.sleep(pause)
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


def write_atomically(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    sync_path(path.parent)
