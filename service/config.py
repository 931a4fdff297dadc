"""The server's settings: one table (flag, environment variable, value check, default, help)
from which ``weightserve serve``'s options, its environment variables and ServerConfig's
defaults all come."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from weightserve.client.arg_types import (
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
from weightserve.service.sources.origin.base import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PART_BYTES,
    UPSTREAM_READ_TIMEOUT,
)
from weightserve.service.sources.publishing.intake import (
    UPLOAD_BODY_TIMEOUT,
    UPLOAD_IDLE_SECONDS,
)
from weightserve.service.sources.swarm.engine import (
    DEFAULT_PEER_PATIENCE_SECONDS,
    DEFAULT_PEER_PORT,
)

# ``--sendfile``: which HTTP peers get file bytes with sendfile (transports/http/streaming.py
# ``sendfile_to``).
SendfileMode = Literal["auto", "on", "off"]
SENDFILE_MODES: tuple[SendfileMode, ...] = ("auto", "on", "off")

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    **{p + s: 1000**i for i, p in enumerate("kmgtpe", 1) for s in ("", "b")},
    **{p + s: 1024**i for i, p in enumerate("kmgtpe", 1) for s in ("i", "ib")},
}


def parse_size(text: str | int) -> int:
    """Bytes from ``500GiB``, ``1.5TB``, ``64Mi`` or a plain number of bytes.

    Binary units (KiB, MiB, GiB, TiB, or Ki, Mi, Gi as Kubernetes writes them) are powers of
    1024, decimal ones (KB, MB, GB, TB, or K, M, G) powers of 1000; case does not matter.
    """
    if isinstance(text, int):
        return text
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size: write a number of bytes, optionally with a unit "
            "such as 500GiB, 64MiB or 2TB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Setting:
    """One ``serve`` option: its flag, environment variable, value check and default.

    ``SETTINGS`` is the one list: the parser, the environment, ``serve --help``,
    ServerConfig's defaults and the README's Configuration table come from it
    (tests/service/test_startup_errors.py compares them).
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


