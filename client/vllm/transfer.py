"""The ``weightserve`` weight-transfer backend: a running vLLM engine brought to a published
revision in place.

An update names the target (``{"revision": COMMIT}``; a ref such as ``main`` is resolved by
the first rank for all). Each rank takes the delta from the revision it holds (per tensor:
nothing, an element patch, or the whole tensor, whichever the server found cheapest) and
applies it to the checkpoint tensors the loader kept, checking each whole tensor against the
target's digest (a wrong result is fetched whole). Only when every tensor is staged does the
engine's model change, through vLLM's layerwise reload (which re-runs each layer's
post-load processing: CPU weight packing, quantization); if that fails midway, the tensors
of the revision held before are reloaded the same way, so the engine serves one revision or
the other, never a mix. Updates that change a tensor's dtype or shape, or the set of
tensors, are refused: the engine must be restarted on such a revision.

A tensor-parallel rank keeps and patches only its slice of the tensors it loaded sliced; the
server's digests are of whole tensors, so those slices are applied as the delta says,
unchecked.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import xxhash

from weightserve.client._client import RemoteModel
from weightserve.client._models import TensorInfo
from weightserve.client.vllm.loader import (
    LoadedRevision,
    as_torch,
    forget,
    loaded_revision,
    record,
)
from weightserve.client.vllm.shards import RankSlice, placed_in_whole, sliced_positions
from weightserve.client.vllm.source import agreed
from weightserve.client.wire.delta import PATCH, SAME, WHOLE, TensorUpdate
from weightserve.client.wire.dtypes import numpy_dtype

log = logging.getLogger("vllm.weightserve")


class UpdateRefused(RuntimeError):
    """The target revision cannot be applied to the running engine in place."""


def _engine_bases() -> tuple[type, type, type]:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    return WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo


_Engine, _InitInfo, _UpdateInfo = _engine_bases()


@dataclass
class WeightserveInitInfo(_InitInfo):  # type: ignore[misc,valid-type]
    """Optional: another server, model or token than the engine loaded from (a mirror)."""

    url: str | None = None
    model: str | None = None
    token: str | None = None


@dataclass
class WeightserveUpdateInfo(_UpdateInfo):  # type: ignore[misc,valid-type]
    """The revision to serve: a commit (what ``watch`` announces), a revision or a ref."""

    revision: str = "main"


class WeightserveTransferEngine(_Engine):  # type: ignore[misc,valid-type]
    """``weight_transfer_config={"backend": "weightserve"}``: updates from the server's
    revisions; see the module's docstring."""

    init_info_cls = WeightserveInitInfo
    update_info_cls = WeightserveUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.overrides: dict[str, Any] = {}
        self.last_update: dict[str, int] = {}

    def init_transfer_engine(self, init_info: WeightserveInitInfo) -> None:
        self.overrides = asdict(init_info)

    def start_weight_update(self) -> None:
        """Nothing to prepare: an update is staged and applied whole in ``receive_weights``."""

    def finish_weight_update(self) -> None:
        """Nothing to finish (see ``start_weight_update``)."""

    def shutdown(self) -> None:
        """No connection is kept between updates."""

    def receive_weights(self, update_info: WeightserveUpdateInfo) -> None:
        held = loaded_revision(self.model)
        if held is None or held.kept is None:
            raise UpdateRefused(
                "the weightserve backend updates a model loaded with --load-format "
                "weightserve while the backend was configured (weight_transfer_config="
                '{"backend": "weightserve"}); this engine loaded its weights otherwise'
            )
        source = held.source.with_overrides(self.overrides)
        started = time.perf_counter()
        with source.client() as client:
            commit = agreed(lambda: source.commit(client, update_info.revision))
            if commit == held.commit:
                self.last_update = {SAME: len(held.tensors), "wire_bytes": 0}
                return
            remote = source.open(client, commit)
            _check_same_layout(held, remote)
            staged, counts = _stage(held, remote)
        tensors = {**held.kept, **staged}
        try:
            _reload(self.model, self.model_config, remote.tensors, held.slices, tensors)
        except BaseException:
            self._restore(held)
            raise
        record(
            self.model,
            LoadedRevision(held.source, commit, dict(remote.tensors), held.slices, tensors),
        )
        self.last_update = counts
        log.info(
            "weightserve: updated to %s@%s in %.2f s: %s",
            remote.id.split("@")[0],
            commit[:12],
            time.perf_counter() - started,
            ", ".join(f"{k} {v}" for k, v in counts.items()),
        )

    def _restore(self, held: LoadedRevision) -> None:
        """Back to the revision held before a reload that failed midway."""
        assert held.kept is not None
        try:
            _reload(self.model, self.model_config, held.tensors, held.slices, held.kept)
        except BaseException as e:
            forget(self.model)  # neither revision: no update may take this as its base
            raise RuntimeError(
                "an update failed while the engine's weights were being replaced, and so did "
                "restoring the revision it held: its weights are now mixed; restart it"
            ) from e


