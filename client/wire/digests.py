"""The digest a file is named by on both sides: the xxh3-128 (hex) of its bytes, the ETag and
version of every served file, checked by a pull, a node cache's fill and a revision's
content commit alike (docs/protocol.md). One reader for all of them: the file mapped and
hashed in blocks, its size checked before each block (a truncation under a mapping would be
SIGBUS).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import xxhash

HASH_BLOCK = 16 << 20  # bytes hashed per step: big enough to run at memory speed


class Hasher(Protocol):
    """An xxhash or hashlib object."""

    def update(self, data: memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


class FileTruncated(OSError):
    """The file shrank while it was hashed; what was read describes no single version."""


def fd_digest(
    fd: int,
    size: int,
    hasher: Hasher | None = None,
    before_block: Callable[[int], None] | None = None,
) -> str:
    """The hex digest (xxh3-128 unless ``hasher`` is given) of the ``size`` first bytes of
    the open file ``fd``; ``before_block(end)`` runs before each block up to ``end`` is read
    (default: FileTruncated when the file no longer covers it)."""
    h: Hasher = hasher if hasher is not None else xxhash.xxh3_128()

    def covered(end: int) -> None:
        if os.fstat(fd).st_size < end:
            raise FileTruncated(f"the file was truncated below {end} bytes while being hashed")

    check = before_block or covered
    if size:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for start in range(0, size, HASH_BLOCK):
                    end = min(start + HASH_BLOCK, size)
                    check(end)
                    h.update(view[start:end])
            finally:
                view.release()
    return str(h.hexdigest())


def file_digest(path: Path, hasher: Hasher | None = None) -> str:
    """The hex digest (xxh3-128 unless ``hasher`` is given) of the file at ``path``."""
    with open(path, "rb") as f:
        return fd_digest(f.fileno(), os.fstat(f.fileno()).st_size, hasher)
