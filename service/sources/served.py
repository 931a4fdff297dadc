"""The composed whole a server serves: its source and what comes with it (a publisher, the
revision log watchers hear, the deltas kept on disk, a node cache's controls and counters, the
follower of an upstream). Built once, by one function (service/server.py, ``build_served``),
and handed whole to the serving state (service/serving/state.py) at its construction: what a
route needs of it is an attribute here, None where this server has none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from weightserve.service.sources.base import CacheControls, ModelSource, RevisionLog
from weightserve.service.sources.cache.stats import CacheStats
from weightserve.service.sources.publishing.uploads import Publishing
from weightserve.service.sources.revisions.stores import KeptDeltas
from weightserve.service.sources.swarm.engine import PeerCounters
from weightserve.service.sources.swarm.tracker import SwarmDesk


class Background(Protocol):
    """A thread that serves the source while the server runs (following an upstream)."""

    def start(self) -> object: ...

    def stop(self, wait: float = 1.0) -> None: ...


@dataclass(frozen=True)
class Served:
    source: ModelSource
    # Uploads taken as revisions: a local root's, or the bucket's a node serves.
    publisher: Publishing | None = None
    # What the watch routes announce: the publisher, or a node cache's catalog.
    revision_log: RevisionLog | None = None
    # Patches between a local root's published revisions, kept beside them.
    kept_deltas: KeptDeltas | None = None
    # A node cache's: the operator's controls (admin routes) and the metrics' counters.
    cache_controls: CacheControls | None = None
    cache_stats: Callable[[], CacheStats] | None = None
    # Runs from start to stop: a node cache following its upstream weightserve.
    follower: Background | None = None
    # Peer fills (service/sources/swarm/): the desk that admits node caches to a revision's
    # swarm (None: joins are refused, for the reason ``swarm_off`` gives), and a node cache's
    # own counters of bytes from peers and from its upstream.
    swarm_desk: SwarmDesk | None = None
    swarm_off: str | None = None
    peer_counters: Callable[[], PeerCounters] | None = None
