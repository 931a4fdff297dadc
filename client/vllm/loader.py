"""vLLM's ``--load-format weightserve``: the model's tensors streamed from the server straight
into the engine's parameters (``model.load_weights`` as they arrive, host memory bounded by
the stream's window), no weight byte on the worker's disk.

Every rank of an engine loads the one revision its first rank resolved; a tensor-parallel
rank fetches only its slice of the layers vLLM slices evenly (client/vllm/shards.py). The
side files vLLM read (config, tokenizer) are checked against the server's digests for that
revision. With the weightserve weight-transfer backend configured, the tensors are kept in
host memory as loaded, the base that later updates are applied to (client/vllm/transfer.py).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

import numpy as np

from weightserve.client._client import RemoteModel
from weightserve.client._models import TensorInfo
from weightserve.client.vllm.shards import RankSlice, plan_rank_slices, sliced_loading
from weightserve.client.vllm.source import ServedSource, agreed, check_side_files

__all__ = ["LOAD_FORMAT", "LoadedRevision", "loaded_revision", "stream_into"]

LOAD_FORMAT = "weightserve"
TRANSFER_BACKEND = "weightserve"

# Under vLLM's logger: its handler and format, at the level vLLM is set to.
log = logging.getLogger("vllm.weightserve")


@dataclass
class LoadedRevision:
    """What an engine's model holds: the revision, where it came from, and (when updates are
    configured) its checkpoint tensors as this rank loaded them."""

    source: ServedSource
    commit: str
    tensors: dict[str, TensorInfo]  # the revision's tensors, whole
    slices: dict[str, RankSlice]  # the ones this rank holds a slice of
    kept: dict[str, Any] | None = field(default=None, repr=False)  # name -> torch tensor


_loaded: WeakKeyDictionary[Any, LoadedRevision] = WeakKeyDictionary()


def loaded_revision(model: Any) -> LoadedRevision | None:
    """What the weightserve load format (or the last update) put in ``model``."""
    return _loaded.get(model)


def record(model: Any, revision: LoadedRevision) -> None:
    _loaded[model] = revision


def forget(model: Any) -> None:
    _loaded.pop(model, None)


def _base_loader() -> type:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    return BaseModelLoader


def make_loader_class() -> type:
    """The loader class, made on first use: vLLM is imported only where it runs."""

    class WeightserveModelLoader(_base_loader()):  # type: ignore[misc]
        """Loads a model's weights from a weightserve server (``--load-format
        weightserve``); see ``ServedSource.from_config`` for how the server is named."""

        def download_model(self, model_config: Any) -> None:
            # Nothing to download: only check that the server has the model, and that the
            # side files vLLM read are its.
            source = ServedSource.from_config(self._extra(), model_config)
            with source.client() as client:
                check_side_files(source.open(client), model_config)

        def load_weights(self, model: Any, model_config: Any) -> None:
            source = ServedSource.from_config(self._extra(), model_config)
            with source.client() as client:
                commit = agreed(lambda: source.commit(client))
                remote = source.open(client, commit)
                checked = check_side_files(remote, model_config)
                log.info("weightserve: side files match the server's: %s", ", ".join(checked))
                loaded = stream_into(model, remote, keep=_updates_configured())
            if model_config.quantization is None and loaded.names is not None:
                _check_complete(model, loaded.names, remote)
            record(
                model,
                LoadedRevision(source, commit, dict(remote.tensors), loaded.slices, loaded.kept),
            )

        def _extra(self) -> dict[str, Any]:
            extra = self.load_config.model_loader_extra_config
            return dict(extra) if isinstance(extra, dict) else {}

    WeightserveModelLoader.__qualname__ = WeightserveModelLoader.__name__
    return WeightserveModelLoader


def _updates_configured() -> bool:
    """Whether the engine takes updates through the weightserve backend (then the loaded
    tensors are kept as their base)."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    transfer = getattr(config, "weight_transfer_config", None)
    return transfer is not None and transfer.backend == TRANSFER_BACKEND


@dataclass
class StreamedLoad:
    names: set[str] | None  # what model.load_weights reported it loaded (None: it does not say)
    slices: dict[str, RankSlice]
    kept: dict[str, Any] | None
    bytes: int = 0


def stream_into(model: Any, remote: RemoteModel, *, keep: bool) -> StreamedLoad:
    """Every tensor of ``remote`` into ``model`` through its ``load_weights``, as they
    arrive; this rank's slice where vLLM slices evenly. ``keep``: the tensors are kept (host
    memory) and returned."""
    shapes = {name: info.shape for name, info in remote.tensors.items()}
    slices, params = plan_rank_slices(model, shapes)
    out = StreamedLoad(None, slices, {} if keep else None)
    started = time.perf_counter()

    def arriving() -> Iterator[tuple[str, Any]]:
        for rank_slice, names in _by_slice(list(remote.tensors), slices).items():
            shard = None if rank_slice is None else (rank_slice.part, rank_slice.parts)
            axis = 0 if rank_slice is None else rank_slice.axis
            for name, array in remote.iter_tensors(names, shard=shard, axis=axis):
                tensor = as_torch(array, remote.tensors[name])
                out.bytes += array.nbytes
                if out.kept is not None:
                    out.kept[name] = tensor
                yield name, tensor

    with sliced_loading(params):
        loaded = model.load_weights(arriving())
    out.names = set(loaded) if loaded is not None else None
    seconds = time.perf_counter() - started
    log.info(
        "weightserve: loaded %d tensors (%.2f GiB) of %s@%s from %s in %.2f s, %d of them sliced "
        "for this rank",
        len(remote.tensors),
        out.bytes / 2**30,
        remote.id.split("@")[0],
        remote.commit[:12],
        remote.client.address.url,
        seconds,
        len(slices),
    )
    return out


def _by_slice(names: list[str], slices: dict[str, RankSlice]) -> dict[RankSlice | None, list[str]]:
    """The names grouped by the slice each is fetched as (one stream per group), whole first."""
    groups: dict[RankSlice | None, list[str]] = {None: []}
    for name in names:
        groups.setdefault(slices.get(name), []).append(name)
    return {k: v for k, v in groups.items() if v}


def as_torch(array: np.ndarray, info: TensorInfo) -> Any:
    """A received array as the torch tensor vLLM's loaders take (same memory)."""
    import torch

    dtype = getattr(torch, info.dtype, None)
    if info.encoding is not None or not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"{info.name} is {info.encoding or info.dtype}, which torch has no dtype for: "
            "vLLM's weightserve load format takes safetensors or PyTorch checkpoints (vLLM "
            "reads GGUF with its own loader)"
        )
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():  # a same-node load's pages: only ever copied from
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        tensor = torch.from_numpy(flat)
    return tensor.view(dtype).reshape(array.shape)


def _check_complete(model: Any, loaded: set[str], remote: RemoteModel) -> None:
    """Refuse a model the served checkpoint does not fill (vLLM's own loaders do the same
    for an unquantized model)."""
    missing = sorted({name for name, _ in model.named_parameters()} - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(
            f"{remote.id}@{remote.commit[:12]} does not have every weight "
            f"{type(model).__name__} needs: {shown} were not loaded"
        )
