"""Which weight types the client hands out: MAX's own, or look-alikes without ``max``.

With the ``max`` package installed, ``RemoteWeights`` returns MAX's own ``DType``, ``Weight``,
``WeightData``, ``QuantizationEncoding`` and ``DeviceRef``, and the values it records for a
graph are what MAX's local loaders record (a ``max.driver.Buffer`` for safetensors, a NumPy
array for GGUF). Without it (or with ``WEIGHTSERVE_NO_MAX=1``) the look-alikes of
``_weight_types`` stand in, and values are NumPy arrays.

``max`` is imported on first use, never when ``weightserve.client`` is imported.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from typing import Any

import numpy as np

from weightserve.client._extras import install_hint
from weightserve.client.max import weight_types as _weight_types
from weightserve.client.transports.handoff import writable_alias
from weightserve.client.wire.dtypes import wire_dtype

# GGML block types MAX can name as a QuantizationEncoding; every other block type is served as
# raw bytes without one.
MAX_GGML_ENCODINGS = ("Q4_0", "Q4_K", "Q5_K", "Q6_K")

# GGML type numbers (the GGUF spec), for messages that print them as MAX does.
GGML_TYPE_NUMBERS = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q8_1": 9,
    "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_K": 15, "IQ2_XXS": 16,
    "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22,
    "IQ4_XS": 23, "I8": 24, "I16": 25, "I32": 26, "I64": 27, "F64": 28, "IQ1_M": 29,
    "BF16": 30, "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39,
}  # fmt: skip


def ggml_type_number(name: str) -> int | str:
    """The GGML type number of a block type name (the name itself if unknown)."""
    try:
        import gguf

        return int(gguf.GGMLQuantizationType[name])
    except (ImportError, KeyError):
        return GGML_TYPE_NUMBERS.get(name, name)


@cache
def max_available() -> bool:
    """Whether MAX's weight types can be used (``WEIGHTSERVE_NO_MAX=1`` says no)."""
    if os.environ.get("WEIGHTSERVE_NO_MAX", "").strip().lower() in ("1", "true", "yes"):
        return False
    if importlib.util.find_spec("max") is None:
        return False
    try:
        import max.driver  # noqa: F401
        import max.graph.weights  # noqa: F401
    except ImportError:
        return False
    return True


# Wire dtypes NumPy itself has (and exports through DLPack); the others (bfloat16, float8)
# are ml_dtypes types NumPy cannot export.
NUMPY_NATIVE = frozenset((
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64",
))  # fmt: skip


def _raw_bytes(arr: np.ndarray) -> np.ndarray:
    """A uint8 view of an array's bytes (0-d arrays viewed as one element)."""
    return (arr.reshape(1) if arr.ndim == 0 else arr).view(np.uint8)


def shareable(arr: np.ndarray) -> np.ndarray:
    """``arr``, or for a read-only handoff view its writable copy-on-write alias."""
    if arr.flags.writeable:
        return arr
    alias = writable_alias(arr)
    return arr if alias is None else alias


