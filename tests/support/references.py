"""Reference answers: ``reference`` (session) reads a model with the format's own reader
(``safetensors.safe_open``, ``gguf.GGUFReader``, ``torch.load(weights_only=True)``), never
with weightserve code, so tests compare what the server sends with an independent answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tests.support.model_root import ModelRoot


@dataclass(frozen=True)
class Ref:
    """One tensor as the reference reader sees it; ``array`` has the served dtype and shape
    (raw uint8 blocks in byte shape for quantized GGML types)."""

    dtype: str
    shape: tuple[int, ...]
    logical_shape: tuple[int, ...]
    encoding: str | None
    array: np.ndarray


def np_dtype(wire: str) -> np.dtype:
    """NumPy dtype of a wire dtype name (bfloat16 and float8 through ml_dtypes)."""
    return np.dtype(getattr(ml_dtypes, wire)) if hasattr(ml_dtypes, wire) else np.dtype(wire)


# Written out here rather than taken from weightserve, so a wrong table there shows up.
SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn", "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn",
}  # fmt: skip
# Packed below one byte per element: served, and compared, as raw bytes.
PACKED_DTYPES = {"float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"}
GGUF_PLAIN_DTYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
    "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
}  # fmt: skip


def _plain(dtype: str, shape: tuple[int, ...], data: bytes | np.ndarray) -> Ref:
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    if dtype in PACKED_DTYPES:
        return Ref(dtype, shape, shape, None, np.frombuffer(raw, dtype=np.uint8))
    arr = np.frombuffer(raw, dtype=np_dtype(dtype)).reshape(shape)
    return Ref(dtype, shape, shape, None, arr)


def reference_safetensors(files: list[Path]) -> dict[str, Ref]:
    import safetensors
    from safetensors import safe_open

    out: dict[str, Ref] = {}
    for f in files:
        raw: dict | None = None
        with safe_open(f, "numpy") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a Mapping
                sl = st.get_slice(name)
                dtype, shape = SAFETENSORS_DTYPES[sl.get_dtype()], tuple(sl.get_shape())
                try:
                    data: bytes | np.ndarray = st.get_tensor(name)
                except (AttributeError, TypeError, ValueError, safetensors.SafetensorError):
                    # NumPy has no float8 / float4 / float6: take the raw bytes instead.
                    if raw is None:
                        raw = dict(safetensors.deserialize(f.read_bytes()))
                    data = raw[name]["data"]
                out[name] = _plain(dtype, shape, data)
    return {name: out[name] for name in sorted(out)}  # MAX's items() order: sorted


def reference_gguf(path: Path) -> dict[str, Ref]:
    import gguf

    out: dict[str, Ref] = {}
    for t in gguf.GGUFReader(path).tensors:  # file order, as MAX lists them
        logical = tuple(reversed(t.shape.tolist()))
        kind = t.tensor_type.name
        if kind in GGUF_PLAIN_DTYPES:
            out[t.name] = _plain(GGUF_PLAIN_DTYPES[kind], logical, t.data)
        else:
            blocks = np.array(t.data, dtype=np.uint8)  # a copy: the reader's mmap goes away
            out[t.name] = Ref("uint8", blocks.shape, logical, kind, blocks)
    return out


def reference_torch(path: Path) -> dict[str, Ref]:
    import torch

    state = torch.load(path, weights_only=True, map_location="cpu")
    out = {}
    for name in sorted(state):
        t = state[name]
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = _plain(str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
    return out


@pytest.fixture(scope="session")
def reference(model_root: ModelRoot):
    """``reference(model_id)`` -> {name: Ref} in items() order (read once per session)."""
    cache: dict[str, dict[str, Ref]] = {}

    def get(model_id: str) -> dict[str, Ref]:
        if model_id not in cache:
            fmt, files = model_root.models[model_id]
            if fmt == "safetensors":
                cache[model_id] = reference_safetensors(files)
            elif fmt == "gguf":
                cache[model_id] = reference_gguf(files[0])
            else:
                cache[model_id] = reference_torch(files[0])
        return cache[model_id]

    return get
