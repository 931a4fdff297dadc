"""Safetensors checkpoints for tests, written by the reference ``safetensors`` writer.

Each ``write_*`` function writes into a given directory and returns the file (or, for shard
sets, the directory), so reader, HTTP and gRPC tests can share the same real files.
``write_crafted`` is the one exception: it writes headers by hand, for files that break a
rule on purpose or use a dtype no reference writer produces.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import TensorSpec, serialize_file
from safetensors.numpy import save_file

MIXED_METADATA = {"format": "np", "written_by": "weightserve tests"}


def mixed_dtype_arrays() -> dict[str, np.ndarray]:
    """One array per dtype NumPy (with ml_dtypes) can express, plus scalars and empties."""
    rng = np.random.default_rng(0)
    floats = rng.standard_normal((3, 5)).astype(np.float32)
    arrays: dict[str, np.ndarray] = {
        "bool": rng.integers(0, 2, (4, 3)).astype(np.bool_),
        "complex64": (floats + 1j * floats[::-1]).astype(np.complex64),
        "float16": floats.astype(np.float16),
        "bfloat16": floats.astype(ml_dtypes.bfloat16),
        "float32": floats,
        "float64": floats.astype(np.float64) * 1e100,
        "float8_e4m3fn": floats.astype(ml_dtypes.float8_e4m3fn),
        "float8_e5m2": floats.astype(ml_dtypes.float8_e5m2),
        "float8_e8m0fnu": np.abs(floats).astype(ml_dtypes.float8_e8m0fnu),
        "scalar.float32": np.array(3.5, dtype=np.float32),
        "scalar.bfloat16": np.array(-2.25, dtype=ml_dtypes.bfloat16),
        "scalar.int64": np.array(-(2**40), dtype=np.int64),
        "empty.float32": np.zeros((0, 3), dtype=np.float32),
        "empty.bfloat16": np.zeros((5, 0, 2), dtype=ml_dtypes.bfloat16),
        "empty.uint8": np.zeros((0,), dtype=np.uint8),
    }
    for name in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"):
        info = np.iinfo(name)
        arrays[name] = rng.integers(info.min, info.max, (2, 3, 4), dtype=name, endpoint=True)
    return arrays


def write_mixed_dtypes(directory: Path, name: str = "mixed.safetensors") -> Path:
    """Every NumPy-expressible dtype (bf16 and float8 included), scalars, zero-sized tensors
    and ``__metadata__``, in one file written by ``safetensors.numpy.save_file``."""
    path = Path(directory) / name
    save_file(mixed_dtype_arrays(), path, metadata=MIXED_METADATA)
    return path


def write_packed_dtypes(directory: Path, name: str = "packed.safetensors") -> Path:
    """F4 (written by the reference writer) and F6_E2M3 / F6_E3M2 tensors.

    No reference writer accepts the F6 types yet, so this file is written by
    ``write_crafted``; the reference reader (``safetensors.deserialize``) does load it.
    """
    rng = np.random.default_rng(1)
    f4 = rng.integers(0, 256, 6, dtype=np.uint8)  # 12 float4 values, two per byte
    f4_file = Path(directory) / "f4-only.safetensors"
    spec = TensorSpec(dtype="float4_e2m1fn_x2", shape=[3, 2], data_ptr=f4.ctypes.data, data_len=6)
    serialize_file({"f4": spec}, f4_file)
    f4_header, f4_data = _split(f4_file)
    f4_file.unlink()

    e2m3 = rng.integers(0, 256, 6, dtype=np.uint8).tobytes()  # 8 float6 values in 6 bytes
    e3m2 = rng.integers(0, 256, 3, dtype=np.uint8).tobytes()  # 4 float6 values in 3 bytes
    end = len(f4_data)
    header = {
        "__metadata__": {"format": "raw"},
        "f4": f4_header["f4"],
        "f6_e2m3": {"dtype": "F6_E2M3", "shape": [2, 4], "data_offsets": [end, end + 6]},
        "f6_e3m2": {"dtype": "F6_E3M2", "shape": [4], "data_offsets": [end + 6, end + 9]},
    }
    return write_crafted(Path(directory) / name, header, f4_data + e2m3 + e3m2)


def write_torch_dtypes(directory: Path, name: str = "torch.safetensors") -> Path:
    """Tensors of every dtype PyTorch can save (float8, float4 x2, unsigned ints), written by
    ``safetensors.torch.save_file``. Needs torch."""
    import torch
    from safetensors.torch import save_file as save_torch

    gen = torch.Generator().manual_seed(2)
    floats = torch.randn(4, 6, generator=gen)
    tensors = {
        "bool": floats > 0,
        "bfloat16": floats.to(torch.bfloat16),
        "float16": floats.to(torch.float16),
        "float32": floats,
        "float64": floats.to(torch.float64),
        "complex64": torch.complex(floats, -floats),
        "int8": (floats * 50).to(torch.int8),
        "uint8": (floats.abs() * 50).to(torch.uint8),
        "int16": (floats * 1000).to(torch.int16),
        "int32": (floats * 1e6).to(torch.int32),
        "int64": (floats * 1e12).to(torch.int64),
        "float8_e4m3fn": floats.to(torch.float8_e4m3fn),
        "float8_e5m2": floats.to(torch.float8_e5m2),
        "scalar": torch.tensor(7.25, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    raw = (floats.abs() * 40).to(torch.uint8)
    optional = {
        "float8_e8m0fnu": lambda: floats.abs().to(torch.float8_e8m0fnu),
        "float4_e2m1fn_x2": lambda: raw.view(torch.float4_e2m1fn_x2),
        "uint16": lambda: raw.to(torch.uint16),
        "uint32": lambda: raw.to(torch.uint32),
        "uint64": lambda: raw.to(torch.uint64),
    }
    for key, make in optional.items():  # newer dtypes; older torch builds lack some
        if hasattr(torch, key):
            tensors[key] = make()
    path = Path(directory) / name
    save_torch(tensors, path, metadata={"format": "pt"})
    return path


SHARD_NAMES = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
INDEX_NAME = "model.safetensors.index.json"


def sharded_arrays() -> list[dict[str, np.ndarray]]:
    """The tensors of each of the three shards ``write_sharded`` writes."""
    rng = np.random.default_rng(3)
    shards: list[dict[str, np.ndarray]] = [{}, {}, {}]
    shards[0]["model.embed.weight"] = rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16)
    for layer in range(4):
        shard = shards[1 + layer // 2]
        prefix = f"model.layers.{layer}"
        shard[f"{prefix}.attn.weight"] = rng.standard_normal((8, 8)).astype(np.float32)
        shard[f"{prefix}.norm.bias"] = rng.standard_normal(8).astype(np.float16)
    shards[2]["lm_head.weight"] = rng.standard_normal((16, 8)).astype(np.float32)
    return shards


def write_sharded(directory: Path, with_index: bool = True) -> Path:
    """A three-shard model in ``directory`` (Hugging Face naming), with
    ``model.safetensors.index.json`` unless ``with_index`` is false. Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for shard_name, arrays in zip(SHARD_NAMES, sharded_arrays(), strict=True):
        save_file(arrays, directory / shard_name, metadata={"format": "pt", "shard": shard_name})
        weight_map.update(dict.fromkeys(arrays, shard_name))
        total += sum(a.nbytes for a in arrays.values())
    if with_index:
        write_index(directory, weight_map, total_size=total)
    return directory


def write_index(directory: Path, weight_map: dict[str, str], total_size: int = 0) -> Path:
    """A shard index as transformers writes it."""
    path = Path(directory) / INDEX_NAME
    document = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return path


def write_crafted(path: Path, header: dict[str, Any] | bytes, data: bytes = b"") -> Path:
    """A safetensors file with exactly this header (a dict, or raw header bytes) and data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = Path(path)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]
