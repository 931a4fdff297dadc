"""``weightserve serve``: the server's part of the command line (the rest is the client's)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weightserve.client._arg_types import (
    non_empty,
    non_negative_seconds,
    one_of,
    port,
    port_or_off,
    positive_int,
    positive_seconds,
    switch,
)
from weightserve.service.serving.state import Limits
from weightserve.service.sources.local import GGUF_SUFFIXES, PYTORCH_SUFFIXES, SAFETENSORS_SUFFIXES
from weightserve.service.sources.node_cache import parse_size
from weightserve.service.sources.origin import OriginCatalog
from weightserve.service.sources.origins import DEFAULT_CONCURRENCY, DEFAULT_PART_BYTES

if TYPE_CHECKING:
    from weightserve.service.server import WeightServer

log = logging.getLogger("weightserve.serve")


@dataclass(frozen=True)
class Setting:
    """One ``serve`` option: its flag, environment variable, value check and default.

    ``SETTINGS`` is the one list: the parser, the environment, ``serve --help`` and the
    README's Configuration table come from it (tests/test_startup_errors.py compares them).
    """

    flag: str  # "--http-port"; "root" for the positional argument
    env: str
    default: object  # when neither the flag nor the variable is given
    help: str
    value: Callable[[str], object] | None = None  # None: a switch, on when the flag is given
    shown_default: str | None = None  # how --help and the README show the default
    # Given any number of times (the variable: comma-separated); the value is a tuple.
    repeat: bool = False

    @property
    def dest(self) -> str:
        """The attribute argparse sets; for listeners and files, ServerConfig's field too."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def label(self) -> str:
        """How an error names this setting: ``--http-port (WEIGHTSERVE_HTTP_PORT)``."""
        name = self.flag if self.flag.startswith("-") else self.flag.upper()
        return f"{name} ({self.env})"

    @property
    def default_text(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.value is None:
            return "off"
        return str(self.default)


def byte_size(text: str) -> int:
    """A number of bytes, optionally with a unit: 500GiB, 64MiB, 2TB."""
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def socket_path(text: str) -> str:
    """A path for a Unix socket (sun_path holds at most 107 bytes, the longest derived name
    adds ".handoff")."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    if len(os.fsencode(text)) + len(".handoff") > 107:
        raise argparse.ArgumentTypeError(
            f"{text!r} is too long for a Unix socket (at most 99 bytes); use a shorter path"
        )
    return text


def file_mode(text: str) -> int:
    """Permission bits in octal: 660, 0o666."""
    try:
        mode = int(text.removeprefix("0o"), 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r} (e.g. 660)") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"not a permission mode: {text!r} (e.g. 660)")
    return mode


def user_ids(text: str) -> tuple[int, ...]:
    """Comma-separated numeric user ids."""
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a list of user ids: {text!r} (e.g. 1000,1001)"
        ) from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"not a list of user ids: {text!r} (e.g. 1000,1001)")
    return ids


SETTINGS: tuple[Setting, ...] = (
    Setting("root", "WEIGHTSERVE_ROOT", None,
            "model root directory, or an origin to fill the node cache from: "
            "s3://BUCKET/PREFIX or gs://BUCKET/PREFIX (pyarrow.fs URI with its query options, "
            "e.g. ?endpoint_override=HOST:PORT&scheme=http), http(s)://HOST:PORT of another "
            "weightserve, file:///DIR", str,
            "none: give ROOT or --demo"),
    Setting("--demo", "WEIGHTSERVE_DEMO", False,
            "write a small demonstration model into the cache directory (--cache-dir) "
            "and serve it"),
    Setting("--host", "WEIGHTSERVE_HOST", "127.0.0.1",
            "address to bind; 0.0.0.0 in a container", non_empty),
    Setting("--http-port", "WEIGHTSERVE_HTTP_PORT", 8080, "HTTP port, 0: any free port", port),
    Setting("--grpc-port", "WEIGHTSERVE_GRPC_PORT", 50051, "gRPC port, 0: any free port", port),
    Setting("--flight-port", "WEIGHTSERVE_FLIGHT_PORT", 50052,
            "Arrow Flight port for bulk tensor data (gRPC clients find it by themselves), "
            "0: any free port, -1: none", port_or_off),
    Setting("--flight-public-port", "WEIGHTSERVE_FLIGHT_PUBLIC_PORT", None,
            "the Flight port clients dial, when port mapping makes it differ from "
            "--flight-port; 0: the bound port", port, "the bound port"),
    Setting("--uds", "WEIGHTSERVE_UDS", None,
            "same-node Unix socket: HTTP on PATH, gRPC on PATH.grpc and the zero-copy "
            "handoff of file descriptors on PATH.handoff (clients: unix://PATH)", socket_path,
            "none"),
    Setting("--uds-mode", "WEIGHTSERVE_UDS_MODE", 0o666,
            "permission bits of the --uds sockets (octal); who may connect is then decided "
            "by who can reach their directory", file_mode, "666"),
    Setting("--uds-uids", "WEIGHTSERVE_UDS_UIDS", None,
            "only these user ids (comma-separated; checked with SO_PEERCRED) get file "
            "descriptors on the handoff socket", user_ids, "any"),
    Setting("--grace", "WEIGHTSERVE_GRACE_SECONDS", 30.0,
            "seconds open streams get to finish on shutdown", non_negative_seconds, "30 s"),
    Setting("--max-streams", "WEIGHTSERVE_MAX_STREAMS", 64,
            "concurrent tensor streams, all clients together", positive_int),
    Setting("--max-streams-per-client", "WEIGHTSERVE_MAX_STREAMS_PER_CLIENT", 16,
            "concurrent tensor streams of one client (its token, else its address)",
            positive_int),
    Setting("--idle-timeout", "WEIGHTSERVE_IDLE_TIMEOUT", 60.0,
            "seconds a client may read nothing before its stream is cut", positive_seconds,
            "60 s"),
    Setting("--token-file", "WEIGHTSERVE_TOKEN_FILE", None,
            "bearer tokens, one per line, each optionally followed by the model ids or "
            "patterns it may read; re-read when it changes", str, "none: no authentication"),
    Setting("--protect-metrics", "WEIGHTSERVE_PROTECT_METRICS", False,
            "/metrics needs a token too"),
    Setting("--tls-cert", "WEIGHTSERVE_TLS_CERT", None,
            "PEM certificate chain: TLS on HTTP, gRPC and Flight", str, "none: plain TCP"),
    Setting("--tls-key", "WEIGHTSERVE_TLS_KEY", None,
            "PEM private key of --tls-cert (unencrypted)", str, "none"),
    Setting("--tls-client-ca", "WEIGHTSERVE_TLS_CLIENT_CA", None,
            "require client certificates signed by this CA (PEM): mutual TLS", str, "none"),
    Setting("--rescan", "WEIGHTSERVE_RESCAN_SECONDS", 30.0,
            "seconds between full searches of the root for new, changed or removed models "
            "(file-system events start one sooner where the platform reports them), 0: never",
            non_negative_seconds, "30 s"),
    Setting("--no-watch", "WEIGHTSERVE_NO_WATCH", False,
            "rescan only every --rescan seconds, not on file-system events (inotify)"),
    Setting("--cache-dir", "WEIGHTSERVE_CACHE_DIR", None,
            "where file content digests (file-digests.sqlite) are kept across restarts, so "
            "revisions cost no reads after the first, and where --demo writes", str,
            "$XDG_CACHE_HOME/weightserve, else ~/.cache/weightserve"),
    Setting("--cache-size", "WEIGHTSERVE_CACHE_SIZE", None,
            "with an origin ROOT: the most bytes the node cache (CACHE_DIR/node-cache) holds, "
            "e.g. 500GiB; least recently used models are evicted", byte_size,
            "nine tenths of the free disk space at start"),
    Setting("--fill-concurrency", "WEIGHTSERVE_FILL_CONCURRENCY", DEFAULT_CONCURRENCY,
            "with an origin ROOT: ranged reads in flight per file while a model is filled",
            positive_int),
    Setting("--fill-part-size", "WEIGHTSERVE_FILL_PART_SIZE", DEFAULT_PART_BYTES,
            "with an origin ROOT: bytes per ranged read while a model is filled", byte_size,
            "16MiB"),
    Setting("--pin", "WEIGHTSERVE_PIN", (),
            "with an origin ROOT: a model filled at start and never evicted; repeatable "
            "(the variable: comma-separated ids)", non_empty, "none", repeat=True),
    Setting("--origin-token", "WEIGHTSERVE_ORIGIN_TOKEN", None,
            "with an http(s):// origin: the bearer token for the upstream weightserve "
            "(WEIGHTSERVE_TOKEN is not used for it)", str, "none"),
    Setting("--origin-ca", "WEIGHTSERVE_ORIGIN_CA", None,
            "with an https:// origin: trust this CA (PEM) for the upstream weightserve",
            str, "the system's CAs"),
    Setting("--origin-cert", "WEIGHTSERVE_ORIGIN_CERT", None,
            "with an https:// origin that requires mutual TLS: this client certificate (PEM)",
            str, "none"),
    Setting("--origin-key", "WEIGHTSERVE_ORIGIN_KEY", None,
            "the unencrypted PEM private key of --origin-cert", str, "none"),
    Setting("--require-models", "WEIGHTSERVE_REQUIRE_MODELS", False,
            "refuse to start when the root holds no servable model (otherwise: a warning)"),
    Setting("--log-level", "WEIGHTSERVE_LOG_LEVEL", "info",
            "debug, info, warning or error", one_of("debug", "info", "warning", "error")),
)  # fmt: skip
SETTINGS_BY_DEST = {s.dest: s for s in SETTINGS}


class ConfigError(Exception):
    """A setting's value is wrong; the message names the setting and what it accepts."""


# How --help names each kind of value.
_METAVARS: dict[Callable[[str], object], str] = {
    port: "PORT",
    port_or_off: "PORT",
    positive_int: "N",
    positive_seconds: "SECONDS",
    non_negative_seconds: "SECONDS",
    non_empty: "ADDRESS",
    str: "FILE",
    socket_path: "PATH",
    file_mode: "MODE",
    user_ids: "UIDS",
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    # Every default is None here: "not given" lets the environment fill it in later
    # (apply_environment), so a bad variable fails only `serve`, never `ls` or `pull`.
    for s in SETTINGS:
        help_text = f"{s.help} (env {s.env}; default {s.default_text})"
        if s.flag == "root":
            parser.add_argument("root", nargs="?", default=None, metavar="ROOT", help=help_text)
        elif s.value is None:
            parser.add_argument(s.flag, action="store_true", default=None, help=help_text)
        elif s.repeat:
            parser.add_argument(
                s.flag, type=s.value, action="append", default=None, metavar="MODEL", help=help_text
            )
        else:
            metavar = _METAVARS.get(s.value, s.dest.split("_")[-1].upper())
            parser.add_argument(s.flag, type=s.value, default=None, metavar=metavar, help=help_text)


def apply_environment(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> None:
    """Fill each setting the command line left out from its environment variable (checked as
    the flag is), else from its default. An empty variable counts as unset."""
    for s in SETTINGS:
        if getattr(args, s.dest, None) is not None:
            continue
        raw = environ.get(s.env, "")
        if not raw.strip():
            setattr(args, s.dest, s.default)
            continue
        try:
            if s.repeat:
                items = [item.strip() for item in raw.split(",") if item.strip()]
                setattr(args, s.dest, tuple((s.value or str)(item) for item in items))
                continue
            setattr(args, s.dest, (s.value or switch)(raw))
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{s.env}={raw!r} (the variable of {s.flag}): {e}") from None


def _models_wanted() -> str:
    """What the catalog serves, for the message about a root without models."""
    pytorch = ", ".join(f"*{suffix}" for suffix in PYTORCH_SUFFIXES)
    safetensors = ", ".join(f"*{suffix}" for suffix in SAFETENSORS_SUFFIXES)
    gguf = ", ".join(f"*{suffix}" for suffix in GGUF_SUFFIXES)
    return (
        f"the server looks for {safetensors} files, PyTorch checkpoints ({pytorch}) and "
        f"{gguf} files anywhere below it (a directory of checkpoints is one model, so is "
        "each GGUF file)"
    )


def run_serve(args: argparse.Namespace) -> int:
    """Serve as ``args`` (and the environment) say until SIGTERM or SIGINT: 0 after a clean
    shutdown; 2, with one line on stderr naming the setting to change, when it cannot start."""
    from weightserve.service.server import StartupError

    try:
        apply_environment(args)
    except ConfigError as e:
        return _cannot_start(str(e))
    logging.basicConfig(
        level=args.log_level.upper(),
        format='{"time":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","message":"%(message)s"}',
    )
    # Handlers first: a SIGTERM that arrives right after "ready" must still drain cleanly.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = _configured_server(args).start()
    except StartupError as e:
        setting = SETTINGS_BY_DEST.get(e.setting)
        return _cannot_start(f"{setting.label}: {e}" if setting else str(e))
    catalog = server.catalog
    if isinstance(catalog, OriginCatalog):
        print(
            f"weightserve: {len(catalog.remote)} models from {catalog.description}, "
            f"{len(catalog.models)} cached in {catalog.root}",
            flush=True,
        )
    else:
        print(f"weightserve: {len(catalog.models)} models from {catalog.root}", flush=True)
    for problem in catalog.problems.values():
        print(f"  refused {problem.model}: {problem.reason}", flush=True)
    print(f"  HTTP  {server.http_url}/v1/models   (OpenAPI: {server.http_url}/docs)", flush=True)
    print(f"  gRPC  {server.grpc_url}", flush=True)
    if server.flight_port:
        print(f"  Flight {server.flight_url}   (bulk data for gRPC clients)", flush=True)
    if args.uds:
        print(
            f"  same node unix://{args.uds}   (zero-copy handoff: {args.uds}.handoff)", flush=True
        )
    for model_id in list(catalog.models)[:5]:
        print(f"  model {server.http_url}/v1/models/{model_id}", flush=True)
    print("ready", flush=True)

    stop.wait()
    print(f"weightserve: shutting down, open streams get {args.grace:.0f} s", flush=True)
    server.stop()
    return 0


def _cannot_start(message: str) -> int:
    print(f"weightserve serve: {message}", file=sys.stderr, flush=True)
    return 2


def _configured_server(args: argparse.Namespace) -> WeightServer:
    """The server ``args`` describe, its catalog scanned, not yet listening; StartupError
    names the setting at fault."""
    from weightserve.service.demo import default_cache_dir, write_demo
    from weightserve.service.server import (
        ServerConfig,
        StartupError,
        WeightServer,
        check_listeners,
        is_origin_uri,
    )

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    root: Path | None
    if args.demo:
        target = Path(args.root) if args.root else cache_dir / "demo-root"
        try:
            root = write_demo(target)
        except OSError as e:
            raise StartupError(
                "demo",
                f"cannot write the demonstration model into {target}: {e.strerror or e}; "
                "point --cache-dir (WEIGHTSERVE_CACHE_DIR) at a writable directory",
            ) from None
    elif args.root and is_origin_uri(args.root):
        root = None
    elif args.root:
        root = Path(args.root)
    else:
        raise StartupError("root", "give a model root directory, or --demo")
    if root is None:
        pass  # an origin: opened (and its URI checked) with the node cache
    elif not root.is_dir():
        raise StartupError(
            "root",
            f"model root {root} is not a directory: give the directory that holds the models",
        )
    elif not os.access(root, os.R_OK | os.X_OK):
        raise StartupError(
            "root", f"model root {root} is not readable by this process (uid {os.getuid()})"
        )
    config = ServerConfig(
        root=args.root if root is None else str(root),
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        flight_port=None if args.flight_port < 0 else args.flight_port,
        flight_public_port=args.flight_public_port or None,
        grace_seconds=args.grace,
        limits=Limits(
            max_streams=args.max_streams,
            max_streams_per_client=args.max_streams_per_client,
            idle_timeout=args.idle_timeout,
        ),
        token_file=args.token_file,
        protect_metrics=args.protect_metrics,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        rescan_seconds=args.rescan,
        watch=not args.no_watch,
        cache_dir=str(cache_dir),
        cache_size=args.cache_size,
        fill_concurrency=args.fill_concurrency,
        fill_part_size=args.fill_part_size,
        pins=tuple(args.pin),
        origin_token=args.origin_token,
        origin_tls=(args.origin_ca, args.origin_cert, args.origin_key),
        uds=args.uds,
        uds_mode=args.uds_mode,
        uds_uids=args.uds_uids or (),
    )
    check_listeners(config)  # before the scan: a taken port is the only line on stderr
    server = WeightServer(config)
    catalog = server.catalog
    if isinstance(catalog, OriginCatalog):
        if catalog.origin_error is not None:
            log.warning(
                "%s; cached models are served, the others once it can be listed",
                catalog.origin_error,
            )
        elif not catalog.remote:
            log.warning("the origin %s holds no model: %s", catalog.description, _models_wanted())
        return server
    if not catalog.models:
        refused = f"; refused: {', '.join(sorted(catalog.problems))}" if catalog.problems else ""
        problem = f"no models found under {catalog.root}: {_models_wanted()}{refused}"
        if args.require_models:
            raise StartupError("require_models", problem)
        log.warning(
            "%s. Serving nothing until models appear; --require-models makes this fatal", problem
        )
    return server
