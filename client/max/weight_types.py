"""Look-alikes of MAX's weight types, used when the ``max`` package is not installed.

They carry the same names and fields as ``max.dtype.DType``,
``max.graph.quantization.QuantizationEncoding``, ``max.graph.DeviceRef``,
``max.graph.Weight`` and ``max.graph.weights.WeightData``, so code written against MAX's
``Weights`` protocol reads them the same way. With ``max`` installed, weightserve hands out
MAX's own types instead (see ``_max_compat``); nothing here imports ``max``.

Arrays are NumPy arrays; bfloat16 and the float8 types come from ``ml_dtypes``.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from weightserve.client.wire.dtypes import DTYPES, from_numpy_dtype, numpy_dtype

# Sizes of the types the wire table does not describe.
_EXTRA_BITS = {"float8_e4m3fnuz": 8, "float8_e5m2fnuz": 8}


class DType(Enum):
    """The element types MAX knows, by MAX's member names (``DType.bfloat16``, ...)."""

    bool = "bool"
    int8 = "int8"
    int16 = "int16"
    int32 = "int32"
    int64 = "int64"
    uint8 = "uint8"
    uint16 = "uint16"
    uint32 = "uint32"
    uint64 = "uint64"
    float16 = "float16"
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"
    float4_e2m1fn = "float4_e2m1fn"
    float6_e2m3fn = "float6_e2m3fn"
    float6_e3m2fn = "float6_e3m2fn"
    float8_e8m0fnu = "float8_e8m0fnu"
    float8_e4m3fn = "float8_e4m3fn"
    float8_e4m3fnuz = "float8_e4m3fnuz"
    float8_e5m2 = "float8_e5m2"
    float8_e5m2fnuz = "float8_e5m2fnuz"

    def __repr__(self) -> str:  # as MAX prints a DType inside containers
        return self.name

    @property
    def bits(self) -> int:
        spec = DTYPES.get(self.name)
        return spec.bits if spec is not None else _EXTRA_BITS[self.name]

    @property
    def size_in_bytes(self) -> int:
        """Bytes per element (1 for the packed sub-byte types, as MAX reports them)."""
        return max(1, self.bits // 8)

    @property
    def align(self) -> int:
        return self.size_in_bytes

    @property
    def is_float(self) -> builtins.bool:
        return self.name.startswith(("float", "bfloat"))

    @property
    def is_integral(self) -> builtins.bool:
        return self.name.startswith(("int", "uint"))

    def to_numpy(self) -> np.dtype:
        """The NumPy dtype (bfloat16 and float8 through ml_dtypes)."""
        if self.name in _EXTRA_BITS:
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, self.name))
        return numpy_dtype(self.name)

    @classmethod
    def from_numpy(cls, dtype: Any) -> DType:
        dtype = np.dtype(dtype)
        for name in _EXTRA_BITS:
            if dtype == cls[name].to_numpy():
                return cls[name]
        try:
            name = from_numpy_dtype(dtype)
        except ValueError:
            name = ""
        if name not in cls.__members__:
            raise ValueError(f"unsupported NumPy dtype: {dtype}")
        return cls[name]


class QuantizationEncoding(Enum):
    """The quantization encodings MAX knows (GGML block types among them)."""

    Q4_0 = "Q4_0"
    Q4_K = "Q4_K"
    Q5_K = "Q5_K"
    Q6_K = "Q6_K"
    GPTQ = "GPTQ"

    @property
    def name(self) -> str:  # type: ignore[override]  # lowercase, as MAX's
        return self.value.lower()

    @property
    def elements_per_block(self) -> int:
        return _GGML_BLOCKS[self.value][0]

    @property
    def block_size(self) -> int:
        """Bytes of one encoded block."""
        return _GGML_BLOCKS[self.value][1]

    @property
    def is_gguf(self) -> builtins.bool:
        return self.value in _GGML_BLOCKS


