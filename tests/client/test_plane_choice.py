"""A model being opened chooses its data planes beside its index read, not after it: the
server's answer (and, for a ``grpc://`` URL, the check of its HTTP port) comes while the index
is on its way, and an error met meanwhile reaches the first fetch, as it would have there."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from weightserve.client import Client
from weightserve.client.transports.base import Connection
from weightserve.client.transports.grpc import GrpcTransport
from weightserve.client.transports.http import HttpTransport
from weightserve.client.wire.routes import parse_url

MODEL = "org/sharded"
ASKED_IN_TIME = 10.0


class AsksMeanwhile:
    """A real transport whose index read holds its answer until the server's data planes
    have been asked for (up to ``ASKED_IN_TIME`` seconds): when they are only asked after
    the index, it waits in vain and says so."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked = threading.Event()
        self.asked_by: list[str] = []
        self.asked_meanwhile: bool | None = None

    def server_info(self) -> dict[str, Any]:
        self.asked_by.append(threading.current_thread().name)
        self.asked.set()
        return super().server_info()  # type: ignore[misc]

    def model_info(self, model: str) -> dict[str, Any]:
        info = super().model_info(model)  # type: ignore[misc]
        self.asked_meanwhile = self.asked.wait(ASKED_IN_TIME)
        return info


class HttpAsksMeanwhile(AsksMeanwhile, HttpTransport):
    pass


class GrpcAsksMeanwhile(AsksMeanwhile, GrpcTransport):
    pass


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_the_planes_are_asked_for_while_the_index_is_read(server, scheme: str) -> None:
    url = server.http_url if scheme == "http" else server.grpc_url
    make = HttpAsksMeanwhile if scheme == "http" else GrpcAsksMeanwhile
    transport = make(parse_url(url)[0], Connection())
    with Client(url, data_plane="network", transport=transport) as client:
        model = client.model(MODEL)
        assert transport.asked_meanwhile, "the planes were only asked for after the index"
        assert transport.asked_by == ["weightserve-planes"]
        streams = client.planes().streams
        # HTTP streams go to the URL; a grpc:// URL's to the HTTP port it advertised.
        assert isinstance(streams, HttpTransport)
        assert (streams is transport) == (scheme == "http")
        got = model.fetch(list(model.tensors))
        assert set(got) == set(model.tensors)
        assert all(got[n].nbytes == t.nbytes for n, t in model.tensors.items())


def test_the_planes_asked_for_beside_the_index_carry_the_first_stream(server) -> None:
    """Over HTTP the planes' request goes on the tensor streams' pool: the load's first
    stream reuses its connection instead of opening one."""
    with Client(server.http_url, data_plane="network") as client:
        transport = client.transport
        assert isinstance(transport, HttpTransport)
        made = [0]
        connect = transport._lean_connect

        def counting():
            made[0] += 1
            return connect()

        transport._lean_connect = counting  # type: ignore[method-assign]
        model = client.model(MODEL)
        name = next(iter(model.tensors))
        expected = model.fetch([name])[name].copy()
        assert made[0] == 1
        again = client.model(MODEL).fetch([name])[name]
        assert made[0] == 1
        assert np.array_equal(again.view(np.uint8), expected.view(np.uint8))


def test_a_plane_error_met_beside_the_index_is_raised_at_the_first_fetch(server) -> None:
    # data_plane="flight" needs a grpc:// URL: the choice refuses it. Opening the model
    # still reads its index; each fetch then says why it cannot go.
    with Client(server.http_url, data_plane="flight") as client:
        model = client.model(MODEL)
        assert model.tensors
        for _ in range(2):
            with pytest.raises(ValueError, match="needs a grpc:// URL"):
                model.fetch(list(model.tensors)[:1])
