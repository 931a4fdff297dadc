"""The four transports (HTTP, gRPC, Arrow Flight, the same-node handoff) in one process over
one catalog, with a clean shutdown.

``WeightServer`` starts one ``Listener`` (service/transports/listener.py) per endpoint the
configuration asks for (port 0 picks a free port, which tests use); a failed start stops
those already started. ``stop`` drains: readiness turns false, new streams are refused, open
streams get ``grace`` seconds to finish, then the listeners stop.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import uvicorn

from weightserve.client.errors import ModelUnavailable, WeightserveError
from weightserve.client.remote import TLSOptions
from weightserve.service.config import SendfileMode, default_of
from weightserve.service.serving.auth import TokenStore
from weightserve.service.serving.feed import RevisionFeed
from weightserve.service.serving.metrics import Metrics
from weightserve.service.serving.state import Lifecycle, Limits, Ports, ServiceState
from weightserve.service.sources.base import FillsOnRequest, ModelSource, Problem
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.sources.origin.base import Origin, OriginFile
from weightserve.service.sources.origin.catalog import OriginCatalog
from weightserve.service.sources.origin.follow import UpstreamFollower
from weightserve.service.sources.origin.objects import FileSystemOrigin
from weightserve.service.sources.origin.opening import open_origin
from weightserve.service.sources.origin.upstream import UpstreamOrigin
from weightserve.service.sources.publishing.publisher import Publisher
from weightserve.service.sources.revisions.content import DigestStore
from weightserve.service.sources.revisions.stores import (
    DELTAS_DIR,
    RECORDS_DIR,
    BucketStore,
    DirectoryStore,
)
from weightserve.service.sources.served import Served
from weightserve.service.sources.swarm.engine import PeerEngine, PeerSettings
from weightserve.service.sources.swarm.node import PeerFills
from weightserve.service.sources.swarm.torrents import libtorrent_missing
from weightserve.service.sources.swarm.tracker import SwarmDesk
from weightserve.service.transports.flight import FlightListener
from weightserve.service.transports.grpc import GrpcListener
from weightserve.service.transports.handoff import HandoffEndpoint, HandoffListener, HandoffServer
from weightserve.service.transports.http.app import create_app
from weightserve.service.transports.http.streaming import WeightserveApp
from weightserve.service.transports.http.uvicorn_listener import UvicornListener
from weightserve.service.transports.listener import (
    Listener,
    StartupError,
    check_port_free,
    url_host,
)

log = logging.getLogger("weightserve.server")


@dataclass
class ServerConfig:
    root: str
    host: str = default_of("host")
    http_port: int = default_of("http_port")
    grpc_port: int = default_of("grpc_port")
    # Arrow Flight for bulk data (gRPC clients use it when GetServerInfo offers it); None: off
    flight_port: int | None = default_of("flight_port")
    # The Flight port clients should dial when it differs from the bound one (port mapping,
    # a Kubernetes Service whose port is not the container's); None: the bound port.
    flight_public_port: int | None = None
    grace_seconds: float = default_of("grace")
    limits: Limits | None = None
    token_file: str | None = None  # bearer tokens, one per line (see service/serving/auth.py)
    protect_metrics: bool = False  # /metrics needs a token too
    # Publishing (service/sources/publishing/publisher.py): open to all only with allow_publish, else
    # to tokens granted publish=PATTERN; uploads bounded; older revisions removed.
    allow_publish: bool = False
    max_upload_bytes: int = default_of("max_upload_bytes")
    keep_revisions: int = default_of("keep_revisions")
    upload_body_timeout: float = default_of("upload_body_timeout")
    upload_idle_timeout: float = default_of("upload_idle_timeout")
    tls_cert: str | None = None  # PEM certificate chain: enables TLS on every TCP listener
    tls_key: str | None = None
    tls_client_ca: str | None = None  # require client certificates signed by this CA (mTLS)
    # How often the root is searched for new or removed models.
    rescan_seconds: float = default_of("rescan")
    watch: bool = True  # rescan on file-system events too (inotify), not only periodically
    # Which HTTP peers get file bytes with sendfile rather than written from the mapping (one
    # copy): auto (peers on other hosts), on, off (transports/http/streaming.py sendfile_to).
    sendfile: SendfileMode = default_of("sendfile")
    # A node cache over an upstream weightserve watches its announcements (sources/origin/follow.py).
    follow: bool = True
    # Where file content digests are remembered across restarts (file-digests.sqlite); None:
    # in memory only, so each start reads every file once to compute revisions.
    cache_dir: str | None = None
    # When ``root`` is an origin URI (s3://, gs://, file://, http(s)://): the node cache in
    # CACHE_DIR/node-cache (see docs/origins.md). None: a fraction of the free disk space.
    cache_size: int | None = None
    fill_concurrency: int = default_of("fill_concurrency")
    fill_part_size: int = default_of("fill_part_size")
    pins: tuple[str, ...] = ()  # models filled at start and never evicted
    origin_token: str | None = None  # bearer token for an upstream weightserve
    # (CA, client certificate, key) PEM files for an https:// upstream; None: system CAs
    origin_tls: tuple[str | None, str | None, str | None] | None = None
    origin_stall_seconds: float = default_of("origin_stall_seconds")
    # Peer fills (service/sources/swarm/): a node cache over an upstream weightserve fills from
    # the other node caches too and seeds what it holds; an upstream admits them. Off for a
    # server built in code (it opens a port); `weightserve serve` turns it on unless
    # --no-peers, where libtorrent is installed (the peers extra).
    peers: bool = False
    peer_port: int = default_of("peer_port")
    peer_address: str | None = None
    peer_upload_limit: int = default_of("peer_upload_limit")
    peer_patience_seconds: float = default_of("peer_patience_seconds")
    # Same-node Unix sockets (docs/deploy.md): HTTP on UDS, gRPC on UDS.grpc and the
    # zero-copy descriptor handoff on UDS.handoff; None: none. Plain (no TLS): the kernel is
    # the transport, and peers are told apart by their credentials.
    uds: str | None = None
    # Who may connect is decided by who can reach the directory.
    uds_mode: int = default_of("uds_mode")
    uds_uids: tuple[int, ...] = ()  # if given, only these user ids get descriptors
    # Memory for the handoff's sealed snapshots (service/sources/files/snapshots.py); None: a
    # quarter of what the server may use, 0: none (clients copy).
    handoff_snapshot_bytes: int | None = None


def freeze_startup_heap() -> None:
    """Leave every object alive now out of the cyclic collector's passes (``gc.freeze``), what
    is garbage already collected first. Call it once the server is up.

    A started server holds about 100,000 objects (FastAPI's routes and models, grpc,
    pyarrow), and each full collection walked them all with the GIL held: a stall of 40-50 ms
    for every stream and request, about once per dozen whole-model loads (docs/performance.md,
    "A server's startup heap"). Objects made later are collected as before. Only for a process
    that is the server (``serve``, the bench's server): garbage that forms among the frozen
    objects is never freed, which the later work of a process embedding a server could make.
    """
    gc.collect()
    gc.freeze()


def is_origin_uri(root: str) -> bool:
    """Whether ROOT names an origin (``SCHEME://...``) rather than a local directory."""
    return "://" in root


def check_listeners(config: ServerConfig) -> None:
    """Fail now, before the catalog is scanned, when the host is not one of this machine's
    addresses or a listener's port is taken. ``start`` checks again: a port can be taken in
    between."""
    _check_ports_distinct(config)
    check_port_free("HTTP", "http_port", config.host, config.http_port)
    check_port_free("gRPC", "grpc_port", config.host, config.grpc_port)
    if config.flight_port is not None:
        check_port_free("Arrow Flight", "flight_port", config.host, config.flight_port)


def uds_paths(uds: str) -> dict[str, str]:
    """The same-node sockets ``--uds PATH`` creates, by what they serve."""
    return {"http": uds, "grpc": uds + ".grpc", "handoff": uds + ".handoff"}


def _check_ports_distinct(config: ServerConfig) -> None:
    listeners = [("HTTP", "http_port", config.http_port), ("gRPC", "grpc_port", config.grpc_port)]
    if config.flight_port is not None:
        listeners.append(("Arrow Flight", "flight_port", config.flight_port))
    taken: dict[int, str] = {}
    for name, setting, port in listeners:
        if port and port in taken:
            raise StartupError(
                setting,
                f"the {name} and {taken[port]} endpoints are both given port {port}; each "
                "needs its own",
            )
        taken[port] = name


def _read_pem(setting: str, what: str, path: str, marker: bytes) -> None:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise StartupError(setting, f"cannot read the {what} {path}: {e.strerror or e}") from None
    if marker not in data:
        raise StartupError(
            setting, f"{path} is not a PEM {what} (no '{marker.decode()}' line); give a PEM file"
        )


def _check_tls(config: ServerConfig) -> None:
    """Every TLS file readable, PEM, and the key that of the certificate, before any port is
    bound: otherwise each transport fails later in its own words (Flight: "port in use?")."""
    cert, key, ca = config.tls_cert, config.tls_key, config.tls_client_ca
    if bool(cert) != bool(key):
        given, missing = ("certificate", "private key") if cert else ("private key", "certificate")
        raise StartupError(
            "tls_key" if cert else "tls_cert",
            f"TLS needs both a certificate and its private key; the {given} is given, "
            f"the {missing} is not",
        )
    if ca and not cert:
        raise StartupError(
            "tls_client_ca", "mutual TLS needs the server's own certificate and key too"
        )
    if not cert or not key:
        return
    _read_pem("tls_cert", "certificate", cert, b"-----BEGIN CERTIFICATE-----")
    _read_pem("tls_key", "private key", key, b"PRIVATE KEY-----")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password callback that gives none: an encrypted key fails instead of prompting.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as e:
        raise StartupError(
            "tls_key",
            f"the private key {key} does not fit the certificate {cert}, is encrypted, or is "
            f"malformed ({e.reason or e}); give the certificate's unencrypted PEM key",
        ) from None
    if ca:
        _read_pem("tls_client_ca", "CA certificate", ca, b"-----BEGIN CERTIFICATE-----")
        try:
            context.load_verify_locations(cafile=ca)
        except ssl.SSLError as e:
            raise StartupError(
                "tls_client_ca", f"{ca} holds no usable CA certificate ({e.reason or e})"
            ) from None


def _token_store(path: str) -> TokenStore:
    try:
        return TokenStore(path)
    except OSError as e:
        raise StartupError(
            "token_file", f"cannot read the token file {path}: {e.strerror or e}"
        ) from None
    except ValueError as e:  # the file holds no token
        raise StartupError(
            "token_file",
            f"{e}; write one bearer token per line, each optionally followed by the model ids "
            "it may read",
        ) from None


def build_served(
    config: ServerConfig,
    metrics: Metrics,
    feed: RevisionFeed,
    source: ModelSource | None = None,
) -> Served:
    """The source the configuration names and what comes with it, composed once: a local
    root takes publishes into itself and keeps deltas beside them; a node cache announces the
    revisions it holds, follows an upstream weightserve, takes publishes into the bucket it
    serves, and gives the operator its controls. The source's callbacks (refusals counted,
    revisions announced) reach ``metrics`` and ``feed``, which the serving state is built with.
    ``source``: one built already (served with what comes with its kind; its callbacks are
    its own)."""
    events = _SourceEvents(metrics, feed)
    if source is None:
        if is_origin_uri(config.root):
            source = _origin_catalog(config, events)
        else:
            source = Catalog(
                config.root,
                # A node cache's digests are its fill records; a local root remembers them here.
                digests=DigestStore(config.cache_dir) if config.cache_dir else None,
                on_refused=events.refused,
            )
    if isinstance(source, Catalog):
        served = _local_served(config, source, events)
    elif isinstance(source, OriginCatalog):
        served = _origin_served(config, source, events)
    else:
        served = Served(source)
    return dataclasses.replace(served, **_swarm_desk(config))


def _swarm_desk(config: ServerConfig) -> dict[str, Any]:
    """The desk that admits node caches to a revision's swarm (any server can be an upstream),
    or why there is none."""
    from weightserve.service.demo import default_cache_dir

    if not config.peers:
        return {"swarm_off": "peer fills are off on this server (--no-peers)"}
    missing = libtorrent_missing()
    if missing is not None:
        return {"swarm_off": f"peer fills are off on this server: {missing}"}
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    return {"swarm_desk": SwarmDesk(cache_dir / "swarm")}


@dataclass(frozen=True)
class _SourceEvents:
    """The callbacks a source and its publisher are built with."""

    metrics: Metrics
    feed: RevisionFeed

    def refused(self, problem: Problem) -> None:
        self.metrics.model_refusals.inc()

    def counted(self, event: str) -> None:
        self.metrics.revisions.labels(event).inc()

    def published(self, model_id: str, record: dict[str, Any]) -> None:
        """A new revision is main: counted, and every watcher of the model told."""
        self.counted("published")
        self.feed.announce(model_id, record)

    def removed(self, model_id: str, commit: str) -> None:
        self.counted("removed")


def _local_served(config: ServerConfig, catalog: Catalog, events: _SourceEvents) -> Served:
    """A local root: revisions are published into it, the patches between them kept beside
    them."""
    store = DirectoryStore(catalog.root)
    publisher = Publisher(
        catalog,
        store,
        config.max_upload_bytes,
        config.keep_revisions,
        on_published=events.published,
        on_removed=events.removed,
        digests=catalog.digests,
        streamed=catalog.streamed,
        body_timeout=config.upload_body_timeout,
        idle_seconds=config.upload_idle_timeout,
    )
    return Served(catalog, publisher=publisher, revision_log=publisher, kept_deltas=store.deltas)


def _origin_served(config: ServerConfig, catalog: OriginCatalog, events: _SourceEvents) -> Served:
    """A node cache: it announces a model's revision once it holds it, follows an upstream
    weightserve by watching it (service/sources/origin/follow.py), and takes publishes into
    the bucket it serves."""
    origin = catalog.origin
    follower = None
    if isinstance(origin, UpstreamOrigin) and config.follow:
        follower = UpstreamFollower(catalog, origin.events, origin.interrupt_events)
    publisher = None
    if isinstance(origin, FileSystemOrigin):  # publishes go into the bucket
        publisher = Publisher(
            catalog,
            BucketStore(
                origin.fs, origin.prefix, catalog.cache.directory / "uploads", origin.description
            ),
            config.max_upload_bytes,
            config.keep_revisions,
            # Announced by the node once it holds the bytes (OriginCatalog.scan).
            on_published=lambda model, record: events.counted("published"),
            on_removed=events.removed,
            body_timeout=config.upload_body_timeout,
            idle_seconds=config.upload_idle_timeout,
        )
    peers = catalog.cache.peers
    return Served(
        catalog,
        publisher=publisher,
        revision_log=catalog.revision_log,
        cache_controls=catalog.admin,
        cache_stats=catalog.cache.snapshot,
        follower=follower,
        peer_counters=peers.engine.snapshot if peers is not None else None,
    )


def _origin_catalog(config: ServerConfig, events: _SourceEvents) -> OriginCatalog:
    """The catalog of an origin through the node cache in CACHE_DIR/node-cache; the pinned
    models are filled before it returns."""
    from weightserve.service.demo import default_cache_dir

    try:
        ca, cert, key = config.origin_tls or (None, None, None)
        tls = TLSOptions(ca, cert, key) if ca or cert or key else None
        origin = open_origin(
            config.root,
            token=config.origin_token,
            tls=tls,
            stall_seconds=config.origin_stall_seconds,
        )
    except ValueError as e:
        raise StartupError("root", str(e)) from None
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    directory = cache_dir / "node-cache"

    def open_cache(*, on_evict: Callable[[], None]) -> NodeCache:
        peers = _peer_fills(config, origin)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return NodeCache(
                origin,
                directory,
                config.cache_size or None,  # None: a share of the file system's room, per fill
                concurrency=config.fill_concurrency,
                part_bytes=config.fill_part_size,
                pins=config.pins,
                watch=config.watch,
                on_evict=on_evict,
                peers=peers,
            )
        except OSError as e:
            raise StartupError(
                "cache_dir", f"cannot use {directory} as the node cache: {e.strerror or e}"
            ) from None
        except ModelUnavailable as e:  # the directory is another server's
            raise StartupError("cache_dir", str(e)) from None

    try:
        catalog = OriginCatalog(
            open_cache, on_refused=events.refused, on_revision=events.feed.announce
        )
    except BaseException:  # the catalog closed the cache it opened
        origin.close()
        raise
    cache = catalog.cache
    try:
        cache.warm(None if catalog.origin_error else _listing(catalog))
    except WeightserveError as e:
        catalog.close()  # the cache's directory and the origin
        raise StartupError("pin", f"cannot fill the pinned models: {e}") from None
    catalog.scan()
    return catalog


def _peer_fills(config: ServerConfig, origin: Origin) -> PeerFills | None:
    """A node cache's side of the swarm, over an upstream weightserve where it is on."""
    if not isinstance(origin, UpstreamOrigin) or not config.peers:
        return None
    missing = libtorrent_missing()
    if missing is not None:
        log.info("peer fills off: %s; the node fills from its upstream alone", missing)
        return None
    settings = PeerSettings(
        port=config.peer_port,
        host=config.host,
        advertise=config.peer_address,
        upload_limit=config.peer_upload_limit,
        patience_seconds=config.peer_patience_seconds,
    )
    try:
        engine = PeerEngine(settings, origin.join_swarm)
    except OSError as e:
        raise StartupError("peer_port", str(e)) from None
    log.info("peer fills on: other node caches reach this one at port %d (TLS)", engine.port)
    return PeerFills(engine, origin)


def _listing(catalog: OriginCatalog) -> list[OriginFile]:
    return [f for model in catalog.remote.values() for f in model.files]


class WeightServer:
    def __init__(self, config: ServerConfig, catalog: ModelSource | None = None) -> None:
        self.config = config
        # Settings first: a mistake there is reported before the root is scanned.
        _check_tls(config)
        _check_ports_distinct(config)
        tokens = _token_store(config.token_file) if config.token_file else None
        metrics, feed = Metrics(), RevisionFeed()
        served = build_served(config, metrics, feed, catalog)
        self.catalog: ModelSource = served.source
        self._follower = served.follower
        self.listeners: list[Listener] = []  # those started (or starting), in start order
        self._http: UvicornListener | None = None
        self._grpc: GrpcListener | None = None
        self._flight: FlightListener | None = None
        self._handoff_listener: HandoffListener | None = None
        self.state = ServiceState(
            served,
            config.limits,
            tokens,
            config.protect_metrics,
            allow_publish=config.allow_publish,
            metrics=metrics,
            feed=feed,
            lifecycle=Lifecycle(
                self._advertised_ports, uds_paths(config.uds)["http"] if config.uds else None
            ),
        )
        self._stop_rescan = threading.Event()

    # The ports bound (0: not listening, or not yet).
    @property
    def http_port(self) -> int:
        return self._http.port if self._http is not None else 0

    @property
    def http_app(self) -> WeightserveApp | None:
        """The HTTP app (its counters say which paths engaged), once started."""
        return self._http.app if self._http is not None else None

    @property
    def grpc_port(self) -> int:
        return self._grpc.port if self._grpc is not None else 0

    @property
    def flight_port(self) -> int:
        return self._flight.port if self._flight is not None else 0

    def _advertised_ports(self) -> Ports:
        """What the transports report: each listener's port once bound, Flight's as clients
        are told to dial it."""
        flight = self._flight.advertised_port if self._flight is not None else 0
        return Ports(self.http_port, self.grpc_port, flight)

    @property
    def tls(self) -> bool:
        return bool(self.config.tls_cert)

    @property
    def http_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{url_host(self.config.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        scheme = "grpcs" if self.tls else "grpc"
        return f"{scheme}://{url_host(self.config.host)}:{self.grpc_port}"

    @property
    def flight_url(self) -> str:
        scheme = "grpc+tls" if self.tls else "grpc"
        return f"{scheme}://{url_host(self.config.host)}:{self.flight_port}"

    def _tls_material(self) -> tuple[bytes, bytes, bytes | None] | None:
        """(certificate chain, key, client CA or None) as PEM bytes; None without TLS."""
        c = self.config
        if not c.tls_cert:
            return None
        ca = Path(c.tls_client_ca).read_bytes() if c.tls_client_ca else None
        return Path(c.tls_cert).read_bytes(), Path(c.tls_key or "").read_bytes(), ca

    def _flight_tls(self) -> dict:
        """pyarrow.flight's TLS settings: the same certificate (and client CA) as gRPC."""
        material = self._tls_material()
        if material is None:
            return {}
        cert, key, ca = material
        settings: dict = {"tls_certificates": [(cert, key)]}
        if ca is not None:
            settings.update(verify_client=True, root_certificates=ca)
        return settings

    def _grpc_credentials(self) -> grpc.ServerCredentials | None:
        material = self._tls_material()
        if material is None:
            return None
        cert, key, ca = material
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def _http_tls(self) -> dict:
        """uvicorn's TLS settings: the same certificate (and client CA) as gRPC."""
        c = self.config
        if not c.tls_cert:
            return {}
        settings: dict = {"ssl_certfile": c.tls_cert, "ssl_keyfile": c.tls_key}
        if c.tls_client_ca:
            settings.update(ssl_ca_certs=c.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return settings

    def start(self) -> WeightServer:
        try:
            return self._start()
        except BaseException:
            self.stop(grace=0)  # e.g. a port in use: do not leave the other listeners running
            raise

    def _start(self) -> WeightServer:
        for listener in self._planned_listeners():
            self.listeners.append(listener)  # first: a listener that fails half-way is stopped
            listener.start()
        self._start_catalog_upkeep()
        catalog = self.catalog
        # A node cache serves what its origin lists (the banner's count), cached or not.
        served = catalog.listed if isinstance(catalog, FillsOnRequest) else catalog.models
        log.info(
            "serving %d models: %s %s%s",
            len(served),
            self.http_url,
            self.grpc_url,
            f" (Flight {self.flight_url})" if self.flight_port else "",
        )
        return self

    def _planned_listeners(self) -> list[Listener]:
        """Every endpoint the configuration asks for, in start order: HTTP on its port and
        on the same-node socket, Flight before gRPC (GetServerInfo must never answer "no
        Flight" while it starts), gRPC (on the socket too), the handoff socket."""
        c = self.config
        app = create_app(self.state, sendfile=c.sendfile)
        idle, grace = self.state.limits.idle_timeout, c.grace_seconds
        self._http = UvicornListener(
            app, c.host, c.http_port, idle_timeout=idle, grace_seconds=grace, **self._http_tls()
        )
        planned: list[Listener] = [self._http]
        paths = uds_paths(c.uds) if c.uds else None
        if paths is not None:
            planned.append(
                UvicornListener(
                    app,
                    uds=paths["http"],
                    uds_mode=c.uds_mode,
                    idle_timeout=idle,
                    grace_seconds=grace,
                )
            )
        if c.flight_port is not None:
            self._flight = FlightListener(
                self.state, c.host, c.flight_port, c.flight_public_port, **self._flight_tls()
            )
            planned.append(self._flight)
        self._grpc = GrpcListener(
            self.state,
            c.host,
            c.grpc_port,
            self._grpc_credentials(),
            uds=paths["grpc"] if paths is not None else None,
            uds_mode=c.uds_mode,
        )
        planned.append(self._grpc)
        if paths is not None:
            uids = frozenset(c.uds_uids) if c.uds_uids else None
            self._handoff_listener = HandoffListener(
                HandoffEndpoint(paths["handoff"], c.uds_mode, uids, c.handoff_snapshot_bytes),
                self.state,
            )
            planned.append(self._handoff_listener)
        return planned

    # Tests reach the running servers through these.
    @property
    def _uvicorn(self) -> uvicorn.Server | None:
        return self._http.server if self._http is not None else None

    @property
    def _handoff(self) -> HandoffServer | None:
        listener = self._handoff_listener
        return listener.server if listener is not None else None

    # How long start() waits for the first content revisions: small roots are ready when it
    # returns; a large never-seen model reports "warming" on /readyz until it is hashed.
    WARM_WAIT_SECONDS = 2.0

    def _start_catalog_upkeep(self) -> None:
        """Revisions computed in the background (readiness waits for them), and rescans: on
        file-system events where the platform has them, and every ``rescan_seconds``."""
        warmed = threading.Event()

        def warm() -> None:
            try:
                self.catalog.warm_revisions()
            finally:
                self.state.lifecycle.warming.clear()
                warmed.set()

        self.state.lifecycle.warming.set()
        threading.Thread(target=warm, name="weightserve-revisions", daemon=True).start()
        if not warmed.wait(self.WARM_WAIT_SECONDS):
            log.info(
                "computing content revisions of %d models (once per file version); ready when done",
                self.catalog.pending_revisions,
            )
            self._set_grpc_health(serving=False)

            def serving_when_warm() -> None:
                warmed.wait()
                self._set_grpc_health(not self.state.draining)

            threading.Thread(target=serving_when_warm, daemon=True).start()
        if self.config.rescan_seconds > 0:
            threading.Thread(
                target=self._rescan_loop, name="weightserve-rescan", daemon=True
            ).start()
        # A node cache's directory changes only by its own fills and evictions, which index
        # the cache themselves; the origin is relisted by the periodic rescan.
        if self.config.watch and self.catalog.watch_files:
            threading.Thread(target=self._watch_loop, name="weightserve-watch", daemon=True).start()
        if self._follower is not None:
            self._follower.start()

    def _set_grpc_health(self, serving: bool) -> None:
        if self._grpc is not None:
            self._grpc.set_serving(serving)

    def rescan(self) -> None:
        try:
            self.catalog.scan()
            self.state.refresh_gauges()
            self.catalog.warm_revisions()
        except Exception:  # a failed scan must not stop later ones
            log.exception("rescan of %s failed", self.catalog.root)

    def _rescan_loop(self) -> None:
        while not self._stop_rescan.wait(self.config.rescan_seconds):
            self.rescan()

    def _watch_loop(self) -> None:
        """Rescan soon after files under the root change (inotify through watchfiles), so a
        fixed or new model does not wait for the periodic rescan. The periodic rescan stays:
        watches miss changes on network file systems and in directories created later."""
        try:
            import watchfiles
        except ImportError:  # pragma: no cover - a server dependency
            return
        default_filter = watchfiles.DefaultFilter()
        kept_deltas = f"/{RECORDS_DIR}/{DELTAS_DIR}/"

        def _catalog_changes(change: watchfiles.Change, path: str) -> bool:
            # A delta the server keeps beside its revisions changes no model: no rescan.
            return kept_deltas not in path and default_filter(change, path)

        try:
            for _changes in watchfiles.watch(
                self.catalog.root,
                watch_filter=_catalog_changes,
                stop_event=self._stop_rescan,
                debounce=500,  # a copy in progress is many events: scan once it settles
                rust_timeout=1000,
                yield_on_timeout=False,
                raise_interrupt=False,
            ):
                self.rescan()
        except Exception as e:  # e.g. inotify watch limit reached: the periodic rescan remains
            log.warning(
                "watching %s for changes stopped (%s); rescanning every %s s",
                self.catalog.root,
                e,
                self.config.rescan_seconds,
            )

    # How long stop() waits for each listener to close once the grace period is over.
    STOP_WAIT_SECONDS = 5.0

    def stop(self, grace: float | None = None) -> None:
        """Drain: readiness turns false and new streams are refused, open streams get
        ``grace`` seconds to finish, then every listener stops, the last started first."""
        grace = self.config.grace_seconds if grace is None else grace
        self._stop_rescan.set()
        if self._follower is not None:
            self._follower.stop()
        self.state.lifecycle.draining.set()
        for listener in self.listeners:
            listener.drain()
        drained = self.state.wait_for_streams(grace)
        if not drained:
            log.warning(
                "%d streams still open after %.0f s; closing them", self.state.open_streams, grace
            )
        stopping, self.listeners = self.listeners, []  # a second stop has nothing to do
        for listener in reversed(stopping):
            try:
                listener.stop(force=not drained, wait=self.STOP_WAIT_SECONDS)
            except Exception:  # the others are stopped all the same
                log.exception("stopping the %s listener failed", listener.name)
        self.catalog.close()  # a node cache's directory: a restarted server may take it over

    def __enter__(self) -> WeightServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=1.0)
