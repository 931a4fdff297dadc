"""``weightserve serve``: the server's part of the command line (the rest is the client's)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from weightserve.service.config import SETTINGS_BY_DEST, ConfigError, apply_environment
from weightserve.service.logs import configure_logging
from weightserve.service.serving.state import Limits
from weightserve.service.sources.base import FillsOnRequest
from weightserve.service.sources.layout import GGUF_SUFFIXES, PYTORCH_SUFFIXES, SAFETENSORS_SUFFIXES

if TYPE_CHECKING:
    from weightserve.service.server import WeightServer

log = logging.getLogger("weightserve.serve")


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
    from weightserve.service.server import StartupError, freeze_startup_heap

    try:
        apply_environment(args)
    except ConfigError as e:
        return _cannot_start(str(e))
    configure_logging(args.log_level)
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
    if isinstance(catalog, FillsOnRequest):
        print(
            f"weightserve: {len(catalog.listed)} models from {catalog.description}, "
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
    freeze_startup_heap()
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
    # A setting named as a ServerConfig field is taken as given; the others are shaped here.
    as_given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ServerConfig)
        if f.name in SETTINGS_BY_DEST
    }
    shaped = {
        "root": args.root if root is None else str(root),
        "flight_port": None if args.flight_port < 0 else args.flight_port,
        "flight_public_port": args.flight_public_port or None,
        "grace_seconds": args.grace,
        "limits": Limits(
            max_streams=args.max_streams,
            max_streams_per_client=args.max_streams_per_client,
            idle_timeout=args.idle_timeout,
        ),
        "rescan_seconds": args.rescan,
        "watch": not args.no_watch,
        "sendfile": "off" if args.no_sendfile else args.sendfile,
        "follow": not args.no_follow,
        "peers": not args.no_peers,
        "cache_dir": str(cache_dir),
        "pins": tuple(args.pin),
        "origin_tls": (args.origin_ca, args.origin_cert, args.origin_key),
        "uds_uids": args.uds_uids or (),
    }
    config = ServerConfig(**{**as_given, **shaped})
    check_listeners(config)  # before the scan: a taken port is the only line on stderr
    server = WeightServer(config)
    catalog = server.catalog
    if isinstance(catalog, FillsOnRequest):  # an empty cache is no mistake: models come on request
        if catalog.origin_error is not None:
            log.warning(
                "%s; cached models are served, the others once it can be listed",
                catalog.origin_error,
            )
        elif not catalog.listed:
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