def _check_same_layout(held: LoadedRevision, remote: RemoteModel) -> None:
    target = remote.tensors
    problems = [f"{name} is new" for name in target if name not in held.tensors]
    problems += [f"{name} was removed" for name in held.tensors if name not in target]
    for name, info in target.items():
        old = held.tensors.get(name)
        if old is not None and (old.dtype, old.shape) != (info.dtype, info.shape):
            problems.append(
                f"{name} changed from {old.dtype} {list(old.shape)} to {info.dtype} {list(info.shape)}"
            )
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        raise UpdateRefused(
            f"{remote.id} cannot be applied to the running engine in place ({shown}): "
            "restart the engine on it"
        )


def _stage(held: LoadedRevision, remote: RemoteModel) -> tuple[dict[str, Any], dict[str, int]]:
    """The target's tensors that differ from the held ones, in this rank's form, each whole
    one checked against its digest; the counts by outcome and the bytes that travelled."""
    assert held.kept is not None
    counts = {SAME: 0, PATCH: 0, WHOLE: 0, "refetched": 0, "wire_bytes": 0}
    staged: dict[str, Any] = {}
    wrong: list[str] = []
    for update in remote.iter_updates(since=held.commit, revision=remote.commit):
        counts[update.kind] += 1
        counts["wire_bytes"] += update.wire_bytes
        if update.kind == SAME:
            continue
        info = remote.tensors[update.name]
        rank_slice = held.slices.get(update.name)
        if update.kind == WHOLE:
            assert update.data is not None
            if _digest(update.data) != update.header.digest:
                wrong.append(update.name)
                continue
            whole = np.frombuffer(update.data, dtype=numpy_dtype(info.dtype)).reshape(info.shape)
            staged[update.name] = _rank_form(whole, info, rank_slice)
            continue
        patched = _patched(held.kept[update.name], update, info, rank_slice)
        if rank_slice is None and _digest(_bytes_of(patched)) != update.header.digest:
            wrong.append(update.name)
            continue
        staged[update.name] = patched
    if wrong:  # a base that was not what the delta assumed: those tensors whole, checked
        counts["refetched"] = len(wrong)
        for name, array in remote.fetch(wrong).items():
            info = remote.tensors[name]
            staged[name] = _rank_form(array, info, held.slices.get(name))
    return staged, counts


def _patched(
    base: Any, update: TensorUpdate, info: TensorInfo, rank_slice: RankSlice | None
) -> Any:
    """A copy of ``base`` (this rank's form of the tensor) with the patch applied."""
    assert update.positions is not None and update.values is not None
    work = base.clone()
    positions, values = update.positions, update.values
    if rank_slice is not None:
        which, positions = sliced_positions(positions, info.shape, rank_slice)
        values = values[which]
    _bytes_of(work).view(values.dtype)[positions] = values
    return work


def _rank_form(array: np.ndarray, info: TensorInfo, rank_slice: RankSlice | None) -> Any:
    """A whole tensor as this rank keeps it: its slice, or all of it (a copy of its own)."""
    if rank_slice is not None:
        start, stop = rank_slice.bounds(info.shape[rank_slice.axis])
        array = np.take(array, np.arange(start, stop), axis=rank_slice.axis)
    return as_torch(np.array(array, copy=True), info)


def _bytes_of(tensor: Any) -> np.ndarray:
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy()


def _digest(data: Any) -> str:
    return xxhash.xxh3_128_hexdigest(memoryview(data))


def _reload(
    model: Any,
    model_config: Any,
    infos: dict[str, TensorInfo],
    slices: dict[str, RankSlice],
    tensors: dict[str, Any],
) -> None:
    """Every tensor into the model through vLLM's layerwise reload: each layer is rebuilt
    from the checkpoint tensors and processed as after a load, then copied into the
    engine's own storage (in place: the memory the engine computes with stays)."""
    import torch
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    def checkpoint_tensors():
        for name, info in infos.items():
            tensor, rank_slice = tensors[name], slices.get(name)
            # A kept slice goes back in its place in a whole tensor: the model's loaders
            # slice this rank's part from it again.
            yield (
                name,
                tensor if rank_slice is None else placed_in_whole(tensor, info.shape, rank_slice),
            )

    with torch.no_grad():
        initialize_layerwise_reload(model)
        model.load_weights(checkpoint_tensors())
        finalize_layerwise_reload(model, model_config)
        _reprocess_tied(model)


def _reprocess_tied(model: Any) -> None:
    """Redo the post-load processing of modules that share a weight with another (a tied
    LM head): vLLM's layerwise reload processes only the module the checkpoint names, so the
    other keeps what it derived from the old weight (on CPU, the LM head's packed copy, and
    the logits of the old revision). Only unquantized methods, whose processing derives
    from the weight afresh each time."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders: dict[int, list[Any]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
    for modules in holders.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            # Exactly these classes: a subclass may process in a way that is not idempotent.
            if method is not None and type(method) in (
                UnquantizedEmbeddingMethod,
                UnquantizedLinearMethod,
            ):
                method.process_weights_after_loading(module)
