"""What the four transports (HTTP, gRPC, Flight, the same-node handoff) share in one process:
the source and what comes with it (service/sources/served.py), settings, metrics, stream
limits and the idle cut, and where the server stands (``Lifecycle``: the ports its listeners
bound, whether it warms or drains). Built whole: nothing is set on it afterwards."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from weightserve.client.errors import (
    InvalidRequest,
    ModelUnavailable,
    ResourceExhausted,
    RevisionNotFound,
)
from weightserve.client.wire.routes import split_revision, with_revision
from weightserve.client.wire.schema import DEFAULT_CHUNK_BYTES
from weightserve.service.serving.auth import Access, TokenStore
from weightserve.service.serving.delta import DeltaCache
from weightserve.service.serving.feed import RevisionFeed
from weightserve.service.serving.idle import IdleCutter
from weightserve.service.serving.metrics import Metrics, NodeCacheCollector, PeerCollector
from weightserve.service.sources.base import ModelSource
from weightserve.service.sources.model import Model
from weightserve.service.sources.revisions.pinning import names_content
from weightserve.service.sources.revisions.stores import revision_record
from weightserve.service.sources.served import Served


@dataclass
class Limits:
    """Bounded by default: a weight server must not be exhausted by one client."""

    max_streams: int = 64  # concurrent tensor streams, all transports together
    # per client (its token when tokens are configured, else its address), so one client
    # can't take them all
    max_streams_per_client: int = 16
    max_names: int = 100_000  # tensor names in one request
    max_request_bytes: int = 16 << 20  # request bodies (JSON name lists)
    idle_timeout: float = 60.0  # a stream whose client reads nothing this long is cut
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # What a client refused a stream slot is told to wait before trying again (Retry-After,
    # grpc-retry-pushback-ms); clients add jitter and back off further on repeated refusals.
    retry_after: float = 1.0


@dataclass(frozen=True)
class Ports:
    """The ports a server advertises (what its listeners bound; 0: none, or not yet)."""

    http: int = 0
    grpc: int = 0
    flight: int = 0  # the Flight port clients dial (--flight-public-port where given)


class Lifecycle:
    """Where the server listens and stands, for the transports to report: the ports its
    listeners bound (``ports()``, asked of the listeners each time), its same-node HTTP socket
    (``uds``, --uds, as this server sees it), whether it warms (``warming``: the content
    revisions of the models found at start being computed) and whether it drains
    (``draining``, set once stop begins: readiness turns false and new streams are refused)."""

    def __init__(self, ports: Callable[[], Ports] = Ports, uds: str | None = None) -> None:
        self.ports = ports
        self.uds = uds
        self.warming = threading.Event()
        self.draining = threading.Event()


class ServiceState:
    def __init__(
        self,
        served: Served | ModelSource,
        limits: Limits | None = None,
        tokens: TokenStore | None = None,
        protect_metrics: bool = False,
        *,
        allow_publish: bool = False,
        metrics: Metrics | None = None,
        feed: RevisionFeed | None = None,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        """``served``: the composed whole (a bare source serves alone). ``metrics`` and
        ``feed`` are given when the source's callbacks (refusals counted, revisions
        announced) were built to reach them; ``lifecycle``: where the server listens and
        whether it drains (none bound, never draining: alone)."""
        self.served = served if isinstance(served, Served) else Served(served)
        self.catalog = self.served.source
        self.publisher = self.served.publisher
        self.revision_log = self.served.revision_log
        self.limits = limits or Limits()
        self.tokens = tokens
        self.protect_metrics = protect_metrics
        self.allow_publish = allow_publish  # publishes without a token file (--allow-publish)
        self.feed = feed or RevisionFeed()  # watchers of published revisions
        self._per_client: dict[str, int] = {}
        self.metrics = metrics or Metrics()
        # Patches between revisions, computed once for all (and kept on disk beside a local
        # root's published revisions).
        self.deltas = DeltaCache(metrics=self.metrics, kept=self.served.kept_deltas)
        self.lifecycle = lifecycle or Lifecycle()
        # What server info advertises, so a client can choose its data plane (client/transports/planes.py)
        # and tell whether a same-node socket it finds is this server's.
        self.instance = uuid.uuid4().hex
        self._streams = 0
        self._lock = threading.Lock()
        self._stream_ended = threading.Condition(self._lock)
        self.idle_cutter = IdleCutter(self.limits.idle_timeout)  # shared by every stream
        if self.served.cache_stats is not None:
            self.metrics.registry.register(NodeCacheCollector(self.served.cache_stats))
        if self.served.peer_counters is not None or self.served.swarm_desk is not None:
            self.metrics.registry.register(
                PeerCollector(self.served.peer_counters, self.served.swarm_desk)
            )
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        self.metrics.models.set(len(self.catalog.models))
        self.metrics.refused_models.set(len(self.catalog.problems))

    @property
    def draining(self) -> bool:
        return self.lifecycle.draining.is_set()

    @property
    def warming(self) -> bool:
        return self.lifecycle.warming.is_set()

    @property
    def open_streams(self) -> int:
        return self._streams

    @contextlib.contextmanager
    def stream_slot(self, transport: str, client: str = "") -> Iterator[None]:
        """Hold one of the limited stream slots for the duration of a stream.

        ``client`` is the key of the per-client limit (``Access.client_key``). A refusal is
        immediate and carries ``retry_after``; there is no wait queue here on purpose: a
        waiting request would park a handler thread (HTTP's sync routes share one threadpool
        with the probes and metadata calls, gRPC's pool is sized to the stream limit), so a
        crowd would starve them. The clients wait instead, with jittered backoff.
        """
        hint = self.limits.retry_after
        with self._lock:
            if self.draining:
                raise ModelUnavailable(
                    "the server is shutting down; retry on another replica", retry_after=hint
                )
            if self._streams >= self.limits.max_streams:
                raise ResourceExhausted(
                    f"{self._streams} streams are open, the limit is {self.limits.max_streams}; "
                    f"retry in {hint:g} s",
                    retry_after=hint,
                )
            mine = self._per_client.get(client, 0)
            if mine >= self.limits.max_streams_per_client:
                raise ResourceExhausted(
                    f"this client ({client or 'unknown'}) has {mine} streams open, the limit per "
                    f"client is {self.limits.max_streams_per_client}; retry when one finishes",
                    retry_after=hint,
                )
            self._streams += 1
            self._per_client[client] = mine + 1
        gauge = self.metrics.child(self.metrics.open_streams, transport)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()
            with self._lock:
                self._streams -= 1
                left = self._per_client[client] - 1
                if left:
                    self._per_client[client] = left
                else:
                    del self._per_client[client]
                self._stream_ended.notify_all()

    def readable_model(self, access: Access, model_id: str, pin: str | None = None) -> Model:
        """The model an id names, if the caller may read it (else PermissionDenied /
        ModelNotFound): every transport's one way from an id to a model. ``ID@R`` is revision
        R of it, resolved by the source (RevisionNotFound naming the revisions it holds).

        ``pin``: the revision a stream was planned against (the index its client read). When
        ``main`` has moved on since, the stream is served from that revision as ``ID@pin``
        is, while the source holds it: a client that resolved ``main`` just before a publish
        still loads what it resolved. One no longer held is left to the pin's check
        (RevisionMismatch: start again)."""
        access.check(model_id)
        model = self.catalog.get(model_id, access.may_read)
        if pin and not names_content(model, pin) and split_revision(model_id)[1] is None:
            with contextlib.suppress(RevisionNotFound, InvalidRequest):
                return self.catalog.get(with_revision(model_id, pin), access.may_read)
        return model

    def readable_metadata(self, access: Access, model_id: str, file: str | None = None) -> Model:
        """The model's index and files for its metadata (``ModelSource.describe``: no fill;
        with ``file``, that file servable), if the caller may read it."""
        access.check(model_id)
        return self.catalog.describe(model_id, access.may_read, file)

    def revisions(self, access: Access, model_id: str) -> list[dict[str, Any]]:
        """The model's revisions as ``GET .../-/revisions`` and gRPC ListRevisions list them:
        a local root's published ones, else the one the model is."""
        access.check(model_id)
        if self.publisher is not None:
            return self.publisher.revisions(model_id)
        current = self.readable_model(access, model_id)
        return [
            revision_record(current.commit, size=sum(f.size for f in current.repo_files.values()))
        ]

    def wait_for_streams(self, timeout: float) -> bool:
        """Block until every open stream ended (True) or the timeout passed (False)."""
        with self._lock:
            return self._stream_ended.wait_for(lambda: self._streams == 0, timeout=timeout)
