"""Which part of each checkpoint tensor a tensor-parallel rank needs, so that it fetches only
that part: the server slices (``shard=(k, n)`` along an axis), and while the load runs each
such parameter's weight loader is one that copies the slice straight into its place (vLLM's
own loaders slice whole tensors, and its ``weight_loader_v2``, which unquantized layers use,
has no way to be told a tensor comes sliced).

Covered: vLLM's unquantized ``ColumnParallelLinear`` (weight and bias, rows),
``MergedColumnParallelLinear`` and ``QKVParallelLinear`` (each packed part's rows; a K/V
head shared by several ranks is that head's rows), ``RowParallelLinear`` (weight columns; its
bias is whole on every rank). Everything else comes whole and vLLM slices it as usual:
embeddings and the LM head (the vocabulary is padded per rank, so a rank's rows are not an
even split of the checkpoint's), norms, quantized layers, MoE experts, and any tensor whose
checkpoint name the model maps to another module name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["RankSlice", "plan_rank_slices", "sliced_loading"]


@dataclass(frozen=True)
class RankSlice:
    """Part ``part`` of ``parts`` along ``axis`` (an even split: numpy.array_split's)."""

    axis: int
    part: int
    parts: int

    def bounds(self, length: int) -> tuple[int, int]:
        size = length // self.parts
        return self.part * size, (self.part + 1) * size


@dataclass(frozen=True)
class _Slot:
    """One checkpoint tensor that lands in a sliceable parameter (``parts``: where each
    packed part lies in this rank's parameter, rows ``(offset, size)``; None: unpacked)."""

    checkpoint_name: str
    param: Any
    slice: RankSlice
    parts: tuple[tuple[int, int], ...] | None = None


def plan_rank_slices(
    model: Any, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, RankSlice], list[tuple[Any, Any]]]:
    """The served tensors (``shapes``: name -> shape) this rank fetches sliced, and the
    parameters they land in (to be marked pre-sliced while they load). A parameter is in
    only when every checkpoint tensor it takes is served and splits evenly, so a parameter
    never gets a slice and a whole tensor at once."""
    try:
        from vllm.model_executor.layers import linear
    except ImportError:
        return {}, []
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}
    plan: dict[str, RankSlice] = {}
    params: list[Any] = []
    for prefix, module in model.named_modules():
        slots = list(_slots(linear, prefix, module, packed))
        if not slots or not all(_fits(s, shapes) for s in slots):
            continue
        for slot in slots:
            plan[slot.checkpoint_name] = slot.slice
        params.extend({id(s.param): (s.param, s.parts) for s in slots}.values())
    return plan, params


def _slots(
    linear: Any, prefix: str, module: Any, packed: Mapping[str, list[str]]
) -> Iterator[_Slot]:
    kind = type(module)
    if kind not in (
        linear.ColumnParallelLinear,
        linear.MergedColumnParallelLinear,
        linear.QKVParallelLinear,
        linear.RowParallelLinear,
    ):
        return
    if type(module.quant_method) is not linear.UnquantizedLinearMethod or module.tp_size < 2:
        return
    rank, ranks = module.tp_rank, module.tp_size
    weight, bias = module.weight, getattr(module, "bias", None)
    if kind is linear.RowParallelLinear:
        if getattr(weight, "input_dim", None) == 1:
            yield _Slot(f"{prefix}.weight", weight, RankSlice(1, rank, ranks))
        return
    if getattr(weight, "output_dim", None) != 0:
        return
    own = [
        (name, param) for name, param in (("weight", weight), ("bias", bias)) if param is not None
    ]
    if kind is linear.ColumnParallelLinear:
        for name, param in own:
            yield _Slot(f"{prefix}.{name}", param, RankSlice(0, rank, ranks))
        return
    parent, _, packed_name = prefix.rpartition(".")
    parts = packed.get(packed_name)
    sizes = list(getattr(module, "output_partition_sizes", ()))
    if not parts or len(parts) != len(sizes):
        return  # the model names its packed parts in a way this plan cannot see
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    rows = tuple(zip(offsets, sizes, strict=True))
    for i, part_name in enumerate(parts):
        part_slice = RankSlice(0, rank, ranks)
        if kind is linear.QKVParallelLinear and i > 0 and module.num_kv_head_replicas > 1:
            # Fewer K/V heads than ranks: a rank takes the one head it shares with others.
            part_slice = RankSlice(
                0, rank // module.num_kv_head_replicas, module.total_num_kv_heads
            )
        base = f"{parent}.{part_name}" if parent else part_name
        for name, param in own:
            yield _Slot(f"{base}.{name}", param, part_slice, rows)


