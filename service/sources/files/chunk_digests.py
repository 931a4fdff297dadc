"""Chunk digests of a mapped file, computed once per range: a weight cache sends the same
chunks to many clients, and hashing every byte again per load costs the server much of its
CPU (docs/performance.md, "digest cache per mapping"). One budget bounds all mappings."""

from __future__ import annotations

import threading
from collections.abc import Callable

import xxhash

# Chunk digests kept across all mappings (~200 bytes each as a dict entry: ~50 MiB at most;
# 512 GiB of chunks at the default 2 MiB), and the smallest chunk worth keeping (hashing
# small chunks again is cheap, and tiny chunk sizes would otherwise fill the budget fast).
MAX_CACHED_DIGESTS = 1 << 18
MIN_CACHED_CHUNK = 256 << 10

# A chunk's framing as a transport sends it around the chunk's bytes: (prefix, suffix).
Framing = tuple[bytes, bytes]


class DigestBudget:
    """How many digests all mappings may still keep; a dropped mapping gives its back."""

    def __init__(self, limit: int = MAX_CACHED_DIGESTS) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.used >= self.limit:
                return False
            self.used += 1
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


SHARED_BUDGET = DigestBudget()  # every mapping's, unless a test gives its own


class ChunkDigests:
    """The xxh3-64 digests of one mapping's chunks, by (start, length).

    It lives with one mapping, so a replaced file starts afresh. Only chunks of at least
    ``min_chunk`` bytes are kept, within ``budget`` (shared by all mappings), so no request
    pattern can grow it without bound.
    """

    def __init__(
        self, budget: DigestBudget = SHARED_BUDGET, min_chunk: int = MIN_CACHED_CHUNK
    ) -> None:
        self.budget = budget
        self.min_chunk = min_chunk
        self._digests: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        # What a transport built around a known digest (a chunk's framing), by the same key:
        # a warm chunk then costs one look-up. Kept only beside a kept digest, so within the
        # same budget; ``framing`` checks the entry was made for the caller's tensor.
        self._framing: dict[tuple[int, int], tuple[object, Framing]] = {}

    def known(self, start: int, length: int) -> int | None:
        """The kept digest of the ``length`` bytes from ``start``, if any: bytes whose digest
        is known need not be read here again (nor checked before reading)."""
        return self._digests.get((start, length))

    def framing(self, start: int, length: int, owner: object) -> Framing | None:
        """What ``keep_framing`` kept for this range and ``owner`` (compared equal), or None."""
        found = self._framing.get((start, length))
        if found is None or found[0] != owner:
            return None
        return found[1]

    def keep_framing(self, start: int, length: int, owner: object, framing: Framing) -> None:
        """Keep ``framing`` for this range and ``owner`` if its digest is kept (one per range:
        another owner's replaces it)."""
        key = (start, length)
        if key in self._digests:
            self._framing[key] = (owner, framing)

    def digest(
        self, start: int, data: memoryview, verify: Callable[[int], None], whole: bool = False
    ) -> int:
        """xxh3-64 of ``data``, the mapped bytes from ``start``; computed once per range.

        ``verify(end)`` runs *after* hashing and raises if the file is no longer the version
        the stream started with; a digest is kept only once it passed (see
        ``MappedFile.digest`` for why that order leaves no mixed data). ``whole``: the range
        is a whole tensor, kept however small (a model has a few hundred; tiny chunks of a
        large tensor are not kept).
        """
        end = start + len(data)
        if len(data) < self.min_chunk and not whole:
            small = xxhash.xxh3_64_intdigest(data)
            verify(end)
            return small
        key = (start, len(data))
        found = self._digests.get(key)
        if found is None:
            found = xxhash.xxh3_64_intdigest(data)
            verify(end)
            with self._lock:  # two streams may hash the same chunk at once
                if key not in self._digests and self.budget.take():
                    self._digests[key] = found
        return found

    def __del__(self) -> None:
        budget = getattr(self, "budget", None)
        if budget is not None:
            budget.give(len(getattr(self, "_digests", ())))
