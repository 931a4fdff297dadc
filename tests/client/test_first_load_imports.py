"""A process's first load imports nothing: what a load needs comes with the client (and,
for a ``grpc://`` URL, with its transport), so no import lands inside a timed load. The lazy
ml_dtypes import at the first bfloat16 tensor and the idna codec at the first connection cost
a fresh process 7-9 ms of a 0.35 s load (docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FIRST_LOAD = """
import json, sys
from weightserve.client import Client
url, model_id = sys.argv[1], sys.argv[2]
with Client(url, data_plane="network") as client:
    before = set(sys.modules)
    model = client.model(model_id)
    got = model.fetch(list(model.tensors))
    dtypes = sorted({a.dtype.name for a in got.values()})
    print(json.dumps({"imported": sorted(set(sys.modules) - before), "dtypes": dtypes}))
"""


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_a_first_load_imports_nothing(server, scheme: str) -> None:
    url = server.http_url if scheme == "http" else server.grpc_url
    out = subprocess.run(
        [sys.executable, "-c", FIRST_LOAD, url, "mixed"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert "bfloat16" in answer["dtypes"]  # the load went through ml_dtypes
    assert answer["imported"] == []
