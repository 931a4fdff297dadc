"""Plain descriptions of models and tensors, as the server reports them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # wire dtype of the served bytes
    shape: tuple[int, ...]  # shape of the served bytes (GGML blocks: the byte shape)
    logical_shape: tuple[int, ...]  # element shape
    encoding: str | None  # GGML type name of quantized blocks, else None
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.logical_shape)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorInfo:
        return cls(
            d["name"],
            d["dtype"],
            tuple(d["shape"]),
            tuple(d["logical_shape"]),
            d.get("encoding") or None,
            int(d["nbytes"]),
        )


# The files whose tensors a server serves (client/max/load.py maps them to MAX's formats).
WEIGHT_FILE_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class RemoteFile:
    """One file of a model's repository as the server lists it (``/-/files``)."""

    name: str  # relative to the model directory, "/" between parts
    size: int
    etag: str  # xxh3-128 (hex) of the whole file

    @property
    def is_side_file(self) -> bool:
        """Not a checkpoint's weights: a config, a tokenizer, an index..."""
        return not self.name.endswith(WEIGHT_FILE_SUFFIXES)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RemoteFile:
        return cls(str(d["name"]), int(d["size"]), str(d["etag"]).strip('"'))


@dataclass(frozen=True)
class ModelInfo:
    """One model as the server describes it (``Client.model_info``, ``RemoteModel.info``)."""

    id: str
    format: str  # "safetensors" | "gguf" | "pytorch"
    revision: str
    alignment: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(repr=False)  # in MAX's items() order
    # The revision as a 40-hex commit (the revision is its prefix); "" from an older server.
    commit: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelInfo:
        tensors = {t["name"]: TensorInfo.from_json(t) for t in d["tensors"]}
        return cls(
            d["id"],
            d["format"],
            d["revision"],
            int(d.get("alignment", 1)),
            d.get("metadata") or {},
            tensors,
            str(d.get("commit") or ""),
        )


@dataclass(frozen=True)
class ModelSummary:
    id: str
    format: str
    revision: str
    tensor_count: int
    total_bytes: int
    # A node cache's models: "cached", "outdated" (held, but the origin's files changed since;
    # the next load fills them), "filling" or "remote" (listed by its origin, filled on first
    # use; tensor_count 0 until then). "local": a server's own root. Over a node cache
    # revision and commit are the origin's current ones ("" where its listing does not tell
    # them: object storage, for a model not held as listed).
    state: str = "local"
    commit: str = ""  # the revision as a 40-hex commit id ("" from an older server)
    cached_revision: str = ""  # the revision of the copy a node cache holds; "" none


@dataclass(frozen=True)
class ModelProblem:
    model: str
    file: str
    reason: str
