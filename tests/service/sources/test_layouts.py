"""Model layouts as the reference tools write them: the Hugging Face hub cache (built with
huggingface_hub's own cache functions), aliases, shard indexes that choose the files (Mistral),
variants (transformers' and diffusers' ``.fp16`` files, ``.bin`` beside safetensors) and split
GGUF (``gguf.GGUFWriter``). Bytes are compared with the reference readers."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.support import fixtures_gguf as gx
from tests.support import fixtures_safetensors as fx
from tests.support.fixtures_gguf import write_split_gguf
from tests.support.paths import REPO
from tests.support.references import reference_gguf, reference_safetensors
from weightserve.client._client import Client
from weightserve.client.errors import ModelNotFound, ModelUnavailable
from weightserve.service.readers.errors import DuplicateTensor, SplitMismatch
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.serving import views as models_view
from weightserve.service.sources.layout import RESERVED_CHARACTER
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.sources.local.discovery import OUTSIDE_ROOT
from weightserve.service.sources.model import Model

MAIN = "a1" * 20  # snapshot commits are 40 hex digits
OLD = "b2" * 20


@pytest.fixture(autouse=True)
def _offline_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads the cache only; nothing may reach the network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")


def tensors(seed: int, dtype: type = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((8, 4)).astype(dtype),
        "layers.0.weight": rng.standard_normal((4, 4)).astype(dtype),
        "layers.1.weight": rng.standard_normal((4, 4)).astype(dtype),
    }


def safetensors_bytes(arrays: dict[str, np.ndarray], tmp: Path) -> bytes:
    save_file(arrays, tmp, metadata={"format": "pt"})
    return tmp.read_bytes()


def write_hub_snapshot(
    cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()
) -> Path:
    """One snapshot of a repository in a hub cache, laid out by huggingface_hub's own cache
    code: blobs named by their ETag (sha256 for LFS files, the git blob sha1 otherwise),
    relative symlinks from ``snapshots/COMMIT/NAME``, refs written as on a download."""
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        repo_folder_name,
    )

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    for name, data in files.items():
        if name.endswith((".safetensors", ".bin", ".gguf")):  # stored in LFS on the Hub
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = storage / "snapshots" / commit / name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=True)
    for ref in refs:
        _cache_commit_hash_for_specific_revision(str(storage), ref, commit)
    return storage / "snapshots" / commit


def assert_serves(model: Model, reference_files: list[Path]) -> None:
    """Every tensor of the reference reader, byte for byte, and nothing else."""
    if reference_files[0].suffix == ".gguf":
        reference = {}
        for f in reference_files:
            reference.update(reference_gguf(f))
    else:
        reference = reference_safetensors(reference_files)
    assert list(model.tensors) == list(reference)
    for name, ref in reference.items():
        entry = model.tensor(name)
        assert (entry.dtype, entry.shape, entry.encoding) == (ref.dtype, ref.shape, ref.encoding)
        assert bytes(model.raw_view(entry)) == np.ascontiguousarray(ref.array).tobytes(), name


# ------------------------------------------------------------------------------ hub cache


@pytest.fixture
def hub_cache(tmp_path: Path) -> dict:
    cache = tmp_path / "hub"
    cache.mkdir()
    main, old = tensors(1), tensors(2)
    config = b'{"model_type": "bert"}'
    files_main = {
        "model.safetensors": safetensors_bytes(main, tmp_path / "main.st"),
        "config.json": config,
        "tokenizer.json": b'{"version": "1.0"}',
    }
    files_old = {
        "model.safetensors": safetensors_bytes(old, tmp_path / "old.st"),
        "config.json": config,  # the same blob, linked from both snapshots
    }
    write_hub_snapshot(cache, "acme/tiny", OLD, files_old, refs=("main", "v1"))
    write_hub_snapshot(cache, "acme/tiny", MAIN, files_main, refs=("main",))  # main moved on
    write_hub_snapshot(
        cache, "gpt2", MAIN, {"model.safetensors": files_main["model.safetensors"]}, ("main",)
    )
    # Other repository types hold no models.
    ds = cache / "datasets--acme--data" / "snapshots" / MAIN
    ds.mkdir(parents=True)
    save_file(main, ds / "model.safetensors")
    return {"cache": cache, "main": main, "old": old}


def test_hub_cache_is_served_by_repository_id(hub_cache: dict) -> None:
    cache: Path = hub_cache["cache"]
    from huggingface_hub import hf_hub_download, scan_cache_dir

    # The fixture is a hub cache as huggingface_hub itself reads it.
    repos = {r.repo_id: r for r in scan_cache_dir(cache).repos if r.repo_type == "model"}
    assert {r.commit_hash for r in repos["acme/tiny"].revisions} == {MAIN, OLD}
    main_file = Path(hf_hub_download("acme/tiny", "model.safetensors", cache_dir=cache))
    assert main_file.is_symlink() and MAIN in str(main_file)

    catalog = Catalog(cache)
    assert catalog.problems == {}
    assert sorted(catalog.models) == sorted(
        ["acme/tiny", f"acme/tiny@{MAIN}", f"acme/tiny@{OLD}", "acme/tiny@v1", "gpt2",
         f"gpt2@{MAIN}"]
    )  # fmt: skip
    tiny = catalog.get("acme/tiny")
    assert tiny.path == main_file.parent  # the snapshot refs/main names
    assert_serves(tiny, [main_file])
    assert_serves(catalog.get("acme/tiny@v1"), [Path(hf_hub_download(
        "acme/tiny", "model.safetensors", revision="v1", cache_dir=cache))])  # fmt: skip
    # Names are the repository's, not the blobs'; the content is read through the links.
    assert sorted(tiny.repo_files) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [f.name for f in tiny.files] == ["model.safetensors"]
    assert tiny.repo_files["config.json"].size == len(b'{"model_type": "bert"}')
    # A ref, a commit and the repository id naming one snapshot are one model: same
    # revision, one index, one mapping per file.
    pinned = catalog.get(f"acme/tiny@{MAIN}")
    assert pinned.revision == tiny.revision and pinned.commit == tiny.commit
    assert pinned.tensors is tiny.tensors
    assert pinned.mapped(tiny.files[0]) is tiny.mapped(tiny.files[0])
    assert catalog.get("acme/tiny@v1").revision != tiny.revision
    # main is a ref like the others: the plain id's model.
    assert catalog.get("acme/tiny@main") is tiny


def test_hub_cache_refs_and_roots(hub_cache: dict, tmp_path: Path) -> None:
    cache: Path = hub_cache["cache"]
    repo = cache / "models--acme--tiny"
    # The repository folder itself as the root.
    catalog = Catalog(repo)
    assert sorted(catalog.models) == ["acme/tiny", f"acme/tiny@{MAIN}", f"acme/tiny@{OLD}",
                                      "acme/tiny@v1"]  # fmt: skip
    assert_serves(catalog.get("acme/tiny"), [repo / "snapshots" / MAIN / "model.safetensors"])

    # A snapshot served directly: its links leave the root (into ../../blobs), so refused.
    snapshot = Catalog(repo / "snapshots" / MAIN)
    assert snapshot.models == {}
    assert snapshot.problems["model.safetensors"].reason == OUTSIDE_ROOT

    # refs/main naming a snapshot that is not there (an interrupted download).
    (repo / "refs" / "main").write_text("c3" * 20)
    catalog = Catalog(cache)
    assert "acme/tiny" not in catalog.models and f"acme/tiny@{MAIN}" in catalog.models
    problem = catalog.problems["acme/tiny"]
    assert problem.file == "models--acme--tiny/refs/main"
    assert "has no snapshot" in problem.reason
    with pytest.raises(ModelUnavailable, match="has no snapshot"):
        catalog.get("acme/tiny")

    # Without refs, a repository with one snapshot serves it under its id.
    shutil.rmtree(cache / "models--gpt2" / "refs")
    assert "gpt2" in Catalog(cache).models


def test_hub_cache_and_a_directory_with_the_same_id(hub_cache: dict) -> None:
    cache: Path = hub_cache["cache"]
    (cache / "acme" / "tiny").mkdir(parents=True)
    save_file(tensors(9), cache / "acme" / "tiny" / "model.safetensors")
    catalog = Catalog(cache)
    # The directory comes first in name order and keeps the id; the snapshot is reported.
    assert catalog.get("acme/tiny").path == (cache / "acme" / "tiny").resolve()
    problem = catalog.problems[f"models--acme--tiny/snapshots/{MAIN}"]
    assert "'acme/tiny' is taken by acme/tiny" in problem.reason


# ------------------------------------------------------------------------------ aliases


def test_symlinked_directories_inside_the_root_are_aliases(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    fx.write_sharded(root / "acme" / "v3")
    (root / "acme" / "v3" / "draft").mkdir()
    save_file(tensors(4), root / "acme" / "v3" / "draft" / "model.safetensors")
    (root / "acme" / "latest").symlink_to("v3", target_is_directory=True)
    (root / "stable").symlink_to(Path("acme") / "latest", target_is_directory=True)  # chained
    fx.write_sharded(outside / "m")
    (root / "acme" / "escape").symlink_to(outside / "m", target_is_directory=True)
    (root / "acme" / "v3" / "loop").symlink_to("..", target_is_directory=True)

    catalog = Catalog(root)
    assert sorted(catalog.models) == [
        "acme/latest", "acme/latest/draft", "acme/v3", "acme/v3/draft", "stable", "stable/draft",
    ]  # fmt: skip
    assert catalog.problems["acme/escape"].reason == OUTSIDE_ROOT
    assert catalog.problems["acme/v3/loop"].reason.startswith("symlink loop")
    v3 = catalog.get("acme/v3")
    shards = sorted((root / "acme" / "v3").glob("*.safetensors"))
    for alias_id in ("acme/latest", "stable"):
        alias = catalog.get(alias_id)
        assert_serves(alias, shards)
        assert alias.revision == v3.revision and alias.repo_files.keys() == v3.repo_files.keys()
        assert alias.mapped(shards[0].resolve()) is v3.mapped(shards[0].resolve())
    assert_serves(
        catalog.get("stable/draft"), [root / "acme" / "v3" / "draft" / "model.safetensors"]
    )


# ------------------------------------------------------------------------------ shard indexes


def test_the_index_chooses_the_files_mistral_style(tmp_path: Path) -> None:
    model = tmp_path / "mistralai" / "tiny"
    fx.write_sharded(model)  # model-0000k-of-00003.safetensors + model.safetensors.index.json
    merged = {k: v for shard in fx.sharded_arrays() for k, v in shard.items()}
    save_file(merged, model / "consolidated.safetensors")  # the same tensors once more
    (model / "params.json").write_text('{"dim": 64}')
    catalog = Catalog(tmp_path)
    assert catalog.problems == {}
    served = catalog.get("mistralai/tiny")
    assert sorted(f.name for f in served.files) == sorted([*fx.SHARD_NAMES, fx.INDEX_NAME])
    assert_serves(served, [model / n for n in fx.SHARD_NAMES])
    # The leftover is no weight, but a file of the repository (a mirror serves it).
    assert {"consolidated.safetensors", "params.json"} <= served.repo_files.keys()

    # Without the index both sets are read, and the repeated names refuse the model.
    (model / fx.INDEX_NAME).unlink()
    catalog = Catalog(tmp_path)
    assert DuplicateTensor.rule in catalog.problems["mistralai/tiny"].reason

    # An index naming a shard that is not there refuses the model, naming the shard.
    fx.write_index(model, {"embed.weight": "model-00009-of-00009.safetensors"})
    problem = Catalog(tmp_path).problems["mistralai/tiny"]
    assert problem.file == f"mistralai/tiny/{fx.INDEX_NAME}"
    assert "model-00009-of-00009.safetensors, not in the directory" in problem.reason


@pytest.mark.torch
def test_the_pytorch_index_chooses_the_files(tmp_path: Path) -> None:
    tx = pytest.importorskip("tests.support.fixtures_torch")
    state = tx.dtype_tensors()
    weight_map = tx.write_sharded(tmp_path / "org" / "pt", state, 2)
    (tmp_path / "org" / "pt" / "consolidated.bin").write_bytes(b"not a checkpoint")
    (tmp_path / "org" / "pt" / "training_args.bin").write_bytes(b"a Trainer pickle")
    catalog = Catalog(tmp_path)
    assert catalog.problems == {} and sorted(catalog.models) == ["org/pt"]
    model = catalog.get("org/pt")
    assert sorted(f.name for f in model.files) == sorted(
        [*set(weight_map.values()), "pytorch_model.bin.index.json"]
    )
    assert set(model.tensors) == set(state)


# ------------------------------------------------------------------------------ variants


@pytest.mark.torch
def test_transformers_variants(tmp_path: Path) -> None:
    """save_pretrained(variant="fp16") beside the plain save, as transformers writes them."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    directory = tmp_path / "acme" / "bert"
    bert = transformers.BertModel(config)
    bert.save_pretrained(directory)
    bert.half().save_pretrained(directory, variant="fp16", max_shard_size="10KB")
    fp16_shards = sorted(directory.glob("model.fp16-*.safetensors"))
    assert len(fp16_shards) > 1 and (directory / "model.safetensors.index.fp16.json").is_file()

    catalog = Catalog(tmp_path)
    assert catalog.problems == {} and sorted(catalog.models) == ["acme/bert"]
    plain = catalog.get("acme/bert")  # the default: the plain safetensors set
    assert [f.name for f in plain.files] == ["model.safetensors"]
    assert_serves(plain, [directory / "model.safetensors"])
    assert {e.dtype for e in plain.tensors.values()} == {"float32"}
    assert catalog.variants.keys() == {"acme/bert:fp16"}
    assert models_view.model_list(catalog)["variants"] == ["acme/bert:fp16"]  # listed
    fp16 = catalog.get("acme/bert:fp16")  # indexed on its first request
    assert_serves(fp16, fp16_shards)
    assert {e.dtype for e in fp16.tensors.values()} == {"float16"}
    assert sorted(f.name for f in fp16.files) == sorted(
        [*(f.name for f in fp16_shards), "model.safetensors.index.fp16.json"]
    )
    # Both name the same repository, so the same revision; the variant stays served.
    assert fp16.revision == plain.revision and fp16.repo_files.keys() == plain.repo_files.keys()
    catalog.scan()
    assert catalog.models["acme/bert:fp16"] is fp16
    with pytest.raises(ModelNotFound):
        catalog.get("acme/bert:bf16")


