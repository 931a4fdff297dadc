"""PytorchReader against real ``torch.save`` files, compared with ``torch.load(weights_only)``.

Also hostile checkpoints: pickles that would run code must be refused, by name, with nothing
run (each payload creates a marker file when actually executed; a control load with
``torch.load(weights_only=False)`` proves the payload is live).
"""

from __future__ import annotations

import copyreg
import json
import os
import pickle
import shlex
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.support import fixtures_torch as ft  # noqa: E402
from tests.support._util import entry_array, entry_bytes  # noqa: E402
from weightserve.service.readers.errors import (  # noqa: E402
    BadMagic,
    CompressedStorage,
    DuplicateTensor,
    ForbiddenPickleGlobal,
    IndexMismatch,
    MalformedHeader,
    MalformedPickle,
    OffsetOutOfFile,
    SizeMismatch,
    UnknownDType,
    UnsupportedVersion,
)
from weightserve.service.readers.pytorch import PytorchReader  # noqa: E402

pytestmark = pytest.mark.torch

WIRE = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32",
    torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool",
    torch.complex64: "complex64", torch.uint16: "uint16", torch.float8_e4m3fn: "float8_e4m3fn",
}  # fmt: skip


def read(*paths: Path):
    return PytorchReader().read(list(paths))


