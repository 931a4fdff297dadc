"""MAX pipelines over a served model: a local directory holding the model's side files
(config, tokenizer) and none of its weights, and the hook through which MAX's pipelines list,
size and load the weights from the server instead of from that directory.

    with served_model_dir("http://host:8080/v1/models/smollm2") as model_path:
        args = PipelineArgs.from_flat_kwargs(model_path=str(model_path), ...)
        tokenizer, pipeline = PIPELINE_REGISTRY.retrieve(PipelineConfig.from_args(args))

MAX 26.7 finds, checks, sizes and loads weights by looking at the model directory; every
place it does so for a directory made here is answered from the server (``install_hook``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from weightserve.client._client import Client
from weightserve.client._download import FilePull
from weightserve.client.max.load import CHECKPOINT_SUFFIXES
from weightserve.client.max.load import load_weights as load_served
from weightserve.client.wire.dtypes import wire_dtype
from weightserve.client.wire.routes import parse_url, split_revision

__all__ = ["MODELS_ENV", "ServedModel", "install_hook", "served_model_dir"]

# {model directory: model URL pinned to its revision}: a MAX model worker is a spawned
# process, which installs the same hook from this variable (see client/max/command.py).
MODELS_ENV = "WEIGHTSERVE_MAX_MODELS"
# What MAX's pipelines read beside the weights: the architecture and a tokenizer (any of
# the forms transformers' AutoTokenizer loads).
CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class IncompleteModel(ValueError):
    """A served model lacks a side file MAX needs to run it (its config or tokenizer)."""


_WEIGHT_SUFFIXES = {"safetensors": ".safetensors", "gguf": ".gguf"}


@dataclass(frozen=True)
class ServedModel:
    """A model on a server as MAX sees it through a local directory of its side files."""

    url: str
    revision: str | None  # the commit the side files are of (None: the URL pins one)
    directory: Path
    format: str
    weight_files: dict[str, int]  # name relative to the model -> size in bytes
    dtypes: tuple[str, ...]  # the tensors' safetensors dtype codes, for MAX's encoding guess

    @classmethod
    def describe(cls, url: str, revision: str | None, directory: Path) -> ServedModel:
        """Ask the server what MAX needs to know of the model's weights."""
        _, model_id = parse_url(url)
        with Client(url) as client:
            model = client.model(model_id or "", revision=revision)
            files = model.files()
        info = model.info
        suffix = _WEIGHT_SUFFIXES.get(info.format)
        if suffix is None:
            raise ValueError(
                f"model {info.id!r} is a {info.format} checkpoint; MAX pipelines load"
                " safetensors and GGUF"
            )
        codes = {wire_dtype(t.dtype).safetensors for t in info.tensors.values()}
        return cls(
            url=url,
            revision=revision,
            directory=directory,
            format=info.format,
            weight_files={f.name: f.size for f in files if f.name.endswith(suffix)},
            dtypes=tuple(sorted(c for c in codes if c)),
        )

    def to_environment(self) -> dict[str, tuple[str, str | None]]:
        return {str(self.directory): (self.url, self.revision)}


_lock = threading.Lock()
_served: dict[Path, ServedModel] = {}
# Directories known only by URL and revision (a spawned worker's), described on first use.
_described: dict[Path, tuple[str, str | None]] = {}


def _model_of(directory: str | os.PathLike[str] | None) -> ServedModel | None:
    """The served model a MAX repository directory stands for, if any."""
    if directory is None:
        return None
    try:
        key = Path(directory).resolve()
    except (OSError, RuntimeError):
        return None
    with _lock:
        model = _served.get(key)
        if model is None and key in _described:
            url, revision = _described.pop(key)
            model = _served[key] = ServedModel.describe(url, revision, key)
        return model


