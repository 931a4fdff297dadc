"""Origins a node cache fills from (service/sources/origin/: objects.py, upstream.py), against real stores: a SeaweedFS S3
server on loopback, a local directory, and an upstream weightserve.

Each origin lists what it holds (names, sizes), fetches byte-identical files with parallel
ranged reads, gives a changed object a new version (and refuses a fetch of the old one), and
fails fast with OriginUnavailable, naming the origin and the cause, when it cannot be reached.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.byte_proxy import ByteCountingProxy
from tests.support.node_caches import write_repository
from tests.support.s3_server import S3Server, free_ports
from weightserve.client.errors import ModelUnavailable, OriginChanged, OriginUnavailable
from weightserve.service.sources.origin.base import FillPlan, Origin, OriginFile, RetryPolicy
from weightserve.service.sources.origin.opening import open_origin

# Small parts and several threads: every file is fetched as many ranged reads, out of order.
PARTS = FillPlan(concurrency=4, part_bytes=1000)
UNREACHABLE_SECONDS = 20.0  # an origin that is down must fail within this, never hang


def listed(origin: Origin) -> dict[str, int]:
    return {f.name: f.size for f in origin.list_files()}


def fetch_all(origin: Origin, dest: Path, parts: FillPlan) -> dict[str, bytes]:
    got = {}
    for i, file in enumerate(origin.list_files()):
        counted: list[int] = []
        target = dest / f"{i}.tmp"
        origin.fetch(file, target, dataclasses.replace(parts, on_bytes=counted.append))
        got[file.name] = target.read_bytes()
        assert sum(counted) == file.size, file.name
    return got


def closed_port() -> int:
    return free_ports(1)[0]


def assert_unavailable_fast(action, *, names: str, cause: str) -> OriginUnavailable:
    started = time.monotonic()
    with pytest.raises(OriginUnavailable) as info:
        action()
    assert time.monotonic() - started < UNREACHABLE_SECONDS
    message = str(info.value)
    assert names in message and cause.lower() in message.lower(), message
    assert isinstance(info.value, ModelUnavailable)  # 503 / UNAVAILABLE through the table
    return info.value


# ----------------------------------------------------------------------------------- S3


@pytest.fixture(scope="module")
def s3_models(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    sent = write_repository(tmp_path_factory.mktemp("s3-source"))
    for name, data in sent.items():
        s3_server.put(f"models/{name}", data)
    return sent


@pytest.mark.s3
def test_s3_lists_and_fetches_every_object_byte_identical(
    s3_server: S3Server, s3_models: dict[str, bytes], tmp_path: Path
) -> None:
    origin = open_origin(s3_server.uri("models"))
    assert origin.description == (
        f"s3://{s3_server.bucket}/models (endpoint http://{s3_server.endpoint})"
    )
    assert listed(origin) == {name: len(data) for name, data in s3_models.items()}
    assert all(f.version for f in origin.list_files())
    assert fetch_all(origin, tmp_path, PARTS) == s3_models


@pytest.mark.s3
def test_s3_fetch_reads_each_byte_from_the_origin_once(
    s3_server: S3Server, s3_models: dict[str, bytes], tmp_path: Path
) -> None:
    with ByteCountingProxy(s3_server.port) as proxy:
        origin = open_origin(s3_server.uri("models", port=proxy.port))
        (file,) = [f for f in origin.list_files() if f.name == "big/model.safetensors"]
        proxy.reset()
        origin.fetch(file, tmp_path / "big.tmp", FillPlan(concurrency=8, part_bytes=256 << 10))
        # Headers and the HEADs that check the version are small; no part travels twice.
        assert file.size <= proxy.bytes_from_upstream < file.size + (64 << 10)
    assert (tmp_path / "big.tmp").read_bytes() == s3_models["big/model.safetensors"]


@pytest.mark.s3
def test_s3_changed_object_gets_a_new_version_and_the_old_one_is_refused(
    s3_server: S3Server, tmp_path: Path
) -> None:
    s3_server.put("changing/model/config.json", b'{"a": 1}')
    origin = open_origin(s3_server.uri("changing"))
    (before,) = origin.list_files()
    s3_server.put("changing/model/config.json", b'{"a": 2}')  # same size, other bytes
    (after,) = origin.list_files()
    assert (after.name, after.size) == (before.name, before.size)
    assert after.version != before.version
    with pytest.raises(OriginChanged, match="config.json changed"):
        origin.fetch(before, tmp_path / "old.tmp")
    assert not (tmp_path / "old.tmp").exists()  # nothing half-written is left
    origin.fetch(after, tmp_path / "new.tmp")
    assert (tmp_path / "new.tmp").read_bytes() == b'{"a": 2}'


@pytest.mark.s3
def test_s3_unreachable_fails_fast_naming_the_origin_without_credentials(
    s3_server: S3Server, tmp_path: Path
) -> None:
    port = closed_port()
    # Credentials written into the URI (pyarrow's user-info syntax) stay out of every message.
    uri = (
        f"s3://{s3_server.access_key}:{s3_server.secret_key}@{s3_server.bucket}/models"
        f"?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    )
    origin = open_origin(uri)
    assert (
        origin.description == f"s3://{s3_server.bucket}/models (endpoint http://127.0.0.1:{port})"
    )
    error = assert_unavailable_fast(origin.list_files, names=origin.description, cause="connect")
    file = OriginFile("org/sharded/config.json", 24, "x")
    error_of_fetch = assert_unavailable_fast(
        lambda: origin.fetch(file, tmp_path / "never.tmp"),
        names=origin.description,
        cause="connect",
    )
    for text in (origin.description, str(error), str(error_of_fetch)):
        assert s3_server.access_key not in text and s3_server.secret_key not in text


@pytest.mark.s3
def test_s3_credentials_in_the_uri_are_used_and_never_shown(
    s3_server: S3Server, s3_models: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    uri = s3_server.uri("models").replace(
        "s3://", f"s3://{s3_server.access_key}:{s3_server.secret_key}@"
    )
    origin = open_origin(uri)
    assert set(listed(origin)) == set(s3_models)
    assert s3_server.secret_key not in origin.description
    assert s3_server.access_key not in origin.description


# ------------------------------------------------------------------------------- file://


@pytest.fixture
def local_models(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "origin"
    return root, write_repository(root)


def test_file_origin_lists_and_fetches_byte_identical(
    local_models: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    root, sent = local_models
    origin = open_origin(root.as_uri())
    assert listed(origin) == {name: len(data) for name, data in sent.items()}
    out = tmp_path / "out"
    out.mkdir()
    assert fetch_all(origin, out, PARTS) == sent


def test_file_origin_changed_file_gets_a_new_version(
    local_models: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    root, _ = local_models
    origin = open_origin(root.as_uri())
    before = {f.name: f for f in origin.list_files()}["org/sharded/config.json"]
    path = root / "org" / "sharded" / "config.json"
    path.write_text('{"model_type": "gemma"}\n'[: before.size].ljust(before.size))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    after = {f.name: f for f in origin.list_files()}["org/sharded/config.json"]
    assert after.size == before.size and after.version != before.version
    with pytest.raises(OriginChanged):
        origin.fetch(before, tmp_path / "old.tmp")
    assert not (tmp_path / "old.tmp").exists()


def test_file_origin_missing_directory_is_unavailable(tmp_path: Path) -> None:
    origin = open_origin((tmp_path / "absent").as_uri())
    assert_unavailable_fast(origin.list_files, names=str(tmp_path / "absent"), cause="not exist")


def test_unsupported_origin_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match=r"unsupported origin 'ftp://host/x'.*s3://"):
        open_origin("ftp://user:pw@host/x")


# --------------------------------------------------------------------- upstream weightserve


@pytest.fixture
def upstream(local_models: tuple[Path, dict[str, bytes]]) -> Iterator:
    from weightserve.service.server import ServerConfig, WeightServer

    root, _ = local_models
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False
    )
    with WeightServer(config) as srv:
        yield srv


def test_upstream_lists_and_fetches_byte_identical(
    upstream, local_models: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    _, sent = local_models
    origin = open_origin(f"http://127.0.0.1:{upstream.http_port}")
    assert origin.description == f"weightserve at http://127.0.0.1:{upstream.http_port}"
    assert listed(origin) == {name: len(data) for name, data in sent.items()}
    assert fetch_all(origin, tmp_path, PARTS) == sent


def test_upstream_changed_file_gets_a_new_version(
    upstream, local_models: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    root, _ = local_models
    origin = open_origin(f"http://127.0.0.1:{upstream.http_port}")
    before = {f.name: f for f in origin.list_files()}["big/tokenizer/tokenizer.json"]
    (root / "big" / "tokenizer" / "tokenizer.json").write_text('{"version": "2.0"}\n')
    upstream.rescan()
    after = {f.name: f for f in origin.list_files()}["big/tokenizer/tokenizer.json"]
    assert after.size == before.size and after.version != before.version
    with pytest.raises(OriginChanged):
        origin.fetch(before, tmp_path / "old.tmp", PARTS)
    assert not (tmp_path / "old.tmp").exists()
    origin.fetch(after, tmp_path / "new.tmp", PARTS)
    assert (tmp_path / "new.tmp").read_text() == '{"version": "2.0"}\n'


def test_upstream_unreachable_fails_fast_without_the_token(tmp_path: Path) -> None:
    port = closed_port()
    origin = open_origin(f"http://127.0.0.1:{port}", token="secret-upstream-token")
    error = assert_unavailable_fast(
        origin.list_files, names=f"weightserve at http://127.0.0.1:{port}", cause="cannot reach"
    )
    assert "secret-upstream-token" not in str(error)
    file = OriginFile("org/sharded/config.json", 24, "x")
    assert_unavailable_fast(
        lambda: origin.fetch(file, tmp_path / "never.tmp"), names=str(port), cause="cannot reach"
    )


def test_upstream_model_url_is_refused() -> None:
    with pytest.raises(ValueError, match="server address"):
        open_origin("http://127.0.0.1:1/v1/models/org/sharded")


def test_bounded_retries_wait_between_attempts() -> None:
    waits = list(RetryPolicy(attempts=5, first_wait=0.1, longest_wait=0.3).waits())
    assert len(waits) == 4
    assert all(0.05 <= w <= 0.3 for w in waits) and waits[-1] >= 0.15
