"""Rescans: refusals remembered, fixes picked up from file-system events, and errors that
never name a model beyond the caller's grant.

- A refused model is parsed and logged once per version of its files, not at every rescan,
  and counted once in ``weightserve_model_refusals_total``.
- A fixed model, and a new one, are served within seconds although the periodic rescan is
  an hour away (inotify through watchfiles).
- With a token limited to ``acme/*``, near-miss ids in every form get errors that name no
  model outside the grant, over HTTP, gRPC and Arrow Flight.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from pathlib import Path

import pytest
from safetensors.numpy import save_file

from tests.support.faults import eventually, save_atomic, tensors
from weightserve.client._client import Client
from weightserve.client.errors import WeightserveError
from weightserve.service.server import ServerConfig, WeightServer


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTSERVE_TOKEN", raising=False)


def write_broken(path: Path) -> None:
    """A safetensors file whose only tensor claims bytes past the end of the file."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}})
    raw = header.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 16)


def refusal_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]


def test_a_refused_model_is_parsed_once_per_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_broken(tmp_path / "bad" / "model.safetensors")
    save_file(tensors(1, 1, 64), tmp_path / "good.safetensors")
    caplog.set_level(logging.WARNING, "weightserve.catalog")
    config = ServerConfig(
        str(tmp_path), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False
    )
    with WeightServer(config) as srv:
        for _ in range(3):
            srv.rescan()
        assert list(srv.catalog.problems) == ["bad"]
        assert len(refusal_logs(caplog)) == 1
        metrics = urllib.request.urlopen(f"{srv.http_url}/metrics", timeout=10).read().decode()
        assert "weightserve_model_refusals_total 1.0" in metrics

        # A new (still broken) version of the file is examined, and counted, once again.
        write_broken(tmp_path / "bad" / "model.safetensors")
        os.utime(tmp_path / "bad" / "model.safetensors", ns=(1, 1))
        srv.rescan()
        srv.rescan()
        assert len(refusal_logs(caplog)) == 2
        metrics = urllib.request.urlopen(f"{srv.http_url}/metrics", timeout=10).read().decode()
        assert "weightserve_model_refusals_total 2.0" in metrics


def test_fixes_and_new_models_are_served_without_waiting_for_the_rescan(tmp_path: Path) -> None:
    write_broken(tmp_path / "bad" / "model.safetensors")
    config = ServerConfig(str(tmp_path), http_port=0, grpc_port=0, flight_port=None)
    config.rescan_seconds = 3600  # only file-system events can make the changes visible
    with WeightServer(config) as srv, Client(srv.http_url, timeout=10) as client:
        models, problems = client.list_models()
        assert [p.model for p in problems] == ["bad"] and models == []

        fixed = tensors(2, 2, 1024)
        save_atomic(fixed, tmp_path / "bad" / "model.safetensors")
        eventually(lambda: "bad" in srv.catalog.models, 10, "the fixed model is served")
        got = client.model("bad").fetch(prefix="")
        assert {k: v.tobytes() for k, v in got.items()} == {
            k: v.tobytes() for k, v in fixed.items()
        }

        (tmp_path / "org" / "new").mkdir(parents=True)
        save_file(tensors(3, 1, 256), tmp_path / "org" / "new" / "model.safetensors")
        eventually(lambda: "org/new" in srv.catalog.models, 10, "the new model is served")


# ----------------------------------------------------------------------- suggestions and grants

ACME_TOKEN = "acme-token-0123456789"
OUTSIDE = ("big/m", "rep/m", "acme-big/m", "other/acme/m")


@pytest.fixture(scope="module")
def granted_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("grants")
    for model_id in ("acme/m", "acme/model-a", *OUTSIDE):
        (root / model_id).mkdir(parents=True)
        save_file(tensors(4, 1, 64), root / model_id / "model.safetensors")
    tokens = root.parent / "grant-tokens"
    tokens.write_text(f"{ACME_TOKEN} acme/*\n")
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0, watch=False,
        token_file=str(tokens),
    )  # fmt: skip
    with WeightServer(config) as srv:
        yield srv


# Near misses of ids outside the grant, inside and outside the grant's pattern.
PROBES = ("big/n", "big/m2", "rep/mm", "acme/big/m", "acme/rep/m", "acme-big/n", "acme/mm")


@pytest.mark.parametrize("transport", ["http", "grpc", "grpc-flight"])
def test_errors_never_name_models_beyond_the_grant(granted_server, transport: str) -> None:
    url = granted_server.http_url if transport == "http" else granted_server.grpc_url
    flight = transport == "grpc-flight"
    with Client(url, token=ACME_TOKEN, timeout=10, flight=flight) as client:
        models, _ = client.list_models()
        assert sorted(m.id for m in models) == ["acme/m", "acme/model-a"]
        messages = []
        for probe in PROBES:
            with pytest.raises(WeightserveError) as err:
                client.model(probe).fetch(prefix="")
            messages.append(str(err.value))
        # Suggestions inside the grant are still made: they help and reveal nothing.
        assert any("Did you mean 'acme/m'" in m for m in messages), messages
        for message in messages:
            for foreign in OUTSIDE:
                assert repr(foreign) not in message, message
