"""The dtype table of the wire contract: one row per dtype the service can serve.

Both sides use it: readers map their format's type codes to these names, the client maps them
to NumPy (through ml_dtypes for bfloat16 and float8) and to MAX's ``DType``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

# Imported with the module, not at the first bfloat16 tensor: most checkpoints are bfloat16,
# and a lazy import landed its 5-7 ms inside a process's first load.
import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class WireDType:
    name: str  # the name on the wire and in JSON; equals MAX's DType member name
    bits: int  # bits per element; sub-byte types are packed
    safetensors: str | None  # the safetensors header code, if the format has one
    numpy_name: str | None  # a NumPy / ml_dtypes dtype name, if one exists

    @property
    def itemsize(self) -> int:
        """Bytes per element for whole-byte types; 1 for packed sub-byte types."""
        return max(1, self.bits // 8)

    def nbytes(self, numel: int) -> int:
        return (numel * self.bits + 7) // 8


_TABLE = [
    WireDType("bool", 8, "BOOL", "bool"),
    WireDType("uint8", 8, "U8", "uint8"),
    WireDType("int8", 8, "I8", "int8"),
    WireDType("uint16", 16, "U16", "uint16"),
    WireDType("int16", 16, "I16", "int16"),
    WireDType("uint32", 32, "U32", "uint32"),
    WireDType("int32", 32, "I32", "int32"),
    WireDType("uint64", 64, "U64", "uint64"),
    WireDType("int64", 64, "I64", "int64"),
    WireDType("float16", 16, "F16", "float16"),
    WireDType("bfloat16", 16, "BF16", "bfloat16"),
    WireDType("float32", 32, "F32", "float32"),
    WireDType("float64", 64, "F64", "float64"),
    WireDType("complex64", 64, "C64", "complex64"),
    WireDType("float8_e4m3fn", 8, "F8_E4M3", "float8_e4m3fn"),
    WireDType("float8_e5m2", 8, "F8_E5M2", "float8_e5m2"),
    WireDType("float8_e8m0fnu", 8, "F8_E8M0", "float8_e8m0fnu"),
    # Sub-byte types are packed (two float4 per byte); served as raw bytes.
    WireDType("float4_e2m1fn", 4, "F4", None),
    WireDType("float6_e2m3fn", 6, "F6_E2M3", None),
    WireDType("float6_e3m2fn", 6, "F6_E3M2", None),
]

DTYPES: dict[str, WireDType] = {d.name: d for d in _TABLE}
BY_SAFETENSORS_CODE: dict[str, WireDType] = {d.safetensors: d for d in _TABLE if d.safetensors}


def wire_dtype(name: str) -> WireDType:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


@cache
def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a wire dtype (bfloat16 and float8 through ml_dtypes)."""
    spec = wire_dtype(name)
    if spec.numpy_name is None:
        raise ValueError(f"dtype {name!r} is packed below one byte and has no NumPy equivalent")
    if hasattr(np, spec.numpy_name) and spec.numpy_name not in ("bfloat16",):
        return np.dtype(spec.numpy_name)
    found: np.dtype = np.dtype(getattr(ml_dtypes, spec.numpy_name))
    return found


def from_numpy_dtype(dtype: np.dtype) -> str:
    """The wire dtype name for a NumPy dtype."""
    for spec in _TABLE:
        if spec.numpy_name is None:
            continue
        try:
            if numpy_dtype(spec.name) == dtype:
                return spec.name
        except (AttributeError, ValueError):
            continue
    raise ValueError(f"NumPy dtype {dtype} has no weightserve wire dtype")