# (elements per block, bytes per block) of the GGML block types above (the GGUF spec).
_GGML_BLOCKS = {"Q4_0": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


@dataclass(frozen=True)
class DeviceRef:
    """Where a weight lives: ``DeviceRef.CPU()`` or ``DeviceRef.GPU(i)``."""

    device_type: str = "cpu"
    id: int = 0

    @staticmethod
    def CPU(id: int = 0) -> DeviceRef:  # noqa: N802  (MAX's spelling)
        return DeviceRef("cpu", id)

    @staticmethod
    def GPU(id: int = 0) -> DeviceRef:  # noqa: N802
        return DeviceRef("gpu", id)

    def is_cpu(self) -> builtins.bool:
        return self.device_type == "cpu"

    def __str__(self) -> str:
        return f"{self.device_type}:{self.id}"


@dataclass
class Weight:
    """A named weight a graph can refer to: what ``Weights.allocate`` returns."""

    name: str
    dtype: Any
    shape: tuple[int, ...]
    device: DeviceRef = DeviceRef.CPU()  # noqa: RUF009  (immutable)
    quantization_encoding: QuantizationEncoding | None = None
    align: int | None = None

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)


@dataclass
class WeightData:
    """A tensor's data with its name, dtype, shape and quantization encoding.

    ``data`` is a NumPy array (a view of the received buffer, no copy).
    """

    data: Any
    name: str
    dtype: Any
    shape: tuple[int, ...]
    quantization_encoding: QuantizationEncoding | None = None

    def __dlpack__(self, *, stream: Any = None) -> Any:
        try:
            return self.data.__dlpack__(stream=stream)
        except BufferError as e:
            raise BufferError(
                f"weight {self.name!r} ({self.dtype.name}) cannot be exported through DLPack"
                f" by NumPy: {e} Use view(DType.uint16)/view(DType.uint8) for the raw bits, or"
                " RemoteWeights.torch_state_dict() for torch tensors of this dtype."
            ) from e

    def __dlpack_device__(self) -> Any:
        return self.data.__dlpack_device__()

    def to_buffer(self) -> np.ndarray:
        """The data as an array (without MAX there is no ``max.driver.Buffer``)."""
        return np.asarray(self.data)

    @classmethod
    def from_numpy(cls, arr: np.ndarray, name: str) -> WeightData:
        return cls(arr, name, DType.from_numpy(arr.dtype), tuple(arr.shape))

    def astype(self, dtype: Any) -> WeightData:
        """Convert the values to ``dtype`` (a copy); the same dtype returns ``self``."""
        if self.dtype == dtype:
            return self
        if self.quantization_encoding is not None:
            raise ValueError(
                f"cannot convert quantized weight {self.name!r}"
                f" ({self.quantization_encoding.value}) with astype"
            )
        target = _as_dtype(dtype)
        data = np.asarray(self.data)
        if not (data.dtype.isbuiltin and target.to_numpy().isbuiltin):
            # ml_dtypes types convert through float32.
            converted = data.astype(np.float32).astype(target.to_numpy())
        else:
            converted = data.astype(target.to_numpy())
        return WeightData(converted, self.name, target, tuple(converted.shape))

    def view(self, dtype: Any) -> WeightData:
        """Reinterpret the bytes as ``dtype``; the last dimension scales by the size ratio."""
        target = _as_dtype(dtype)
        data = np.asarray(self.data)
        if data.ndim == 0:
            data = data.reshape(1)
        viewed = data.view(target.to_numpy())
        return WeightData(viewed, self.name, target, tuple(viewed.shape))

    def __repr__(self) -> str:
        return f"WeightData({self.dtype}, {list(self.shape)})"


def _as_dtype(dtype: Any) -> Any:
    if isinstance(dtype, DType):
        return dtype
    name = getattr(dtype, "name", dtype)
    if isinstance(name, str) and name in DType.__members__:
        return DType[name]
    return DType.from_numpy(dtype)
