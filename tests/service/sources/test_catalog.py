"""The catalog: discovery rules, ids, refused models, confinement to the root, revisions,
header-only start-up and one shared mmap per file. Real checkpoint files throughout."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support import fixtures_gguf as gx
from tests.support import fixtures_safetensors as fx
from weightserve.client.errors import InvalidRequest, ModelNotFound, ModelUnavailable
from weightserve.service.readers.errors import BadMagic, TruncatedFile
from weightserve.service.sources.files.chunk_digests import ChunkDigests, DigestBudget
from weightserve.service.sources.files.mapped import MappedFile
from weightserve.service.sources.layout import validate_model_id
from weightserve.service.sources.local.catalog import Catalog

try:
    from tests.support import fixtures_torch as tx
except ImportError:  # torch is optional (the `torch` extra)
    tx = None  # type: ignore[assignment]

OUTSIDE = "symlink points outside the model root"
GIB = 1 << 30


def write_single(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A one-file safetensors model; returns its arrays."""
    rng = np.random.default_rng(seed)
    arrays = {
        "a.weight": rng.standard_normal((4, 8)).astype(np.float32),
        "b.bias": rng.standard_normal(8).astype(np.float16),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    save_file(arrays, path)
    return arrays


def write_truncated_header(path: Path) -> Path:
    """A safetensors file whose header length says 1000 bytes but only 20 follow."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", 1000) + b'{"x": {"dtype": "F32"')
    return path


def write_huge_sparse(path: Path, nbytes: int) -> Path:
    """A safetensors file declaring ``nbytes`` of tensor data, all of it a sparse hole."""
    n_f32 = nbytes // 4
    header = {
        "__metadata__": {"format": "pt"},
        "huge.weight": {"dtype": "F32", "shape": [n_f32], "data_offsets": [0, 4 * n_f32]},
        "small.bias": {"dtype": "F32", "shape": [4], "data_offsets": [4 * n_f32, 4 * n_f32 + 16]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 4 * n_f32 + 16)
    return path


# ------------------------------------------------------------------------------ discovery


@pytest.fixture
def layout(tmp_path: Path) -> dict:
    """A root with every layout the catalog documents, plus things it must ignore."""
    root = tmp_path / "root"
    root.mkdir()
    expect: dict = {"root": root}
    expect["single"] = write_single(root / "single.safetensors")
    expect["gguf"] = gx.write_mixed(root / "tiny.gguf")
    fx.write_sharded(root / "org" / "sharded")  # three shards + model.safetensors.index.json
    (root / "org" / "sharded" / "config.json").write_text('{"model_type": "llama"}')
    fx.write_sharded(root / "org" / "noindex", with_index=False)
    # Both formats: served from safetensors; the .bin is garbage, so reading it would fail.
    expect["both"] = write_single(root / "org" / "both" / "model.safetensors", seed=1)
    (root / "org" / "both" / "pytorch_model.bin").write_bytes(b"not a zip archive at all")
    expect["deep"] = write_single(root / "org" / "sub" / "deep" / "model.safetensors", seed=2)
    (root / "org" / "quant").mkdir()
    expect["quant"] = gx.write_mixed(root / "org" / "quant" / "model-q8.gguf", seed=3)
    # Hidden things are never models.
    write_single(root / ".cache" / "m" / "model.safetensors")
    write_single(root / "org" / ".git" / "x" / "model.safetensors")
    write_single(root / ".hidden.safetensors")
    (root / "README.md").write_text("not a model")
    if tx is not None:
        expect["pt"] = tx.write_dtypes(root / "state.pt")
        state = tx.dtype_tensors()
        expect["pt_sharded"] = tx.write_sharded(root / "org" / "pt-sharded", state, 2)
    return expect


def test_discovery_ids_formats_and_files(layout: dict) -> None:
    root: Path = layout["root"]
    catalog = Catalog(root)
    expected = {
        "single.safetensors": ("safetensors", root / "single.safetensors"),
        "tiny.gguf": ("gguf", root / "tiny.gguf"),
        "org/sharded": ("safetensors", root / "org" / "sharded"),
        "org/noindex": ("safetensors", root / "org" / "noindex"),
        "org/both": ("safetensors", root / "org" / "both"),
        "org/sub/deep": ("safetensors", root / "org" / "sub" / "deep"),
        "org/quant/model-q8.gguf": ("gguf", root / "org" / "quant" / "model-q8.gguf"),
    }
    if tx is not None:
        expected["state.pt"] = ("pytorch", root / "state.pt")
        expected["org/pt-sharded"] = ("pytorch", root / "org" / "pt-sharded")
    assert catalog.problems == {}
    assert sorted(catalog.models) == sorted(expected)
    for model_id, (fmt, path) in expected.items():
        model = catalog.get(model_id)
        assert model.id == model_id
        assert model.format == fmt == model.contents.format
        assert model.path == path.resolve()
        assert len(model.revision) == 16

    sharded = catalog.get("org/sharded")
    assert sorted(f.name for f in sharded.files) == sorted([*fx.SHARD_NAMES, fx.INDEX_NAME])
    noindex = catalog.get("org/noindex")
    assert sorted(f.name for f in noindex.files) == sorted(fx.SHARD_NAMES)
    both = catalog.get("org/both")
    assert [f.name for f in both.files] == ["model.safetensors"]  # the .bin is not read
    assert catalog.get("single.safetensors").files == [(root / "single.safetensors").resolve()]
    if tx is not None:
        pt = catalog.get("org/pt-sharded")
        assert sorted(f.name for f in pt.files) == sorted(
            [*set(layout["pt_sharded"].values()), "pytorch_model.bin.index.json"]
        )


def test_discovery_indexes_every_tensor(layout: dict) -> None:
    catalog = Catalog(layout["root"])

    def check_arrays(model_id: str, arrays: dict[str, np.ndarray]) -> None:
        model = catalog.get(model_id)
        assert list(model.tensors) == sorted(arrays)
        for name, array in arrays.items():
            entry = model.tensor(name)
            assert entry.shape == array.shape
            assert bytes(model.raw_view(entry)) == array.tobytes()

    check_arrays("single.safetensors", layout["single"])
    check_arrays("org/both", layout["both"])
    check_arrays("org/sub/deep", layout["deep"])
    shards = fx.sharded_arrays()
    merged = {k: v for shard in shards for k, v in shard.items()}
    check_arrays("org/sharded", merged)
    check_arrays("org/noindex", merged)
    sharded = catalog.get("org/sharded")
    for shard_name, arrays in zip(fx.SHARD_NAMES, shards, strict=True):
        for name in arrays:
            assert sharded.tensor(name).file.name == shard_name
    assert sharded.metadata["format"] == "pt"

    for model_id, written in [
        ("tiny.gguf", layout["gguf"]),
        ("org/quant/model-q8.gguf", layout["quant"]),
    ]:
        model = catalog.get(model_id)
        assert set(model.tensors) == set(written)
        for name, w in written.items():
            entry = model.tensor(name)
            assert entry.logical_shape == tuple(w.logical_shape)
            assert bytes(model.raw_view(entry)) == w.data.tobytes()
        assert model.metadata["general.name"] == "weightserve mixed fixture"
        assert model.tensor("blk.0.ffn_up.weight").encoding == "Q8_0"

    if tx is not None:
        for model_id in ("state.pt", "org/pt-sharded"):
            model = catalog.get(model_id)
            assert set(model.tensors) == set(layout["pt"])
            for name, t in layout["pt"].items():
                assert model.tensor(name).shape == tuple(t.shape)


def test_broken_model_is_reported_and_the_others_are_served(layout: dict) -> None:
    root: Path = layout["root"]
    write_truncated_header(root / "org" / "broken" / "model.safetensors")
    (root / "bad.gguf").write_bytes(b"GGML" + bytes(60))
    catalog = Catalog(root)

    assert sorted(catalog.problems) == ["bad.gguf", "org/broken"]
    problem = catalog.problems["org/broken"]
    assert problem.model == "org/broken"
    # Problems reach clients, so files are named relative to the root, never by server paths.
    assert problem.file == "org/broken/model.safetensors"
    assert str(root.resolve()) not in problem.reason
    assert TruncatedFile.rule in problem.reason  # "file ends inside its header"
    assert "header length 1000" in problem.reason
    bad = catalog.problems["bad.gguf"]
    assert (bad.model, Path(bad.file).name) == ("bad.gguf", "bad.gguf")
    assert BadMagic.rule in bad.reason

    # Every good model is still served.
    assert "org/broken" not in catalog.models and "bad.gguf" not in catalog.models
    assert {"single.safetensors", "tiny.gguf", "org/sharded", "org/sub/deep"} <= set(catalog.models)

    with pytest.raises(ModelUnavailable) as info:
        catalog.get("org/broken")
    assert "'org/broken'" in str(info.value) and TruncatedFile.rule in str(info.value)
    with pytest.raises(ModelUnavailable, match="bad magic"):
        catalog.get("bad.gguf")


def test_unknown_model_suggests_a_close_id(layout: dict) -> None:
    catalog = Catalog(layout["root"])
    with pytest.raises(ModelNotFound) as info:
        catalog.get("org/shardd")
    assert str(info.value) == (
        "No model 'org/shardd' under the model root. Did you mean 'org/sharded'?"
    )
    with pytest.raises(ModelNotFound) as info:
        catalog.get("zzzz/qqqq")
    assert "Did you mean" not in str(info.value)


@pytest.mark.parametrize(
    "model_id",
    ["../x", "/etc", "/etc/passwd", "a/../b", "a//b", "", ".", "./a", "a/.", "a/", "..",
     "a\\..\\b", "a\0b"],
)  # fmt: skip
def test_invalid_ids_are_refused(tmp_path: Path, model_id: str) -> None:
    write_single(tmp_path / "a" / "model.safetensors")
    catalog = Catalog(tmp_path)
    with pytest.raises(InvalidRequest):
        catalog.get(model_id)
    with pytest.raises(InvalidRequest):
        validate_model_id(model_id)


def test_valid_ids_pass_validation() -> None:
    for model_id in ("a", "org/name", "org/sub/name", "x.safetensors", "q/m-Q4_K.gguf", "a..b"):
        assert validate_model_id(model_id) == model_id


# ------------------------------------------------------------------------------ symlinks


def test_symlinks_leaving_the_root_are_refused_and_reported(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    secret = write_single(outside / "secret.safetensors")
    write_single(outside / "dir" / "model.safetensors")
    fx.write_sharded(outside / "shards", with_index=False)
    write_single(root / "good" / "model.safetensors")

    # A root-level file that points outside.
    (root / "escape.safetensors").symlink_to(outside / "secret.safetensors")
    # A model directory with one shard that points outside: refused as a whole, never half.
    part = root / "org" / "partial"
    part.mkdir(parents=True)
    for i, shard in enumerate(fx.SHARD_NAMES):
        if i == 1:
            (part / shard).symlink_to(outside / "shards" / shard)
        else:
            shutil.copy(outside / "shards" / shard, part / shard)
    # A directory symlink that points outside.
    (root / "org" / "dirlink").symlink_to(outside / "dir", target_is_directory=True)
    # A relative symlink climbing out.
    (root / "climb.safetensors").symlink_to(Path("..") / "outside" / "secret.safetensors")

    catalog = Catalog(root)
    assert sorted(catalog.models) == ["good"]
    assert sorted(catalog.problems) == [
        "climb.safetensors",
        "escape.safetensors",
        "org/dirlink",
        "org/partial",
    ]
    for problem in catalog.problems.values():
        assert problem.reason == OUTSIDE
    assert catalog.problems["org/partial"].file == f"org/partial/{fx.SHARD_NAMES[1]}"
    for model_id in ("escape.safetensors", "climb.safetensors", "org/partial"):
        with pytest.raises(ModelUnavailable, match="outside the model root"):
            catalog.get(model_id)
    assert secret  # the bytes outside were never served under any id
    for model in catalog.models.values():
        for f in model.files:
            assert f.resolve().is_relative_to(root.resolve())


def test_symlinks_inside_the_root_are_served(tmp_path: Path) -> None:
    root = tmp_path / "root"
    arrays = write_single(root / "blobs" / "weights.bin.data")  # no checkpoint suffix: no model
    (root / "org" / "name").mkdir(parents=True)
    # Hugging Face cache style: the checkpoint is a relative link to a blob.
    (root / "org" / "name" / "model.safetensors").symlink_to(
        Path("..") / ".." / "blobs" / "weights.bin.data"
    )
    (root / "alias.safetensors").symlink_to(root / "blobs" / "weights.bin.data")
    catalog = Catalog(root)
    assert catalog.problems == {}
    assert sorted(catalog.models) == ["alias.safetensors", "org/name"]
    for model_id in catalog.models:
        model = catalog.get(model_id)
        assert bytes(model.raw_view(model.tensor("a.weight"))) == arrays["a.weight"].tobytes()


# ------------------------------------------------------------------------------ revisions


def test_revision_stable_across_scans_and_catalogs(layout: dict) -> None:
    first = Catalog(layout["root"])
    second = Catalog(layout["root"])
    revisions = {m.id: m.revision for m in first.models.values()}
    assert revisions == {m.id: m.revision for m in second.models.values()}
    assert len(set(revisions.values())) == len(revisions)  # distinct models, distinct revisions
    before = dict(first.models)
    first.scan()
    assert {m.id: m.revision for m in first.models.values()} == revisions
    for model_id, model in first.models.items():
        assert model is before[model_id]  # unchanged: same object, same index and mappings


def test_revision_changes_when_a_file_changes(layout: dict) -> None:
    root: Path = layout["root"]
    catalog = Catalog(root)
    before = dict(catalog.models)
    revisions = {m.id: m.revision for m in before.values()}
    single = catalog.get("single.safetensors")
    view = single.raw_view(single.tensor("a.weight"))  # a live mapping of the old file

    # 1. Content rewritten in place (same inode, same size, later mtime).
    new_single = write_single(root / "single.safetensors", seed=42)
    # 2. Only the mtime of one shard changes (content identical).
    shard = root / "org" / "sharded" / fx.SHARD_NAMES[2]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    # 3. Replaced by an identical copy with the same mtime (new inode).
    deep = root / "org" / "sub" / "deep" / "model.safetensors"
    st = deep.stat()
    shutil.copy(deep, deep.with_suffix(".tmp"))
    os.replace(deep.with_suffix(".tmp"), deep)
    os.utime(deep, ns=(st.st_atime_ns, st.st_mtime_ns))
    # 4. A new model appears, one disappears.
    write_single(root / "org" / "new" / "model.safetensors")
    shutil.rmtree(root / "org" / "noindex")

    catalog.scan()
    # Revisions name content: only new bytes give a new revision. Every touched file is
    # indexed again all the same (its stamp changed), and only untouched models keep their
    # Model object (index and mappings).
    new_bytes = {"single.safetensors"}
    touched = new_bytes | {"org/sharded", "org/sub/deep"}
    assert set(catalog.models) == (set(before) - {"org/noindex"}) | {"org/new"}
    for model_id, model in catalog.models.items():
        if model_id == "org/new":
            continue
        if model_id in new_bytes:
            assert model.revision != revisions[model_id], model_id
        else:
            assert model.revision == revisions[model_id], model_id
        if model_id in touched:
            assert model is not before[model_id], model_id
        else:
            assert model is before[model_id], model_id
    single2 = catalog.get("single.safetensors")
    assert bytes(single2.raw_view(single2.tensor("a.weight"))) == new_single["a.weight"].tobytes()
    # The old Model object still answers with its own mapping (what an open stream holds).
    assert len(bytes(view)) == new_single["a.weight"].nbytes
    # And a second catalog agrees with the rescanned one.
    assert {m.id: m.revision for m in Catalog(root).models.values()} == {
        m.id: m.revision for m in catalog.models.values()
    }


# ------------------------------------------------------------------------------ start-up cost


def test_opening_a_100_gib_sparse_file_is_fast(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "big" / "model").mkdir(parents=True)
    path = write_huge_sparse(root / "big" / "model" / "model.safetensors", 100 * GIB)
    assert path.stat().st_size > 100 * GIB
    started = time.perf_counter()
    catalog = Catalog(root)
    elapsed = time.perf_counter() - started
    assert catalog.problems == {}
    model = catalog.get("big/model")
    assert elapsed < 1.0, f"opening a 100 GiB checkpoint took {elapsed:.3f} s"
    assert model.tensor("huge.weight").nbytes == 100 * GIB
    assert model.total_bytes == 100 * GIB + 16
    assert model._maps == {}  # nothing mapped until a tensor is asked for
    # The mapping is made lazily and covers the whole file; the hole reads as zeros.
    tail = model.raw_view(model.tensor("small.bias"))
    assert bytes(tail) == bytes(16)


def _rchar() -> int:
    """Bytes this process read through read(2) and friends, per the kernel."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_start_up_reads_headers_only(tmp_path: Path) -> None:
    """Garbage tensor bytes index fine, and indexing reads a tiny fraction of the files."""
    root = tmp_path / "root"
    root.mkdir()
    size = 64 << 20
    garbage = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes()
    header = {"blob": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}
    fx.write_crafted(root / "garbage.safetensors", header, garbage)
    raw = gx.RawGGUF(tensors=[("blob", [size // 4], gx.Q.F32, 0)])
    raw.write(root / "garbage.gguf", data=garbage)
    total = 2 * size
    if tx is not None:
        import torch

        torch.save({"blob": torch.zeros(size // 4)}, root / "zeros.pt")
        total += size

    if not Path("/proc/self/io").exists():
        pytest.skip("needs /proc/self/io")
    before = _rchar()
    catalog = Catalog(root)
    read = _rchar() - before
    assert catalog.problems == {}
    assert len(catalog.models) == (3 if tx is not None else 2)
    for model in catalog.models.values():
        assert model.tensor("blob").nbytes == size
        assert model._maps == {}
    assert read < 1 << 20, f"indexing {total} bytes of checkpoints read {read} bytes"


# ------------------------------------------------------------------------------ mappings


def test_one_mmap_per_file_shared_by_every_view(tmp_path: Path) -> None:
    fx.write_sharded(tmp_path / "org" / "m")
    catalog = Catalog(tmp_path)
    model = catalog.get("org/m")
    shard = fx.SHARD_NAMES[1]
    a, b = [e for e in model.tensors.values() if e.file.name == shard][:2]
    assert a.file == b.file
    va, vb = model.raw_view(a), model.raw_view(b)
    mapped = model.mapped(a.file)
    assert isinstance(mapped, MappedFile)
    assert model.mapped(b.file) is mapped
    assert va.obj is vb.obj  # both slices of the one mmap object
    assert va.obj is mapped._map
    assert list(model._maps) == [a.file]  # only the file asked for is mapped
    # Another shard gets its own, single mapping; the model lookup returns the same Model.
    other = next(e for e in model.tensors.values() if e.file.name == fx.SHARD_NAMES[0])
    vo = model.raw_view(other)
    assert vo.obj is not va.obj
    assert len(model._maps) == 2
    again = catalog.get("org/m")
    assert again is model
    assert again.raw_view(a).obj is va.obj


def test_chunk_digests_are_computed_once_per_mapping(tmp_path: Path, monkeypatch) -> None:
    """The server digests each range of a file once; a replaced file starts afresh; small
    chunks are not kept, and all mappings share one bounded budget."""
    import gc

    import xxhash

    budget = DigestBudget(limit=5)
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 64)
    mapped = MappedFile(path, digests=ChunkDigests(budget, min_chunk=1024))
    view = mapped.view()
    calls: list[int] = []
    real = xxhash.xxh3_64_intdigest

    def counting(data) -> int:
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", counting)
    first = mapped.digest(1024, view[1024:5120])
    assert first == real(bytes(view[1024:5120]))
    assert mapped.digest(1024, view[1024:5120]) == first  # cached: no second read
    assert calls == [4096]
    assert mapped.digest(1024, view[1024:2048]) == real(bytes(view[1024:2048]))  # another range
    assert mapped.digest(0, view[0:512]) == real(bytes(view[0:512]))  # small: not kept
    assert mapped.digest(0, view[0:512]) == real(bytes(view[0:512]))
    assert calls == [4096, 1024, 512, 512]
    assert budget.used == 2
    path.write_bytes(b"\xff" * (256 * 64))  # replaced: a new mapping, new digests
    renewed = MappedFile(path, digests=ChunkDigests(budget, min_chunk=1024))
    assert renewed.digest(1024, renewed.view()[1024:5120]) == real(b"\xff" * 4096)
    assert budget.used == 3
    for start in range(0, 16384, 1024):
        renewed.digest(start, renewed.view()[start : start + 1024])
    assert budget.used == 5  # the shared budget bounds every mapping together
    del mapped, view
    gc.collect()
    assert budget.used == 3  # the dropped mapping gave its two back