def test_diffusers_variants_and_pytorch_beside_safetensors(tmp_path: Path) -> None:
    """A diffusers unet (``diffusion_pytorch_model[.fp16].safetensors``) and a PyTorch file
    beside safetensors: the plain safetensors set is the default, the others are variants."""
    unet = tmp_path / "acme" / "sd" / "unet"
    unet.mkdir(parents=True)
    plain, half = tensors(5), tensors(5, np.float16)
    save_file(plain, unet / "diffusion_pytorch_model.safetensors")
    save_file(half, unet / "diffusion_pytorch_model.fp16.safetensors")
    (unet / "diffusion_pytorch_model.bin").write_bytes(b"garbage: read only when asked for")
    (unet / "config.json").write_text('{"_class_name": "UNet2DConditionModel"}')
    (tmp_path / "acme" / "sd" / "model_index.json").write_text("{}")

    catalog = Catalog(tmp_path)
    assert catalog.problems == {} and sorted(catalog.models) == ["acme/sd/unet"]
    assert sorted(catalog.variants) == ["acme/sd/unet:fp16", "acme/sd/unet:pytorch"]
    assert_serves(catalog.get("acme/sd/unet"), [unet / "diffusion_pytorch_model.safetensors"])
    fp16 = catalog.get("acme/sd/unet:fp16")
    assert_serves(fp16, [unet / "diffusion_pytorch_model.fp16.safetensors"])
    assert {k: bytes(fp16.raw_view(fp16.tensor(k))) for k in half} == {
        k: v.tobytes()
        for k, v in load_file(unet / "diffusion_pytorch_model.fp16.safetensors").items()
    }
    # The broken .bin refuses its own variant only, on request.
    with pytest.raises(ModelUnavailable, match="diffusion_pytorch_model.bin"):
        catalog.get("acme/sd/unet:pytorch")
    assert list(catalog.problems) == ["acme/sd/unet:pytorch"]
    assert "acme/sd/unet" in catalog.models


