"""The node fill cache (service/sources/cache/node_cache.py) over a real local-directory origin: whole
models filled byte-identical, once for concurrent callers, reused after a restart, evicted
least-recently-used within the size bound, and kept serving while the origin is down."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from tests.support.node_caches import CountingOrigin, files_of, partials, visible_files, write_model
from weightserve.client.errors import (
    CacheTooSmall,
    ModelNotFound,
    ModelUnavailable,
    OriginChanged,
    OriginUnavailable,
    ResourceExhausted,
)
from weightserve.service.config import parse_size
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.origin.base import OriginFile
from weightserve.service.sources.origin.opening import open_origin

LIMIT = 1 << 20


@pytest.fixture
def origin_root(tmp_path: Path) -> Path:
    root = tmp_path / "origin"
    root.mkdir()
    return root


@pytest.fixture
def origin(origin_root: Path) -> CountingOrigin:
    return CountingOrigin(open_origin(origin_root.as_uri()))


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def test_fill_is_byte_identical_and_second_use_costs_no_origin_bytes(
    origin_root: Path, origin: CountingOrigin, cache_dir: Path
) -> None:
    written = write_model(origin_root, "org/llama", 64 << 10, seed=1)
    solo = origin_root / "solo.safetensors"
    save_file({"w": np.arange(100, dtype=np.int64)}, str(solo))
    with NodeCache(origin, cache_dir, LIMIT, concurrency=4, part_bytes=8 << 10) as cache:
        path = cache.ensure("org/llama", files_of(origin, "org/llama"))
        assert path == cache_dir / "data" / "org" / "llama"
        assert visible_files(cache_dir) == written
        with (
            safe_open(str(path / "model.safetensors"), "np") as got,
            safe_open(str(origin_root / "org/llama/model.safetensors"), "np") as want,
        ):
            assert got.metadata() == want.metadata() == {"format": "pt"}
            for name in want.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert got.get_tensor(name).tobytes() == want.get_tensor(name).tobytes()
        total = sum(len(b) for b in written.values())
        assert cache.stats.origin_bytes == total
        assert cache.bytes_used() == total

        # A one-file model's path is the file itself.
        assert cache.ensure("solo.safetensors").read_bytes() == solo.read_bytes()

        fetched, origin_bytes = len(origin.fetched), cache.stats.origin_bytes
        assert cache.ensure("org/llama", files_of(origin, "org/llama")) == path
        assert cache.ensure("org/llama") == path
        assert (len(origin.fetched), cache.stats.origin_bytes) == (fetched, origin_bytes)
        stats = cache.snapshot()
        assert (stats.fills, stats.hits, stats.misses, stats.models_cached) == (2, 2, 2, 2)
        assert stats.fill_seconds > 0
        assert cache.cached_models() == ["org/llama", "solo.safetensors"]
    assert not partials(cache_dir)


def test_concurrent_cold_callers_cause_one_fill(
    origin_root: Path, origin: CountingOrigin, cache_dir: Path
) -> None:
    written = write_model(origin_root, "org/llama", 256 << 10, seed=2)
    files = files_of(origin, "org/llama")
    origin.gate = threading.Event()
    cache = NodeCache(origin, cache_dir, LIMIT, concurrency=4, part_bytes=16 << 10)
    start = threading.Barrier(8)
    results: list[Path | BaseException] = []

    def reader() -> None:
        start.wait()
        try:
            results.append(cache.ensure("org/llama", files))
        except BaseException as e:
            results.append(e)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for thread in threads:
        thread.start()
    assert origin.fetch_started.wait(10)
    progress = cache.progress("org/llama")
    assert progress is not None
    assert (progress.bytes_done, progress.bytes_total) == (0, sum(map(len, written.values())))
    origin.gate.set()
    for thread in threads:
        thread.join(10)
    assert results == [cache_dir / "data" / "org" / "llama"] * 8
    assert sorted(origin.fetched) == sorted(written)  # each file fetched exactly once
    stats = cache.snapshot()
    assert (stats.fills, stats.hits + stats.misses) == (1, 8)
    assert cache.progress("org/llama") is None
    assert visible_files(cache_dir) == written
    cache.close()


def test_restart_reuses_the_cache_and_removes_leftovers(
    origin_root: Path, origin: CountingOrigin, cache_dir: Path
) -> None:
    written = write_model(origin_root, "org/llama", 64 << 10, seed=3)
    with NodeCache(origin, cache_dir, LIMIT) as cache:
        cache.ensure("org/llama", files_of(origin, "org/llama"))
    # What a crash leaves: a partial file, and a whole file no state records.
    leftover = cache_dir / "data" / "org" / "llama" / ".model.safetensors.partial-0123abcd"
    leftover.write_bytes(b"half")
    (cache_dir / "data" / "stray").mkdir()
    (cache_dir / "data" / "stray" / "model.safetensors").write_bytes(b"unrecorded")

    restarted = CountingOrigin(open_origin(origin_root.as_uri()))
    with NodeCache(restarted, cache_dir, LIMIT) as cache:
        assert not partials(cache_dir)
        assert visible_files(cache_dir) == written
        assert not (cache_dir / "data" / "stray").exists()
        path = cache.ensure("org/llama", files_of(restarted, "org/llama"))
        assert (path / "config.json").read_bytes() == written["org/llama/config.json"]
        assert restarted.fetched == []
        assert restarted.listings == 1  # the revalidation: one listing, no download
        assert cache.stats.origin_bytes == 0


def test_one_cache_directory_per_process(origin: CountingOrigin, cache_dir: Path) -> None:
    with (
        NodeCache(origin, cache_dir, LIMIT),
        pytest.raises(ModelUnavailable, match="in use by another process"),
    ):
        NodeCache(origin, cache_dir, LIMIT)


def test_a_changed_origin_file_is_fetched_again_alone(
    origin_root: Path, origin: CountingOrigin, cache_dir: Path
) -> None:
    write_model(origin_root, "org/llama", 64 << 10, seed=4)
    with NodeCache(origin, cache_dir, LIMIT) as cache:
        cache.ensure("org/llama", files_of(origin, "org/llama"))
        origin.fetched.clear()
        config = origin_root / "org/llama/config.json"
        config.write_text(json.dumps({"model_type": "llama", "changed": True}))
        (origin_root / "org/llama/tokenizer/vocab.txt").unlink()
        path = cache.ensure("org/llama", files_of(origin, "org/llama"))
        assert origin.fetched == ["org/llama/config.json"]
        assert (path / "config.json").read_bytes() == config.read_bytes()
        assert not (path / "tokenizer").exists()  # no longer listed: removed with its folder
        state = json.loads((cache_dir / "state" / "org%2Fllama.json").read_text())
        assert sorted(state["files"]) == ["org/llama/config.json", "org/llama/model.safetensors"]
        assert state["complete"] is True


def test_least_recently_used_models_are_evicted_within_the_bound(
    origin_root: Path, origin: CountingOrigin, cache_dir: Path
) -> None:
    sizes = {
        m: sum(map(len, write_model(origin_root, m, 96 << 10, seed=i).values()))
        for i, m in enumerate(["a", "b", "c"])
    }
    limit = sizes["a"] + sizes["b"] + sizes["c"] // 2
    with NodeCache(origin, cache_dir, limit) as cache:
        cache.ensure("a", files_of(origin, "a"))
        cache.ensure("b", files_of(origin, "b"))
        cache.ensure("a", files_of(origin, "a"))  # a is now more recent than b
        cache.ensure("c", files_of(origin, "c"))
        assert cache.cached_models() == ["a", "c"]
        assert not (cache_dir / "data" / "b").exists()
        assert not (cache_dir / "state" / "b.json").exists()
        assert cache.bytes_used() == sizes["a"] + sizes["c"] <= limit
        stats = cache.snapshot()
        assert (stats.evictions, stats.evicted_bytes) == (1, sizes["b"])

        # Fetched again on demand; a (least recently used now) makes room.
        cache.ensure("b", files_of(origin, "b"))
        assert cache.cached_models() == ["b", "c"]
        assert cache.bytes_used() <= limit


def test_models_in_use_and_pinned_models_are_never_evicted(
    origin_root: Path, origin: CountingOrigin, cache_dir: Path
) -> None:
    sizes = {
        m: sum(map(len, write_model(origin_root, m, 96 << 10, seed=i).values()))
        for i, m in enumerate(["pinned", "streamed", "new"])
    }
    limit = sizes["pinned"] + sizes["streamed"] + sizes["new"] // 2
    with NodeCache(origin, cache_dir, limit, pins=["pinned"]) as cache:
        cache.warm()
        assert cache.cached_models() == ["pinned"]
        with cache.using("streamed", files_of(origin, "streamed")) as path:
            assert (path / "config.json").is_file()
            with pytest.raises(ResourceExhausted) as refused:
                cache.ensure("new", files_of(origin, "new"))
            assert refused.value.retry_after is not None  # temporary: the stream will end
            assert "being streamed" in str(refused.value)
            assert cache.cached_models() == ["pinned", "streamed"]
        cache.ensure("new", files_of(origin, "new"))  # the stream ended: it may go now
        assert cache.cached_models() == ["new", "pinned"]


def test_a_model_larger_than_the_cache_is_refused_naming_both_sizes(
    origin_root: Path, origin: CountingOrigin, cache_dir: Path
) -> None:
    size = sum(map(len, write_model(origin_root, "big", 128 << 10, seed=5).values()))
    with NodeCache(origin, cache_dir, 100_000) as cache, pytest.raises(CacheTooSmall) as refused:
        cache.ensure("big")
    message = str(refused.value)
    assert f"{size} bytes" in message and "100000 bytes" in message and "'big'" in message
    assert refused.value.retry_after is None
    assert origin.fetched == []


def test_a_fill_failing_midway_leaves_nothing_half_written(
    origin_root: Path, origin: CountingOrigin, cache_dir: Path
) -> None:
    written = write_model(origin_root, "org/llama", 64 << 10, seed=6)
    files = files_of(origin, "org/llama")
    # The second file (in name order) vanishes between listing and fetch.
    weights = origin_root / "org/llama/model.safetensors"
    weights.rename(origin_root / "moved")
    with NodeCache(origin, cache_dir, LIMIT) as cache:
        with pytest.raises(OriginChanged, match="model.safetensors"):
            cache.ensure("org/llama", files)
        assert not partials(cache_dir)
        assert "org/llama/model.safetensors" not in visible_files(cache_dir)
        assert cache.cached_models() == []
        assert cache.snapshot().fill_failures == 1

        (origin_root / "moved").rename(weights)
        origin.fetched.clear()
        path = cache.ensure("org/llama", files_of(origin, "org/llama"))
        # Files completed before the failure are kept; only the rest is fetched.
        assert origin.fetched == ["org/llama/model.safetensors", "org/llama/tokenizer/vocab.txt"]
        assert visible_files(cache_dir) == written
        assert path.is_dir()


def test_waiting_callers_see_the_fill_error(
    origin_root: Path, origin: CountingOrigin, cache_dir: Path
) -> None:
    write_model(origin_root, "org/llama", 64 << 10, seed=7)
    files = files_of(origin, "org/llama")
    (origin_root / "org/llama/config.json").unlink()  # the first file fetched
    origin.gate = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            cache.ensure("org/llama", files)
        except BaseException as e:
            errors.append(e)

    with NodeCache(origin, cache_dir, LIMIT) as cache:
        threads = [threading.Thread(target=reader) for _ in range(4)]
        threads[0].start()
        assert origin.fetch_started.wait(10)
        for thread in threads[1:]:
            thread.start()
        time.sleep(0.5)  # the others reach ensure() and wait on the running fill
        origin.gate.set()
        for thread in threads:
            thread.join(10)
        assert len(errors) == 4 and all(isinstance(e, OriginChanged) for e in errors)
        assert origin.fetched == ["org/llama/config.json"]
        assert not partials(cache_dir)


def test_origin_down_cached_models_are_served_and_uncached_fail_clearly(
    tmp_path: Path, origin_root: Path, origin: CountingOrigin, cache_dir: Path
) -> None:
    written = write_model(origin_root, "cached", 64 << 10, seed=8)
    write_model(origin_root, "uncached", 64 << 10, seed=9)
    listing = origin.list_files()
    with NodeCache(origin, cache_dir, LIMIT, pins=["cached"]) as cache:
        cache.warm()
    origin_root.rename(tmp_path / "gone")  # the origin disappears, the server restarts

    with NodeCache(origin, cache_dir, LIMIT, pins=["cached"]) as cache:
        cache.warm()  # the listing fails: the pinned model is kept as cached
        path = cache.ensure("cached")
        assert cache.ensure("cached", [f for f in listing if f.name.startswith("cached/")]) == path
        assert {
            f"cached/{p.relative_to(path).as_posix()}": p.read_bytes()
            for p in path.rglob("*")
            if p.is_file()
        } == written
        with pytest.raises(OriginUnavailable) as refused:
            cache.ensure("uncached")
        assert str(tmp_path / "origin") in str(refused.value)
        assert "does not exist" in str(refused.value)
        with pytest.raises(ModelUnavailable):  # its files vanished since the listing
            cache.ensure("uncached", [f for f in listing if f.name.startswith("uncached/")])
        assert cache.cached_models() == ["cached"]
        assert not partials(cache_dir)
        assert cache.snapshot().origin_failures >= 2


def test_unsafe_names_never_reach_the_disk(origin: CountingOrigin, cache_dir: Path) -> None:
    with NodeCache(origin, cache_dir, LIMIT) as cache:
        for bad in ["../escape", "/abs", "a//b", "a/./b", "a/.x.partial-1"]:
            with pytest.raises(ModelUnavailable, match="cannot be kept"):
                cache.ensure("a", [OriginFile(bad, 1, "v")])
        with pytest.raises(ValueError, match="not part of model"):
            cache.ensure("a", [OriginFile("b/config.json", 1, "v")])
        with pytest.raises(ModelNotFound, match="names no file"):
            cache.ensure("a", [])
    assert list((cache_dir / "data").iterdir()) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500GiB", 500 << 30),
        ("1.5 TB", 1_500_000_000_000),
        ("64Mi", 64 << 20),
        ("4096", 4096),
        ("2k", 2000),
        ("10gb", 10**10),
        (123, 123),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-5GiB", "1e9"])
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)
