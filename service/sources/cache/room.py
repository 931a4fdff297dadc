"""Room in the node cache: its bound, read again before each fill, and eviction (least recently
used first) to stay within it and within what its file system has free."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightserve.client.errors import (
    CacheTooSmall,
    ModelNotFound,
    ResourceExhausted,
)
from weightserve.service.sources.cache.records import CacheBook

if TYPE_CHECKING:
    from weightserve.service.sources.origin.base import OriginFile

log = logging.getLogger("weightserve.node_cache")


# How long a client refused for a full cache (every model in use) should wait: long enough
# for a stream to end, short enough that a freed cache is used soon.
FULL_RETRY_SECONDS = 5.0
# Without --cache-size the cache may take this share of its room: what it holds plus the
# file system's free space, read again before each fill.
DEFAULT_CACHE_FRACTION = 0.9
# Space never counted as room, whatever --cache-size says: 1% of the file system, at most
# 64 MiB, for the state files, the header images and whoever else writes there.
DISK_RESERVE_FRACTION = 0.01
DISK_RESERVE_MAX_BYTES = 64 << 20


class EvictionRefused(ResourceExhausted):
    """An operator's evict of a model streamed, being filled or pinned (server only: the admin
    route answers it 409 Conflict)."""


@dataclass(frozen=True)
class CacheRoom:
    """What the cache may hold, read again before each fill: the smaller of ``--cache-size``
    (or DEFAULT_CACHE_FRACTION of its room) and what its file system has room for, which is
    the bytes the cache holds there plus the free bytes, less the reserve."""

    bound: int
    disk_bound: int  # all the cache could hold if it evicted everything: held + free - reserve
    disk_free: int  # the file system's free bytes (as an unprivileged writer sees them)
    held: int  # the cache's bytes on that file system (whole files and partial ones)

    @property
    def by_disk(self) -> bool:
        """Whether the file system, not the configured size, sets the bound."""
        return self.bound == self.disk_bound


class Room:
    """What the cache may hold and how it makes room: its bound (``--cache-size`` or a share of
    its file system, read again before each fill), least-recently-used eviction of models
    neither pinned, streamed nor being filled, and eviction when the file system turns out
    full. ``on_evict`` is called (outside the lock) after models were evicted, before their
    space is counted on: whoever maps cached files lets go of the evicted ones, or the space
    stays used."""

    def __init__(
        self,
        book: CacheBook,
        size_limit_bytes: int | None,
        on_evict: Callable[[], None] | None = None,
    ) -> None:
        self.book = book
        self.size_limit_bytes = size_limit_bytes
        self.on_evict = on_evict
        # Called (under the lock) with a model about to be evicted: its seeding stops first.
        self.before_evict: Callable[[str], None] | None = None
        self.evicted_unreleased = False

    def now(self) -> CacheRoom:
        """The bound as of now (under the lock): statvfs is read again on every call, so the
        bound follows the file system as others write to it or free it."""
        usage = shutil.disk_usage(self.book.directory)
        held = self.book.bytes_on_disk()
        disk_bound = max(0, held + usage.free - _disk_reserve(usage.total))
        configured = (
            self.size_limit_bytes
            if self.size_limit_bytes is not None
            else int((held + usage.free) * DEFAULT_CACHE_FRACTION)
        )
        return CacheRoom(min(configured, disk_bound), disk_bound, usage.free, held)

    def bound_name(self) -> str:
        if self.size_limit_bytes is not None:
            return "--cache-size"
        return f"{DEFAULT_CACHE_FRACTION:.0%} of its file system's room, without --cache-size"

    def evictable(self, model_id: str) -> list[tuple[float, str]]:
        """(last used, id) of the models that may be evicted to make room for ``model_id``."""
        return [
            (state.last_used, victim)
            for victim, state in self.book.states.items()
            if victim != model_id
            and victim not in self.book.pins
            and victim not in self.book.holds
            and victim not in self.book.fills
        ]

    def kept(self, model_id: str) -> tuple[str, bool]:
        """Which held models cannot be evicted for ``model_id`` and why, and whether that
        passes by itself (streams and fills end; pins stay)."""
        reasons, temporary = [], False
        for held, state in sorted(self.book.states.items()):
            if held == model_id or not state.files and held not in self.book.fills:
                continue
            if held in self.book.pins:
                why = "pinned (--pin)"
            elif held in self.book.fills:
                why, temporary = "being filled", True
            elif held in self.book.holds:
                streams = self.book.holds[held]
                why = f"being streamed by {streams} stream{'s' * (streams != 1)}"
                temporary = True
            else:
                continue
            reasons.append(f"{held!r} ({_bytes(state.size)}, {why})")
        return (", ".join(reasons) or "none"), temporary

    def evict_for(self, model_id: str, total: int, room: CacheRoom) -> None:
        """Evict least-recently-used models until ``total`` bytes of ``model_id`` fit in
        ``room.bound`` (under the lock)."""
        others = self.book.bytes_used() - (
            self.book.states[model_id].size if model_id in self.book.states else 0
        )
        reason = "disk_full" if room.by_disk else "size"
        while others + total > room.bound:
            candidates = self.evictable(model_id)
            if not candidates:
                kept, temporary = self.kept(model_id)
                where = (
                    f"the file system of the node cache {self.book.directory} has room for "
                    f"{_bytes(room.bound)} of the cache ({_bytes(room.disk_free)} free)"
                    if room.by_disk
                    else f"the node cache {self.book.directory} ({_bytes(room.bound)}, "
                    f"{self.bound_name()})"
                )
                raise ResourceExhausted(
                    f"{where}: no room for model {model_id!r} ({_bytes(total)}); "
                    f"{_bytes(others)} are held by models that cannot be evicted: {kept}; "
                    + (
                        "try again shortly"
                        if temporary
                        else "unpin some or give the cache more room"
                    ),
                    retry_after=FULL_RETRY_SECONDS if temporary else None,
                )
            _, victim = min(candidates)
            others -= self.evict(victim, reason)

    def make_disk_room(self, model_id: str, file: OriginFile, error: OSError) -> None:
        """The file system was full writing ``file``: evict least-recently-used idle models
        until it has room for the file, so that it can be written again; a clear refusal
        when nothing can be evicted."""
        with self.book.lock:
            usage = shutil.disk_usage(self.book.directory)
            short = file.size + _disk_reserve(usage.total) - usage.free
            evicted = 0
            # At least one model's bytes: the write failed whatever statvfs says (a quota,
            # space still mapped by a stream that just ended).
            while evicted == 0 or evicted < short:
                candidates = self.evictable(model_id)
                if not candidates:
                    break
                evicted += self.evict(min(candidates)[1], "disk_full")
            if not evicted:
                kept, temporary = self.kept(model_id)
                message = (
                    f"model {model_id!r}: the node cache {self.book.directory} ran out of disk "
                    f"space writing {file.name} ({error.strerror}): it needs "
                    f"{_bytes(file.size)} and its file system has {_bytes(usage.free)} free; "
                    f"nothing more could be evicted (models held that cannot be: {kept}); "
                )
                if temporary:
                    raise ResourceExhausted(
                        message + "try again shortly", retry_after=FULL_RETRY_SECONDS
                    ) from error
                raise CacheTooSmall(
                    message + "free space on that file system or give the cache another "
                    "directory (--cache-dir)"
                ) from error
        self.release_evicted()

    def evict_now(self, model_id: str) -> int:
        """Remove the whole model now (an operator's evict): the bytes freed. EvictionRefused
        while it is streamed, being filled or pinned; ModelNotFound when it is not held."""
        with self.book.lock:
            holds = self.book.holds.get(model_id, 0)
            refusal = (
                "is pinned (--pin): pinned models are never evicted"
                if model_id in self.book.pins
                else "is being filled; evict it once the fill ends"
                if model_id in self.book.fills
                else f"is in use by {holds} stream(s); evict it when they end"
                if holds
                else None
            )
            if refusal is not None:
                temporary = model_id not in self.book.pins
                raise EvictionRefused(
                    f"model {model_id!r} {refusal}",
                    retry_after=FULL_RETRY_SECONDS if temporary else None,
                )
            if model_id not in self.book.states:
                raise ModelNotFound(f"model {model_id!r} is not in this node's cache")
            freed = self.evict(model_id, "operator")
        self.release_evicted()
        return freed

    def evict(self, model_id: str, reason: str) -> int:
        if self.before_evict is not None:
            self.before_evict(model_id)
        # The state file goes first: a crash midway leaves unrecorded files, removed at start.
        state = self.book.states.pop(model_id)
        self.book.state_path(model_id).unlink(missing_ok=True)
        for name in state.files:
            self.book.remove_data(name)
        self.book.stats.evictions += 1
        self.book.stats.evicted_bytes += state.size
        counts, sizes = self.book.stats.evictions_by_reason, self.book.stats.evicted_bytes_by_reason
        counts[reason] = counts.get(reason, 0) + 1
        sizes[reason] = sizes.get(reason, 0) + state.size
        self.evicted_unreleased = True
        log.info(
            "evicted model %r (%s) from the node cache (%s)", model_id, _bytes(state.size), reason
        )
        return state.size

    def release_evicted(self) -> None:
        """Tell ``on_evict`` (outside the lock) that models were evicted: their files' space
        is freed only once nothing maps them any more."""
        with self.book.lock:
            evicted, self.evicted_unreleased = self.evicted_unreleased, False
        if evicted and self.on_evict is not None:
            self.on_evict()


def _disk_reserve(file_system_bytes: int) -> int:
    """The bytes of a file system never counted as the cache's room."""
    return min(DISK_RESERVE_MAX_BYTES, int(file_system_bytes * DISK_RESERVE_FRACTION))


def _bytes(n: int) -> str:
    """Bytes exactly, and in the largest binary unit that fits, for error messages."""
    scaled, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if scaled < 1024 or unit == "TiB":
            break
        scaled /= 1024
    return f"{n} bytes" if unit == "B" else f"{n} bytes ({scaled:.1f} {unit})"