def byte_budget(text: str) -> int:
    """A number of bytes, optionally with a unit: 500GiB, 64MiB, 2TB; 0: none."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def byte_size(text: str) -> int:
    """A number of bytes as ``byte_budget`` takes it, at least 1."""
    value = byte_budget(text)
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
    Setting("--handoff-snapshot-bytes", "WEIGHTSERVE_HANDOFF_SNAPSHOT_BYTES", None,
            "memory for the sealed snapshots the handoff maps (a loaded model never changes "
            "when its files are written later), e.g. 8GiB; files beyond it are copied by the "
            "client; 0: none", byte_budget, "a quarter of the memory the server may use"),
    Setting("--grace", "WEIGHTSERVE_GRACE_SECONDS", 30.0,
            "seconds open streams get to finish on shutdown", non_negative_seconds, "30 s"),
    Setting("--max-streams", "WEIGHTSERVE_MAX_STREAMS", Limits.max_streams,
            "concurrent tensor streams, all clients together", positive_int),
    Setting("--max-streams-per-client", "WEIGHTSERVE_MAX_STREAMS_PER_CLIENT",
            Limits.max_streams_per_client,
            "concurrent tensor streams of one client (its token, else its address)",
            positive_int),
    Setting("--idle-timeout", "WEIGHTSERVE_IDLE_TIMEOUT", Limits.idle_timeout,
            "seconds a client may read nothing before its stream is cut", positive_seconds,
            "60 s"),
    Setting("--sendfile", "WEIGHTSERVE_SENDFILE", "auto",
            "HTTP: which peers get tensor and file bytes with sendfile rather than written "
            "from the file's mapping (one copy in the server): auto (peers on other hosts; "
            "those on this host, by loopback, Unix socket or this host's address, load "
            "faster from the copy), on (all), off (none)", one_of(*SENDFILE_MODES)),
    Setting("--no-sendfile", "WEIGHTSERVE_NO_SENDFILE", False,
            "the same as --sendfile off (kept for existing deployments)"),
    Setting("--token-file", "WEIGHTSERVE_TOKEN_FILE", None,
            "bearer tokens, one per line, each optionally followed by the model ids or "
            "patterns it may read; re-read when it changes", str, "none: no authentication"),
    Setting("--allow-publish", "WEIGHTSERVE_ALLOW_PUBLISH", False,
            "take publishes (new revisions, written under ROOT) from anyone who reaches the "
            "port; with --token-file, only tokens granted publish=PATTERN may publish"),
    Setting("--max-upload-bytes", "WEIGHTSERVE_MAX_UPLOAD_BYTES", 1 << 40,
            "the most bytes one publish may upload, e.g. 500GiB; 0: no limit but the disk",
            byte_budget, "1TiB"),
    Setting("--upload-body-timeout", "WEIGHTSERVE_UPLOAD_BODY_TIMEOUT", UPLOAD_BODY_TIMEOUT,
            "seconds a publish's file upload may send nothing before it is cut off and the "
            "whole upload discarded; a commit waits twice this long at most for files still "
            "arriving",
            positive_seconds, "60 s"),
    Setting("--upload-idle-timeout", "WEIGHTSERVE_UPLOAD_IDLE_TIMEOUT", UPLOAD_IDLE_SECONDS,
            "seconds a publish in progress may go without a request before it is discarded "
            "(its files removed)", positive_seconds, "600 s"),
    Setting("--keep-revisions", "WEIGHTSERVE_KEEP_REVISIONS", 4,
            "published revisions kept per model (main and held ones always are); older ones "
            "are removed", positive_int),
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
    Setting("--no-follow", "WEIGHTSERVE_NO_FOLLOW", False,
            "with an upstream weightserve ROOT: follow its new revisions by rescanning only, not "
            "by watching its announcements"),
    Setting("--cache-dir", "WEIGHTSERVE_CACHE_DIR", None,
            "where file content digests (file-digests.sqlite) are kept across restarts, so "
            "revisions cost no reads after the first, and where --demo writes", str,
            "$XDG_CACHE_HOME/weightserve, else ~/.cache/weightserve"),
    Setting("--cache-size", "WEIGHTSERVE_CACHE_SIZE", None,
            "with an origin ROOT: the most bytes the node cache (CACHE_DIR/node-cache) holds, "
            "e.g. 500GiB, never more than its file system has room for; least recently used "
            "models are evicted", byte_size,
            "nine tenths of what the cache holds plus the free disk space, read before each "
            "fill"),
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
    Setting("--origin-stall-seconds", "WEIGHTSERVE_ORIGIN_STALL_SECONDS", UPSTREAM_READ_TIMEOUT,
            "with an http(s):// origin: a read that receives no byte for this long is abandoned "
            "and retried; a fill fails with OriginUnavailable after 4 such attempts",
            positive_seconds),
    Setting("--no-peers", "WEIGHTSERVE_NO_PEERS", False,
            "no peer fills: a node cache fills from its upstream weightserve alone and seeds to "
            "no other node; as an upstream, refuse node caches' swarm joins"),
    Setting("--peer-port", "WEIGHTSERVE_PEER_PORT", DEFAULT_PEER_PORT,
            "with an http(s):// origin: the TCP port (TLS) other node caches take this node's "
            "pieces of a revision from, 0: any free port", port),
    Setting("--peer-address", "WEIGHTSERVE_PEER_ADDRESS", None,
            "with an http(s):// origin: the address other node caches reach this one at (a "
            "pod's IP)", non_empty, "the address the upstream sees"),
    Setting("--peer-upload-limit", "WEIGHTSERVE_PEER_UPLOAD_LIMIT", 0,
            "with an http(s):// origin: bytes per second this node uploads to all peers "
            "together, e.g. 100MB; 0: no limit", byte_budget, "no limit"),
    Setting("--peer-patience-seconds", "WEIGHTSERVE_PEER_PATIENCE_SECONDS",
            DEFAULT_PEER_PATIENCE_SECONDS,
            "with an http(s):// origin: while a node fills from its peers, the upstream gives "
            "what is missing once no peer is connected, or no peer brought a verified piece, "
            "for this long", positive_seconds),
    Setting("--require-models", "WEIGHTSERVE_REQUIRE_MODELS", False,
            "refuse to start when the root holds no servable model (otherwise: a warning)"),
    Setting("--log-level", "WEIGHTSERVE_LOG_LEVEL", "info",
            "debug, info, warning or error", one_of("debug", "info", "warning", "error")),
)  # fmt: skip
SETTINGS_BY_DEST = {s.dest: s for s in SETTINGS}


def default_of(dest: str) -> Any:
    """The default of the setting ``dest`` names, for ServerConfig's fields."""
    return SETTINGS_BY_DEST[dest].default


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
# Settings whose value is not named by its check (a plain string is a file).
_METAVARS_BY_DEST = {"cache_dir": "DIR", "origin_token": "TOKEN", "sendfile": "PEERS"}


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
            metavar = _METAVARS_BY_DEST.get(s.dest) or _METAVARS.get(
                s.value, s.dest.split("_")[-1].upper()
            )
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
