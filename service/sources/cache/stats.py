"""A node cache's counters for the server's metrics (service/serving/metrics.py), apart from
the cache so that what reads them needs nothing else of it."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a model was evicted: the --cache-size bound, a full file system, an operator's evict.
EVICTION_REASONS = ("size", "disk_full", "operator")


@dataclass
class CacheStats:
    """Counters since start (and two gauges) for the server's metrics."""

    origin_failures: int = 0  # listings and fetches that raised
    origin_bytes: int = 0  # a fill's bytes from the origin (through the swarm's reads too)
    peer_bytes: int = 0  # a fill's bytes from other node caches (service/sources/swarm/)
    fills: int = 0  # fills started; fill_failures of them failed
    fill_failures: int = 0
    fill_seconds: float = 0.0
    hits: int = 0  # ensure() found the model whole
    misses: int = 0  # ensure() filled the model or waited for a fill
    evictions: int = 0
    evicted_bytes: int = 0
    # The same by reason (EVICTION_REASONS).
    evictions_by_reason: dict[str, int] = field(default_factory=dict)
    evicted_bytes_by_reason: dict[str, int] = field(default_factory=dict)
    corrupt_files: int = 0  # cached files found not to match their fill record (dropped)
    # The origin's own requests by (kind, outcome), set by snapshot(): origins.OriginRequests.
    origin_requests: dict[tuple[str, str], int] = field(default_factory=dict)
    # Bytes taken from the origin by what for (origins.ORIGIN_BYTE_KINDS), set by snapshot():
    # ``fill`` is origin_bytes, the others the metadata of models not cached.
    origin_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    bytes_used: int = 0  # gauge, set by snapshot()
    models_cached: int = 0  # gauge, set by snapshot()
    bound_bytes: int = 0  # gauge, set by snapshot(): CacheRoom.bound
    disk_free_bytes: int = 0  # gauge, set by snapshot(): CacheRoom.disk_free
