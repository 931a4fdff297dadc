"""``weightserve pull --to safetensors``: a model's tensors converted into one safetensors
file (``_download.py`` is the pull of its original files).

The conversion (``pull_to_safetensors``) writes the file's header first from the model
index, then receives every chunk straight into its place in the memory-mapped output file:
memory stays flat whatever the model's size, and the result opens with
``safetensors.safe_open``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from weightserve.client._client import RemoteModel
from weightserve.client._download import PARTIAL_SUFFIX, destination_error, prepare_destination
from weightserve.client._retry import OnWait
from weightserve.client.errors import ConversionRefused, DestinationError
from weightserve.client.wire.dtypes import wire_dtype
from weightserve.client.wire.safetensors_layout import LayoutEntry
from weightserve.client.wire.safetensors_layout import safetensors_header as layout_header
from weightserve.client.wire.schema import ChunkHeader


def source_metadata(model: RemoteModel) -> dict[str, str]:
    """The ``__metadata__`` a converted file keeps: a safetensors source's own, exactly
    (``format: pt`` included, which transformers requires); ``format: pt`` for PyTorch."""
    fmt = model.info.format
    if fmt == "safetensors":
        return {str(k): str(v) for k, v in model.info.metadata.items()}
    if fmt == "pytorch":
        return {"format": "pt"}
    raise ConversionRefused(
        f"model {model.id!r} is {fmt}: its {fmt} metadata and block types do not fit a "
        "safetensors file; pull its original files instead (without --to)"
    )


def safetensors_header(model: RemoteModel, names: list[str]) -> tuple[bytes, dict[str, int]]:
    """The header bytes (length prefix included) and each tensor's offset in the file."""
    entries = []
    for name in names:
        t = model.tensors[name]
        if wire_dtype(t.dtype).safetensors is None:
            raise ConversionRefused(
                f"tensor {name!r}: dtype {t.dtype} has no safetensors code; pull the original "
                "files instead (without --to)"
            )
        entries.append(LayoutEntry(name, t.dtype, tuple(t.shape), t.nbytes))
    header = layout_header(entries, source_metadata(model))
    offsets: dict[str, int] = {}
    position = len(header)
    for e in entries:
        offsets[e.name] = position
        position += e.nbytes
    return header, offsets


def pull_to_safetensors(
    model: RemoteModel,
    out: Path,
    prefix: str = "",
    on_bytes: Callable[[int], None] | None = None,
    on_wait: OnWait | None = None,
    force: bool = False,
) -> Path:
    """The model's tensors under ``prefix`` as one safetensors file ``out``, keeping the
    source's metadata (``source_metadata``); GGUF models are refused."""
    source_metadata(model)  # refuses a format that does not convert, before any file
    names = model.names(prefix)
    if not names:
        raise ValueError(f"model {model.id!r} has no tensor whose name starts with {prefix!r}")
    header, offsets = safetensors_header(model, names)
    total = len(header) + sum(model.tensors[n].nbytes for n in names)
    prepare_destination(out.parent)
    if out.exists() and not force:
        raise DestinationError(f"{out} exists; pass --force (force=True) to overwrite it")
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    try:
        _convert_into(model, names, header, offsets, total, partial, on_bytes, on_wait)
        os.replace(partial, out)  # a half-written pull never looks like a finished one
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise destination_error(e, partial) from e
    except BaseException:
        # Tensors land anywhere in the file: a broken conversion has nothing to resume.
        partial.unlink(missing_ok=True)
        raise
    return out


def _convert_into(
    model: RemoteModel,
    names: list[str],
    header: bytes,
    offsets: dict[str, int],
    total: int,
    partial: Path,
    on_bytes: Callable[[int], None] | None,
    on_wait: OnWait | None,
) -> None:
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
