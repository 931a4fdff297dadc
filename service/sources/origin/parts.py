"""A file fetched in parallel ranged parts into a preallocated file, and checked whole against
the digest its origin named; nothing half-written is left behind."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

from weightserve.client.errors import (
    WeightserveError,
)
from weightserve.client.wire.digests import file_digest
from weightserve.service.sources.origin.base import FillPlan


def _fetch_parts(
    dest: Path,
    size: int,
    copy_part: Callable[[int, int, int], None],
    plan: FillPlan,
) -> None:
    """Preallocate ``dest`` to ``size`` bytes and run ``copy_part(fd, offset, length)`` for
    every part of ``plan.part_bytes`` on ``plan.concurrency`` threads. On any failure the other parts stop and ``dest``
    is removed, so nothing half-written is left behind."""
    concurrency, part_bytes = plan.concurrency, plan.part_bytes
    if concurrency < 1 or part_bytes < 1:
        raise ValueError(f"concurrency ({concurrency}) and part_bytes ({part_bytes}) must be >= 1")
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _preallocate(fd, size)
        parts = [(offset, min(part_bytes, size - offset)) for offset in range(0, size, part_bytes)]
        failed = threading.Event()

        def run(offset: int, length: int) -> None:
            if not failed.is_set():  # a part already failed: the file is lost anyway
                try:
                    copy_part(fd, offset, length)
                except BaseException:
                    failed.set()
                    raise

        with concurrent.futures.ThreadPoolExecutor(max(1, min(concurrency, len(parts)))) as pool:
            futures = [pool.submit(run, offset, length) for offset, length in parts]
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            for future in futures:
                future.cancel()
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
    except BaseException:
        os.close(fd)
        _remove(dest)
        raise
    os.close(fd)


def _fetch_checked(
    dest: Path,
    size: int,
    copy_part: Callable[[int, int, int], None],
    plan: FillPlan,
    expected: str,
    mismatch: Callable[[str], WeightserveError],
) -> str:
    """``_fetch_parts``, then the whole file's xxh3-128 (returned), which must be
    ``expected``: else ``dest`` is removed and ``mismatch(digest)`` raised."""
    _fetch_parts(dest, size, copy_part, plan)
    digest = file_digest(dest)
    if digest != expected:
        _remove(dest)
        raise mismatch(digest)
    return digest


def _preallocate(fd: int, size: int) -> None:
    """Reserve the blocks now: a full disk fails here, not after half the download."""
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a file system without fallocate: a sparse file


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
