"""Node caches over real origins: origin repositories and models written to disk, an origin
that counts what it is asked, the server config of a node, and comparing what it serves."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests.support import fixtures_safetensors
from weightserve.client import Client
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.origin.base import DEFAULT_PLAN, FillPlan, Origin, OriginFile
from weightserve.service.sources.origin.catalog import OriginCatalog


def corrupt_in_place(path: Path, offset: int = 1 << 12) -> None:
    """16 bytes flipped in place: same size, the mtime put back (the ctime moves: only the
    kernel sets it)."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(16)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size


MIB = 1 << 20

BIG = "org/big"  # 256 MiB of weights in two shards, with an index and side files


def write_big(root: Path, model_id: str = BIG, shard_bytes: int = 128 * MIB) -> None:
    """Two safetensors shards of ``shard_bytes`` each, their index, a config and a tokenizer."""
    model = root / model_id
    model.mkdir(parents=True)
    half = shard_bytes // 4
    weight_map = {}
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {
            f"layers.{shard}.w": np.full(half - 4096, shard, dtype=np.float32),
            f"layers.{shard}.b": np.arange(4096, dtype=np.float32),
        }
        fixtures_safetensors.save_file(tensors, model / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (model / "config.json").write_text('{"model_type": "llama"}\n')
    (model / "tokenizer.json").write_text('{"version": "1.0"}\n' + " " * 200_000)


class CountingOrigin:
    """Delegates to a real origin, counting listings and fetches; ``gate`` (when set up)
    holds every fetch until the test releases it."""

    def __init__(self, inner: Origin) -> None:
        self.inner = inner
        self.description = inner.description
        self.requests = inner.requests
        self.fetched: list[str] = []
        self.listings = 0
        self.fetch_started = threading.Event()
        self.gate: threading.Event | None = None
        self._lock = threading.Lock()

    def list_files(self) -> list[OriginFile]:
        self.listings += 1
        return self.inner.list_files()

    def fetch(self, file: OriginFile, dest: Path, plan: FillPlan = DEFAULT_PLAN) -> str | None:
        with self._lock:
            self.fetched.append(file.name)
        self.fetch_started.set()
        if self.gate is not None:
            assert self.gate.wait(10), "the test never released the fetch"
        return self.inner.fetch(file, dest, plan)

    def close(self) -> None:
        self.inner.close()


def write_model(root: Path, model_id: str, tensor_bytes: int, seed: int) -> dict[str, bytes]:
    """A small repository (safetensors weights and side files); name -> bytes as written."""
    directory = root / model_id
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file(
        {
            "embed.weight": rng.standard_normal(tensor_bytes // 4, dtype=np.float32),
            "norm.weight": np.ones(16, dtype=np.float32),
        },
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    (directory / "tokenizer").mkdir(exist_ok=True)
    (directory / "tokenizer" / "vocab.txt").write_text("a\nb\nc\n")
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in directory.rglob("*")
        if path.is_file()
    }


def files_of(origin: Origin, model_id: str) -> list[OriginFile]:
    return [f for f in origin.list_files() if f.name.startswith(model_id + "/")]


def visible_files(cache_dir: Path) -> dict[str, bytes]:
    data = cache_dir / "data"
    return {p.relative_to(data).as_posix(): p.read_bytes() for p in data.rglob("*") if p.is_file()}


def partials(cache_dir: Path) -> list[Path]:
    return [p for p in cache_dir.rglob("*") if ".partial-" in p.name]


MODELS = ["big", "org/sharded"]


def config(root: str, cache_dir: Path, **settings: object) -> ServerConfig:
    settings = {"flight_port": None, **settings}
    return ServerConfig(
        root,
        http_port=0,
        grpc_port=0,
        rescan_seconds=0,
        watch=False,
        cache_dir=str(cache_dir),
        **settings,  # type: ignore[arg-type]
    )


def node_cache(server: WeightServer):  # the server's NodeCache
    assert isinstance(server.catalog, OriginCatalog)
    return server.catalog.cache


def reference(root: Path, model_id: str) -> dict[str, np.ndarray]:
    """Every tensor of a model as the reference reader (safetensors) reads it."""
    tensors: dict[str, np.ndarray] = {}
    for path in sorted((root / model_id).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def load(url: str, model_id: str, *, flight: bool = False) -> dict[str, np.ndarray]:
    with Client(url, retry_seconds=30, flight=flight) as client:
        return client.model(model_id).fetch(prefix="")


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].tobytes() == array.tobytes(), name


def write_repository(root: Path) -> dict[str, bytes]:
    """Two models as a Hub repository holds them: weights, index, side files, a subfolder.
    Returns name below ``root`` -> bytes."""
    fixtures_safetensors.write_sharded(root / "org" / "sharded")
    (root / "org" / "sharded" / "config.json").write_text('{"model_type": "llama"}\n')
    big = root / "big"
    big.mkdir()
    rng = np.random.default_rng(14)
    fixtures_safetensors.save_file(
        {"w": rng.standard_normal((512, 700), dtype=np.float32)}, big / "model.safetensors"
    )
    (big / "tokenizer").mkdir()
    (big / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0"}\n')
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
