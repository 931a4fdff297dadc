"""Sealed snapshots of file versions for the same-node handoff: a memfd filled once from a
mapped file, checked against that file version, sealed so that nobody can write, shrink or
grow it, and shared by every handoff of the version within a budget of bytes (docs/protocol.md,
"Same-node socket and zero-copy handoff")."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import mmap
import os
import threading
import time
from pathlib import Path

import xxhash

from weightserve.client.errors import ModelUnavailable
from weightserve.service.sources.files.mapped import MappedFile

log = logging.getLogger("weightserve.handoff")

# Linux memfd seals; a platform without them gets no snapshots (handoffs copy instead).
SEALS = (
    getattr(fcntl, "F_SEAL_WRITE", 0)
    | getattr(fcntl, "F_SEAL_SHRINK", 0)
    | getattr(fcntl, "F_SEAL_GROW", 0)
    | getattr(fcntl, "F_SEAL_SEAL", 0)
)
CAN_SEAL = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and SEALS != 0
_COPY_STEP = 64 << 20  # bytes per sendfile call while a snapshot fills
# Snapshots of files changed since (a new version indexed) are let go at most this often.
SWEEP_SECONDS = 1.0
_CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")

# The key of a file version: device, inode, size and modification time (a rename over the
# file or a new link changes its ctime, not its bytes).
VersionKey = tuple[int, int, int, int]


def default_snapshot_bytes() -> int:
    """A quarter of the memory this process may use: the machine's, or its cgroup's limit
    where that is lower (a snapshot's pages are charged to the server's cgroup and cannot be
    paged out without swap)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        limit = _CGROUP_MEMORY_MAX.read_text().strip()
        if limit != "max":
            total = min(total, int(limit))
    return total // 4


class Snapshot:
    """One sealed memfd holding one file version's bytes; checked chunk by chunk against the
    file's digests the first time each chunk is handed out."""

    def __init__(self, key: VersionKey, path: Path, fd: int, size: int) -> None:
        self.key, self.path, self.size = key, path, size
        self._fd = fd
        self._view = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        self._checked: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self.holds = 0  # handoffs sending it now (under the store's lock)
        self.dropped = False  # out of the store: closed once the last hold ends

    def fileno(self) -> int:
        return self._fd

    def stamp(self) -> tuple[int, int]:
        """(size, mtime in ns) of the memfd: what a client's after-read check compares."""
        st = os.fstat(self._fd)
        return st.st_size, st.st_mtime_ns

    def matches(self, start: int, length: int, digest: int) -> bool:
        """Whether the snapshot's bytes ``start .. start + length`` have the file's digest
        ``digest`` (each range is hashed once)."""
        with self._lock:
            if (start, length) in self._checked:
                return True
        if xxhash.xxh3_64_intdigest(memoryview(self._view)[start : start + length]) != digest:
            return False
        with self._lock:
            self._checked.add((start, length))
        return True

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still out: the mapping goes with it
            self._view.close()
        os.close(self._fd)


def version_key(mapped: MappedFile) -> VersionKey:
    st = os.fstat(mapped.fileno())  # device and inode never change for an open file
    size, mtime_ns = mapped.content_stamp()
    return st.st_dev, st.st_ino, size, mtime_ns


