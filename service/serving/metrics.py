"""Prometheus metrics of the data plane: bytes, tensors, requests, latency, open streams.

Each server gets its own registry, so several servers can run in one process (tests).
Every metric and label is listed in docs/protocol.md ("Metrics"); keep the two in step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from weightserve.client.errors import WeightserveError, status_for
from weightserve.service.sources.cache.stats import EVICTION_REASONS, CacheStats
from weightserve.service.sources.origin.base import ORIGIN_BYTE_KINDS, ORIGIN_REQUEST_KINDS


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, documentation: str, *labels: str) -> Counter:
            return Counter(name, documentation, labels, registry=self.registry)

        def gauge(name: str, documentation: str, *labels: str) -> Gauge:
            return Gauge(name, documentation, labels, registry=self.registry)

        self.requests = counter(
            "weightserve_requests_total",
            "Requests by transport, operation (the call) and the status code the client got",
            "transport",
            "operation",
            "code",
        )
        self.errors = counter(
            "weightserve_errors_total",
            "Failed requests, and streams cut after they started, by error class",
            "transport",
            "operation",
            "error",
        )
        self.latency = Histogram(
            "weightserve_request_seconds",
            "Time to answer a request that succeeded (the whole stream for data)",
            ["transport", "operation"],
            registry=self.registry,
            buckets=(
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
                30,
                60,
                120,
            ),
        )
        self.bytes_served = counter(
            "weightserve_bytes_served_total", "Tensor data bytes sent", "transport", "model"
        )
        self.tensors_served = counter(
            "weightserve_tensors_served_total",
            "Tensors (or slices) sent completely",
            "transport",
            "model",
        )
        self.http_direct_bytes = counter(
            "weightserve_http_direct_bytes_total",
            "HTTP body bytes written straight to the socket by a stream's writer thread, by "
            "how: sendfile (from the file's page cache) or write (framing, and file bytes "
            "copied from the mapping: --sendfile)",
            "how",
        )
        self.open_streams = gauge(
            "weightserve_open_streams", "Tensor streams in progress", "transport"
        )
        self.models = gauge("weightserve_models", "Models in the catalog")
        self.refused_models = gauge(
            "weightserve_refused_models", "Models found but refused (failed validation)"
        )
        self.model_refusals = counter(
            "weightserve_model_refusals_total",
            "Times a model was refused (once per version of its files: not per rescan)",
        )
        self.revisions = counter(
            "weightserve_revisions_total",
            "Published revisions, by event: published (became main), removed (retention)",
            "event",
        )
        self.delta_computed = counter(
            "weightserve_delta_computed_total",
            "Delta entries computed (one per base, target and tensor: a diff)",
        )
        self.delta_served = counter(
            "weightserve_delta_served_total",
            "Delta entries served, by source: memory (kept in memory), disk (kept beside the "
            "revisions), computed (diffed for this request or one it waited on)",
            "source",
        )
        # One recorder per transport: a request resolves no label there (see CallRecorder).
        self.http = CallRecorder(self, "http")
        self.grpc = CallRecorder(self, "grpc")
        self.flight = CallRecorder(self, "flight")
        self.handoff = CallRecorder(
            self, "handoff"
        )  # same-node descriptors (service/transports/handoff.py)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Counter | Gauge, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: each stream takes a few, and a look-up
        is a lock and a tuple of strings (docs/performance.md, "Small requests")."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found


# The node cache's counters (service/sources/cache/node_cache.py CacheStats): (metric, kind, help, field).
NODE_CACHE_METRICS = (
    ("weightserve_origin_requests_total", "counter",
     "Requests made to the origin, by kind (list, head, get, watch) and outcome (ok, error)",
     "origin_requests"),
    ("weightserve_origin_failures_total", "counter", "Origin listings and fetches that failed",
     "origin_failures"),
    ("weightserve_origin_bytes_total", "counter",
     "Bytes a node cache took, by kind: fill (a model's files), header (metadata of a model "
     "not cached), file (a side file fetched alone), patch (an upstream's delta stream and "
     "headers a changed file was built from); and by source: origin, or peers (other node "
     "caches, a fill's pieces through the revision's swarm)", "origin_bytes_by_kind"),
    ("weightserve_cache_fills_total", "counter", "Models filled (or refreshed) from the origin",
     "fills"),
    ("weightserve_cache_fill_failures_total", "counter", "Fills that failed", "fill_failures"),
    ("weightserve_cache_fill_seconds_total", "counter", "Time spent filling models",
     "fill_seconds"),
    ("weightserve_cache_hits_total", "counter", "Requests that found their model cached",
     "hits"),
    ("weightserve_cache_misses_total", "counter", "Requests that filled or waited for a fill",
     "misses"),
    ("weightserve_cache_evictions_total", "counter",
     "Models evicted, by reason: size (the cache's bound), disk_full (its file system), "
     "operator (an admin evict, or a failed verify)", "evictions_by_reason"),
    ("weightserve_cache_evicted_bytes_total", "counter", "Bytes of the models evicted, by reason",
     "evicted_bytes_by_reason"),
    ("weightserve_cache_corrupt_files_total", "counter",
     "Cached files found not to match their fill record (dropped, filled again)",
     "corrupt_files"),
    ("weightserve_cache_bytes", "gauge", "Bytes the node cache holds (and reserves for fills)",
     "bytes_used"),
    ("weightserve_cache_models", "gauge", "Models held whole in the node cache",
     "models_cached"),
    ("weightserve_cache_bound_bytes", "gauge",
     "What the node cache may hold now: the smaller of --cache-size and what its file system "
     "has room for (the cache's bytes there plus the free bytes, less a reserve)", "bound_bytes"),
    ("weightserve_cache_disk_free_bytes", "gauge",
     "Free bytes of the node cache's file system", "disk_free_bytes"),
)  # fmt: skip


# The labelled ones, a dict in CacheStats: their label names and every key, reported even at 0.
_LABELLED: dict[str, tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]] = {
    "origin_requests": (
        ("kind", "outcome"),
        tuple((kind, outcome) for kind in ORIGIN_REQUEST_KINDS for outcome in ("ok", "error")),
    ),
    # (kind, source): every kind from the origin, a fill's bytes from peers too (peer_bytes).
    "origin_bytes_by_kind": (
        ("kind", "source"),
        (("fill", "peers"), *((kind, "origin") for kind in ORIGIN_BYTE_KINDS)),
    ),
    "evictions_by_reason": (("reason",), tuple((reason,) for reason in EVICTION_REASONS)),
    "evicted_bytes_by_reason": (("reason",), tuple((reason,) for reason in EVICTION_REASONS)),
}


class NodeCacheCollector(Collector):
    """The node cache's counters, read from one consistent ``snapshot()`` per scrape."""

    def __init__(self, snapshot: Callable[[], CacheStats]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot()
        for name, kind, text, field in NODE_CACHE_METRICS:
            if field in _LABELLED:
                labels, keys = _LABELLED[field]
                counts = getattr(stats, field)
                family = CounterMetricFamily(name.removesuffix("_total"), text, labels=labels)
                for key in keys:
                    if field == "origin_bytes_by_kind":  # (kind, source)
                        count = stats.peer_bytes if key[1] == "peers" else counts.get(key[0], 0)
                    else:
                        count = counts.get(key if len(key) > 1 else key[0], 0)
                    family.add_metric(key, count)
                yield family
                continue
            value: float = getattr(stats, field)
            if kind == "counter":
                yield CounterMetricFamily(name.removesuffix("_total"), text, value=value)
            else:
                yield GaugeMetricFamily(name, text, value=value)


# A node's swarm (service/sources/swarm/engine.py PeerCounters): (metric, kind, help, field).
PEER_METRICS = (
    ("weightserve_peer_fills_total", "counter",
     "Fills that went through a revision's swarm (peers and the upstream at once)", "fills"),
    ("weightserve_peer_fills_abandoned_total", "counter",
     "Swarm fills abandoned (stalled, the upstream failing); the upstream alone filled the rest",
     "fills_abandoned"),
    ("weightserve_peer_hash_failures_total", "counter",
     "Pieces that did not match the revision's Merkle tree (refused, fetched again)",
     "hash_failures"),
    ("weightserve_peer_bans_total", "counter", "Peers banned for sending bad pieces",
     "peers_banned"),
    ("weightserve_peer_uploaded_bytes_total", "counter",
     "Payload bytes this node sent to other node caches", "uploaded"),
    ("weightserve_peer_seeding_revisions", "gauge",
     "Revisions this node serves to other node caches now", "seeding"),
)  # fmt: skip


class PeerCollector(Collector):
    """A node cache's swarm counters, and, on any server, its desk's (joins, nodes known)."""

    def __init__(
        self,
        counters: Callable[[], Any] | None,
        desk: Any | None,
    ) -> None:
        self.counters, self.desk = counters, desk

    def collect(self) -> Iterator[Metric]:
        if self.counters is not None:
            counters = self.counters()
            for name, kind, text, field in PEER_METRICS:
                value = getattr(counters, field)
                if kind == "counter":
                    yield CounterMetricFamily(name.removesuffix("_total"), text, value=value)
                else:
                    yield GaugeMetricFamily(name, text, value=value)
        if self.desk is not None:
            yield CounterMetricFamily(
                "weightserve_swarm_joins",
                "Node caches' joins of a revision's swarm answered (fills, re-announces, seeds)",
                value=self.desk.joins,
            )
            yield GaugeMetricFamily(
                "weightserve_swarm_nodes",
                "Node caches named to each other now, over every revision's swarm",
                value=self.desk.peers(),
            )


class CallRecorder:
    """Counts one transport's requests as they end: ``weightserve_requests_total`` by call
    (``operation``) and status code, the latency of those that succeeded, and
    ``weightserve_errors_total`` for the others.

    Label children are looked up once per (operation, code) and kept: ``labels()`` takes a
    lock and checks its values on every call, which each small request would pay again.
    Operations and codes are fixed small sets, so the dicts stay small.
    """

    def __init__(self, metrics: Metrics, transport: str) -> None:
        self._metrics = metrics
        self._transport = transport
        self._requests: dict[tuple[str, str], Counter] = {}
        self._errors: dict[tuple[str, str], Counter] = {}
        self._latency: dict[str, Histogram] = {}

    def succeeded(self, operation: str, code: str, seconds: float) -> None:
        self._count(operation, code)
        latency = self._latency.get(operation)
        if latency is None:
            latency = self._metrics.latency.labels(self._transport, operation)
            self._latency[operation] = latency
        latency.observe(seconds)

    def ended(
        self,
        operation: str,
        started: float,
        error: BaseException | None = None,
        finished: bool = True,
        idle_cut: bool = False,
    ) -> None:
        """Counts a call by what ended it: ``finished`` (its answer went out whole; a unary
        call that returned), one of our errors (its class, and the code the error table
        gives it), a cancellation or a stream left unfinished (``Cancelled``, or
        ``IdleTimeout`` when the idle cut ended it), anything else (``Internal``, which grpc
        answers as UNKNOWN). ``started`` is ``time.perf_counter()`` at the call's start."""
        if finished:
            self.succeeded(operation, "OK", time.perf_counter() - started)
        elif isinstance(error, WeightserveError):
            self.failed(operation, status_for(error)[1], type(error).__name__)
        elif error is None or isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            self.failed(operation, "CANCELLED", "IdleTimeout" if idle_cut else "Cancelled")
        else:
            self.failed(operation, "UNKNOWN", "Internal")

    def failed(self, operation: str, code: str, error: str) -> None:
        """A request answered with an error, or a stream cut after it started (``code`` is
        then the status already sent). ``error`` is our error class name, ``Cancelled`` (the
        client went away), ``IdleTimeout`` (it read nothing for too long) or ``Internal``."""
        self._count(operation, code)
        self._child(self._errors, self._metrics.errors, operation, error).inc()

    def _count(self, operation: str, code: str) -> None:
        self._child(self._requests, self._metrics.requests, operation, code).inc()

    def _child(
        self, made: dict[tuple[str, str], Counter], metric: Counter, operation: str, label: str
    ) -> Counter:
        """``metric``'s child for this transport, ``operation`` and ``label``, made once."""
        child = made.get((operation, label))
        if child is None:
            child = made[operation, label] = metric.labels(self._transport, operation, label)
        return child