def _fits(slot: _Slot, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    shape = shapes.get(slot.checkpoint_name)
    if shape is None or len(shape) <= slot.slice.axis:
        return False
    return shape[slot.slice.axis] % slot.slice.parts == 0


# vLLM's packed-part ids of a QKV layer, in the order of its output_partition_sizes
_QKV_PARTS = {"q": 0, "k": 1, "v": 2}


class sliced_loading:  # noqa: N801 - used as a context manager, like torch.no_grad
    """While inside, the given parameters (with their packed parts' rows) take this rank's
    slices, copied straight into place; outside, vLLM's own loaders are back (an update then
    sends whole tensors, which they slice)."""

    def __init__(self, params: Iterable[tuple[Any, Any]]) -> None:
        self.params = list(params)
        self.saved: list[tuple[Any, Any]] = []

    def __enter__(self) -> sliced_loading:
        for param, parts in self.params:
            self.saved.append((param, param.weight_loader))
            param.weight_loader = _slice_loader(parts)
        return self

    def __exit__(self, *exc: object) -> None:
        for param, loader in self.saved:
            param.weight_loader = loader
        self.saved.clear()


def _slice_loader(parts: tuple[tuple[int, int], ...] | None) -> Any:
    def load_slice(param: Any, loaded_weight: Any, loaded_shard_id: Any = None) -> None:
        target = param.data
        if loaded_shard_id is not None:
            if parts is None:
                raise ValueError(f"a packed part ({loaded_shard_id!r}) for an unpacked parameter")
            offset, size = parts[_QKV_PARTS.get(loaded_shard_id, loaded_shard_id)]
            target = target.narrow(0, offset, size)
        if tuple(target.shape) != tuple(loaded_weight.shape):
            raise ValueError(
                f"this rank's slice is {list(loaded_weight.shape)}, its place in the "
                f"parameter {list(target.shape)}"
            )
        target.copy_(loaded_weight)

    return load_slice


def sliced_positions(
    positions: Any, shape: tuple[int, ...], rank_slice: RankSlice
) -> tuple[Any, Any]:
    """Of a patch's flat positions in the whole tensor (``shape``), those inside this rank's
    slice: ``(which, local)``, a mask over ``positions`` and their flat positions in the
    slice."""
    import numpy as np

    index = np.unravel_index(positions, shape)
    start, stop = rank_slice.bounds(shape[rank_slice.axis])
    along = index[rank_slice.axis]
    which = (along >= start) & (along < stop)
    local_shape = list(shape)
    local_shape[rank_slice.axis] = stop - start
    local_index = [axis_index[which] for axis_index in index]
    local_index[rank_slice.axis] = local_index[rank_slice.axis] - start
    return which, np.ravel_multi_index(tuple(local_index), tuple(local_shape))


def placed_in_whole(part: Any, shape: tuple[int, ...], rank_slice: RankSlice) -> Any:
    """A tensor of the whole ``shape`` holding ``part`` (this rank's slice) where it lies,
    zeros elsewhere: what vLLM's loaders slice this rank's part from again."""
    import torch

    whole = torch.zeros(shape, dtype=part.dtype)
    start, stop = rank_slice.bounds(shape[rank_slice.axis])
    whole.narrow(rank_slice.axis, start, stop - start).copy_(part)
    return whole
