"""A refusal holds for the file version it was made from: a checkpoint scanned while it was
still being copied into the root is read again once the copy finishes, without a touch.

- A GGUF written in two steps (header and half its data, then the rest) is refused, then
  served after the next file-system event, whatever the reader's format.
- The race of the field: the copy finishes while the half-written file is being read. The
  refusal is made from the half-written version, so the finished file is read again at the
  next rescan instead of staying refused until someone touches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from safetensors.numpy import save_file

from tests.support.faults import eventually
from weightserve.client._client import Client
from weightserve.service.readers.base import ModelContents
from weightserve.service.readers.gguf import GGUFReader
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.local.catalog import Catalog, default_readers


def gguf_bytes(tmp_path: Path) -> tuple[bytes, dict[str, np.ndarray]]:
    """A real GGUF (gguf's writer) of two float32 tensors, as bytes."""
    arrays = {
        "a.weight": np.arange(4096, dtype=np.float32).reshape(64, 64),
        "b.weight": np.linspace(-1, 1, 2048, dtype=np.float32),
    }
    path = tmp_path / "written.gguf"
    writer = GGUFWriter(path, "llama")
    for name, arr in arrays.items():
        writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    path.unlink()
    return data, arrays


def safetensors_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "written.safetensors"
    save_file({"w": np.arange(1024, dtype=np.float32)}, path)
    data = path.read_bytes()
    path.unlink()
    return data


def test_a_gguf_copied_in_two_steps_is_served_once_complete(tmp_path: Path) -> None:
    data, arrays = gguf_bytes(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    target = root / "copied.gguf"
    target.write_bytes(data[: len(data) // 2])
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=None)
    config.rescan_seconds = 3600  # only the file-system event of the copy's end can help
    with WeightServer(config) as srv, Client(srv.http_url, timeout=10) as client:
        _, problems = client.list_models()
        assert [p.model for p in problems] == ["copied.gguf"]
        assert "past" in problems[0].reason or "outside" in problems[0].reason

        with target.open("ab") as f:  # the copy goes on where it was
            f.write(data[len(data) // 2 :])

        eventually(lambda: [m.id for m in client.list_models()[0]] == ["copied.gguf"], 10, "served")
        got = client.model("copied.gguf").fetch()
        for name, arr in arrays.items():
            assert got[name].tobytes() == arr.tobytes()


class _CopyFinishesWhileRead:
    """A reader that lets the copy finish right after it read the half-written file: the
    timing a real copy has when a rescan reads it mid-way, made deterministic."""

    def __init__(self, inner: object, target: Path, rest: bytes) -> None:
        self.inner = inner
        self.target = target
        self.rest = rest

    def read(self, files: Sequence[Path]) -> ModelContents:
        try:
            return self.inner.read(files)  # type: ignore[attr-defined]
        finally:
            if self.rest:
                with self.target.open("ab") as f:
                    f.write(self.rest)
                self.rest = b""


def test_a_file_finished_during_its_read_is_read_again(tmp_path: Path) -> None:
    gguf, _ = gguf_bytes(tmp_path)
    for fmt, name, data in [
        ("gguf", "copied.gguf", gguf),
        ("safetensors", "copied.safetensors", safetensors_bytes(tmp_path)),
    ]:
        root = tmp_path / fmt
        root.mkdir()
        target = root / name
        target.write_bytes(data[: len(data) // 2])
        readers = default_readers()
        readers[fmt] = _CopyFinishesWhileRead(readers[fmt], target, data[len(data) // 2 :])  # type: ignore[assignment]
        catalog = Catalog(root, readers=readers)  # scans once
        assert list(catalog.problems) == [name], fmt  # read while half written
        assert target.stat().st_size == len(data)  # ... and finished meanwhile
        catalog.scan()
        assert list(catalog.models) == [name] and not catalog.problems, fmt


def test_an_unchanged_refused_file_is_not_read_again(tmp_path: Path) -> None:
    """The other side of the rule: a refusal of a version that stays is kept."""
    data, _ = gguf_bytes(tmp_path)
    (tmp_path / "half.gguf").write_bytes(data[: len(data) // 2])
    reads = []

    class CountingReader(GGUFReader):
        def read(self, files: Sequence[Path]) -> ModelContents:
            reads.append(files)
            return super().read(files)

    catalog = Catalog(tmp_path, readers={**default_readers(), "gguf": CountingReader()})
    for _ in range(2):
        catalog.scan()
    assert list(catalog.problems) == ["half.gguf"] and len(reads) == 1
