"""``weightserve pull``: stream a model (or a prefix of it) into a local safetensors file.

The file's header is written first from the model index, then every chunk is received
straight into its place in the memory-mapped output file: memory stays flat whatever the
model's size, and the result opens with ``safetensors.safe_open``.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from weightserve.client._client import RemoteModel
from weightserve.client._dtypes import wire_dtype
from weightserve.client._retry import OnWait
from weightserve.client._schema import ChunkHeader

_ALIGN = 8  # safetensors pads the header so tensor data starts 8-byte aligned


def safetensors_header(model: RemoteModel, names: list[str]) -> tuple[bytes, dict[str, int]]:
    """The header bytes (length prefix included) and each tensor's offset in the file."""
    header: dict[str, object] = {}
    offsets: dict[str, int] = {}
    position = 0
    for name in names:
        t = model.tensors[name]
        code = wire_dtype(t.dtype).safetensors
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code")
        header[name] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [position, position + t.nbytes],
        }
        offsets[name] = position
        position += t.nbytes
    metadata = {
        "weightserve.model": model.id,
        "weightserve.revision": model.info.revision,
        "weightserve.format": model.info.format,
    }
    encodings = {n: model.tensors[n].encoding for n in names if model.tensors[n].encoding}
    if encodings:  # GGML blocks travel as uint8; keep what they are and their element shape
        metadata["weightserve.encodings"] = json.dumps(encodings)
        metadata["weightserve.logical_shapes"] = json.dumps(
            {n: list(model.tensors[n].logical_shape) for n in encodings}
        )
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    data_start = 8 + len(raw)
    return len(raw).to_bytes(8, "little") + raw, {n: data_start + o for n, o in offsets.items()}


def pull_to_safetensors(
    model: RemoteModel,
    out: Path,
    prefix: str = "",
    on_bytes: Callable[[int], None] | None = None,
    on_wait: OnWait | None = None,
) -> Path:
    names = model.names(prefix)
    if not names:
        raise ValueError(f"model {model.id!r} has no tensor whose name starts with {prefix!r}")
    header, offsets = safetensors_header(model, names)
    total = len(header) + sum(model.tensors[n].nbytes for n in names)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with open(partial, "w+b") as f:
        f.truncate(total)
        f.write(header)
        mapped = mmap.mmap(f.fileno(), total) if total else None

        def place(h: ChunkHeader) -> np.ndarray:
            assert mapped is not None
            start = offsets[h.name]
            return np.frombuffer(mapped, dtype=np.uint8, count=h.total_bytes, offset=start)

        try:
            model.fetch(
                names, on_bytes=on_bytes, allocate=place if mapped else None, on_wait=on_wait
            )
            if mapped is not None:
                mapped.flush()
        finally:
            if mapped is not None:
                # Views may still be alive; the map then closes when they go.
                with contextlib.suppress(BufferError):
                    mapped.close()
    os.replace(partial, out)  # a half-written pull never looks like a finished one
    return out
