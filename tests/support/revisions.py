"""A model whose one file is replaced by another revision, and files overwritten in place."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.support.faults import MIB

TENSORS = ("a", "b", "c", "d")


def arrays(value: float) -> dict[str, np.ndarray]:
    return {name: np.full(4096, value + i, dtype=np.float32) for i, name in enumerate(TENSORS)}


def write_model(directory: Path, value: float) -> None:
    """The model's weights, replaced the way tools do: a new file renamed over the old."""
    directory.mkdir(parents=True, exist_ok=True)
    fresh = directory / "model.safetensors.tmp"
    save_file(arrays(value), str(fresh))
    os.replace(fresh, directory / "model.safetensors")


def values(got: dict[str, np.ndarray]) -> dict[str, float]:
    return {name: float(arr[0]) for name, arr in got.items()}


def overwrite_in_place(path: Path, data: bytes, how: str) -> None:
    """Not an atomic rename: the served inode itself gets the new bytes, in 1 MiB writes."""
    # "cp" truncates, then writes (shutil.copyfile, cp); "rewrite" writes the same size over
    # the old bytes without truncating.
    with open(path, "wb" if how == "cp" else "r+b") as f:
        for start in range(0, len(data), MIB):
            f.write(data[start : start + MIB])
            f.flush()