def _models_from_environment() -> None:
    """Directories a parent process made (``MODELS_ENV``), described on first use."""
    text = os.environ.get(MODELS_ENV)
    if text:
        for directory, (url, revision) in json.loads(text).items():
            key = Path(directory).resolve()
            with _lock:
                if key not in _served:
                    _described[key] = (url, revision)


def _is_side_file(name: str) -> bool:
    return not name.endswith(CHECKPOINT_SUFFIXES)


@contextlib.contextmanager
def served_model_dir(url: str, directory: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """A local directory for MAX's ``model_path`` that stands for the model at ``url``.

    The model's side files (config, tokenizer, generation config...) are fetched into it,
    verified; its weights are not, and MAX pipelines built inside the block list, size and
    load them from the server. ``directory``: where to put the files (default: a temporary
    directory, removed on exit). The model is pinned to the revision the files are of.
    """
    install_hook()
    made = directory is None
    path = Path(tempfile.mkdtemp(prefix="weightserve-max-") if made else directory)  # type: ignore[arg-type]
    try:
        model = prepare_model_dir(url, path)
        with _lock:
            _served[model.directory] = model
        try:
            yield model.directory
        finally:
            with _lock:
                _served.pop(model.directory, None)
    finally:
        if made:
            shutil.rmtree(path, ignore_errors=True)


def prepare_model_dir(url: str, directory: Path) -> ServedModel:
    """Fetch the side files of the model at ``url`` into ``directory`` (verified, as ``pull``
    does); describe its weights. The model is pinned to the revision the files are of."""
    _, model_id = parse_url(url)
    if not model_id:
        raise ValueError(
            f"{url!r} names a server, not a model: use http://HOST:PORT/v1/models/MODEL or"
            " grpc://HOST:PORT/MODEL"
        )
    with Client(url) as client:
        pull = FilePull(client.model(model_id), directory, force=True).plan()  # ours to replace
        pull.files = [p for p in pull.files or () if _is_side_file(p.file.name)]
        _check_runnable(model_id, [p.file.name for p in pull.files])
        pull.run()
    pinned = None if split_revision(model_id)[1] else pull.revision
    return ServedModel.describe(url, pinned, directory.resolve())


def _check_runnable(model_id: str, side_files: list[str]) -> None:
    """Refuse, before MAX starts, a model it could only fail on later with a long traceback."""
    missing = []
    if CONFIG_FILE not in side_files:
        missing.append(f"{CONFIG_FILE} (the architecture)")
    if not any(name in side_files for name in TOKENIZER_FILES):
        missing.append(f"tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if missing:
        served = ", ".join(sorted(side_files)) or "none"
        raise IncompleteModel(
            f"{model_id} cannot run in MAX: the server has no {' and no '.join(missing)} for it "
            f"(side files served: {served}). Put them beside the weights in the model's "
            "directory, as a Hugging Face repository holds them."
        )


# -- the hook ------------------------------------------------------------------------------

_installed = False


def install_hook() -> None:
    """Make MAX's pipelines answer from the server for the directories made here.

    MAX's pipeline modules import ``load_weights`` by name (``from max.graph.weights import
    load_weights``), so it is replaced in ``max.graph.weights`` and in every module that has
    already taken it; MAX sizes memory (``MAXModelConfig.weights_size``), finds weight files
    (``HuggingFaceRepo.weight_files``), guesses a safetensors checkpoint's encoding from its
    headers and checks each weight file exists, all on the local directory: each of these is
    answered from the server for a served directory and left to MAX for any other.
    """
    global _installed
    _models_from_environment()
    if _installed:
        return
    import sys

    import max.graph.weights as max_weights
    from max.pipelines.lib.config.model_config import MAXModelConfig
    from max.pipelines.weights.hf_utils import HuggingFaceRepo

    original_load = max_weights.load_weights

    def load_weights(paths: Any, *args: Any, **kwargs: Any) -> Any:
        held = [_model_holding(Path(p)) for p in paths] if paths else [None]
        model = held[0] if all(m is held[0] for m in held) else None
        if model is None:
            return original_load(paths, *args, **kwargs)
        return load_served([model.url], revision=model.revision)

    # The pipeline modules hold their own reference: each one that took MAX's is repointed.
    max_weights.load_weights = load_weights
    for name, module in list(sys.modules.items()):
        # Only MAX's own modules, read without getattr (lazy modules import on getattr).
        if name.startswith("max.") and vars(module).get("load_weights") is original_load:
            module.load_weights = load_weights  # type: ignore[attr-defined]

    weight_files = HuggingFaceRepo.weight_files.func  # type: ignore[attr-defined]

    def served_weight_files(repo: Any) -> Any:
        model = _model_of(repo.local_path) if repo.repo_type == "local" else None
        if model is None:
            return weight_files(repo)
        from max.graph.weights import WeightsFormat

        return {WeightsFormat(model.format): sorted(model.weight_files)}

    files_property = cached_property(served_weight_files)
    files_property.__set_name__(HuggingFaceRepo, "weight_files")
    HuggingFaceRepo.weight_files = files_property  # type: ignore[method-assign,assignment]

    detect = HuggingFaceRepo._detect_safetensors_encodings_from_files

    def detect_encodings(repo: Any) -> Any:
        model = _model_of(repo.local_path) if repo.repo_type == "local" else None
        if model is None:
            return detect(repo)
        # MAX's own reading of a header, given one that names each dtype the model holds.
        header = json.dumps({f"t{i}": {"dtype": c} for i, c in enumerate(model.dtypes)})
        raw = struct.pack("<Q", len(header)) + header.encode()
        return repo._get_safetensors_encoding(io.BytesIO(raw))[0]

    HuggingFaceRepo._detect_safetensors_encodings_from_files = detect_encodings  # type: ignore[method-assign]

    file_exists = HuggingFaceRepo.file_exists

    def served_file_exists(repo: Any, filename: str) -> bool:
        model = _model_of(repo.local_path) if repo.repo_type == "local" else None
        if model is not None and filename in model.weight_files:
            return True
        return bool(file_exists(repo, filename))

    HuggingFaceRepo.file_exists = served_file_exists  # type: ignore[method-assign]

    local_weight_path = MAXModelConfig._local_weight_path

    def served_local_weight_path(config: Any, relative_path: Path) -> str | None:
        model = _served_model_of_config(config)
        if model is not None:
            name = _weight_name(model, Path(relative_path))
            if name is not None:
                return str(model.directory / name)  # held by the server, not on this disk
        return local_weight_path(config, relative_path)  # type: ignore[no-any-return]

    MAXModelConfig._local_weight_path = served_local_weight_path  # type: ignore[method-assign]

    weights_size = MAXModelConfig.weights_size

    def served_weights_size(config: Any) -> int:
        model = _served_model_of_config(config)
        if model is None:
            return weights_size(config)  # type: ignore[no-any-return]
        # The sizes of the server's files: what MAX would stat for the same local model.
        return sum(model.weight_files[str(p)] for p in config.weight_path)

    MAXModelConfig.weights_size = served_weights_size  # type: ignore[method-assign]
    _installed = True


def _model_holding(path: Path) -> ServedModel | None:
    """The served model whose directory ``path`` (a weight file MAX resolved) lies in."""
    for directory in [path.parent, *path.parent.parents]:
        model = _model_of(directory)
        if model is not None:
            return model
    return None


def _served_model_of_config(config: Any) -> ServedModel | None:
    repo = config.huggingface_weight_repo
    return _model_of(repo.local_path) if repo.repo_type == "local" else None


def _weight_name(model: ServedModel, path: Path) -> str | None:
    """The model's weight file ``path`` names (relative, or under the model's directory)."""
    if path.is_absolute():
        try:
            path = path.relative_to(model.directory)
        except ValueError:
            return None
    name = path.as_posix()
    return name if name in model.weight_files else None
