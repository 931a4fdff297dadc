"""Holds against retention: one per holder (another reader's short hold or release never
shortens a worker's long one), finite seconds up to a week (anything else is a 400), a grant
to take them where tokens are used, kept across a restart, and shared through the bucket
where nodes publish into one."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from tests.support._util import http_request
from tests.support.publishing import serve
from tests.support.s3_server import S3Server
from tests.support.security import write_tokens
from weightserve.client._client import Client
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.publishing.holds import MAX_HOLD_SECONDS

MODEL = "team/policy"
HOLDS = f"/v1/models/{MODEL}/-/holds"


def weights(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(256, step, dtype=np.float32)}


def hold(port: int, commit: str, seconds: object, holder: str, token: str | None = None):
    headers = {"Authorization": f"Bearer {token}"} if token else None
    body = {"commit": commit, "seconds": seconds, "holder": holder}
    return http_request(port, HOLDS, "POST", body=body, headers=headers)


@pytest.fixture
def server_root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


def listed(client: Client) -> list[str]:
    return [r.commit for r in client.revisions(MODEL)]


def test_another_holders_short_hold_never_shortens_a_long_one(server_root: Path) -> None:
    with serve(server_root, allow_publish=True, keep_revisions=1) as srv, Client(srv.http_url) as c:
        first = c.publish(MODEL, weights(0)).commit
        assert hold(srv.http_port, first, 3600, "worker").status == 200
        for seconds in (1, 0):  # a second reader holds briefly, then releases its own hold
            answer = hold(srv.http_port, first, seconds, "reader")
            assert answer.status == 200
            assert answer.json()["held_until"] is not None  # the worker's hold still runs
        for step in (1, 2):
            c.publish(MODEL, weights(step))
        assert first in listed(c)  # retention left the worker's revision
        assert hold(srv.http_port, first, 0, "worker").json()["held_until"] is None
        last = c.publish(MODEL, weights(3)).commit
        assert listed(c) == [last]


@pytest.mark.parametrize(
    "seconds", [float("inf"), float("nan"), 1e308, MAX_HOLD_SECONDS + 1, True, "60", -1, None]
)
def test_a_hold_takes_finite_seconds_up_to_the_maximum(server_root: Path, seconds) -> None:
    with serve(server_root, allow_publish=True) as srv, Client(srv.http_url) as c:
        commit = c.publish(MODEL, weights(0)).commit
        answer = hold(srv.http_port, commit, seconds, "worker")
        assert answer.status == 400, answer.body
        kind, message = answer.error()
        assert kind == "InvalidRequest" and "seconds" in message
        assert hold(srv.http_port, commit, MAX_HOLD_SECONDS, "worker").status == 200


def test_holding_needs_a_hold_or_publish_grant(tmp_path: Path, server_root: Path) -> None:
    tokens = tmp_path / "tokens"
    write_tokens(tokens, "reader team/*\nworker team/* hold=team/*\ntrainer publish=team/*\n")
    with serve(server_root, token_file=str(tokens)) as srv:
        with Client(srv.http_url, token="trainer") as c:
            commit = c.publish(MODEL, weights(0)).commit
        refused = hold(srv.http_port, commit, 60, "x", token="reader")
        assert refused.status == 403
        assert "hold=PATTERN" in refused.error()[1]
        assert hold(srv.http_port, commit, 60, "x", token="worker").status == 200
        assert hold(srv.http_port, commit, 60, "x", token="trainer").status == 200


def test_holds_are_kept_across_a_restart(server_root: Path) -> None:
    with serve(server_root, allow_publish=True, keep_revisions=1) as srv, Client(srv.http_url) as c:
        first = c.publish(MODEL, weights(0)).commit
        c.model(MODEL).hold(first, 3600)
    with serve(server_root, allow_publish=True, keep_revisions=1) as srv, Client(srv.http_url) as c:
        for step in (1, 2):
            c.publish(MODEL, weights(step))
        assert first in listed(c)


def node(uri: str, cache: Path) -> WeightServer:
    config = ServerConfig(
        uri, http_port=0, grpc_port=0, flight_port=None, watch=False, cache_dir=str(cache),
        grace_seconds=1, allow_publish=True, keep_revisions=1, rescan_seconds=0,
    )  # fmt: skip
    return WeightServer(config)


@pytest.mark.s3
def test_a_nodes_retention_sees_another_nodes_holds(s3_server: S3Server, tmp_path: Path) -> None:
    uri = s3_server.uri(f"holds-{uuid.uuid4().hex[:8]}")
    with node(uri, tmp_path / "a") as a, node(uri, tmp_path / "b") as b:
        with Client(a.http_url) as c:
            first = c.publish(MODEL, weights(0)).commit
            assert hold(a.http_port, first, 3600, "worker").status == 200
        with Client(b.http_url) as c:
            for step in (1, 2):
                c.publish(MODEL, weights(step))
        with Client(a.http_url) as c:
            c.publish(MODEL, weights(3))  # node A's own retention, after B's publishes
        fs, prefix = pafs.FileSystem.from_uri(uri)
        with fs.open_input_stream(f"{prefix}/models--team--policy/.revisions/{first}.json") as f:
            assert first in f.read().decode()  # the held revision's record is still there
