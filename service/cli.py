"""``weightserve serve``: the server's part of the command line (the rest is the client's)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from weightserve.service.state import Limits


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"WEIGHTSERVE_{name}", default)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "root", nargs="?", default=_env("ROOT"), help="model root directory (env WEIGHTSERVE_ROOT)"
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="write a small demonstration model into the cache directory and serve it",
    )
    parser.add_argument(
        "--host",
        default=_env("HOST", "127.0.0.1"),
        help="address to bind (env WEIGHTSERVE_HOST; default 127.0.0.1)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=int(_env("HTTP_PORT", "8080") or 8080),
        help="HTTP port, 0 for any free port (env WEIGHTSERVE_HTTP_PORT; default 8080)",
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=int(_env("GRPC_PORT", "50051") or 50051),
        help="gRPC port, 0 for any free port (env WEIGHTSERVE_GRPC_PORT; default 50051)",
    )
    parser.add_argument(
        "--flight-port",
        type=int,
        default=int(_env("FLIGHT_PORT", "50052") or 50052),
        help="Arrow Flight port for bulk tensor data (gRPC clients use it when offered), "
        "0 for any free port, -1 for none (env WEIGHTSERVE_FLIGHT_PORT; default 50052)",
    )
    parser.add_argument(
        "--flight-public-port",
        type=int,
        default=int(_env("FLIGHT_PUBLIC_PORT", "0") or 0) or None,
        help="the Flight port clients dial, when port mapping makes it differ from "
        "--flight-port (env WEIGHTSERVE_FLIGHT_PUBLIC_PORT; default: the bound port)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=float(_env("GRACE_SECONDS", "30") or 30),
        help="seconds open streams get to finish on shutdown (env WEIGHTSERVE_GRACE_SECONDS)",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        default=int(_env("MAX_STREAMS", "64") or 64),
        help="concurrent tensor streams allowed (env WEIGHTSERVE_MAX_STREAMS)",
    )
    parser.add_argument(
        "--max-streams-per-client",
        type=int,
        default=int(_env("MAX_STREAMS_PER_CLIENT", "16") or 16),
        help="concurrent tensor streams per client address (env WEIGHTSERVE_MAX_STREAMS_PER_CLIENT)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=float(_env("IDLE_TIMEOUT", "60") or 60),
        help="seconds a client may read nothing before its stream is cut "
        "(env WEIGHTSERVE_IDLE_TIMEOUT)",
    )
    parser.add_argument(
        "--token-file",
        default=_env("TOKEN_FILE"),
        help="bearer tokens, one per line, each optionally followed by the model ids or "
        "patterns it may read; re-read when it changes (env WEIGHTSERVE_TOKEN_FILE)",
    )
    parser.add_argument(
        "--protect-metrics",
        action="store_true",
        default=(_env("PROTECT_METRICS") or "") in ("1", "true", "yes"),
        help="/metrics needs a token too (env WEIGHTSERVE_PROTECT_METRICS=1)",
    )
    parser.add_argument(
        "--tls-cert",
        default=_env("TLS_CERT"),
        help="PEM certificate chain: TLS on HTTP and gRPC (env WEIGHTSERVE_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key", default=_env("TLS_KEY"), help="PEM private key (env WEIGHTSERVE_TLS_KEY)"
    )
    parser.add_argument(
        "--tls-client-ca",
        default=_env("TLS_CLIENT_CA"),
        help="require client certificates signed by this CA: mutual TLS "
        "(env WEIGHTSERVE_TLS_CLIENT_CA)",
    )
    parser.add_argument(
        "--rescan",
        type=float,
        default=float(_env("RESCAN_SECONDS", "30") or 30),
        help="seconds between searches of the root for new or removed models, 0: never "
        "(env WEIGHTSERVE_RESCAN_SECONDS); a changed file is noticed on its next request",
    )
    parser.add_argument(
        "--log-level",
        default=_env("LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
    )


def run_serve(args: argparse.Namespace) -> int:
    from weightserve.service.demo import default_cache_dir, write_demo
    from weightserve.service.server import ServerConfig, WeightServer

    logging.basicConfig(
        level=args.log_level.upper(),
        format='{"time":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","message":"%(message)s"}',
    )
    if args.demo:
        root = write_demo(Path(args.root) if args.root else default_cache_dir() / "demo-root")
    elif args.root:
        root = Path(args.root)
    else:
        print("weightserve serve: give a model root directory, or --demo", file=sys.stderr)
        return 2
    if not root.is_dir():
        print(f"weightserve serve: model root {root} is not a directory", file=sys.stderr)
        return 2
    config = ServerConfig(
        root=str(root),
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        flight_port=None if args.flight_port < 0 else args.flight_port,
        flight_public_port=args.flight_public_port,
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
    )
    # Handlers first: a SIGTERM that arrives right after "ready" must still drain cleanly.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = WeightServer(config).start()
    catalog = server.catalog
    print(f"weightserve: {len(catalog.models)} models from {root}", flush=True)
    for problem in catalog.problems.values():
        print(f"  refused {problem.model}: {problem.reason}", flush=True)
    print(f"  HTTP  {server.http_url}/v1/models   (OpenAPI: {server.http_url}/docs)", flush=True)
    print(f"  gRPC  {server.grpc_url}", flush=True)
    if server.flight_port:
        print(f"  Flight {server.flight_url}   (bulk data for gRPC clients)", flush=True)
    for model_id in list(catalog.models)[:5]:
        print(f"  model {server.http_url}/v1/models/{model_id}", flush=True)
    print("ready", flush=True)

    stop.wait()
    print(f"weightserve: shutting down, open streams get {args.grace:.0f} s", flush=True)
    server.stop()
    return 0
