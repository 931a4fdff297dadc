"""JSON nested deeper than the parser's stack, in any body the publish routes read (an
upload's start, a hold, a patch's header line), is a 400 naming what is wrong: never a 500
from a RecursionError, and the server serves on."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.publishing import put_patch, serve
from weightserve.client._client import Client
from weightserve.service.server import WeightServer

MODEL = "team/nested"


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.fixture
def published(tmp_path: Path) -> Iterator[tuple[WeightServer, str]]:
    with serve(tmp_path, allow_publish=True) as srv, Client(srv.http_url) as c:
        yield srv, c.publish(MODEL, {"w": np.arange(16, dtype=np.float32)}).commit


def post(srv: WeightServer, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=30)
    try:
        conn.request("POST", path, body=body)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


@pytest.mark.parametrize("depth", [990, 100_000])
def test_deeply_nested_json_is_a_400(published, depth: int) -> None:
    srv, commit = published
    models = f"/v1/models/{MODEL}/-"
    answers = [
        post(srv, f"{models}/uploads", b'{"metadata": {"x": ' + nested(depth) + b"}}"),
        post(srv, f"{models}/holds", b'{"commit": "' + commit.encode() + b'", "x": ' + nested(depth) + b"}"),
        put_patch(srv.http_port, MODEL, commit, b'{"kind": "same", "x": ' + nested(depth) + b"}\n"),
    ]  # fmt: skip
    for status, answer in answers:
        assert status == 400, answer
        assert "nested too deeply" in answer["error"]["message"], answer
    with Client(srv.http_url) as c:
        assert c.model(MODEL).commit == commit
