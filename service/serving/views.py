"""The JSON/protobuf-neutral description of models: what /v1/models and GetModel return."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from weightserve.service.readers.base import TensorEntry
from weightserve.service.sources.base import FillsOnRequest, ModelSource
from weightserve.service.sources.model import Model, ReadCheck


def server_version() -> str:
    try:
        return importlib.metadata.version("weightserve")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


def tensor_info(entry: TensorEntry) -> dict[str, Any]:
    return {
        "name": entry.name,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "logical_shape": list(entry.logical_shape),
        "encoding": entry.encoding,
        "nbytes": entry.nbytes,
    }


def model_summary(model: Model) -> dict[str, Any]:
    return {
        "id": model.id,
        "format": model.format,
        "revision": model.revision,
        "commit": model.commit,
        "tensor_count": len(model.tensors),
        "total_bytes": model.total_bytes,
    }


def model_files(model: Model) -> list[dict[str, Any]]:
    """The model's files: name relative to the model (as the revision names them) and size."""
    return [{"name": name, "size": size} for name, size in model.file_names()]


def model_info(model: Model) -> dict[str, Any]:
    """The summary, the revision as a 40-hex ``commit`` (what a pinned load names), the
    files and the tensor index."""
    return {
        **model_summary(model),
        "commit": model.commit,
        "files": model_files(model),
        "alignment": model.contents.alignment,
        "metadata": model.metadata,
        "tensors": [tensor_info(e) for e in model.tensors.values()],
    }


def model_list(catalog: ModelSource, may_read: ReadCheck = lambda _: True) -> dict[str, Any]:
    """Models (and refused models) the caller may read; the others are not even named.
    Over a node cache, each model has a ``state`` (``cached``, ``outdated``, ``filling``,
    ``remote``) and the revision the origin lists now, and the origin's models not cached
    yet are listed too."""
    remote = catalog if isinstance(catalog, FillsOnRequest) else None
    summaries = [
        {**model_summary(m), **(remote.listing_fields(m) if remote is not None else {})}
        for m in catalog.models.values()
        if may_read(m.id)
    ]
    if remote is not None:
        summaries += remote.remote_summaries(may_read)
    return {
        "models": summaries,
        "problems": [
            {"model": p.model, "file": p.file, "reason": p.reason}
            for p in catalog.problems.values()
            if may_read(p.model)
        ],
        # Other weight sets of a model (ID:fp16, ID:pytorch, ...): indexed on first request.
        "variants": sorted(v for v in catalog.variants if may_read(v)),
    }
