"""The reader interface: what every checkpoint format reader produces.

A reader parses a checkpoint's headers (never its tensor data) with strict validation and
returns a ``ModelContents``: an ordered index of ``TensorEntry`` records pointing into files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes live and how to interpret them.

    ``shape`` is the shape of the bytes as served: for quantized GGUF tensors that is the byte
    shape (dtype uint8, last dim = blocks x block bytes) while ``logical_shape`` is the element
    shape. For plain tensors both are equal.

    ``offset`` is the absolute byte offset in ``file`` of element [0, ..., 0]. ``strides`` (in
    elements) is set only for non-contiguous PyTorch views; ``None`` means C-contiguous and
    the tensor occupies ``nbytes`` bytes from ``offset``.
    """

    name: str
    dtype: str  # a wire dtype name (weightserve.client.wire.dtypes)
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int
    logical_shape: tuple[int, ...]
    encoding: str | None = None  # GGML type name for quantized tensors ("Q4_0", ...)
    strides: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        return self.strides is None


@dataclass(slots=True)
class ModelContents:
    """What a reader found in one model's files."""

    format: str  # "safetensors" | "gguf" | "pytorch"
    tensors: dict[str, TensorEntry]  # in the order MAX lists them (items() order)
    metadata: dict[str, Any] = field(default_factory=dict)
    alignment: int = 1  # GGUF data alignment; 1 elsewhere (MAX's allocate align)


class FormatReader(Protocol):
    """One per checkpoint format. ``read`` must not touch tensor data, only headers."""

    format: ClassVar[str]

    def read(self, files: Sequence[Path]) -> ModelContents:
        """Parse and validate these files (all shards of one model) into one index."""
        ...
