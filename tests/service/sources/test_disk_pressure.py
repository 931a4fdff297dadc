"""A node cache on a small file system (a 20 MiB tmpfs the test mounts, so root only): the
bound follows the free space as well as --cache-size, a full disk (ENOSPC) met while writing
evicts idle models and the file is written again, a model that cannot fit is refused naming
the directory and the bytes, and the node keeps serving the rest."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support._util import http_request
from tests.support.commands import free_port
from tests.support.node_caches import CountingOrigin, files_of, partials, visible_files, write_model
from tests.support.paths import REPO
from weightserve.client import Client
from weightserve.client.errors import CacheTooSmall
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.origin.catalog import OriginCatalog
from weightserve.service.sources.origin.opening import open_origin

MIB = 1 << 20
DISK = 20 * MIB


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A fresh 20 MiB tmpfs, unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for the cache directory needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not allowed here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def origin_root(tmp_path: Path) -> Path:
    root = tmp_path / "origin"
    root.mkdir()
    return root


def take_space(path: Path, size: int) -> None:
    """Another writer on the cache's file system."""
    with open(path, "wb") as f:
        f.write(b"\1" * size)


def fill_while_space_is_taken(
    cache: NodeCache, origin: CountingOrigin, disk: Path, model_id: str, leave_free: int
) -> list[BaseException]:
    """Fill the model; once its room was checked and its first fetch started, another writer
    takes the disk's free space but ``leave_free`` bytes. The errors the fill raised."""
    origin.gate = threading.Event()
    failure: list[BaseException] = []

    def fill() -> None:
        try:
            cache.ensure(model_id, files_of(origin, model_id))
        except BaseException as e:
            failure.append(e)

    filling = threading.Thread(target=fill)
    filling.start()
    assert origin.fetch_started.wait(10)
    take_space(disk / "ballast", shutil.disk_usage(disk).free - leave_free)
    origin.gate.set()
    filling.join(30)
    assert not filling.is_alive()
    return failure


def metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = http_request(port, "/metrics").body.decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def evictions(port: int, reason: str) -> float:
    return metrics(port)[("weightserve_cache_evictions_total", (("reason", reason),))]


def gauge(port: int, name: str) -> float:
    return metrics(port)[(name, ())]


def test_a_disk_filled_mid_fill_evicts_idle_models_and_writes_the_file_again(
    origin_root: Path, disk: Path
) -> None:
    written = {m: write_model(origin_root, m, 6 * MIB, seed=i) for i, m in enumerate("abc")}
    origin = CountingOrigin(open_origin(origin_root.as_uri()))
    with NodeCache(origin, disk / "cache", 100 * MIB) as cache:
        cache.ensure("a", files_of(origin, "a"))
        cache.ensure("b", files_of(origin, "b"))
        room = cache.room()
        assert room.by_disk and room.bound < DISK and room.disk_free < 8 * MIB
        # c fits the room read before its fill; then another writer takes half of what is free.
        failure = fill_while_space_is_taken(cache, origin, disk, "c", leave_free=4 * MIB)
        assert not failure, failure
        assert cache.cached_models() == ["b", "c"]  # a: the least recently used
        assert cache.stats.evictions_by_reason == {"disk_full": 1}
        files = visible_files(disk / "cache")
        assert {n: b for n, b in files.items() if n.startswith("c/")} == written["c"]
        assert partials(disk / "cache") == []


def test_a_full_disk_with_nothing_to_evict_fails_clearly_and_keeps_the_rest(
    origin_root: Path, disk: Path
) -> None:
    for i, m in enumerate("ac"):
        write_model(origin_root, m, 6 * MIB, seed=i)
    origin = CountingOrigin(open_origin(origin_root.as_uri()))
    with NodeCache(origin, disk / "cache", 100 * MIB, pins=["a"]) as cache:
        cache.warm()
        failure = fill_while_space_is_taken(cache, origin, disk, "c", leave_free=2 * MIB)
        assert len(failure) == 1 and isinstance(failure[0], CacheTooSmall), failure
        message = str(failure[0])
        assert str(disk / "cache") in message, message
        assert "c/model.safetensors" in message and "ran out of disk space" in message, message
        size = (origin_root / "c/model.safetensors").stat().st_size
        assert f"needs {size} bytes" in message, message
        assert "'a'" in message and "pinned (--pin)" in message, message
        assert cache.cached_models() == ["a"] and partials(disk / "cache") == []
        (disk / "ballast").unlink()
        cache.ensure("a", files_of(origin, "a"))  # the rest is served as it was
        assert cache.stats.evictions == 0


