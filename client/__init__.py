"""weightserve client: fetch model weights from a weightserve server.

    from weightserve.client import Client, load_weights

    weights = load_weights(["http://127.0.0.1:8080/v1/models/demo/tiny-llama"])
    state = {name: w.data() for name, w in weights.items()}   # one bulk request

One flat namespace. Importing it never imports ``max`` or ``torch``: ``WeightData``,
``DType`` and ``QuantizationEncoding`` resolve on first use to MAX's own types when ``max``
is installed, to look-alikes otherwise.
"""

from __future__ import annotations

from typing import Any

from weightserve.client import errors
from weightserve.client._client import Client, FetchOptions, RemoteModel
from weightserve.client._models import (
    ModelInfo,
    ModelProblem,
    ModelSummary,
    RemoteFile,
    TensorInfo,
)
from weightserve.client._publish import Revision
from weightserve.client.errors import ConversionRefused, DestinationError, WeightsClosed
from weightserve.client.max.compat import backend as _backend
from weightserve.client.max.load import WeightsFormat, load_weights, weights_format
from weightserve.client.max.pipelines import served_model_dir
from weightserve.client.max.weights import RandomWeights, RemoteWeights
from weightserve.client.transports.base import TLSOptions

__all__ = [
    "Client",
    "ConversionRefused",
    "DType",
    "DestinationError",
    "FetchOptions",
    "ModelInfo",
    "ModelProblem",
    "ModelSummary",
    "QuantizationEncoding",
    "RandomWeights",
    "RemoteFile",
    "RemoteModel",
    "RemoteWeights",
    "Revision",
    "TLSOptions",
    "TensorInfo",
    "WeightData",
    "WeightsClosed",
    "WeightsFormat",
    "errors",
    "load_weights",
    "served_model_dir",
    "weights_format",
]

_BACKEND_TYPES = ("WeightData", "DType", "QuantizationEncoding")


def __getattr__(name: str) -> Any:
    if name in _BACKEND_TYPES:
        return getattr(_backend(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
