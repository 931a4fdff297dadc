"""Faithful pull (the model's original files, byte-identical, resumable), the explicit
conversion to safetensors, and bounded-memory loading with ``iter_tensors``.

Real servers on loopback port 0, real files from the reference writers (the session's
``model_root`` and a module root with a few-MiB sharded repository and side files).
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
from safetensors import safe_open
from safetensors.numpy import save_file

from tests.support.commands import run_cli
from tests.support.faults import CuttingProxy
from tests.support.model_root import ModelRoot
from tests.support.references import reference_gguf, reference_safetensors, reference_torch
from weightserve.client import Client
from weightserve.client._download import STATE_FILE, FilePull, _safe_relative
from weightserve.client._pull import ConversionRefused, DestinationError, pull_to_safetensors
from weightserve.client.errors import WeightserveError

MIB = 1 << 20
REPO = "acme/repo"  # the module root's model: 2 shards of 3 MiB, index, config, tokenizer


def _write_repo(directory: Path) -> None:
    rng = np.random.default_rng(7)
    weight_map = {}
    for i, shard in enumerate(
        ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    ):
        arrays = {
            f"layers.{i}.{k}": rng.standard_normal(MIB // 4 * 3 // 4, dtype=np.float32)
            for k in "abcd"
        }
        save_file(arrays, directory / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(arrays, shard))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )
    (directory / "config.json").write_text('{"model_type": "bert", "hidden_size": 8}\n')
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    (directory / "sub").mkdir()
    (directory / "sub" / "config.json").write_text('{"pooling": "mean"}\n')


@pytest.fixture(scope="module")
def repo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from weightserve.service.server import ServerConfig, WeightServer

    root = tmp_path_factory.mktemp("pull-root")
    (root / REPO).mkdir(parents=True)
    _write_repo(root / REPO)
    srv = WeightServer(ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0)).start()
    srv.root = root
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


def _url(server, transport: str) -> str:
    return (
        f"http://127.0.0.1:{server.http_port}"
        if transport == "http"
        else (f"grpc://127.0.0.1:{server.grpc_port}")
    )


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def _same_tree(pulled: Path, source: Path) -> None:
    # Hidden entries (.gitattributes) are not served, as the catalog skips them.
    names = [n for n in _files(source) if not any(part.startswith(".") for part in n.split("/"))]
    assert _files(pulled) == names  # no .partial, no state file left behind
    for name in names:
        assert filecmp.cmp(pulled / name, source / name, shallow=False), name


# ------------------------------------------------------------------------- faithful pull
@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("model", ["org/sharded", "tiny.gguf", "torch"])
def test_pull_writes_the_original_files_byte_identical(
    server, model_root: ModelRoot, tmp_path: Path, transport: str, model: str
) -> None:
    if model in model_root.skipped or "torch" in model_root.skipped and model == "torch":
        pytest.skip(model_root.skipped.get(model) or model_root.skipped["torch"])
    fmt, sources = model_root.models[model]
    with Client(_url(server, transport)) as client:
        out = client.model(model).download(tmp_path / "out")
    assert out == tmp_path / "out"
    if fmt == "gguf":  # a GGUF model is one file, named as on the server
        assert _files(out) == [sources[0].name]
        assert filecmp.cmp(out / sources[0].name, sources[0], shallow=False)
        assert reference_gguf(out / sources[0].name).keys() == reference_gguf(sources[0]).keys()
        return
    _same_tree(out, sources[0].parent)
    if fmt == "safetensors":
        assert "model.safetensors.index.json" in _files(out)
        pulled = reference_safetensors([out / p.name for p in sources])
        for name, ref in reference_safetensors(sources).items():
            assert pulled[name].array.tobytes() == ref.array.tobytes(), name
    else:
        pulled = reference_torch(out / sources[0].name)
        for name, ref in reference_torch(sources[0]).items():
            assert pulled[name].array.tobytes() == ref.array.tobytes(), name


def test_pull_keeps_side_files_and_subdirectories(repo_server, tmp_path: Path) -> None:
    with Client(_url(repo_server, "http")) as client:
        model = client.model(REPO)
        listed = {f.name: f for f in model.files()}
        assert {"config.json", "tokenizer_config.json", "sub/config.json"} <= set(listed)
        source = repo_server.root / REPO
        for name, f in listed.items():
            assert f.size == (source / name).stat().st_size
            assert f.etag == xxhash.xxh3_128((source / name).read_bytes()).hexdigest()
        model.download(tmp_path / "out")
    _same_tree(tmp_path / "out", source)


def test_interrupted_pull_resumes_with_only_the_missing_bytes(repo_server, tmp_path: Path) -> None:
    source = repo_server.root / REPO
    out = tmp_path / "out"
    total = sum((source / n).stat().st_size for n in _files(source))
    sent = 0

    def interrupt(n: int) -> None:  # Ctrl-C in the middle of the first shard
        nonlocal sent
        sent += n
        if sent >= 2 * MIB:
            raise KeyboardInterrupt

    with Client(_url(repo_server, "http")) as client:
        model = client.model(REPO)
        with pytest.raises(KeyboardInterrupt):
            model.download(out, on_bytes=interrupt)
        partials = [p for p in out.rglob("*.partial")]
        assert len(partials) == 1 and partials[0].stat().st_size == sent
        assert (out / STATE_FILE).is_file()

        resumed = FilePull(model, out).plan()
        assert resumed.already == sent and resumed.total == total
        counted: list[int] = []
        resumed.run(on_bytes=counted.append)
    assert sum(counted) == total - sent  # nothing that had arrived travelled again
    _same_tree(out, source)


def test_dropped_connection_resumes_with_a_range_request(repo_server, tmp_path: Path) -> None:
    source = repo_server.root / REPO
    total = sum((source / n).stat().st_size for n in _files(source))
    proxy = CuttingProxy(repo_server.http_port, cut_after=MIB + 12345)
    try:
        counted: list[int] = []
        with Client(f"http://127.0.0.1:{proxy.port}", retry_seconds=10) as client:
            client.model(REPO).download(tmp_path / "out", on_bytes=counted.append)
        assert proxy.cuts == 1
    finally:
        proxy.close()
    assert sum(counted) == total  # each byte received once: the cut file went on, not over
    _same_tree(tmp_path / "out", source)


def test_a_partial_of_other_content_starts_again(repo_server, tmp_path: Path) -> None:
    source = repo_server.root / REPO
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json.partial").write_bytes(b"stale bytes of another version")
    (out / STATE_FILE).write_text(json.dumps({"model": REPO, "files": {"config.json": "0" * 32}}))
    with Client(_url(repo_server, "http")) as client:
        pull = FilePull(client.model(REPO), out).plan()
        assert pull.already == 0
        pull.run()
    _same_tree(out, source)


def test_existing_files_refused_unless_forced_identical_ones_kept(
    repo_server, tmp_path: Path
) -> None:
    source = repo_server.root / REPO
    out = tmp_path / "out"
    with Client(_url(repo_server, "http")) as client:
        model = client.model(REPO)
        model.download(out)
        kept = (out / "model-00001-of-00002.safetensors").stat().st_ino
        (out / "config.json").write_text("{}")  # a local edit
        with pytest.raises(DestinationError, match=r"config\.json exists and differs.*--force"):
            model.download(out)
        assert (out / "config.json").read_text() == "{}"  # untouched
        counted: list[int] = []
        model.download(out, force=True, on_bytes=counted.append)
    assert sum(counted) == (source / "config.json").stat().st_size  # only the changed file
    assert (out / "model-00001-of-00002.safetensors").stat().st_ino == kept
    _same_tree(out, source)


@pytest.mark.parametrize(
    "name", ["../escape", "/etc/passwd", "a/../../b", "a//b", "./x", "", "a\\b", STATE_FILE]
)
def test_unsafe_names_from_the_server_are_refused(name: str) -> None:
    with pytest.raises(WeightserveError, match="refusing to write it"):
        _safe_relative(name, "m")


def test_cli_pull_writes_files_and_reports_destination_errors(repo_server, tmp_path: Path) -> None:
    url = f"{_url(repo_server, 'http')}/v1/models/{REPO}"
    out = tmp_path / "out"
    result = run_cli("pull", url, "--out", str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out) and result.stderr == ""
    _same_tree(out, repo_server.root / REPO)

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result = run_cli("pull", url, "--out", str(not_a_dir), "--quiet")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "exists and is not a directory" in result.stderr

    result = run_cli("pull", url, "--prefix", "layers.0", "--out", str(out))
    assert result.returncode == 2 and "--prefix" in result.stderr and "--to" in result.stderr

    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            result = run_cli("pull", url, "--out", str(locked / "m"), "--quiet")
        finally:
            locked.chmod(0o700)
        assert result.returncode == 1
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert "Permission denied" in result.stderr and "choose another --out" in result.stderr


# -------------------------------------------------------------------------- conversion
def test_convert_keeps_the_source_metadata(server, model_root: ModelRoot, tmp_path: Path) -> None:
    with Client(_url(server, "http")) as client:
        for model_id in ("org/sharded", "torch"):
            if model_id in model_root.skipped or (
                "torch" in model_root.skipped and model_id == "torch"
            ):
                continue
            fmt, sources = model_root.models[model_id]
            out = pull_to_safetensors(
                client.model(model_id), tmp_path / model_id / "model.safetensors"
            )
            with safe_open(str(out), framework="numpy") as f:
                metadata = f.metadata()
            if fmt == "safetensors":  # the union of the shards' metadata, as served
                with safe_open(str(sources[0]), framework="numpy") as f:
                    first = f.metadata()
                assert metadata["format"] == "pt" and metadata == {
                    **client.model(model_id).info.metadata
                }
                assert first.items() <= metadata.items()
            else:
                assert metadata == {"format": "pt"}
            with pytest.raises(DestinationError, match="exists; pass --force"):
                pull_to_safetensors(client.model(model_id), out)
        with pytest.raises(ConversionRefused, match="pull its original files instead"):
            pull_to_safetensors(client.model("tiny.gguf"), tmp_path / "g" / "model.safetensors")
        assert not (tmp_path / "g").exists()


# ----------------------------------------------------------------------- transformers
def test_transformers_loads_a_pulled_directory(
    server, model_root: ModelRoot, tmp_path: Path
) -> None:
    if "minilm" in model_root.skipped:
        pytest.skip(model_root.skipped["minilm"])
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with Client(_url(server, "http")) as client:
        out = client.model("minilm").download(tmp_path / "minilm")
    source = model_root.path / "minilm"
    _same_tree(out, source)
    sentences = ["weights over the wire", "a second sentence"]
    embeddings = []
    for directory in (source, out):
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        model = transformers.AutoModel.from_pretrained(directory, local_files_only=True)
        with torch.no_grad():
            batch = tokenizer(sentences, padding=True, return_tensors="pt")
            embeddings.append(model(**batch).last_hidden_state)
    assert torch.equal(embeddings[0], embeddings[1])


# ------------------------------------------------------------------ bounded-memory loading
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_iter_tensors_yields_every_tensor_in_order(
    server, reference, model_root: ModelRoot, transport: str
) -> None:
    with Client(_url(server, transport)) as client:
        for model_id in ("org/sharded", "tiny.gguf"):
            expected = reference(model_id)
            model = client.model(model_id)
            got = [(n, a.copy()) for n, a in model.iter_tensors(window_bytes=512)]
            assert [n for n, _ in got] == list(expected)
            for name, array in got:
                assert array.dtype == expected[name].array.dtype, name
                assert array.tobytes() == expected[name].array.tobytes(), name
        model = client.model("org/sharded")
        first = next(iter(model.iter_tensors()))  # leaving early closes the stream
        assert first[0] == next(iter(model.tensors))
        with pytest.raises(KeyError, match="Did you mean"):
            model.iter_tensors([next(iter(model.tensors)) + "x"])


_RSS_CHILD = r"""
import json, sys, xxhash
from weightserve.client import Client, RemoteWeights

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

