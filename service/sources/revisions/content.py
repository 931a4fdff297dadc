"""Revisions from content: what a model's revision names, and how it stays cheap.

A revision names bytes, not a path: two servers holding byte-identical files report the same
revision whatever the root, inode or mtime, so a load balancer may send a resume to any
replica; any changed byte gives a new revision.

Each file's digest (xxh3-128 of every byte) is computed once per file *version* and remembered
by the file's identity (device, inode, size, mtime, ctime): in memory, and on disk in a small
SQLite table under the cache directory, so a restarted server does not read a 100 GiB model
again. A file whose identity changes while it is being hashed is hashed again. The revision of
a model is a digest of its files' names (relative to the model), sizes and content digests.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from weightserve.client.wire.digests import fd_digest
from weightserve.service.sources.files.stamps import FileStamp, file_stamp

log = logging.getLogger("weightserve.revisions")

REVISION_CHARS = 16
COMMIT_CHARS = 40  # the revision as a commit id, what Hub clients expect


class FileChanged(OSError):
    """The file changed while it was read; what was read describes no single version."""


def hash_file(path: Path, stamp: FileStamp) -> str:
    """xxh3-128 of the whole file, if it is still the version ``stamp`` names afterwards."""

    def covered(end: int) -> None:  # a truncation under the mapping would be SIGBUS
        if os.fstat(f.fileno()).st_size < end:
            raise FileChanged(f"{path.name} was truncated while being hashed")

    with open(path, "rb") as f:
        if file_stamp(os.fstat(f.fileno())) != stamp:
            raise FileChanged(f"{path.name} changed before it could be hashed")
        digest = fd_digest(f.fileno(), stamp.size, before_block=covered)
        if file_stamp(os.fstat(f.fileno())) != stamp:
            raise FileChanged(f"{path.name} changed while it was being hashed")
    return digest


class DigestStore:
    """Content digests of files, by file identity; persisted when given a directory.

    The table is a cache: losing it costs one more read of each file, never a wrong answer,
    because an entry is only used for the exact identity it was computed for.
    """

    MAX_ROWS = 1_000_000  # ~100 MB at most; older entries are dropped past it

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self._memory: dict[FileStamp, str] = {}
        self._lock = threading.Lock()
        self._db_path: Path | None = None
        if directory is not None:
            path = Path(directory) / "file-digests.sqlite"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with self._connect(path) as db:
                    db.execute(
                        "CREATE TABLE IF NOT EXISTS digests (dev INTEGER, ino INTEGER, "
                        "size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER, digest TEXT, "
                        "PRIMARY KEY (dev, ino, size, mtime_ns, ctime_ns))"
                    )
                self._db_path = path
            except (OSError, sqlite3.Error) as e:
                # A read-only or full cache directory costs speed at the next start, not service.
                log.warning("file digests kept in memory only (%s: %s)", path, e)

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        # Several servers on one node may share the cache directory: wait for each other.
        return sqlite3.connect(path, timeout=10, isolation_level=None)

    def _lookup(self, stamp: FileStamp) -> str | None:
        found = self._memory.get(stamp)
        if found is not None or self._db_path is None:
            return found
        try:
            with contextlib.closing(self._connect(self._db_path)) as db:
                row = db.execute(
                    "SELECT digest FROM digests WHERE dev=? AND ino=? AND size=? AND "
                    "mtime_ns=? AND ctime_ns=?",
                    stamp,
                ).fetchone()
        except sqlite3.Error as e:
            log.warning("file digest table unreadable (%s); hashing again", e)
            return None
        if row is not None:
            self._memory[stamp] = row[0]
            return str(row[0])
        return None

    def _remember(self, stamp: FileStamp, digest: str) -> None:
        self._remember_all({stamp: digest})

    def _remember_all(self, found: dict[FileStamp, str]) -> None:
        """Keep digests in memory and in the table: one connection and one transaction for
        all of them (a write per file would cost a sync of the table per file)."""
        self._memory.update(found)
        if self._db_path is None or not found:
            return
        try:
            with contextlib.closing(self._connect(self._db_path)) as db:
                db.execute("BEGIN")
                db.executemany(
                    "INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?, ?, ?)",
                    [(*stamp, digest) for stamp, digest in found.items()],
                )
                (rows,) = db.execute("SELECT COUNT(*) FROM digests").fetchone()
                if rows > self.MAX_ROWS:
                    db.execute(
                        "DELETE FROM digests WHERE rowid IN (SELECT rowid FROM digests "
                        "ORDER BY rowid LIMIT ?)",
                        (rows - self.MAX_ROWS,),
                    )
                db.execute("COMMIT")
        except sqlite3.Error as e:
            log.warning("file digests not saved (%s); they are kept in memory", e)

    def prime(self, files: Iterable[tuple[Path, FileStamp]]) -> None:
        """Compute the digests of many files at once (a model's files, before its revision):
        the table read and written once for all of them, not once per file. A file that
        cannot be hashed now is left to ``digest``, which says why. A store that finds
        digests its own way (a node cache's records, an origin's listing) has nothing to
        prime."""
        if type(self).digest is not DigestStore.digest:
            return
        with self._lock:
            missing = [(p, s) for p, s in files if s not in self._memory]
            if missing and self._db_path is not None:
                with (
                    contextlib.suppress(sqlite3.Error),
                    contextlib.closing(self._connect(self._db_path)) as db,
                ):
                    for _, stamp in missing:
                        row = db.execute(
                            "SELECT digest FROM digests WHERE dev=? AND ino=? AND size=? "
                            "AND mtime_ns=? AND ctime_ns=?",
                            stamp,
                        ).fetchone()
                        if row is not None:
                            self._memory[stamp] = str(row[0])
            missing = [(p, s) for p, s in missing if s not in self._memory]
        found = {}
        for path, stamp in missing:
            with contextlib.suppress(OSError):  # FileChanged, FileNotFoundError
                found[stamp] = hash_file(path, stamp)
        with self._lock:
            self._remember_all(found)

    def record(self, stamp: FileStamp, digest: str) -> None:
        """Keep ``digest``, taken of a file's bytes as this process wrote them (an upload
        hashed as it arrived), for the file's identity ``stamp`` taken after the last write:
        its revision's commit then reads it from here, not from the disk again. A store that
        finds digests its own way keeps nothing."""
        if type(self).digest is not DigestStore.digest:
            return
        with self._lock:
            self._remember(stamp, digest)

    def renamed(self, before: FileStamp, after: FileStamp) -> None:
        """A file whose digest was just recorded was renamed (same bytes; the rename moved its
        ctime): its digest holds for its new identity ``after`` too."""
        if type(self).digest is not DigestStore.digest:
            return
        with self._lock:
            found = self._memory.get(before)
            if found is not None:
                self._remember(after, found)

    def digest(self, path: Path, stamp: FileStamp) -> str:
        """The content digest of ``path`` as of ``stamp``; FileChanged if it is not that file
        any more (the caller re-indexes it)."""
        with self._lock:
            found = self._lookup(stamp)
        if found is not None:
            return found
        digest = hash_file(path, stamp)
        with self._lock:
            self._remember(stamp, digest)
        return digest

    def content_check(self, path: Path) -> Callable[[FileStamp], None] | None:
        """What a new mapping of ``path`` must pass, given the file's stamp as mapped, before
        its first byte is served; None: nothing (a local root's files are what they are; a
        node cache checks its files against their fill records)."""
        return None


def content_revision(files: Iterable[tuple[str, int, str]]) -> str:
    """The full content digest (64 hex) of a model from (name relative to the model, size,
    content digest) of each file: names, sizes and bytes count; paths, inodes and times do
    not. The revision is its first ``REVISION_CHARS`` characters."""
    h = hashlib.sha256()
    for name, size, digest in sorted(files):
        h.update(f"{name}\0{size}\0{digest}\n".encode())
    return h.hexdigest()