def _path_key(path: Path) -> VersionKey | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def fill_snapshot(mapped: MappedFile, key: VersionKey) -> Snapshot:
    """Copy the mapped file version into a new memfd and seal it.

    The file is checked to be the mapped version before and after the copy (a write updates
    its times before it changes bytes, and the caller holds the file's read lease, so an
    in-place writer waits or is seen); the kernel copies with ``sendfile``, which stops short
    at a truncation instead of faulting. The caller checks chunk digests (``matches``).
    """
    size = key[2]
    mapped.ensure_unchanged(size)
    fd = os.memfd_create(f"weightserve:{mapped.path.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        source, copied = mapped.fileno(), 0
        while copied < size:
            n = os.sendfile(fd, source, copied, min(_COPY_STEP, size - copied))
            if n == 0:
                raise ModelUnavailable(
                    f"{mapped.path.name} was truncated while its snapshot was made; the model "
                    "reloads on its next request"
                )
            copied += n
        mapped.ensure_unchanged(size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return Snapshot(key, mapped.path, fd, size)
    except BaseException:
        os.close(fd)
        raise


class SnapshotStore:
    """Sealed snapshots by file version, at most ``budget_bytes`` together, least recently
    used let go first; a snapshot whose file changed is let go too. A handoff that finds no
    room (or a platform without memfd seals) gets None: the client copies instead."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes if CAN_SEAL else 0
        self._lock = threading.Lock()
        self._snapshots: collections.OrderedDict[VersionKey, Snapshot] = collections.OrderedDict()
        self._filling: dict[VersionKey, threading.Event] = {}
        self._reserved = 0  # bytes of the snapshots being filled
        self._swept = time.monotonic()

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return sum(s.size for s in self._snapshots.values())

    def acquire(self, mapped: MappedFile) -> Snapshot | None:
        """The sealed snapshot of the mapped file version, made now if needed; None when it
        does not fit the budget. ``release`` it once its descriptor is sent."""
        key = version_key(mapped)
        if not 0 < key[2] <= self.budget_bytes:
            return None
        while True:
            with self._lock:
                self._sweep()
                found = self._snapshots.get(key)
                if found is not None:
                    self._snapshots.move_to_end(key)
                    found.holds += 1
                    return found
                filling = self._filling.get(key)
                if filling is None:
                    if not self._make_room(key[2]):
                        return None
                    filling = self._filling[key] = threading.Event()
                    self._reserved += key[2]
                    break
            filling.wait()  # another handoff fills it: take it from the store then
            with self._lock:
                if key not in self._snapshots:
                    return None  # that fill failed; this handoff copies
        made: Snapshot | None = None
        started = time.monotonic()
        try:
            made = fill_snapshot(mapped, key)
        finally:
            with self._lock:
                del self._filling[key]
                self._reserved -= key[2]
                if made is not None:
                    made.holds += 1
                    self._snapshots[key] = made
            filling.set()
        log.info(
            "sealed snapshot of %s (%d MiB) made in %.2f s",
            mapped.path, key[2] >> 20, time.monotonic() - started,
        )  # fmt: skip
        return made

    def release(self, snapshot: Snapshot) -> None:
        with self._lock:
            snapshot.holds -= 1
            if snapshot.dropped and snapshot.holds == 0:
                snapshot.close()

    def discard(self, snapshot: Snapshot) -> None:
        """Let a snapshot go at once (its bytes did not match the file's digests)."""
        with self._lock:
            if self._snapshots.get(snapshot.key) is snapshot:
                self._drop(snapshot.key)

    def close(self) -> None:
        with self._lock:
            for key in list(self._snapshots):
                self._drop(key)

    def _drop(self, key: VersionKey) -> None:
        """Under the lock. Clients that mapped it keep their pages until they unmap them."""
        snapshot = self._snapshots.pop(key)
        snapshot.dropped = True
        if snapshot.holds == 0:
            snapshot.close()

    def _make_room(self, size: int) -> bool:
        """Under the lock: let least recently used snapshots go until ``size`` fits. Those
        a handoff is passing now stay: a model larger than the budget then gets its first
        files as snapshots and the rest copied, instead of each file evicting the last."""
        used = sum(s.size for s in self._snapshots.values()) + self._reserved
        idle = [key for key, s in self._snapshots.items() if s.holds == 0]  # LRU first
        if used - sum(self._snapshots[key].size for key in idle) + size > self.budget_bytes:
            return False  # it would not fit even so: keep what is there
        while used + size > self.budget_bytes:
            key = idle.pop(0)
            used -= self._snapshots[key].size
            self._drop(key)
        return True

    def _sweep(self) -> None:
        """Under the lock: let go of snapshots whose file is no longer that version."""
        now = time.monotonic()
        if now - self._swept < SWEEP_SECONDS:
            return
        self._swept = now
        for key, snapshot in list(self._snapshots.items()):
            if _path_key(snapshot.path) != key:
                self._drop(key)
