"""PyTorch users: ``RemoteWeights.torch_state_dict()`` feeds ``nn.Module.load_state_dict``.

A module loaded from the server (a ``torch.save`` checkpoint and a safetensors one, over
HTTP and gRPC) must compute exactly what the same module computes when loaded with
``torch.load`` / ``safetensors.torch.load_file`` from the file; dtypes are kept (bfloat16
stays ``torch.bfloat16``) and tensors share memory with the received buffers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from safetensors.torch import load_file as load_safetensors  # noqa: E402
from safetensors.torch import save_file as save_safetensors  # noqa: E402

from tests.support import fixtures_torch  # noqa: E402
from weightserve.client import RemoteWeights, WeightsFormat, load_weights, weights_format  # noqa: E402
from weightserve.service.server import ServerConfig, WeightServer  # noqa: E402


def make_model(seed: int, dtype: Any = torch.float32) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(32, 16),
            "proj": torch.nn.Linear(16, 24),
            "norm": torch.nn.LayerNorm(24),
            "block": torch.nn.TransformerEncoderLayer(
                d_model=24, nhead=2, dim_feedforward=48, batch_first=True, dropout=0.0
            ),
            "head": torch.nn.Linear(24, 32, bias=False),
        }
    )
    model.register_buffer("position_scale", torch.linspace(0.5, 1.5, 24))  # a buffer too
    return model.to(dtype).eval()


def forward(model: Any, tokens: Any) -> Any:
    x = model["embed"](tokens)
    x = model["norm"](model["proj"](x)) * model.position_scale
    return model["head"](model["block"](x))


TOKENS = torch.tensor([[1, 5, 9, 30], [2, 2, 17, 0]])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, WeightServer]]:
    path = tmp_path_factory.mktemp("torch-client-root")
    trained = make_model(seed=0)
    (path / "torch-f32").mkdir()
    torch.save(trained.state_dict(), path / "torch-f32" / "pytorch_model.bin")
    bf16 = make_model(seed=0, dtype=torch.bfloat16)
    (path / "torch-bf16").mkdir()
    torch.save(bf16.state_dict(), path / "torch-bf16" / "model.pt")
    (path / "st-bf16").mkdir()
    save_safetensors(
        {k: v.contiguous() for k, v in bf16.state_dict().items()},
        str(path / "st-bf16" / "model.safetensors"),
    )
    (path / "dtypes").mkdir()
    fixtures_torch.write_dtypes(path / "dtypes" / "pytorch_model.bin")
    (path / "views").mkdir()
    fixtures_torch.write_views(path / "views" / "pytorch_model.bin")
    server = WeightServer(ServerConfig(str(path), http_port=0, grpc_port=0, flight_port=0)).start()
    try:
        yield path, server
    finally:
        server.stop(grace=1.0)


@pytest.fixture(params=["http", "grpc"])
def url(request: pytest.FixtureRequest, root: tuple[Path, WeightServer]) -> Callable[[str], str]:
    _, server = root

    def make(model_id: str) -> str:
        if request.param == "http":
            return f"{server.http_url}/v1/models/{model_id}"
        return f"{server.grpc_url}/{model_id}"

    return make


@pytest.fixture
def weights(url: Callable[[str], str]) -> Iterator[Callable[[str], RemoteWeights]]:
    opened: list[RemoteWeights] = []

    def open_(model_id: str) -> RemoteWeights:
        w = load_weights([url(model_id)])
        opened.append(w)
        return w

    yield open_
    for w in opened:
        w.close()


def _file(root: tuple[Path, WeightServer], model_id: str) -> Path:
    return next(p for p in (root[0] / model_id).iterdir() if p.is_file())


def test_module_from_torch_checkpoint(root: Any, weights: Callable) -> None:
    w = weights("torch-f32")
    remote_model = make_model(seed=1)
    result = remote_model.load_state_dict(w.torch_state_dict())  # strict by default
    assert not result.missing_keys and not result.unexpected_keys
    local_model = make_model(seed=1)
    local_model.load_state_dict(torch.load(_file(root, "torch-f32"), weights_only=True))
    with torch.no_grad():
        expected = forward(local_model, TOKENS)
        got = forward(remote_model, TOKENS)
    assert torch.equal(got, expected)
    assert not torch.equal(got, forward(make_model(seed=1), TOKENS))  # the load did something


@pytest.mark.parametrize(
    ("model_id", "loader"),
    [
        ("torch-bf16", lambda p: torch.load(p, weights_only=True)),
        ("st-bf16", lambda p: load_safetensors(str(p))),
    ],
)
def test_bfloat16_stays_bfloat16(root: Any, weights: Callable, model_id: str, loader) -> None:
    w = weights(model_id)
    state = w.torch_state_dict()
    reference = loader(_file(root, model_id))
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        assert state[name].dtype == tensor.dtype == torch.bfloat16, name
        assert state[name].shape == tensor.shape
        assert torch.equal(state[name], tensor), name
    remote_model = make_model(seed=3, dtype=torch.bfloat16)
    remote_model.load_state_dict(state, strict=True)
    local_model = make_model(seed=3, dtype=torch.bfloat16)
    local_model.load_state_dict(reference, strict=True)
    with torch.no_grad():
        got = forward(remote_model, TOKENS)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, forward(local_model, TOKENS))


def test_every_dtype_as_torch_load(root: Any, weights: Callable) -> None:
    state = weights("dtypes").torch_state_dict()
    reference = torch.load(_file(root, "dtypes"), weights_only=True)
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        got = state[name]
        assert got.dtype == tensor.dtype, name
        assert got.shape == tensor.shape, name
        assert got.view(torch.uint8).numpy().tobytes() == (
            tensor.contiguous().view(torch.uint8).numpy().tobytes()
        ), name


def test_weights_format_of_a_torch_model(url: Callable[[str], str]) -> None:
    assert weights_format([url("torch-f32")]) is WeightsFormat.pytorch
    assert weights_format([url("st-bf16")]) is WeightsFormat.safetensors


def test_views_and_tied_tensors(root: Any, weights: Callable) -> None:
    state = weights("views").torch_state_dict()
    reference = torch.load(_file(root, "views"), weights_only=True)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor.contiguous()), name


def test_zero_copy_and_prefix(weights: Callable) -> None:
    w = weights("torch-f32")
    arrays = w.numpy_state_dict()
    state = w.torch_state_dict()
    for name, tensor in state.items():
        assert tensor.data_ptr() == arrays[name].ctypes.data, name  # shares the buffer
    proj = w.torch_state_dict("proj.", strip_prefix=True)
    assert set(proj) == {"weight", "bias"}
    layer = torch.nn.Linear(16, 24)
    layer.load_state_dict(proj)
    assert torch.equal(layer.weight, state["proj.weight"])
    # The same through a cursor: its name is the prefix.
    assert set(w.block.torch_state_dict()) == {n for n in state if n.startswith("block")}


def test_safetensors_bf16_through_data(weights: Callable) -> None:
    """The MAX protocol's data() on the same model: its DLPack export keeps bfloat16."""
    w = weights("st-bf16")
    data = w.proj.weight.data()
    assert data.dtype.name == "bfloat16"
    tensor = torch.from_dlpack(data)
    assert tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, w.torch_state_dict()["proj.weight"])


def test_without_max_torch_state_dict_still_works(url: Callable[[str], str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONEXECUTABLE"}
    env["WEIGHTSERVE_NO_MAX"] = "1"
    code = (
        "import sys, torch; from weightserve.client import load_weights; "
        f"w = load_weights([{url('st-bf16')!r}]); "
        "sd = w.torch_state_dict(); "
        "assert all(t.dtype == torch.bfloat16 for t in sd.values()); "
        "assert 'max' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
