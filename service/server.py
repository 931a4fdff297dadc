"""Both transports in one process over one catalog, with a clean shutdown.

``WeightServer`` binds its sockets first (port 0 picks a free port, which tests use), then runs
uvicorn on its own thread and the gRPC server on its thread pool. ``stop`` drains: readiness
turns false, new streams are refused, open streams get ``grace`` seconds to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import uvicorn

from weightserve.client.errors import ModelUnavailable, WeightserveError
from weightserve.client.transports.base import TLSOptions
from weightserve.service.config import default_of
from weightserve.service.serving.auth import TokenStore
from weightserve.service.serving.state import Limits, ServiceState
from weightserve.service.sources.base import ModelSource
from weightserve.service.sources.local import Catalog
from weightserve.service.sources.node_cache import NodeCache
from weightserve.service.sources.origin import OriginCatalog, default_cache_size
from weightserve.service.sources.origins import OriginFile, open_origin
from weightserve.service.sources.revisions import DigestStore
from weightserve.service.transports.flight import FlightService
from weightserve.service.transports.grpc import SERVICE_NAME, create_grpc_server
from weightserve.service.transports.handoff import HandoffServer
from weightserve.service.transports.http.app import create_app

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
    tls_cert: str | None = None  # PEM certificate chain: enables TLS on both transports
    tls_key: str | None = None
    tls_client_ca: str | None = None  # require client certificates signed by this CA (mTLS)
    # How often the root is searched for new or removed models.
    rescan_seconds: float = default_of("rescan")
    watch: bool = True  # rescan on file-system events too (inotify), not only periodically
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
    # Same-node Unix sockets (docs/deploy.md): HTTP on UDS, gRPC on UDS.grpc and the
    # zero-copy descriptor handoff on UDS.handoff; None: none. Plain (no TLS): the kernel is
    # the transport, and peers are told apart by their credentials.
    uds: str | None = None
    # Who may connect is decided by who can reach the directory.
    uds_mode: int = default_of("uds_mode")
    uds_uids: tuple[int, ...] = ()  # if given, only these user ids get descriptors


def is_origin_uri(root: str) -> bool:
    """Whether ROOT names an origin (``SCHEME://...``) rather than a local directory."""
    return "://" in root


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class StartupError(RuntimeError):
    """The server cannot start as configured. ``setting`` names the ServerConfig field to
    change (the command line turns it into its flag and environment variable); the message
    says what is wrong and what would work."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


def _listen_error(listener: str, setting: str, host: str, port: int, e: OSError) -> StartupError:
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return StartupError(
            "host",
            f"cannot listen on {host!r}: not an address of this machine ({e.strerror or e}); "
            "use 127.0.0.1, 0.0.0.0 (every IPv4 address) or :: (every IPv6 address)",
        )
    where = f"the {listener} endpoint could not listen on {_url_host(host)}:{port}"
    if e.errno == errno.EADDRINUSE:
        return StartupError(
            setting,
            f"{where}: the port is already in use (another weightserve?); stop what holds it "
            "or choose another port (0: any free port)",
        )
    if e.errno == errno.EACCES:
        return StartupError(
            setting, f"{where}: permission denied (ports below 1024 need privileges)"
        )
    return StartupError(setting, f"{where}: {e.strerror or e}")


def _check_port_free(listener: str, setting: str, host: str, port: int) -> None:
    """Fail with a clear StartupError before a gRPC library tries ``port``: grpc-core says
    only "failed to bind" (and logs to stderr on its own). Port 0 checks the host alone."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            probe.bind((host, port))
        except OSError as e:
            raise _listen_error(listener, setting, host, port, e) from None


def check_listeners(config: ServerConfig) -> None:
    """Fail now, before the catalog is scanned, when the host is not one of this machine's
    addresses or a listener's port is taken. ``start`` checks again: a port can be taken in
    between."""
    _check_ports_distinct(config)
    _check_port_free("HTTP", "http_port", config.host, config.http_port)
    _check_port_free("gRPC", "grpc_port", config.host, config.grpc_port)
    if config.flight_port is not None:
        _check_port_free("Arrow Flight", "flight_port", config.host, config.flight_port)


def _claim_socket_path(path: str) -> None:
    """Make ``path`` free for a new Unix socket: a stale socket of a server that is gone is
    removed; a live one, or anything that is not a socket, is a StartupError."""
    p = Path(path)
    if not p.parent.is_dir():
        raise StartupError(
            "uds", f"cannot listen on {path}: the directory {p.parent} does not exist"
        )
    try:
        st = p.lstat()
    except FileNotFoundError:
        return
    import stat

    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError("uds", f"{path} exists and is not a socket; choose another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            p.unlink()  # nobody listens: left behind by a server that stopped without cleaning
            return
    raise StartupError(
        "uds",
        f"another server listens on {path} (another weightserve?); stop it or choose another path",
    )


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


def _origin_catalog(config: ServerConfig, digests: DigestStore | None) -> OriginCatalog:
    """The catalog of an origin through the node cache in CACHE_DIR/node-cache; the pinned
    models are filled before it returns."""
    from weightserve.service.demo import default_cache_dir

    try:
        ca, cert, key = config.origin_tls or (None, None, None)
        tls = TLSOptions(ca, cert, key) if ca or cert or key else None
        origin = open_origin(config.root, token=config.origin_token, tls=tls)
    except ValueError as e:
        raise StartupError("root", str(e)) from None
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    directory = cache_dir / "node-cache"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        size = config.cache_size or default_cache_size(directory)
        cache = NodeCache(
            origin,
            directory,
            size,
            concurrency=config.fill_concurrency,
            part_bytes=config.fill_part_size,
            pins=config.pins,
        )
    except OSError as e:
        raise StartupError(
            "cache_dir", f"cannot use {directory} as the node cache: {e.strerror or e}"
        ) from None
    except ModelUnavailable as e:  # the directory is another server's
        raise StartupError("cache_dir", str(e)) from None
    catalog = OriginCatalog(cache, digests=digests)
    try:
        cache.warm(None if catalog.origin_error else _listing(catalog))
    except WeightserveError as e:
        cache.close()
        raise StartupError("pin", f"cannot fill the pinned models: {e}") from None
    catalog.scan()
    return catalog


def _listing(catalog: OriginCatalog) -> list[OriginFile]:
    return [f for model in catalog.remote.values() for f in model.files]


class WeightServer:
    def __init__(self, config: ServerConfig, catalog: ModelSource | None = None) -> None:
        self.config = config
        # Settings first: a mistake there is reported before the root is scanned.
        _check_tls(config)
        _check_ports_distinct(config)
        tokens = _token_store(config.token_file) if config.token_file else None
        digests = DigestStore(config.cache_dir) if config.cache_dir else None
        self.catalog: ModelSource = catalog or (
            _origin_catalog(config, digests)
            if is_origin_uri(config.root)
            else Catalog(config.root, digests=digests)
        )
        self.state = ServiceState(self.catalog, config.limits, tokens, config.protect_metrics)
        self._http_thread: threading.Thread | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._grpc: grpc.Server | None = None
        self.http_port = 0
        self.grpc_port = 0
        self._flight: FlightService | None = None
        self.flight_port = 0
        self._uvicorn_uds: uvicorn.Server | None = None
        self._handoff: HandoffServer | None = None
        self._stop_rescan = threading.Event()

    @property
    def tls(self) -> bool:
        return bool(self.config.tls_cert)

    @property
    def http_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{_url_host(self.config.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        scheme = "grpcs" if self.tls else "grpc"
        return f"{scheme}://{_url_host(self.config.host)}:{self.grpc_port}"

    @property
    def flight_url(self) -> str:
        scheme = "grpc+tls" if self.tls else "grpc"
        return f"{scheme}://{_url_host(self.config.host)}:{self.flight_port}"

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

    def _start_flight(self) -> None:
        scheme = "grpc+tls" if self.tls else "grpc+tcp"
        host, port = self.config.host, self.config.flight_port or 0
        _check_port_free("Arrow Flight", "flight_port", host, port)
        location = f"{scheme}://{_url_host(host)}:{port}"
        try:
            self._flight = FlightService(self.state, location, **self._flight_tls())
        except pa.ArrowException as e:  # pyarrow says only "Server did not start properly"
            raise StartupError(
                "flight_port",
                f"the Arrow Flight endpoint could not listen on {location} (the port taken "
                f"since it was checked?): {e}",
            ) from e
        self.flight_port = self._flight.port
        self.state.flight_port = self.config.flight_public_port or self.flight_port

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
        host = self.config.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP given explicitly: asyncio sets TCP_NODELAY only on sockets that say so,
        # and without it small responses on kept-alive connections wait 40 ms (Nagle).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux; accepted connections inherit it
            # A client that stops reading is cut by the stream's idle timeout, but closing the
            # connection waits for its unsent data; this lets the kernel drop it instead.
            idle_ms = int(self.state.limits.idle_timeout * 1000)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, idle_ms)
        try:
            sock.bind((host, self.config.http_port))
        except OSError as e:
            sock.close()
            raise _listen_error("HTTP", "http_port", host, self.config.http_port, e) from None
        self.http_port = sock.getsockname()[1]
        app = create_app(self.state)
        self._uvicorn = self._uvicorn_server(app, **self._http_tls())
        uds_sock = self._bind_uds_http(app) if self.config.uds else None
        started = threading.Event()

        def run_http() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)

            async def main() -> None:
                task = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))  # type: ignore[union-attr]
                tasks = [task]
                if self._uvicorn_uds is not None:
                    assert uds_sock is not None
                    tasks.append(asyncio.ensure_future(self._uvicorn_uds.serve(sockets=[uds_sock])))
                servers = [s for s in (self._uvicorn, self._uvicorn_uds) if s is not None]
                while not all(s.started for s in servers) and not any(t.done() for t in tasks):
                    await asyncio.sleep(0.01)
                started.set()
                await asyncio.gather(*tasks)

            try:
                loop.run_until_complete(main())
            finally:
                started.set()
                loop.close()

        self._http_thread = threading.Thread(target=run_http, name="weightserve-http", daemon=True)
        self._http_thread.start()
        if self.config.flight_port is not None:
            # Before gRPC: GetServerInfo must never answer "no Flight" while it starts.
            self._start_flight()  # pyarrow.flight serves on its own threads once constructed
        _check_port_free("gRPC", "grpc_port", host, self.config.grpc_port)
        try:
            self._grpc, self.grpc_port = create_grpc_server(
                self.state,
                f"{_url_host(host)}:{self.config.grpc_port}",
                credentials=self._grpc_credentials(),
            )
        except RuntimeError as e:  # grpc: "Failed to bind to address ..."
            raise StartupError(
                "grpc_port",
                f"the gRPC endpoint could not listen on {_url_host(host)}:"
                f"{self.config.grpc_port}: {e}",
            ) from e
        if self.config.uds:
            self._start_uds_grpc_and_handoff(self.config.uds)
        self._grpc.start()
        if self.config.uds:  # grpc-core creates its socket with the process umask
            os.chmod(uds_paths(self.config.uds)["grpc"], self.config.uds_mode)
        started.wait()
        if not self._uvicorn.started:
            raise RuntimeError(f"HTTP server failed to start on {host}:{self.http_port}")
        if self._uvicorn_uds is not None and not self._uvicorn_uds.started:
            raise RuntimeError(f"HTTP server failed to start on {self.config.uds}")
        self.state.http_port, self.state.grpc_port = self.http_port, self.grpc_port
        self._start_catalog_upkeep()
        log.info(
            "serving %d models: %s %s%s",
            len(self.catalog.models),
            self.http_url,
            self.grpc_url,
            f" (Flight {self.flight_url})" if self._flight else "",
        )
        return self

    def _uvicorn_server(self, app: Any, **tls: Any) -> uvicorn.Server:
        return uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                lifespan="off",
                access_log=False,
                timeout_graceful_shutdown=int(self.config.grace_seconds),
                **tls,
            )
        )

    def _bind_uds_http(self, app: Any) -> socket.socket:
        """The HTTP API on the same-node socket: a second uvicorn server (no TLS) on the
        same event loop and app."""
        assert self.config.uds
        path = uds_paths(self.config.uds)["http"]
        _claim_socket_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, self.config.uds_mode)
        except OSError as e:
            sock.close()
            raise StartupError("uds", f"cannot listen on {path}: {e.strerror or e}") from None
        self._uvicorn_uds = self._uvicorn_server(app)
        self.state.uds = path
        return sock

    def _start_uds_grpc_and_handoff(self, uds: str) -> None:
        paths = uds_paths(uds)
        assert self._grpc is not None
        for what in ("grpc", "handoff"):
            _claim_socket_path(paths[what])
        if not self._grpc.add_insecure_port(f"unix:{paths['grpc']}"):
            raise StartupError("uds", f"the gRPC endpoint could not listen on {paths['grpc']}")
        uids = frozenset(self.config.uds_uids) if self.config.uds_uids else None
        try:
            self._handoff = HandoffServer(
                paths["handoff"], self.state, self.state.instance, self.config.uds_mode, uids
            ).start()
        except OSError as e:
            raise StartupError(
                "uds", f"cannot listen on {paths['handoff']}: {e.strerror or e}"
            ) from None

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
                self.state.warming = False
                warmed.set()

        self.state.warming = True
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

    def _set_grpc_health(self, serving: bool) -> None:
        """gRPC health follows /readyz (probes may use either)."""
        if self._grpc is None:
            return
        from grpc_health.v1 import health_pb2

        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        for name in ("", SERVICE_NAME):
            self._grpc.health_servicer.set(name, status)  # type: ignore[attr-defined]

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
        try:
            for _changes in watchfiles.watch(
                self.catalog.root,
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

    def stop(self, grace: float | None = None) -> None:
        grace = self.config.grace_seconds if grace is None else grace
        self._stop_rescan.set()
        self.state.draining = True
        if self._grpc is not None:
            self._grpc.health_servicer.enter_graceful_shutdown()  # type: ignore[attr-defined]
        drained = self.state.wait_for_streams(grace)
        if not drained:
            log.warning(
                "%d streams still open after %.0f s; closing them", self.state.open_streams, grace
            )
        if self._grpc is not None:
            self._grpc.stop(0).wait()
        if self._flight is not None:
            # shutdown() waits for open calls: streams still open after the grace period end
            # at their next batch (pyarrow cannot cancel a call from the server side).
            self._flight.closing = True
            closer = threading.Thread(target=self._flight.shutdown, daemon=True)
            closer.start()
            closer.join(timeout=5)
        for server in (self._uvicorn, self._uvicorn_uds):
            if server is not None:
                server.should_exit = True
                if not drained:
                    server.force_exit = True
        if self._handoff is not None:
            self._handoff.stop()
        if self._http_thread is not None:
            self._http_thread.join(timeout=grace + 5)
        self.catalog.close()  # a node cache's directory: a restarted server may take it over
        if self.config.uds:
            for path in uds_paths(self.config.uds).values():
                with contextlib.suppress(OSError):
                    if Path(path).is_socket():
                        os.unlink(path)

    def __enter__(self) -> WeightServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=1.0)
