"""A file version's identity: what tells the file a model was indexed from apart from one
written over it, renamed over it or truncated since; and ``sync_path``, which makes a written
file or a rename in a directory durable."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple


class FileStamp(NamedTuple):
    """A file's identity and version from ``stat``: any write, truncation, rename over or
    chmod changes one field. The ctime also moves with every link made or removed, which
    weightserve does to published files: a mapping compares without it (files/mapped.py)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    def same_but_ctime(self, other: FileStamp) -> bool:
        """The same inode, size and mtime: only the ctime differs (or nothing does)."""
        return self._replace(ctime_ns=0) == other._replace(ctime_ns=0)


def file_stamp(st: os.stat_result) -> FileStamp:
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def current_stamps(files: Iterable[Path]) -> dict[Path, FileStamp]:
    return {f: file_stamp(f.stat()) for f in files}


def sync_path(path: Path) -> None:
    """fsync a file or a directory by its path (a directory: the renames in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
