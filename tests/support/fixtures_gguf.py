"""GGUF test files: real ones written with ``gguf.GGUFWriter`` and hand-built raw ones.

``write_mixed`` / ``write_all_types`` / ``write_edge`` write valid files and return what they
stored, so reader and server tests can compare. ``RawGGUF`` assembles a GGUF byte by byte,
which is how the malformed files of the reader tests are made (the writer refuses to write
them) and how a huge sparse file gets a header without data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quantize

Q = GGMLQuantizationType
V = GGUFValueType


class Written(NamedTuple):
    """One tensor as stored: ``data`` has the plain dtype and logical shape, or for block
    types the uint8 block bytes in byte shape."""

    ggml_type: GGMLQuantizationType
    logical_shape: tuple[int, ...]
    data: np.ndarray


# A small tokenizer with non-ASCII tokens, like a real one (the real ones hold 32k-256k).
TOKENS = ["<unk>", "<s>", "</s>", "▁the", "Ġa", "é", "日本", "🙂", "\n", ""]
MERGES = ["Ġ t", "Ġ a", "i n", "日 本"]
METADATA: dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]] = {
    "general.name": (V.STRING, "weightserve mixed fixture", None),
    "general.description": (V.STRING, "line one\nline two — ünïcödé", None),
    "test.u8": (V.UINT8, 255, None),
    "test.i8": (V.INT8, -128, None),
    "test.u16": (V.UINT16, 65535, None),
    "test.i16": (V.INT16, -32768, None),
    "test.u32": (V.UINT32, 4294967295, None),
    "test.i32": (V.INT32, -2147483648, None),
    "test.f32": (V.FLOAT32, 0.1, None),
    "test.u64": (V.UINT64, 2**64 - 1, None),
    "test.i64": (V.INT64, -(2**63), None),
    "test.f64": (V.FLOAT64, 1e-300, None),
    "test.bool_true": (V.BOOL, True, None),
    "test.bool_false": (V.BOOL, False, None),
    "test.bools": (V.ARRAY, [True, False, True], V.BOOL),
    "test.u64s": (V.ARRAY, [0, 1, 2**64 - 1], V.UINT64),
    "test.f64s": (V.ARRAY, [0.5, -2.25], V.FLOAT64),
    "test.nested_ints": (V.ARRAY, [[1, 2], [3, 4, 5], [6]], None),
    "test.nested_strings": (V.ARRAY, [["a", "b"], ["ç"]], None),
    "tokenizer.ggml.model": (V.STRING, "llama", None),
    "tokenizer.ggml.tokens": (V.ARRAY, TOKENS, V.STRING),
    "tokenizer.ggml.scores": (V.ARRAY, [float(-i) / 4 for i in range(len(TOKENS))], V.FLOAT32),
    "tokenizer.ggml.token_type": (V.ARRAY, [2, 3, 3] + [1] * (len(TOKENS) - 3), V.INT32),
    "tokenizer.ggml.merges": (V.ARRAY, MERGES, V.STRING),
    "tokenizer.ggml.bos_token_id": (V.UINT32, 1, None),
    "tokenizer.chat_template": (
        V.STRING,
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        None,
    ),
}


def _add_metadata(w: GGUFWriter) -> None:
    for key, (vtype, value, sub_type) in METADATA.items():
        w.add_key_value(key, value, vtype, sub_type=sub_type)


def _write(path: Path, tensors: dict[str, Written], *, alignment: int | None = None) -> None:
    w = GGUFWriter(path, arch="llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    _add_metadata(w)
    for name, t in tensors.items():
        raw = None if t.ggml_type in _NUMPY_NATIVE else t.ggml_type
        data = t.data.view(np.uint8) if t.ggml_type == Q.BF16 else t.data
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Types GGUFWriter derives from the NumPy dtype (no raw_dtype needed).
_NUMPY_NATIVE: dict[GGMLQuantizationType, type[np.generic]] = {
    Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64,
    Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64,
}  # fmt: skip


def mixed_tensors(seed: int = 0) -> dict[str, Written]:
    """Every plain type, several quantized ones, 1-d to 4-d, in a deliberately unsorted order."""
    rng = np.random.default_rng(seed)
    out: dict[str, Written] = {}

    def plain(name: str, gtype: GGMLQuantizationType, arr: np.ndarray) -> None:
        out[name] = Written(gtype, arr.shape, arr)

    def quant(name: str, gtype: GGMLQuantizationType, shape: tuple[int, ...]) -> None:
        blocks = quantize(rng.standard_normal(shape).astype(np.float32), gtype)
        out[name] = Written(gtype, shape, blocks)

    plain("token_embd.weight", Q.F32, rng.standard_normal((16, 64)).astype(np.float32))
    quant("blk.0.ffn_up.weight", Q.Q8_0, (24, 64))
    quant("blk.0.ffn_down.weight", Q.Q4_0, (64, 32))
    quant("blk.0.ffn_gate.weight", Q.Q4_1, (8, 96))
    quant("blk.0.attn_q.weight", Q.Q5_0, (4, 64))
    plain("blk.0.attn_norm.weight", Q.F32, rng.standard_normal(64).astype(np.float32))
    plain("blk.0.attn_k.weight", Q.F16, rng.standard_normal((8, 64)).astype(np.float16))
    plain(
        "blk.0.attn_v.weight",
        Q.BF16,
        rng.standard_normal((8, 64)).astype(np.float32).astype(ml_dtypes.bfloat16),
    )
    plain("blk.1.f64", Q.F64, rng.standard_normal((3, 3)))
    plain("blk.1.i8", Q.I8, rng.integers(-128, 128, (3, 5), dtype=np.int8))
    plain("blk.1.i16", Q.I16, rng.integers(-(2**15), 2**15, (7,), dtype=np.int16))
    plain("blk.1.i32", Q.I32, rng.integers(-(2**31), 2**31, (2, 3, 4), dtype=np.int32))
    plain("blk.1.i64", Q.I64, rng.integers(-(2**62), 2**62, (5,), dtype=np.int64))
    plain("blk.1.conv4d", Q.F32, rng.standard_normal((2, 3, 4, 5)).astype(np.float32))
    plain("output_norm.weight", Q.F32, np.ones(64, dtype=np.float32))
    return out


def write_mixed(path: Path, *, alignment: int | None = None, seed: int = 0) -> dict[str, Written]:
    """A realistic small model; ``alignment`` sets ``general.alignment`` (default 32)."""
    tensors = mixed_tensors(seed)
    _write(path, tensors, alignment=alignment)
    return tensors


def write_all_types(path: Path, seed: int = 0) -> dict[str, Written]:
    """One tensor of every GGML type the gguf package knows, as random block bytes (the
    package cannot quantize most K/IQ types; the bytes are served as is, never decoded)."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, Written] = {}
    for gtype, (block_elems, block_bytes) in GGML_QUANT_SIZES.items():
        logical = (3, 2 * block_elems)
        if gtype in _NUMPY_NATIVE:
            dtype = np.dtype(_NUMPY_NATIVE[gtype])
            raw = rng.integers(0, 256, 3 * 2 * dtype.itemsize, dtype=np.uint8)
            data = raw.view(dtype).reshape(logical)
        else:
            data = rng.integers(0, 256, (3, 2 * block_bytes), dtype=np.uint8)
            if gtype == Q.BF16:
                data = data.view(ml_dtypes.bfloat16)
        tensors[f"t.{gtype.name}"] = Written(gtype, logical, data)
    _write(path, tensors)
    return tensors