def _unsigned_view(arr: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned integers of the same size (for DLPack export)."""
    return arr.view(np.dtype(f"u{arr.dtype.itemsize}"))


class Backend:
    """The weight types of one flavour (MAX's or the look-alikes), and array conversions."""

    is_max = False
    DType: Any = _weight_types.DType
    WeightData: Any = _weight_types.WeightData
    Weight: Any = _weight_types.Weight
    QuantizationEncoding: Any = _weight_types.QuantizationEncoding
    DeviceRef: Any = _weight_types.DeviceRef
    SafetensorWeights: Any = None  # MAX's class; the look-alikes have none

    def cpu(self) -> Any:
        return self.DeviceRef.CPU()

    def dtype(self, wire: str, name: str = "") -> Any:
        try:
            return self.DType[wire]
        except KeyError:
            what = f"weight {name!r} has dtype {wire}" if name else f"dtype {wire}"
            raise ValueError(f"{what}, which MAX's DType cannot represent") from None

    def shape(self, dims: tuple[int, ...]) -> Any:
        return tuple(int(d) for d in dims)

    def encoding(self, ggml_name: str | None) -> Any:
        """MAX's QuantizationEncoding for a GGML block type, None where MAX has none."""
        if ggml_name in MAX_GGML_ENCODINGS:
            return self.QuantizationEncoding[ggml_name]
        return None

    def weight(self, **kwargs: Any) -> Any:
        return self.Weight(**kwargs)

    # What ``data()`` wraps and ``allocate()`` records, per checkpoint format.
    def tensor_value(self, arr: np.ndarray, wire: str, fmt: str) -> Any:
        return arr

    def bytes_value(self, value: Any, arr: np.ndarray, wire: str, shape: tuple[int, ...]) -> Any:
        """A uint8 view: the last dimension times the itemsize (a scalar becomes 1-d)."""
        return _byte_view(arr, wire, shape)

    def value_shape(self, value: Any) -> tuple[int, ...]:
        return tuple(value.shape)


def _byte_view(arr: np.ndarray, wire: str, shape: tuple[int, ...]) -> np.ndarray:
    raw = _raw_bytes(arr)
    if wire_dtype(wire).numpy_name is not None:
        return raw
    # Packed sub-byte types arrive as flat bytes: give them rows if the bytes divide evenly.
    lead = shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    if rows and raw.size % rows == 0:
        return raw.reshape(*lead, raw.size // rows)
    return raw


class MaxBackend(Backend):
    is_max = True

    def __init__(self) -> None:
        from max.driver import Buffer
        from max.dtype import DType
        from max.graph import DeviceRef, Shape, Weight
        from max.graph.quantization import QuantizationEncoding
        from max.graph.weights import SafetensorWeights, WeightData

        self.Buffer = Buffer
        self.SafetensorWeights = SafetensorWeights
        self.DType = DType
        self.DeviceRef = DeviceRef
        self.Shape = Shape
        self.Weight = Weight
        self.QuantizationEncoding = QuantizationEncoding
        self.WeightData = WeightData

    def shape(self, dims: tuple[int, ...]) -> Any:
        return self.Shape([int(d) for d in dims])

    def buffer(self, arr: np.ndarray, wire: str) -> Any:
        """A ``max.driver.Buffer`` over the array's memory (no copy; it keeps the array
        alive). bfloat16 and float8 leave NumPy as unsigned integers of the same size and
        are viewed back as their MAX dtype. A read-only view of a same-node handoff goes in as
        its copy-on-write alias: MAX copies read-only arrays, and there is nothing to copy."""
        arr = shareable(arr)
        if wire in NUMPY_NATIVE:
            return self.Buffer.from_dlpack(arr)
        buf = self.Buffer.from_dlpack(_unsigned_view(arr))
        return buf.view(self.DType[wire], list(arr.shape))

    def tensor_value(self, arr: np.ndarray, wire: str, fmt: str) -> Any:
        if wire_dtype(wire).numpy_name is None:
            return arr  # packed sub-byte bytes: MAX's Buffer has no exact view of them
        if fmt == "gguf":
            # MAX's GGUF loader hands out NumPy arrays; those NumPy cannot export through
            # DLPack (bfloat16) are its raw bytes, as the gguf reader gives them.
            return arr if wire in NUMPY_NATIVE else _raw_bytes(arr)
        return self.buffer(arr, wire)

    def bytes_value(self, value: Any, arr: np.ndarray, wire: str, shape: tuple[int, ...]) -> Any:
        raw = _byte_view(shareable(arr), wire, shape)
        if isinstance(value, self.Buffer):
            return self.Buffer.from_dlpack(raw)
        return raw


@cache
def _backend(use_max: bool) -> Backend:
    return MaxBackend() if use_max else Backend()


def backend(use_max: bool | None = None) -> Backend:
    """MAX's types if ``use_max`` (default: when installed), else the look-alikes."""
    if use_max is None:
        use_max = max_available()
    elif use_max and not max_available():
        raise ImportError(f"use_max=True needs the max package: {install_hint('max')}")
    return _backend(bool(use_max))
