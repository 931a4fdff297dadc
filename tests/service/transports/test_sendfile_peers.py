"""``--sendfile auto`` tells a peer on this host from one on another by the connected
socket's addresses (``same_host_peer``). Real sockets: a Unix socket pair, loopback TCP over
IPv4, IPv6 and a dual-stack listener's IPv4-mapped peer. A peer on another host is
tests/e2e/test_sendfile_peers_netns.py (network namespaces)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from weightserve.service.transports.http.streaming import same_host_peer, sendfile_to


@contextlib.contextmanager
def accepted(family: int, host: str, dual_stack: bool = False) -> Iterator[socket.socket]:
    """The server's end of a TCP connection made to ``host`` on a fresh listener."""
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        if dual_stack:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind((host, 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        target = "127.0.0.1" if dual_stack else host
        with socket.create_connection((target, port), timeout=5) as _client:
            server_end, _ = listener.accept()
            with server_end:
                yield server_end


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_a_unix_socket_peer_is_on_this_host() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert same_host_peer(a)


def test_a_loopback_peer_is_on_this_host() -> None:
    with accepted(socket.AF_INET, "127.0.0.1") as conn:
        assert same_host_peer(conn)


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_and_ipv4_mapped_loopback_peers_are_on_this_host() -> None:
    with accepted(socket.AF_INET6, "::1") as conn:
        assert same_host_peer(conn)
    # A dual-stack listener sees an IPv4 client as ::ffff:127.0.0.1.
    with accepted(socket.AF_INET6, "::", dual_stack=True) as conn:
        assert conn.getpeername()[0] == "::ffff:127.0.0.1"
        assert same_host_peer(conn)


def test_a_peer_gone_before_the_check_counts_as_remote() -> None:
    # getpeername fails once the peer has gone (ENOTCONN): the check must not raise, and
    # sendfile (the default for other hosts) is what the write then tries.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as never_connected:
        assert not same_host_peer(never_connected)


@pytest.mark.parametrize(
    ("mode", "same_host", "expected"),
    [("auto", True, False), ("auto", False, True), ("on", True, True), ("off", False, False)],
)
def test_the_sendfile_modes(mode, same_host: bool, expected: bool) -> None:
    assert sendfile_to(mode, same_host) is expected
