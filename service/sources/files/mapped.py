"""Mapped files: one read-only mmap per file version, shared by every stream, with the checks
and read leases that keep a file overwritten or truncated under a stream from mixing two
versions' bytes or ending the process (SIGBUS)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import signal
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from weightserve.client.errors import ModelUnavailable
from weightserve.service.sources.files.chunk_digests import ChunkDigests
from weightserve.service.sources.files.stamps import FileStamp, file_stamp

log = logging.getLogger("weightserve.catalog")

# The hint given with "changed since it was indexed": the next request re-indexes the model.
RELOAD_RETRY_AFTER = 0.5

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

    def __init__(
        self,
        path: Path,
        stamp: FileStamp | None = None,
        digests: ChunkDigests | None = None,
        check_content: Callable[[FileStamp], None] | None = None,
    ) -> None:
        self.path = path
        self.stamp = stamp  # the file as it was indexed; another file under its name is refused
        # Raises unless the file's bytes are what its source vouches for (a node cache's fill
        # record): run once, before the first byte of this mapping is served or digested.
        self._check_content = check_content
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self.size = stamp.size if stamp is not None else path.stat().st_size
        self._mapped_stamp: FileStamp | None = None  # the file as mapped, checked by streams
        self._holds = 0  # streams reading this mapping now (see hold)
        self._leased = False
        self._digests = digests if digests is not None else ChunkDigests()

    def digest(self, start: int, data: memoryview, whole: bool = False) -> int:
        """xxh3-64 of ``data``, the mapped bytes from ``start``; computed once per range
        (service/sources/files/chunk_digests.py; ``whole``: ``data`` is a whole tensor).

        The file is checked unchanged *after* hashing (``ensure_unchanged``): a write updates
        the file's times before it copies data, so bytes hashed before an unchanged check
        are bytes of the indexed version. A digest is kept only once that holds, and the
        client compares it with what it received: a chunk torn by a later overwrite fails
        there, and an overwrite before the check cuts the stream here. No mixed data passes.
        """
        return self._digests.digest(start, data, self.ensure_unchanged, whole)

    @property
    def chunks(self) -> ChunkDigests:
        """This mapping's known chunk digests (and what transports keep beside them)."""
        return self._digests

    def view(self) -> memoryview:
        with self._lock:
            if self._view is None:
                # The file stays open: ensure_unchanged() fstat()s it before data is touched, and
                # the open file pins this inode, so a later rename over it changes nothing here.
                f = open(self.path, "rb")  # noqa: SIM115
                try:
                    st = os.fstat(f.fileno())
                    found = file_stamp(st)
                    if self.stamp is not None and not found.same_but_ctime(self.stamp):
                        # Replaced between indexing and first use: the index describes another
                        # file, so serving these bytes under the old revision would mix two.
                        raise ModelUnavailable(
                            f"{self.path.name} changed since it was indexed; the model reloads "
                            "on its next request",
                            retry_after=RELOAD_RETRY_AFTER,  # clients retry by themselves
                        )
                    if self._check_content is not None:
                        self._check_content(found)
                    self.size = found.size
                    self._mapped_stamp = found
                    if self.size == 0:
                        f.close()
                        self._view = memoryview(b"")
                    else:
                        self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                        self._file, self._view = f, memoryview(self._map)
                        # The file closes with this mapping, as before, but by a close() call:
                        # a file left to its own finalizer warns (ResourceWarning).
                        weakref.finalize(self, f.close)
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
        return self._mapped_stamp.size, self._mapped_stamp.mtime_ns

    def hold(self) -> None:
        """A stream starts reading this mapping: while any does, hold a read lease on the file.

        A truncation under a mapping makes the next read of a removed page SIGBUS, which kills
        the process (every stream, every model). With the lease, the kernel makes a writer's
        ``open`` (``cp`` over the file, ``truncate``) wait until we release it, and tells us a
        writer waits (``F_GETLEASE``, checked in ``ensure_unchanged`` before any chunk is read
        here, and once per batch of chunks the kernel sends from the file): the streams of
        this file are cut at their next check, the last one releases the lease,
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

    def ensure_unchanged(self, end: int = 0) -> None:
        """Refuse to go on if the file is not the version the stream started with.

        One fstat: a size below ``end`` means a truncation (reading a mapped page it removed
        raises SIGBUS and kills the process), a changed size or mtime means the file was
        overwritten in place (``cp`` over it, not a rename): its bytes may now be a mix of two
        versions, so the streams of this file end with a clear error instead.

        A change of the ctime alone is links, not a write: weightserve itself adds and removes
        hard links of published files (a revision keeps its base's files as links; retention
        and aborted uploads drop them), often leaving the link count where it was. A write that
        puts the mtime back at the same size (``cp -p`` over a live file) is caught by the
        read lease a stream holds and by the per-chunk digests every client checks.
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
        if now.size < end:
            raise ModelUnavailable(
                f"{self.path.name} was truncated while being served; the model reloads on "
                "its next request"
            )
        assert self._mapped_stamp is not None  # set with the mapping this file belongs to
        if not now.same_but_ctime(self._mapped_stamp):
            raise ModelUnavailable(
                f"{self.path.name} was overwritten in place while being served; the stream "
                "is cut so no bytes of two versions mix; the model reloads on its next "
                "request (replace files by renaming a new file over them)"
            )