url, model_id, window, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
weights = RemoteWeights(f"{url}/v1/models/{model_id}")
if how == "torch":
    import torch  # imported before measuring: its own memory is not the load's
digests = {}
try:
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS starts again from here
except OSError:
    pass
start = status("VmRSS")
items = weights.iter_torch(window_bytes=window) if how == "torch" else weights.iter_numpy(window_bytes=window)
for name, tensor in items:
    array = tensor.numpy() if how == "torch" else tensor
    digests[name] = xxhash.xxh3_64_hexdigest(array.tobytes())
    del array, tensor
print(json.dumps({"growth": status("VmHWM") - start, "digests": digests}))
"""


@pytest.mark.parametrize("how", ["numpy", "torch"])
def test_iter_loads_200_mib_with_memory_near_the_window(
    tmp_path_factory: pytest.TempPathFactory, child_env: dict[str, str], how: str
) -> None:
    if how == "torch":
        pytest.importorskip("torch")
    from weightserve.service.server import ServerConfig, WeightServer

    root = tmp_path_factory.mktemp("big-root")
    (root / "big").mkdir()
    rng = np.random.default_rng(3)
    arrays = {
        f"layers.{i:02}.w": rng.random(MIB, dtype=np.float32) for i in range(50)
    }  # 4 MiB each
    save_file(arrays, root / "big" / "model.safetensors", metadata={"format": "pt"})
    expected = {n: xxhash.xxh3_64_hexdigest(a.tobytes()) for n, a in arrays.items()}
    del arrays
    window = 32 * MIB
    srv = WeightServer(ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0)).start()
    try:
        result = subprocess.run(
            [sys.executable, "-c", _RSS_CHILD, _url(srv, "http"), "big", str(window), how],
            capture_output=True, text=True, env=child_env, timeout=120,
        )  # fmt: skip
    finally:
        srv.stop(grace=1.0)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["digests"] == expected
    # 200 MiB travelled; the peak grew by about the window (32 MiB) plus one tensor, not by
    # the model. Generous: allocator slack and the interpreter's own growth.
    assert report["growth"] < 3 * window, report["growth"] / MIB
