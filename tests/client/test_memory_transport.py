"""``MemoryTransport``: a model table served in-process through the transport seam, so what
sits above it (resumes, windows, names) is tested without a socket, as httpx's
``MockTransport`` lets its client be."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from weightserve.client import Client, FetchOptions
from weightserve.client.errors import TensorNotFound, WrongTransport
from weightserve.client.transports.memory import MemoryTransport

CHUNK = 1024


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "layers.0.w": rng.standard_normal((48, 40)).astype(ml_dtypes.bfloat16),  # 3.75 chunks
        "layers.0.b": rng.standard_normal(40).astype(np.float32),
        "layers.1.w": rng.standard_normal((40, 40)).astype(np.float32),  # 6.25 chunks
        "empty": np.zeros((0, 3), dtype=np.int8),
    }


def _raw(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def test_a_stream_cut_three_times_resumes_from_the_last_whole_chunk() -> None:
    tensors = _tensors()
    # Each cut falls inside a tensor (the Arrow framing of a chunk is about 1.4 KiB here).
    memory = MemoryTransport({"m": tensors}, chunk_bytes=CHUNK, cuts=[5500, 5500, 6000])
    with Client("http://memory", transport=memory, retry_seconds=10) as client:
        model = client.model("m", FetchOptions(chunk_bytes=CHUNK))
        got = model.fetch(prefix="")
    assert {n: _raw(a) for n, a in got.items()} == {n: _raw(a) for n, a in tensors.items()}
    first, *resumed = memory.opened
    assert first.resume_tensor is None and len(resumed) == 3
    assert {p.revision for p in memory.opened} == {model.revision}
    # Each resume names the tensor it was in and the whole chunks it already held, always
    # further on: no byte is asked for twice.
    at = [(p.resume_tensor, p.resume_offset) for p in resumed]
    assert all(offset > 0 and offset % CHUNK == 0 for _, offset in at), at
    assert at == sorted(at, key=lambda r: (sorted(tensors).index(r[0]), r[1])), at
    assert {"layers.0.w", "layers.1.w"} <= {name for name, _ in at}, at


def test_iter_tensors_hands_out_each_tensor_in_stream_order_within_the_window() -> None:
    tensors = _tensors()
    memory = MemoryTransport({"m": tensors}, chunk_bytes=CHUNK)
    with Client("http://memory", transport=memory) as client:
        model = client.model("m")
        seen = [(n, _raw(a)) for n, a in model.iter_tensors(prefix="layers.", window_bytes=CHUNK)]
    assert seen == [(n, _raw(tensors[n])) for n in sorted(tensors) if n.startswith("layers.")]
    assert len(memory.opened) == 1  # one stream, however small the window


def test_a_wrong_name_is_refused_before_any_stream_and_control_verbs_need_a_server() -> None:
    memory = MemoryTransport({"m": _tensors()})
    with Client("http://memory", transport=memory) as client:
        model = client.model("m")
        with pytest.raises(TensorNotFound, match="Did you mean 'layers.0.w'"):
            model.fetch(["layers.0.v"])
        assert memory.opened == []
        with pytest.raises(WrongTransport, match="^publishing needs a server"):
            client.publish("m", _tensors())
        with pytest.raises(WrongTransport, match="^watching revisions needs a server"):
            next(model.watch(timeout=1))