def test_only_variant_files_are_served_under_the_plain_id(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    save_file(tensors(6, np.float16), tmp_path / "m" / "model.fp16.safetensors")
    catalog = Catalog(tmp_path)
    assert sorted(catalog.models) == ["m"] and catalog.variants == {}


def test_names_holding_id_separators_are_refused(tmp_path: Path) -> None:
    fx.write_sharded(tmp_path / "org" / "m@v2")
    gx.write_mixed(tmp_path / "q:4.gguf")
    fx.write_sharded(tmp_path / "org" / "line\nbreak")  # no route carries it: refused too
    catalog = Catalog(tmp_path)
    assert catalog.models == {}
    assert {k: p.reason for k, p in catalog.problems.items()} == {
        "org/m@v2": RESERVED_CHARACTER,
        "q:4.gguf": RESERVED_CHARACTER,
        "org/line\nbreak": RESERVED_CHARACTER,
    }


# ------------------------------------------------------------------------------ split GGUF


def test_split_gguf_is_one_model(tmp_path: Path) -> None:
    parts = write_split_gguf(tmp_path / "org" / "llama.gguf")
    assert [p.name for p in parts] == [f"llama-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    catalog = Catalog(tmp_path)
    assert catalog.problems == {} and sorted(catalog.models) == ["org/llama.gguf"]
    model = catalog.get("org/llama.gguf")
    assert model.files == [p.resolve() for p in parts]
    assert_serves(model, parts)  # every tensor of every part, in part order
    assert list(model.tensors) == [f"blk.{i}.weight" for i in range(5)]
    assert model.metadata["general.name"] == "split fixture"
    assert model.metadata["split.count"] == 3 and model.metadata["split.tensors.count"] == 5
    assert sorted(model.repo_files) == [p.name for p in parts]


def test_split_gguf_with_a_missing_or_misplaced_part_is_refused(tmp_path: Path) -> None:
    parts = write_split_gguf(tmp_path / "llama.gguf")
    parts[1].unlink()
    problem = Catalog(tmp_path).problems["llama.gguf"]
    assert problem.reason == (
        "split GGUF llama.gguf has 2 of its 3 parts; missing llama-00002-of-00003.gguf "
        "(a split model is served only whole)"
    )
    # Parts renamed out of order: their split.no keys say so.
    parts = write_split_gguf(tmp_path / "other.gguf")
    os.rename(parts[1], tmp_path / "swap")
    os.rename(parts[2], parts[1])
    os.rename(tmp_path / "swap", parts[2])
    problem = Catalog(tmp_path).problems["other.gguf"]
    assert problem.file == "other-00002-of-00003.gguf" and SplitMismatch.rule in problem.reason
    assert "split.no is 2" in problem.reason


# ------------------------------------------------------------------------------ over the wire


def test_layout_ids_over_http_and_grpc(hub_cache: dict) -> None:
    """Ids with '@' and ':' reach their models through the HTTP and the gRPC URLs."""
    cache: Path = hub_cache["cache"]
    unet = cache / "acme" / "unet"
    unet.mkdir(parents=True)
    save_file(tensors(8, np.float16), unet / "diffusion_pytorch_model.fp16.safetensors")
    save_file(tensors(8), unet / "diffusion_pytorch_model.safetensors")
    config = ServerConfig(str(cache), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0)
    with WeightServer(config) as srv:
        for url in (srv.http_url, srv.grpc_url):
            with Client(url, timeout=10) as client:
                old = client.model("acme/tiny@v1").fetch(prefix="")
                assert {k: v.tobytes() for k, v in old.items()} == {
                    k: v.tobytes() for k, v in hub_cache["old"].items()
                }
                half = client.model("acme/unet:fp16").fetch(prefix="")
                assert {str(v.dtype) for v in half.values()} == {"float16"}


def test_layout_rules_are_documented() -> None:
    """The README states the rules the catalog applies (one place, kept true)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Model layouts", 1)[1].split("\n## ", 1)[0]
    for rule in ("models--ORG--NAME", "refs/main", "@REV", ":fp16", ":pytorch",
                 "-00001-of-00003.gguf", "consolidated.safetensors"):  # fmt: skip
        assert rule in section, rule
