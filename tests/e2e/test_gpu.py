"""Weights into GPU memory, on a machine with CUDA (the group is skipped without one; run it
there with ``pytest -m gpu``): tensors received into page-locked buffers and copied to the
device asynchronously, as the README shows, byte-identical to safetensors' own loader onto
the device; a module on the GPU brought to the next revision in place by a delta update."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.publishing import serve
from weightserve.client._client import Client
from weightserve.service.server import WeightServer

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.torch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MODEL = "team/gpu-model"  # a checkpoint file in the root
PUBLISHED = "team/gpu-policy"  # revisions a trainer publishes


def checkpoint() -> dict[str, torch.Tensor]:
    """Every dtype a GPU engine keeps, sizes from a scalar to tensors of several chunks."""
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(4096, 1024, generator=g).to(torch.bfloat16),  # 8 MiB
        "layers.0.attn.weight": torch.randn(1024, 1024, generator=g).to(torch.float16),
        "layers.0.mlp.weight": torch.randn(2048, 1024, generator=g).to(torch.float8_e4m3fn),
        "layers.0.norm.weight": torch.randn(1024, generator=g),
        "layers.0.scale": torch.tensor(0.5, dtype=torch.float32),
        "lm_head.q": torch.randint(-128, 127, (512, 96), generator=g, dtype=torch.int8),
    }


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "models" / MODEL / "model.safetensors"
    path.parent.mkdir(parents=True)
    save_file(checkpoint(), str(path))  # the reference writer
    return path


@pytest.fixture
def server(model_file: Path) -> Iterator[WeightServer]:
    with serve(model_file.parents[2], allow_publish=True, grace_seconds=1) as srv:
        yield srv


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_pinned_buffers_copied_to_the_gpu_match_safetensors_on_the_device(
    server: WeightServer, model_file: Path
) -> None:
    from safetensors.torch import load_file

    expected = load_file(str(model_file), device="cuda")
    params = {n: torch.empty_like(t) for n, t in expected.items()}  # the engine's parameters
    buffers: list[torch.Tensor] = []

    def pinned(header) -> np.ndarray:
        buffer = torch.empty(header.total_bytes, dtype=torch.uint8, pin_memory=True)
        buffers.append(buffer)
        return buffer.numpy()

    with Client(server.http_url) as c:
        # A window smaller than the embedding: tensors arrive while earlier copies still run.
        for name, array in c.model(MODEL).iter_tensors(allocate=pinned, window_bytes=1 << 20):
            host = torch.from_numpy(array.reshape(-1).view(np.uint8))
            assert host.is_pinned(), name  # received straight into the page-locked buffer
            as_bytes(params[name]).copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert len(buffers) == len(expected)
    for name, want in expected.items():
        assert params[name].is_cuda and params[name].dtype == want.dtype, name
        assert torch.equal(as_bytes(params[name]), as_bytes(want)), name


def test_fetch_into_pinned_buffers_then_to_the_gpu(server: WeightServer, model_file: Path) -> None:
    from safetensors.torch import load_file

    expected = load_file(str(model_file), device="cuda")

    def pinned(header) -> np.ndarray:
        return torch.empty(header.total_bytes, dtype=torch.uint8, pin_memory=True).numpy()

    with Client(server.http_url) as c:
        arrays = c.model(MODEL).fetch(prefix="", allocate=pinned)
    on_device = {
        name: torch.from_numpy(array.reshape(-1).view(np.uint8)).to("cuda", non_blocking=True)
        for name, array in arrays.items()
    }
    torch.cuda.synchronize()
    assert set(on_device) == set(expected)
    for name, want in expected.items():
        assert torch.equal(on_device[name], as_bytes(want)), name


def test_a_module_on_the_gpu_is_updated_in_place(server: WeightServer) -> None:
    trainer = torch.nn.Linear(1024, 512).to(torch.bfloat16)
    worker = torch.nn.Linear(1024, 512).to(torch.bfloat16)
    worker.load_state_dict(trainer.state_dict())
    worker = worker.to("cuda")
    weight, bias = worker.weight, worker.bias
    storage = (weight.data_ptr(), bias.data_ptr())
    with Client(server.http_url) as c:
        r1 = c.publish(PUBLISHED, trainer.state_dict())
        with torch.no_grad():
            trainer.weight.view(-1)[::97] += 1.0  # about 1 % of the elements
            trainer.bias.fill_(0.25)  # every element: comes as a patch or whole
        r2 = c.publish(PUBLISHED, trainer.state_dict(), base=r1.commit)
        model = c.model(PUBLISHED)
        assert model.update(worker.state_dict(), since=r1.commit).commit == r2.commit
    # The same device tensors, at the same addresses, now holding the new revision's bytes.
    assert worker.weight is weight and worker.bias is bias
    assert (weight.data_ptr(), bias.data_ptr()) == storage and weight.is_cuda
    assert torch.equal(weight.cpu(), trainer.weight) and torch.equal(bias.cpu(), trainer.bias)
    done = model.last_update
    assert done["patch"] >= 1 and done["refetched"] == 0
    assert done["wire_bytes"] < trainer.weight.nbytes // 10
    out = worker(torch.ones(1, 1024, dtype=torch.bfloat16, device="cuda"))
    assert out.is_cuda and out.shape == (1, 512)


def test_a_wrong_base_on_the_gpu_is_fetched_whole_into_place(server: WeightServer) -> None:
    g = torch.Generator().manual_seed(1)
    r1_weights = {"w": torch.randn(256, 256, generator=g).to(torch.bfloat16)}
    r2_weights = {"w": r1_weights["w"].clone()}
    r2_weights["w"].view(-1)[::50] += 1.0
    with Client(server.http_url) as c:
        r1 = c.publish(PUBLISHED, r1_weights)
        c.publish(PUBLISHED, r2_weights, base=r1.commit)
        held = r1_weights["w"].to("cuda")
        held.view(-1)[7] += 3.0  # the worker's copy drifted from what it says it holds
        storage = held.data_ptr()
        state = {"w": held}
        model = c.model(PUBLISHED)
        model.update(state, since=r1.commit)
    assert state["w"] is held and held.data_ptr() == storage
    assert torch.equal(held.cpu(), r2_weights["w"])
    assert model.last_update["refetched"] == 1


def test_to_device_matches_safetensors_on_the_device(
    server: WeightServer, model_file: Path
) -> None:
    from safetensors.torch import load_file

    expected = load_file(str(model_file), device="cuda")
    # Over HTTP (the ring takes what a worker on another node receives); the same-node
    # handoff's views are copied from where they lie, in the next test.
    with Client(server.http_url, data_plane="http") as c:
        model = c.model(MODEL)
        got = model.to_device("cuda")
        assert model.last_device_load == {"staged": len(expected), "unstaged": 0}
        # A ring smaller than the embedding: the rest cycle through it, copies still running.
        small = model.to_device("cuda", staging_bytes=3 << 20)
        assert model.last_device_load["unstaged"] >= 1 and model.last_device_load["staged"] >= 3
    for name, want in expected.items():
        for loaded in (got, small):
            t = loaded[name]
            assert t.is_cuda and t.dtype == want.dtype and t.shape == want.shape, name
            assert torch.equal(as_bytes(t), as_bytes(want)), name


def test_to_device_writes_a_gpu_module_in_place(server: WeightServer, model_file: Path) -> None:
    from safetensors.torch import load_file

    expected = load_file(str(model_file), device="cuda")
    params = {n: torch.zeros_like(t) for n, t in expected.items()}
    pointers = {n: t.data_ptr() for n, t in params.items()}
    with Client(server.http_url, data_plane="http") as c:
        got = c.model(MODEL).to_device("cuda", into=params, staging_bytes=3 << 20)
    for name, want in expected.items():
        assert got[name] is params[name] and params[name].data_ptr() == pointers[name]
        assert torch.equal(as_bytes(params[name]), as_bytes(want)), name


def test_to_device_from_the_same_node_handoff(server: WeightServer, model_file: Path) -> None:
    from safetensors.torch import load_file

    expected = load_file(str(model_file), device="cuda")
    with Client(server.http_url) as c:
        assert c.planes().handoff is not None
        model = c.model(MODEL)
        got = model.to_device("cuda")
        assert model.last_device_load == {"staged": 0, "unstaged": len(expected)}
    for name, want in expected.items():
        assert got[name].is_cuda and torch.equal(as_bytes(got[name]), as_bytes(want)), name
