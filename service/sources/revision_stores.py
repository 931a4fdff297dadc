"""Where published revisions are kept, in the Hugging Face hub cache's layout: a local root
(``DirectoryStore``) or an object-store bucket (``BucketStore``), the durable source of truth
every node over it follows.

A repository folder (``models--ORG--NAME``) holds ``snapshots/COMMIT/`` (the revision's
files), ``.revisions/COMMIT.json`` (its record) and ``refs/main`` (the commit that is main).
Writes go in that order, ``refs/main`` last and whole (a rename on a disk; one PUT in a
bucket, which S3 applies atomically), so a reader never sees main name an incomplete revision.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol

import pyarrow.fs as pafs

INCOMING_PREFIX = ".incoming-"
RECORDS_DIR = ".revisions"
COPY_BLOCK = 8 << 20


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

    def put(self, folder: str, commit: str, files: Path, record: dict[str, Any]) -> None:
        """Store the revision's files (the directory ``files``) and its record."""
        ...

    def set_main(self, folder: str, commit: str) -> None: ...

    def main(self, folder: str) -> str | None: ...

    def commits(self, folder: str) -> list[str]:
        """Every revision the repository holds."""
        ...

    def record(self, folder: str, commit: str) -> dict[str, Any] | None: ...

    def remove(self, folder: str, commit: str) -> None: ...


class DirectoryStore:
    """Revisions under a local root, served by the root's catalog as a hub cache."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.description = str(root)

    def staging(self, folder: str) -> Path:
        return self.root / folder / "snapshots" / f"{INCOMING_PREFIX}{uuid.uuid4().hex}"

    def leftovers(self) -> list[Path]:
        return list(self.root.glob(f"**/models--*/snapshots/{INCOMING_PREFIX}*"))

    def holds(self, folder: str, commit: str) -> bool:
        return (self.root / folder / "snapshots" / commit).is_dir()

    def put(self, folder: str, commit: str, files: Path, record: dict[str, Any]) -> None:
        os.rename(files, self.root / folder / "snapshots" / commit)
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
        shutil.rmtree(self.root / folder / "snapshots" / commit, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.root / folder / RECORDS_DIR / f"{commit}.json").unlink()


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
        with contextlib.suppress(OSError):
            self.fs.delete_dir(self._key(folder, "snapshots", commit))
        with contextlib.suppress(OSError):
            self.fs.delete_file(self._key(folder, RECORDS_DIR, f"{commit}.json"))


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


def write_atomically(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