def server_config(origin_root: Path, disk: Path) -> ServerConfig:
    return ServerConfig(
        origin_root.as_uri(),
        http_port=0,
        grpc_port=0,
        flight_port=None,
        rescan_seconds=0,
        watch=False,
        cache_dir=str(disk),
        cache_size=100 * MIB,
    )


def load(url: str, model_id: str) -> int:
    with Client(url, retry_seconds=10, flight=False) as client:
        return sum(a.nbytes for a in client.model(model_id).fetch(prefix="").values())


def test_the_bound_follows_the_disk_and_a_model_that_cannot_fit_is_refused(
    origin_root: Path, disk: Path
) -> None:
    for i, m in enumerate("abc"):
        write_model(origin_root, m, 7 * MIB, seed=i)  # two fit the disk, three do not
    write_model(origin_root, "huge", 24 * MIB, seed=9)
    with WeightServer(server_config(origin_root, disk)) as server:
        port = server.http_port
        for m in "abc":
            assert load(server.http_url, m) > 7 * MIB
        assert isinstance(server.catalog, OriginCatalog)
        assert server.catalog.cache.cached_models() == ["b", "c"]
        assert evictions(port, "disk_full") == 1 and evictions(port, "size") == 0
        bound = gauge(port, "weightserve_cache_bound_bytes")
        free = gauge(port, "weightserve_cache_disk_free_bytes")
        assert bound < DISK and abs(free - shutil.disk_usage(disk).free) < MIB
        with pytest.raises(CacheTooSmall) as refused:
            load(server.http_url, "huge")
        message = str(refused.value)
        assert str(disk / "node-cache") in message and "can hold on its file system" in message
        assert "'huge'" in message and "free" in message, message
        for m in "bc":  # the node serves the rest, from the cache
            assert load(server.http_url, m) > 7 * MIB
        assert server.catalog.cache.stats.evictions == 1


@contextlib.contextmanager
def serve_process(origin_root: Path, disk: Path, log: Path) -> Iterator[int]:
    """``weightserve serve file://ORIGIN --cache-dir DISK --cache-size 100MiB``: its HTTP port."""
    port = free_port()
    command = [
        sys.executable, "-c",
        "import sys; from weightserve.client._cli import main; sys.exit(main())",
        "serve", origin_root.as_uri(), "--cache-dir", str(disk), "--cache-size", "100MiB",
        "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", str(free_port()),
        "--flight-port", str(free_port()), "--rescan", "0", "--no-watch", "--grace", "1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WEIGHTSERVE_TOKEN", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                if http_request(port, "/healthz").status == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_a_server_process_on_a_small_disk_evicts_for_the_third_model(
    origin_root: Path, disk: Path, tmp_path: Path
) -> None:
    for i, m in enumerate("abc"):
        write_model(origin_root, m, 7 * MIB, seed=i)
    with serve_process(origin_root, disk, tmp_path / "server.log") as port:
        url = f"http://127.0.0.1:{port}"
        for m in "abc":
            assert load(url, m) > 7 * MIB
        assert evictions(port, "disk_full") == 1
        before = gauge(port, "weightserve_cache_bound_bytes")
        take_space(disk / "ballast", 2 * MIB)  # the bound follows what others write there
        after = gauge(port, "weightserve_cache_bound_bytes")
        assert before - after == pytest.approx(2 * MIB, abs=64 << 10)
        with Client(url, flight=False) as client:
            models, _ = client.list_models()
        assert {m.id: m.state for m in models} == {"a": "remote", "b": "cached", "c": "cached"}