def flat(obj, prefix: str = "") -> dict:
    """torch.load's result flattened the way the reader names tensors."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    out: dict = {}
    for k, v in items:
        if isinstance(v, (dict, list, tuple, torch.Tensor)):
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def assert_entry_matches(entry, tensor) -> None:
    tensor = tensor.detach()
    assert entry.shape == tuple(tensor.shape) == entry.logical_shape
    assert entry.dtype == WIRE[tensor.dtype]
    assert entry.nbytes == tensor.numel() * tensor.element_size()
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16: compare the raw bits
        expect = tensor.contiguous().view(torch.int16).numpy()
        np.testing.assert_array_equal(entry_array(entry).view(np.int16), expect)
    elif tensor.dtype in (torch.float8_e4m3fn, torch.uint16):
        raw = tensor.contiguous().view(torch.uint8 if tensor.element_size() == 1 else torch.int16)
        assert entry_bytes(entry) == raw.numpy().tobytes()
    else:
        np.testing.assert_array_equal(entry_array(entry), tensor.numpy())


def assert_all_match(path: Path, contents) -> dict:
    loaded = flat(torch.load(path, weights_only=True))
    assert set(contents.tensors) == set(loaded)
    for name, tensor in loaded.items():
        assert_entry_matches(contents.tensors[name], tensor)
    return loaded


# --------------------------------------------------------------------------- real checkpoints


def test_every_dtype(tmp_path):
    path = tmp_path / "dtypes.pt"
    ft.write_dtypes(path)
    contents = read(path)
    assert contents.format == "pytorch"
    assert list(contents.tensors) == sorted(contents.tensors)
    assert_all_match(path, contents)
    assert all(e.strides is None and e.file == path for e in contents.tensors.values())


def test_views_ties_and_strides(tmp_path):
    path = tmp_path / "views.pt"
    saved = ft.write_views(path)
    t = read(path).tensors
    assert_all_match(path, read(path))
    assert t["tied"].offset == t["base"].offset and t["base"].strides is None
    assert t["rows"].offset == t["base"].offset + 6 * 4 and t["rows"].strides is None
    assert t["transposed"].strides == (1, 6) and t["transposed"].offset == t["base"].offset
    assert t["every_other"].strides == (6, 2)
    assert t["column"].strides is None or t["column"].strides == (6,)
    assert t["column"].offset == t["base"].offset + 4 * 4
    assert t["element"].shape == () and t["element"].offset == t["base"].offset + 23 * 4
    assert t["expanded"].strides == (0, 1)
    assert entry_array(t["transposed"]).tolist() == saved["base"].t().tolist()


def test_storage_offset_without_base(tmp_path):
    path = tmp_path / "part.bin"
    part = ft.write_offset_only(path)
    entry = read(path).tensors["part"]
    with zipfile.ZipFile(path) as zf:
        record = zf.getinfo(ft.archive_prefix(path) + "data/0")
    assert record.file_size == 100 * 8  # the whole storage is saved
    assert entry.strides is None and entry.nbytes == 80
    np.testing.assert_array_equal(entry_array(entry), part.numpy())


def test_scalars_and_zero_sized(tmp_path):
    path = tmp_path / "edge.pt"
    ft.write_edge_shapes(path)
    t = read(path).tensors
    assert_all_match(path, read(path))
    assert t["scalar"].shape == () and t["scalar"].nbytes == 4
    assert t["empty_rows"].shape == (0, 3) and t["empty_rows"].nbytes == 0
    assert t["empty_cols"].nbytes == 0 and t["empty_cols"].dtype == "float16"


def test_nested_dicts_and_metadata(tmp_path):
    path = tmp_path / "train.ckpt"
    ft.write_nested(path)
    contents = read(path)
    assert_all_match(path, contents)
    assert set(contents.tensors) == {
        "state_dict.fc.weight", "state_dict.fc.bias", "model.encoder.weight",
        "model.encoder.layers.0", "model.encoder.layers.1",
    }  # fmt: skip
    assert contents.metadata == {
        "epoch": 3, "lr": 0.25, "arch": "mlp", "betas": [0.9, 0.999], "done": False
    }  # fmt: skip


def test_odd_keys_and_values(tmp_path):
    path = tmp_path / "odd.pt"
    torch.save(
        {
            "opt": {"state": {0: {"exp_avg": torch.ones(2)}}, (1, 2): torch.ones(1)},
            "huge": 10**30,
            "blob": b"bytes are not metadata",
            "dtype": torch.float16,
        },
        path,
    )
    contents = read(path)
    assert list(contents.tensors) == ["opt.state.0.exp_avg"]  # tuple keys are skipped
    assert contents.metadata == {}
    bad = tmp_path / "surrogate.pt"
    ft.write_float_checkpoint(tmp_path / "src.pt")
    body = ft.op_dict(
        [(b"X\x03\x00\x00\x00\xed\xa0\x80", ft.op_tensor(ft.op_storage("0", 12), 0, (12,), (1,)))]
    )  # BINUNICODE of a lone surrogate (the unpickler decodes with surrogatepass)
    ft.replace_data_pkl(tmp_path / "src.pt", bad, ft.op_pickle(body))
    with pytest.raises(MalformedPickle, match="not valid UTF-8"):
        read(bad)


def test_module_state_dict_and_parameters(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    state = ft.write_module_state(path)
    contents = read(path)
    assert_all_match(path, contents)
    assert "2.self_attn.in_proj_weight" in contents.tensors and len(state) == len(contents.tensors)
    # nn.Parameter objects saved directly go through _rebuild_parameter.
    params = tmp_path / "params.pt"
    torch.save(dict(ft.make_module().named_parameters()), params)
    assert_all_match(params, read(params))


def test_whole_module_is_refused(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(ft.make_module(), path)
    with pytest.raises(ForbiddenPickleGlobal, match=r"torch\.nn\.modules\.container\.Sequential"):
        read(path)


def test_folder_name_is_found(tmp_path):
    # Saving to a path uses the file stem as the folder, not "archive/".
    path = tmp_path / "mymodel.pt"
    ft.write_views(path)
    assert ft.archive_prefix(path) == "mymodel/"
    assert_all_match(path, read(path))
    odd = tmp_path / "odd.pt"
    ft.rewrite_archive(path, odd, prefix="some_older_writer/")
    assert ft.archive_prefix(odd) == "some_older_writer/"
    assert_all_match(odd, read(odd))


def test_compressed_pickle_is_fine_compressed_storage_is_not(tmp_path):
    src = tmp_path / "src.pt"
    ft.write_dtypes(src)
    ok = tmp_path / "pkl_deflated.pt"
    ft.rewrite_archive(src, ok, compress=["data.pkl"])
    assert_all_match(ok, read(ok))
    bad = tmp_path / "deflated.pt"
    ft.rewrite_archive(src, bad, compress=["data/"])
    with pytest.raises(CompressedStorage, match="compression method 8"):
        read(bad)


def test_short_storage_record(tmp_path):
    src = tmp_path / "src.pt"
    ft.write_float_checkpoint(src, 12)
    with zipfile.ZipFile(src) as zf:
        data = zf.read(ft.archive_prefix(src) + "data/0")
    bad = tmp_path / "short.pt"
    ft.rewrite_archive(src, bad, replace={"data/0": data[:-4]})
    with pytest.raises(SizeMismatch, match="holds 44 bytes"):
        read(bad)


def _patch_sizes(path: Path, record: str, size: int) -> None:
    """Make both zip headers of ``record`` claim ``size`` bytes (past the end of the file)."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(record)
    struct.pack_into("<II", raw, info.header_offset + 18, size, size)
    pos = raw.find(b"PK\x01\x02" + raw[info.header_offset + 4 : info.header_offset + 6])
    while raw[pos + 46 : pos + 46 + len(record)] != record.encode():
        pos = raw.find(b"PK\x01\x02", pos + 4)
    struct.pack_into("<II", raw, pos + 20, size, size)
    path.write_bytes(bytes(raw))


