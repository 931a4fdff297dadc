"""A running fill as others see it: its progress, and each file's bytes as they land, which a
reader may stream before the fill ends."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

log = logging.getLogger("weightserve.node_cache")


@dataclass(frozen=True)
class FillProgress:
    """How far a running fill is, so a server can keep its waiting clients alive."""

    model_id: str
    bytes_done: int
    bytes_total: int
    started: float  # time.monotonic() at its start


@dataclass
class Fill:
    """One model's fill while it runs (registered in the cache's book)."""

    total: int
    remaining: int  # bytes of this fill's files not yet renamed into place (reserved space)
    writing: int = 0  # bytes of the file being written now (allocated on disk up front)
    started: float = field(default_factory=time.monotonic)
    done_bytes: int = 0
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    landing: dict[str, LandedFile] = field(default_factory=dict)  # this fill's files, by name


class LandedFile:
    """One file of a running fill as far as its bytes have landed, for a reader that streams
    it before the fill ends (``follow``). What is readable is the contiguous prefix written so
    far, less its last byte until the file is whole, verified and in place: a file that fails
    its final check never reaches a reader whole."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._path: Path | None = None  # the partial being written, then the file in place
        self._prefix = 0
        self._by_start: dict[int, int] = {}  # spans landed past the prefix, start -> end
        self._by_end: dict[int, int] = {}
        self._whole = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    def _started(self, partial: Path) -> None:
        with self._changed:  # a file written again starts from nothing
            self._path, self._prefix, self._by_start, self._by_end = partial, 0, {}, {}
            self._changed.notify_all()

    def _landed(self, offset: int, length: int) -> None:
        start, end = offset, offset + length
        with self._changed:
            if start in self._by_end:  # join the spans this one touches
                start = self._by_end.pop(start)
                del self._by_start[start]
            if end in self._by_start:
                end_of_next = self._by_start.pop(end)
                del self._by_end[end_of_next]
                end = end_of_next
            if start <= self._prefix:
                self._prefix = max(self._prefix, end)
                self._changed.notify_all()
            else:
                self._by_start[start], self._by_end[end] = end, start

    def _placed(self, target: Path) -> None:
        with self._changed:
            self._path, self._prefix, self._whole = target, self.size, True
            self._changed.notify_all()

    def _failed(self, error: BaseException) -> None:
        with self._changed:
            if not self._whole:
                self._error = error
                self._changed.notify_all()

    def _readable(self) -> int:
        return self._prefix if self._whole else min(self._prefix, self.size - 1)

    def follow(
        self, start: int, stop: int, idle: float, piece: int = 1 << 20
    ) -> Generator[bytes, None, None]:
        """The bytes ``[start, stop)`` as they land, ``piece`` at most at a time; ``b""``
        after each ``idle`` seconds with nothing new (the caller's turn to look at its
        client). Raises the fill's error once it fails."""
        fd, opened = -1, None

        def news() -> bool:
            return self._error is not None or self._readable() > start

        try:
            while start < stop:
                with self._changed:
                    self._changed.wait_for(news, idle)
                    if self._error is not None:
                        raise self._error
                    readable, path = self._readable(), self._path
                if readable <= start or path is None:
                    yield b""
                    continue
                if path != opened:  # the partial renamed into place, or written again
                    try:
                        new_fd = os.open(path, os.O_RDONLY)
                    except FileNotFoundError:
                        continue  # renamed meanwhile: the new path is known now
                    if fd >= 0:
                        os.close(fd)
                    fd, opened = new_fd, path
                data = os.pread(fd, min(start + piece, readable, stop) - start, start)
                if not data:
                    raise OSError(f"{path.name} ended at byte {start} while being followed")
                start += len(data)
                yield data
        finally:
            if fd >= 0:
                os.close(fd)
