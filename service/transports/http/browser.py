"""The model browser at ``/``: a static page (``service/web/``) over the JSON API, and the one
endpoint only it needs, ``/v1/models/{id}/-/stats/{name}``: a tensor's value statistics and
histogram, computed on the server from a bounded sample of the mapped bytes."""

from __future__ import annotations

import math
from collections.abc import Callable
from importlib import resources
from typing import Annotated, Literal

import numpy as np
from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from weightserve.client.wire.dtypes import numpy_dtype, wire_dtype
from weightserve.service.readers.base import TensorEntry
from weightserve.service.serving.auth import Access
from weightserve.service.serving.state import ServiceState
from weightserve.service.sources.model import Model
from weightserve.service.transports.http.routes import get_and_head

ASSETS_URL = "/-/web"  # `-` is never a model id part, so no id can collide with it
# At most this many values are read for one histogram: a few MB of the mapping, whatever the
# tensor's size, so a click in the page never reads a whole multi-GB tensor.
SAMPLE_VALUES = 1 << 20
MAX_BINS = 256


class Histogram(BaseModel):
    edges: list[float] = Field(description="bins + 1 bin edges over the finite sampled values")
    counts: list[int] = Field(description="finite sampled values in each bin")


class TensorStats(BaseModel):
    """Value statistics of one tensor, from an evenly spaced sample of its values."""

    model: str
    revision: str
    tensor: str
    dtype: str
    encoding: str | None = Field(None, description="GGML type of a quantized GGUF tensor")
    values: Literal["elements", "dequantized", "raw bytes"] = Field(
        description="what was counted: the elements, quantized blocks dequantized by the "
        "gguf package, or the raw bytes (packed sub-byte dtypes, GGML types it cannot decode)"
    )
    count: int = Field(description="values of that kind in the whole tensor")
    sampled: int = Field(description=f"values in the sample (at most {SAMPLE_VALUES})")
    finite: int = Field(description="sampled values that are neither NaN nor infinite")
    nan_count: int
    inf_count: int
    min: float | None = Field(None, description="over finite sampled values; null when none")
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    histogram: Histogram


def add_browser_routes(
    app: FastAPI, state: ServiceState, access: Callable[[Request], Access]
) -> None:
    """Serve the page at ``/``, its script and style under ``/-/web/``, and the stats route.

    Call before the catch-all ``/v1/models/{model:path}`` routes, which would take the stats
    URL for a model id otherwise."""
    web = resources.files("weightserve.service") / "web"
    app.mount(ASSETS_URL, StaticFiles(packages=[("weightserve.service", "web")]), name="web-assets")

    @get_and_head(app, "/", include_in_schema=False)
    def browser_page() -> HTMLResponse:
        # The page holds no data: it fetches the JSON API, with the caller's token.
        return HTMLResponse(
            (web / "index.html").read_text(encoding="utf-8"),
            headers={"cache-control": "no-cache"},
        )

    @get_and_head(
        app,
        "/v1/models/{model:model_id}/-/stats/{name:path}",
        tags=["models"],
        response_model=TensorStats,
    )
    def tensor_stats(
        request: Request,
        model: str,
        name: str,
        bins: Annotated[int, Query(ge=1, le=MAX_BINS, description="histogram bins")] = 48,
    ) -> TensorStats:
        """Min, max, mean, standard deviation, NaN and Inf counts and a histogram of one
        tensor's values, from an evenly spaced sample of at most 2^20 values (GGUF quantized
        tensors dequantized where the gguf package can)."""
        m = state.readable_model(access(request), model)
        return compute_stats(m, m.tensor(name), bins)


def compute_stats(model: Model, entry: TensorEntry, bins: int) -> TensorStats:
    model.pin([entry.file])
    with model.holding([entry.file]):  # no truncation under the sampled pages (SIGBUS)
        values, kind, count = _sample(model, entry)
        model.mapped(entry.file).ensure_unchanged()
    finite_mask = np.isfinite(values)
    finite = values[finite_mask]
    nan_count = int(np.isnan(values).sum())
    summary: dict[str, float | None] = dict.fromkeys(("min", "max", "mean", "std"))
    if finite.size:
        summary = {
            "min": float(finite.min()),
            "max": float(finite.max()),
            "mean": float(finite.mean()),
            "std": float(finite.std()),
        }
        counts, edges = np.histogram(finite, bins=bins)
        histogram = Histogram(edges=edges.tolist(), counts=counts.tolist())
    else:
        histogram = Histogram(edges=[], counts=[])
    return TensorStats(
        model=model.id,
        revision=model.revision,
        tensor=entry.name,
        dtype=entry.dtype,
        encoding=entry.encoding,
        values=kind,
        count=count,
        sampled=int(values.size),
        finite=int(finite.size),
        nan_count=nan_count,
        inf_count=int(values.size - finite.size - nan_count),
        histogram=histogram,
        **summary,
    )


def _evenly_spaced(total: int, limit: int) -> np.ndarray:
    return np.linspace(0, total - 1, num=min(total, limit), dtype=np.int64)


def _sample(
    model: Model, entry: TensorEntry
) -> tuple[np.ndarray, Literal["elements", "dequantized", "raw bytes"], int]:
    """(up to SAMPLE_VALUES values as float64, what they are, how many the tensor holds)."""
    if entry.encoding is not None:
        dequantized = _dequantized_sample(model, entry)
        if dequantized is not None:
            return dequantized, "dequantized", math.prod(entry.logical_shape)
    spec = wire_dtype(entry.dtype)
    if entry.encoding is not None or spec.numpy_name is None:
        raw = np.frombuffer(model.raw_view(entry), dtype=np.uint8)
        return (
            raw[_evenly_spaced(raw.size, SAMPLE_VALUES)].astype(np.float64),
            "raw bytes",
            raw.size,
        )
    dtype = numpy_dtype(entry.dtype)
    if entry.contiguous:
        flat = np.frombuffer(model.raw_view(entry), dtype=dtype)
        picked = flat[_evenly_spaced(flat.size, SAMPLE_VALUES)]
    else:  # a strided PyTorch view: index the mapping through its strides, copy the sample only
        mapping = model.mapped(entry.file).view()
        strides = tuple(s * dtype.itemsize for s in entry.strides or ())
        array = np.ndarray(entry.shape, dtype, buffer=mapping, offset=entry.offset, strides=strides)
        picked = array[np.unravel_index(_evenly_spaced(array.size, SAMPLE_VALUES), array.shape)]
    if picked.dtype.kind == "c":  # complex: the magnitude is what a histogram can show
        picked = np.abs(picked)
    return picked.astype(np.float64), "elements", int(entry.numel)


def _dequantized_sample(model: Model, entry: TensorEntry) -> np.ndarray | None:
    """Evenly spaced whole blocks of a quantized GGUF tensor, dequantized; None when the gguf
    package cannot decode this GGML type."""
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[entry.encoding or ""]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.frombuffer(model.raw_view(entry), dtype=np.uint8).reshape(-1, block_bytes)
    picked = blocks[_evenly_spaced(len(blocks), max(1, SAMPLE_VALUES // block_values))]
    try:
        return dequantize(picked, qtype).astype(np.float64).reshape(-1)
    except NotImplementedError:
        return None
