"""What the server listens on: each transport's endpoint as a ``Listener`` (start, drain,
stop), so ``WeightServer`` starts and stops them alike; and the start-up errors they raise.

HTTP (uvicorn, on TCP and on the same-node Unix socket), gRPC, Arrow Flight and the
same-node handoff each implement it next to their transport.
"""

from __future__ import annotations

import errno
import socket
import stat
from pathlib import Path
from typing import Protocol


class Listener(Protocol):
    """One endpoint of the server."""

    name: str  # what it serves, for messages ("HTTP", "gRPC", ...)

    def start(self) -> None:
        """Bind and serve; a ``StartupError`` says why it cannot."""

    def drain(self) -> None:
        """Shutdown begins: say so where the protocol can (gRPC health), keep serving the
        open streams."""

    def stop(self, force: bool, wait: float) -> None:
        """Stop serving and close what it opened (its socket file too), waiting at most
        ``wait`` seconds; ``force`` cuts what is still open (the grace period is over)."""


class StartupError(RuntimeError):
    """The server cannot start as configured. ``setting`` names the ServerConfig field to
    change (the command line turns it into its flag and environment variable); the message
    says what is wrong and what would work."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


def url_host(host: str) -> str:
    """``host`` as a URL spells it (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host else host


def listen_error(listener: str, setting: str, host: str, port: int, e: OSError) -> StartupError:
    """Why ``listener`` could not listen on ``host:port``, and what would work."""
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return StartupError(
            "host",
            f"cannot listen on {host!r}: not an address of this machine ({e.strerror or e}); "
            "use 127.0.0.1, 0.0.0.0 (every IPv4 address) or :: (every IPv6 address)",
        )
    where = f"the {listener} endpoint could not listen on {url_host(host)}:{port}"
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


def check_port_free(listener: str, setting: str, host: str, port: int) -> None:
    """Fail with a clear StartupError before a gRPC library tries ``port``: grpc-core says
    only "failed to bind" (and logs to stderr on its own). Port 0 checks the host alone."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            probe.bind((host, port))
        except OSError as e:
            raise listen_error(listener, setting, host, port, e) from None


def claim_socket_path(path: str) -> None:
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


def remove_socket_file(path: str) -> None:
    """Remove the Unix socket this server created at ``path`` (not whatever else is there)."""
    p = Path(path)
    try:
        if p.is_socket():
            p.unlink()
    except OSError:
        pass
