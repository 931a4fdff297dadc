"""The HTTP client keeps connections alive between requests, and replaces one the server
closed while it was idle, without the caller seeing an error."""

from __future__ import annotations

import socket

import numpy as np

from weightserve.client import Client
from weightserve.client.transports.http import HttpTransport


def _count_connects(transport: HttpTransport, monkeypatch) -> list[int]:
    made = [0]
    original = transport._connect

    def counting():
        made[0] += 1
        return original()

    monkeypatch.setattr(transport, "_connect", counting)
    return made


def test_sequential_requests_share_one_connection(server, monkeypatch) -> None:
    with Client(server.http_url) as client:
        transport = client.transport
        assert isinstance(transport, HttpTransport)
        made = _count_connects(transport, monkeypatch)
        model = client.model("org/sharded")
        names = list(model.tensors)
        first = {n: model.fetch([n])[n].copy() for n in names}
        again = {n: model.fetch([n])[n] for n in names}
        assert made[0] == 1  # model info and 2 x len(names) streams over one connection
        assert all(np.array_equal(first[n].view(np.uint8), again[n].view(np.uint8)) for n in names)


def test_a_connection_closed_while_idle_is_replaced(server, monkeypatch) -> None:
    with Client(server.http_url) as client:
        transport = client.transport
        model = client.model("org/sharded")
        name = next(iter(model.tensors))
        expected = model.fetch([name])[name].copy()
        assert len(transport._idle) == 1
        # As when the server's keep-alive timeout closes it: the next request fails on it.
        transport._idle[0].sock.shutdown(socket.SHUT_RDWR)
        made = _count_connects(transport, monkeypatch)
        got = model.fetch([name])[name]
        assert made[0] == 1
        assert np.array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_a_stream_cut_short_does_not_return_its_connection(server) -> None:
    with Client(server.http_url) as client:
        transport = client.transport
        model = client.model("org/sharded")
        source = transport.open_stream(model.id, _params(model))
        source.readinto(memoryview(bytearray(16)))  # read a little, then give up
        source.close()
        assert transport._idle == []


def _params(model):
    from weightserve.client.transports.base import StreamParams

    return StreamParams(prefix="", revision=model.info.revision)


def test_accepted_connections_have_nodelay(server) -> None:
    """Without TCP_NODELAY a small response on a kept-alive connection waits for the
    client's delayed ACK: ~40 ms per request instead of ~1 ms (measured)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.http_port)
    conn.request("GET", "/healthz")
    conn.getresponse().read()
    connections = server._uvicorn.server_state.connections
    assert connections
    for protocol in connections:
        sock = protocol.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    conn.close()
