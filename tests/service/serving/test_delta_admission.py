"""The delta stream (``/-/delta``) is a data route like the tensor streams: it waits for a
stream slot under ``--max-streams`` and ``--max-streams-per-client`` (429 with Retry-After,
which ``update()`` waits through within its budget), and its ``since`` must name a revision:
a name that is neither a ref the server holds nor a commit's hex digits is a 400, and a
commit the server does not hold gets every tensor whole only as an admitted stream."""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.faults import eventually
from tests.support.publishing import first_weights, serve
from weightserve.client._client import Client
from weightserve.client.errors import InvalidRequest, ResourceExhausted
from weightserve.service.server import WeightServer
from weightserve.service.serving.state import Limits

MODEL = "team/policy"
HINT = 0.25
LOOPBACK = "127.0.0.1"  # the per-client key of a caller without a token: its address


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[WeightServer, str, str]]:
    """A server at 4 streams, 1 per client, holding two published revisions."""
    limits = Limits(max_streams=4, max_streams_per_client=1, retry_after=HINT)
    with serve(tmp_path, allow_publish=True, limits=limits) as srv, Client(srv.http_url) as c:
        r1 = c.publish(MODEL, first_weights()).commit
        changed = dict(first_weights(), norm=first_weights()["norm"] + 1)
        r2 = c.publish(MODEL, changed, base=r1).commit
        yield srv, r1, r2


def delta(srv: WeightServer, since: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, srv.http_port, timeout=30)
    try:
        conn.request("GET", f"/v1/models/{MODEL}/-/delta?since={since}")
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


@contextlib.contextmanager
def slots(srv: WeightServer, *clients: str) -> Iterator[None]:
    """A stream slot held for each of ``clients`` (the server's own admission)."""
    with contextlib.ExitStack() as held:
        for client in clients:
            held.enter_context(srv.state.stream_slot("http", client))
        yield


def test_the_per_client_limit_holds_for_the_delta_stream(server) -> None:
    srv, r1, r2 = server
    with slots(srv, LOOPBACK):  # this address has its one stream open
        status, headers, body = delta(srv, r1)
        assert status == 429, body
        assert "limit per client is 1" in json.loads(body)["error"]["message"]
        assert float(headers["retry-after"]) > 0
        with Client(srv.http_url, retry_seconds=0) as c, pytest.raises(ResourceExhausted):
            c.model(MODEL).update(dict(first_weights()), since=r1)
    with slots(srv, "another client"):  # another client's stream leaves this one's free
        status, headers, _ = delta(srv, r1)
        assert status == 200 and headers["x-weightserve-delta-base"] == r1
    eventually(lambda: srv.state.open_streams == 0, 10, "every delta stream's slot released")


def test_the_stream_limit_holds_for_an_unknown_base(server) -> None:
    srv, r1, r2 = server
    unknown = "f" * 40  # well formed, not held: every tensor whole, as a counted stream
    with slots(srv, "a", "b", "c", "d"):
        assert delta(srv, unknown)[0] == 429
        assert delta(srv, r1)[0] == 429
    status, headers, body = delta(srv, unknown)
    assert status == 200 and headers["x-weightserve-delta-base"] == ""
    assert body.count(b'"kind":"whole"') == len(first_weights())


@pytest.mark.parametrize("since", ["zzzz", "v1", "main%20x", "abc"])
def test_a_since_that_names_no_revision_is_refused(server, since: str) -> None:
    srv, r1, r2 = server
    status, _, body = delta(srv, since)
    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["type"] == "InvalidRequest" and "since" in error["message"], error
    with Client(srv.http_url, retry_seconds=0) as c, pytest.raises(InvalidRequest):
        c.model(MODEL).update(dict(first_weights()), since=since.replace("%20", " "))
    eventually(lambda: srv.state.open_streams == 0, 10, "every delta stream's slot released")