def test_record_past_end_of_file(tmp_path):
    src = tmp_path / "src.pt"
    ft.write_float_checkpoint(src, 12)
    bad = tmp_path / "long.pt"
    ft.rewrite_archive(src, bad)  # zipfile writes sizes into the local headers
    _patch_sizes(bad, ft.archive_prefix(bad) + "data/0", 1 << 20)
    with pytest.raises(OffsetOutOfFile, match="data/0"):
        read(bad)


def test_view_beyond_its_storage(tmp_path):
    src = tmp_path / "src.pt"
    ft.write_float_checkpoint(src, 12)
    bad = tmp_path / "beyond.pt"
    body = ft.op_dict([(ft.op_str("w"), ft.op_tensor(ft.op_storage("0", 12), 4, (3, 4), (4, 1)))])
    ft.replace_data_pkl(src, bad, ft.op_pickle(body))
    with pytest.raises(OffsetOutOfFile, match="element 15 of a storage of 12"):
        read(bad)
    # The same view at offset 0 fits and is read through the spliced pickle.
    good = tmp_path / "fits.pt"
    body = ft.op_dict([(ft.op_str("w"), ft.op_tensor(ft.op_storage("0", 12), 0, (4, 3), (1, 4)))])
    ft.replace_data_pkl(src, good, ft.op_pickle(body))
    entry = read(good).tensors["w"]
    assert entry.strides == (1, 4)
    assert entry_array(entry).tolist() == torch.arange(12.0).reshape(3, 4).t().tolist()


def test_unsupported_dtype_named(tmp_path):
    path = tmp_path / "c128.pt"
    torch.save({"z": torch.zeros(2, dtype=torch.complex128)}, path)
    with pytest.raises(UnknownDType, match="complex128") as err:
        read(path)
    assert err.value.tensor == "z"