def write_edge(path: Path) -> dict[str, Written]:
    """Shapes at the edges: a 0-d scalar, a zero-size tensor, a one-element tensor."""
    tensors = {
        "scalar": Written(Q.F32, (), np.array(3.5, dtype=np.float32)),
        "empty": Written(Q.F32, (0, 4), np.zeros((0, 4), dtype=np.float32)),
        "one": Written(Q.I32, (1,), np.array([7], dtype=np.int32)),
    }
    _write(path, tensors)
    return tensors


def set_version(path: Path, version: int) -> None:
    """Overwrite the version field. v2 and v3 share one layout (v3 only added big-endian
    files), so a v3 file patched to 2 is a valid v2 file."""
    with open(path, "r+b") as f:
        f.seek(4)
        f.write(struct.pack("<I", version))


# --- raw files ---------------------------------------------------------------------------

_SCALAR_FMT = {
    V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
    V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d",
}  # fmt: skip


def gguf_string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def gguf_value(vtype: GGUFValueType, value: Any, sub_type: GGUFValueType | None = None) -> bytes:
    """The encoding of one value, without its type tag."""
    if vtype == V.STRING:
        return gguf_string(value)
    if vtype == V.ARRAY:
        assert sub_type is not None
        head = struct.pack("<IQ", sub_type, len(value))
        return head + b"".join(gguf_value(sub_type, v) for v in value)
    return struct.pack("<" + _SCALAR_FMT[vtype], value)


def gguf_kv(
    key: str, vtype: GGUFValueType, value: Any, sub_type: GGUFValueType | None = None
) -> bytes:
    return gguf_string(key) + struct.pack("<I", vtype) + gguf_value(vtype, value, sub_type)


@dataclass
class RawGGUF:
    """A GGUF assembled from parts; every field can be set to a wrong value on purpose.

    ``kvs`` are encoded key-values (``gguf_kv`` or hand-made bytes); ``tensors`` are
    ``(name, dims in GGUF order, ggml type, offset relative to the data section)``.
    """

    kvs: list[bytes] = field(default_factory=list)
    tensors: list[tuple[str | bytes, list[int], int, int]] = field(default_factory=list)
    magic: bytes = b"GGUF"
    version: int = 3
    n_tensors: int | None = None  # override the counts
    n_kv: int | None = None
    alignment: int = 32  # where the data section starts; add a general.alignment kv to match

    def header(self) -> bytes:
        """Everything up to the data section, padded to ``alignment``."""
        out = bytearray(self.magic + struct.pack("<I", self.version))
        n_t = len(self.tensors) if self.n_tensors is None else self.n_tensors
        n_kv = len(self.kvs) if self.n_kv is None else self.n_kv
        out += struct.pack("<QQ", n_t, n_kv)
        for kv in self.kvs:
            out += kv
        for name, dims, gtype, offset in self.tensors:
            out += gguf_string(name) + struct.pack("<I", len(dims))
            out += struct.pack(f"<{len(dims)}Q", *dims)
            out += struct.pack("<IQ", gtype, offset)
        out += b"\0" * (-len(out) % self.alignment)
        return bytes(out)

    def write(self, path: Path, data: bytes | int = 0) -> Path:
        """Write the header then ``data`` (bytes, or that many zero bytes, sparse)."""
        head = self.header()
        with open(path, "wb") as f:
            f.write(head)
            if isinstance(data, int):
                f.truncate(len(head) + data)
            else:
                f.write(data)
        return path


def write_split_gguf(path: Path, seed: int = 0, per_part: int = 2) -> list[Path]:
    """A GGUF split by gguf.GGUFWriter itself (``split_max_tensors``), as llama.cpp splits."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, "llama", split_max_tensors=per_part)
    writer.add_name("split fixture")
    writer.add_block_count(2)
    for i in range(5):
        writer.add_tensor(f"blk.{i}.weight", rng.standard_normal((4, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
