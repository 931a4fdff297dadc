"""One safetensors header writer (client/wire/safetensors_layout.py): a tensor named outside
ASCII gets byte-identical headers from every file either side writes (a publish, a patch
applied on the server, a pull's converted file), and they are the bytes of the format's
reference writer, ``safetensors.numpy.save``."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from weightserve.client._client import Client
from weightserve.client._pull import pull_to_safetensors
from weightserve.client.wire.dtypes import from_numpy_dtype
from weightserve.client.wire.safetensors_layout import LayoutEntry, safetensors_header
from weightserve.service.server import ServerConfig, WeightServer

MODEL = "team/names"
# One dtype, sorted: the reference writer orders tensors by dtype, then name; given so here.
NAMES = tuple(sorted(("a.weight", "couche.élan", "层.权重", "слой.😀")))


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((4, 8)).astype(np.float32) for name in NAMES}


def header_of(data: bytes) -> bytes:
    """A safetensors file's header, its length prefix included."""
    return data[: 8 + int.from_bytes(data[:8], "little")]


def reference(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    return header_of(save(tensors, metadata=metadata))


def written(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    entries = [
        LayoutEntry(name, from_numpy_dtype(a.dtype), a.shape, a.nbytes)
        for name, a in tensors.items()
    ]
    return safetensors_header(entries, metadata)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[WeightServer]:
    sockets = tempfile.mkdtemp(prefix="ws-")
    config = ServerConfig(
        str(tmp_path), http_port=0, grpc_port=0, flight_port=None, uds=f"{sockets}/ws.sock",
        rescan_seconds=0, watch=False, allow_publish=True,
    )  # fmt: skip
    with WeightServer(config) as srv:
        yield srv


def snapshot_header(root: Path, commit: str) -> bytes:
    """The header of the one safetensors file of a published revision, as the server keeps it."""
    (path,) = (root / "models--team--names" / "snapshots" / commit).glob("*.safetensors")
    return header_of(path.read_bytes())


def test_the_writer_is_the_reference_writer_byte_for_byte() -> None:
    first = arrays(1)
    assert written(first) == reference(first)
    assert b"\\u" not in written(first)  # UTF-8, never escaped to ASCII
    # One key: the reference keeps metadata in a hash map, its key order differs per process.
    metadata = {"note": "étape 1 — 第一步"}
    assert written(first, metadata) == reference(first, metadata)
    assert written(first, {}) == reference(first, {})


def test_every_writer_gives_a_non_ascii_name_the_same_header(
    server: WeightServer, tmp_path: Path
) -> None:
    first, second = arrays(1), arrays(2)
    second["a.weight"] = first["a.weight"]  # unchanged: the patch leaves it to the base
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, first)
        r2 = c.publish(MODEL, second, base=r1.commit, base_tensors=first)
        model = c.model(f"{MODEL}@{r2.commit}")
        assert model.tensors["слой.😀"].dtype == "float32"
        pulled = pull_to_safetensors(model, tmp_path / "pulled" / "model.safetensors")
        metadata = {str(k): str(v) for k, v in model.info.metadata.items()}
    published = snapshot_header(tmp_path, r1.commit)  # the publisher's file
    patched = snapshot_header(tmp_path, r2.commit)  # the server's patch applied onto r1
    assert published == reference(first) == written(first)
    assert patched == reference(second) == written(second)
    assert len(metadata) <= 1  # the reference's key order is its hash map's (see above)
    assert header_of(pulled.read_bytes()) == reference(second, metadata)
    assert "слой.😀".encode() in published and "слой.😀".encode() in patched