def test_reader_never_imports_torch(tmp_path):
    path = tmp_path / "w.pt"
    ft.write_float_checkpoint(path)
    code = (
        "import sys; from pathlib import Path\n"
        "from weightserve.service.readers.pytorch import PytorchReader\n"
        f"c = PytorchReader().read([Path({str(path)!r})])\n"
        "assert list(c.tensors) == ['weight'], c\n"
        "assert 'torch' not in sys.modules, 'the reader imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- sharded


def _shard_set(tmp_path: Path, **kw) -> tuple[Path, dict]:
    state = ft.make_module().state_dict()
    directory = tmp_path / "model"
    weight_map = ft.write_sharded(directory, state, 3, **kw)
    (directory / "config.json").write_text("{}")
    torch.save({"not": "weights"}, directory / "training_args.bin")
    return directory, weight_map


def test_sharded_with_index(tmp_path):
    directory, weight_map = _shard_set(tmp_path)
    contents = read(*sorted(directory.iterdir()))
    assert list(contents.tensors) == sorted(weight_map)
    for name, entry in contents.tensors.items():
        assert entry.file.name == weight_map[name]
    state = ft.make_module().state_dict()
    for name, tensor in state.items():
        assert_entry_matches(contents.tensors[name], tensor)


def test_sharded_index_disagrees(tmp_path):
    directory, weight_map = _shard_set(tmp_path)
    index = directory / "pytorch_model.bin.index.json"
    doc = json.loads(index.read_text())
    name = sorted(weight_map)[0]
    other = next(v for v in sorted(set(weight_map.values())) if v != weight_map[name])

    doc["weight_map"][name] = other
    index.write_text(json.dumps(doc))
    with pytest.raises(IndexMismatch, match=f"index says {other}") as err:
        read(*directory.iterdir())
    assert err.value.tensor == name

    doc["weight_map"] = dict(weight_map, ghost=other)
    index.write_text(json.dumps(doc))
    with pytest.raises(IndexMismatch, match="not found in shard"):
        read(*directory.iterdir())

    doc["weight_map"] = dict(weight_map, extra="pytorch_model-00009-of-00009.bin")
    index.write_text(json.dumps(doc))
    with pytest.raises(IndexMismatch, match="missing"):
        read(*directory.iterdir())

    doc["weight_map"] = dict(weight_map, evil="../outside.bin")
    index.write_text(json.dumps(doc))
    with pytest.raises(IndexMismatch, match="file names"):
        read(*directory.iterdir())


def test_duplicate_names_across_shards(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    torch.save({"w": torch.ones(2), "x": torch.ones(1)}, a)
    torch.save({"w": torch.zeros(2)}, b)
    with pytest.raises(DuplicateTensor) as err:
        read(a, b)
    assert err.value.tensor == "w"
    # Without an index every checkpoint is read; disjoint shards merge.
    torch.save({"y": torch.zeros(2)}, b)
    assert list(read(b, a).tensors) == ["w", "x", "y"]


def test_nested_names_collide(tmp_path):
    path = tmp_path / "collide.pt"
    torch.save({"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)}, path)
    with pytest.raises(DuplicateTensor):
        read(path)


# --------------------------------------------------------------------------- not checkpoints


def test_legacy_format_refused(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsupportedVersion, match="legacy.*re-save"):
        read(path)


def test_big_endian_refused(tmp_path):
    src = tmp_path / "src.pt"
    ft.write_float_checkpoint(src)
    bad = tmp_path / "big.pt"
    ft.rewrite_archive(src, bad, replace={"byteorder": b"big"})
    with pytest.raises(UnsupportedVersion, match="big-endian"):
        read(bad)


def test_not_checkpoints(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(BadMagic):
        read(junk)
    plain = tmp_path / "plain.pt"
    plain.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    with pytest.raises(BadMagic, match="bare pickle"):
        read(plain)
    other_zip = tmp_path / "other.pt"
    with zipfile.ZipFile(other_zip, "w") as zf:
        zf.writestr("readme.txt", "hello")
    with pytest.raises(BadMagic, match="data.pkl"):
        read(other_zip)
    truncated = tmp_path / "trunc.pt"
    ft.write_float_checkpoint(truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(MalformedHeader, match="zip"):
        read(truncated)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"X\x10\x00\x00\x00ab", "truncated"),  # a string cut short
        (ft.op_tuple(ft.op_int(1)), "top-level object is tuple"),
        (ft.op_call(ft.op_global("_codecs", "encode"), ft.op_str("x"), ft.op_str("zlib")), "bytes"),
        (ft.op_tuple(ft.op_str("storage"), ft.op_str("x")) + b"Q", "persistent id"),
        (ft.op_tuple(*[ft.op_str("s")] * 5) + b"Q", "persistent id"),
        (ft.op_call(ft.op_global("torch", "FloatStorage"), ft.op_int(1)), "not callable"),
        (ft.op_global("torch._utils", "_rebuild_tensor_v2") + b"}b", "BUILD"),  # BUILD
        (ft.op_global("collections", "OrderedDict") + b")\x81", "NEWOBJ|class|type"),
        (
            ft.op_call(ft.op_global("torch._utils", "_rebuild_tensor_v2"), ft.op_str("x")),
            "argument",
        ),
        (
            ft.op_dict([(ft.op_str("w"), ft.op_tensor(ft.op_storage("0", 12), 0, (3,), (1, 1)))]),
            "differ in rank",
        ),
    ],
)
def test_malformed_pickles(tmp_path, body, match):
    _check_malformed(tmp_path, body, match)


def _check_malformed(tmp_path, body, match):
    src = tmp_path / "src.pt"
    ft.write_float_checkpoint(src)
    bad = tmp_path / "bad.pt"
    ft.replace_data_pkl(src, bad, ft.op_pickle(body))
    with pytest.raises(MalformedPickle, match=match):
        read(bad)


def test_shared_and_cyclic_containers(tmp_path):
    # 30 levels of lists, each holding the previous one 10 times: 10**30 paths, ~1 kB pickle.
    body = b"}" + ft.op_str("x") + b"]q\x00(" + ft.op_int(1) * 10 + b"e0"
    for k in range(1, 31):
        body += b"]q" + bytes([k]) + b"(" + (b"h" + bytes([k - 1])) * 10 + b"e"
        body += b"0" if k < 30 else b"s"  # POP all but the last level
    _check_malformed(tmp_path, body, "shared/cyclic")
    cyclic = b"}q\x00" + ft.op_str("a") + b"h\x00s"  # d = {"a": d}
    _check_malformed(tmp_path, cyclic, "shared/cyclic")


# --------------------------------------------------------------------------- hostile pickles


def _wait_for(marker: Path, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return marker.exists()


def _payloads(marker: Path, module_name: str) -> dict[str, bytes]:
    """Opcodes that create ``marker`` when unpickled by an unrestricted unpickler."""
    code = ft.op_str(f"open({str(marker)!r}, 'w').close()")
    return {
        "os.system": ft.op_call(ft.op_global("os", "system"), ft.op_str(f"touch {shlex.quote(str(marker))}")),
        "builtins.exec": ft.op_call(ft.op_global("builtins", "exec"), code),
        "builtins.eval": ft.op_call(ft.op_global("builtins", "eval"), code),
        "__builtin__.eval": ft.op_call(ft.op_global("__builtin__", "eval"), code),
        "subprocess.Popen": ft.op_call(
            ft.op_global("subprocess", "Popen"),
            b"(" + ft.op_str("touch") + ft.op_str(str(marker)) + b"l",  # MARK ... LIST
        ),
        "importlib.import_module": ft.op_call(
            ft.op_global("importlib", "import_module"), ft.op_str(module_name)
        ),
        # INST and OBJ instantiate a class from find_class without REDUCE.
        "os.system (INST)": b"(" + ft.op_str(f"touch {shlex.quote(str(marker))}") + b"ios\nsystem\n",
        "builtins.exec (OBJ)": b"(" + ft.op_global("builtins", "exec") + code + b"o",
        # STACK_GLOBAL (protocol 4) names the global with two strings on the stack.
        "builtins.exec (STACK_GLOBAL)": ft.op_str("builtins") + ft.op_str("exec") + b"\x93"
        + ft.op_tuple(code) + b"R",
    }  # fmt: skip


@pytest.fixture
def payload_module(tmp_path, monkeypatch):
    """A module that creates a marker file when imported (for import_module payloads)."""
    name = f"ws_payload_{os.getpid()}_{time.monotonic_ns()}"
    marker = tmp_path / "imported.marker"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "label",
    [
        "os.system", "builtins.exec", "builtins.eval", "__builtin__.eval", "subprocess.Popen",
        "importlib.import_module", "os.system (INST)", "builtins.exec (OBJ)",
        "builtins.exec (STACK_GLOBAL)",
    ],
)  # fmt: skip
def test_code_execution_refused(tmp_path, payload_module, label):
    marker = tmp_path / ("imported.marker" if "import_module" in label else "ran.marker")
    payload = _payloads(marker, payload_module)[label]
    path = tmp_path / "evil.pt"
    ft.write_with_payload(path, tmp_path / "work.pt", payload)
    global_name = label.split(" ")[0]
    with pytest.raises(ForbiddenPickleGlobal, match=repr(global_name).replace(".", r"\.")):
        read(path)
    assert not _wait_for(marker, 0.3), "the payload ran inside the reader"
    # Control: an unrestricted load really runs it, so the refusal above was meaningful.
    loaded = torch.load(path, weights_only=False)
    assert _wait_for(marker), "the payload is not live; the test proves nothing"
    if isinstance(loaded["config"], subprocess.Popen):
        loaded["config"].wait(10)  # the payload's child, reaped


def test_reduce_payload_written_by_torch_save(tmp_path):
    marker = tmp_path / "ran.marker"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {shlex.quote(str(marker))}",))

    for protocol in (2, 4):
        path = tmp_path / f"evil{protocol}.pt"
        torch.save({"weight": torch.ones(3), "evil": Evil()}, path, pickle_protocol=protocol)
        with pytest.raises(ForbiddenPickleGlobal, match=rf"{os.system.__module__}\.system"):
            read(path)
        assert not marker.exists()


def test_extension_registry_goes_through_find_class(tmp_path):
    marker = tmp_path / "ran.marker"
    code = 0x7EAB
    copyreg.add_extension("builtins", "exec", code)
    try:
        payload = (
            b"\x83"
            + struct.pack("<H", code)
            + ft.op_tuple(ft.op_str(f"open({str(marker)!r}, 'w').close()"))
            + b"R"
        )  # EXT2 code, args, REDUCE
        path = tmp_path / "ext.pt"
        ft.write_with_payload(path, tmp_path / "work.pt", payload)
        with pytest.raises(ForbiddenPickleGlobal, match=r"builtins\.exec"):
            read(path)
        assert not marker.exists()
    finally:
        copyreg.remove_extension("builtins", "exec", code)
