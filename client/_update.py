"""Delta updates on the worker: arrays holding revision A brought to revision B in place, from
the server's per-tensor answer (nothing, an element patch, or the whole tensor; wire form in
client/wire/delta.py), every tensor then checked against B's digest and fetched whole where it
does not match (a wrong base), never left wrong.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from weightserve.client.errors import ServerUnreachable
from weightserve.client.transports.base import ControlTransport, LineStream
from weightserve.client.wire.delta import (
    PATCH,
    SAME,
    WHOLE,
    DeltaCut,
    DeltaHeader,
    TensorUpdate,
    read_updates,
)
from weightserve.client.wire.dtypes import from_numpy_dtype, numpy_dtype
from weightserve.client.wire.file_patch import apply_update


@dataclass(frozen=True)
class UpdateTarget:
    """The revision an update leads to, as the server answered (its headers)."""

    commit: str
    revision: str
    base: str  # the commit the server diffed against; "" when it no longer holds ``since``


def iter_updates(
    transport: ControlTransport, model_id: str, since: str, revision: str | None = None
) -> tuple[UpdateTarget, Generator[TensorUpdate, None, None]]:
    """The server's per-tensor answer for a worker holding ``since`` that wants ``revision``
    (default ``main``): the target, and the updates in the model's order."""
    target, stream = open_updates(transport, model_id, since, revision)

    def updates() -> Generator[TensorUpdate, None, None]:
        try:
            yield from read_updates(stream)
        except (ServerUnreachable, DeltaCut) as e:
            raise ServerUnreachable(f"the update of {model_id!r} was cut off: {e}") from e
        finally:
            stream.close()

    return target, updates()


def open_updates(
    transport: ControlTransport, model_id: str, since: str, revision: str | None = None
) -> tuple[UpdateTarget, LineStream]:
    """The delta stream (on a connection of its own, which the caller closes) and the
    target it leads to. A transport without it (gRPC) refuses with WrongTransport."""
    stream = transport.open_delta(model_id, since, revision)
    target = UpdateTarget(
        commit=stream.header("x-weightserve-commit"),
        revision=stream.header("x-weightserve-revision"),
        base=stream.header("x-weightserve-delta-base"),
    )
    return target, stream


def apply_updates(
    state: MutableMapping[str, Any],
    updates: Iterator[TensorUpdate],
    fetch_whole: Callable[[list[str]], dict[str, np.ndarray]],
) -> dict[str, int]:
    """Apply ``updates`` to ``state`` in place; check every tensor against its digest and fetch
    whole (``fetch_whole(names)``) those that do not match. Counts by outcome.

    A tensor whose own memory cannot be written where it is (a torch tensor on a GPU or not
    contiguous: patched in a host copy, then copied back into it; a read-only NumPy array,
    such as a same-node load's shared pages: replaced by its patched copy) still takes the
    patch: what travels does not depend on where the worker keeps its weights."""
    counts = {SAME: 0, PATCH: 0, WHOLE: 0, "refetched": 0, "wire_bytes": 0}
    wrong: list[str] = []
    for update in updates:
        counts[update.kind] += 1
        counts["wire_bytes"] += update.wire_bytes
        header = update.header
        value = state.get(update.name)
        if not _is_tensor(value, header):  # missing, or another dtype or shape: a new array
            if update.kind == WHOLE:
                assert update.data is not None
                state[update.name] = _new_array(header, update.data, like=value)
            else:
                wrong.append(update.name)
            continue
        target = _writable_bytes(value)
        if target is None and update.kind == SAME:
            readable = _host_bytes(value, copy=False)
            if xxhash.xxh3_128_hexdigest(memoryview(readable.data)) != header.digest:
                wrong.append(update.name)
            continue
        staged = target is None
        if target is None:
            target = _host_bytes(value, copy=True)
        apply_update(target, update)  # same size: _is_tensor checked dtype and shape
        if xxhash.xxh3_128_hexdigest(memoryview(target.data)) != header.digest:
            wrong.append(update.name)
        elif staged:
            _put_back(state, update.name, value, target)
    if wrong:
        counts["refetched"] = len(wrong)
        for name, array in fetch_whole(wrong).items():
            fetched = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            found = state.get(name)
            target = _writable_bytes(found) if found is not None else None
            if target is not None and target.size == fetched.size:
                target[:] = fetched
            elif found is not None and _is_tensor(found, _shape_of(array, name)):
                _put_back(state, name, found, fetched)
            else:
                state[name] = _new_array(_shape_of(array, name), fetched.tobytes(), like=found)
    return counts


def remove_absent(state: MutableMapping[str, Any], kept: set[str]) -> list[str]:
    """Remove from ``state`` the tensors not in ``kept`` (the revision it now holds does not
    have them); their names, in ``state``'s order."""
    removed = [name for name in state if name not in kept]
    for name in removed:
        del state[name]
    return removed


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def _is_tensor(value: Any, header: DeltaHeader) -> bool:
    """Whether ``value`` is the tensor ``header`` describes: its dtype and shape."""
    if value is None:
        return False
    if _is_torch(value):
        dtype = str(value.dtype).removeprefix("torch.")
    else:
        try:
            dtype = from_numpy_dtype(np.asarray(value).dtype)
        except ValueError:
            return False
    return dtype == header.dtype and list(value.shape) == list(header.shape)


def _shape_of(array: np.ndarray, name: str) -> DeltaHeader:
    """A header naming a fetched array's dtype and shape (to match it against the state's)."""
    return DeltaHeader(
        kind=WHOLE, name=name, dtype=from_numpy_dtype(array.dtype), shape=list(array.shape)
    )


def _writable_bytes(value: Any) -> np.ndarray | None:
    """The array's own memory as a flat writable uint8 array (None where it has none of its
    own to give: not contiguous, read-only, not on the CPU)."""
    if _is_torch(value):
        import torch  # only for torch tensors: torch is optional

        t = value.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        return t.reshape(-1).view(torch.uint8).numpy()
    if not isinstance(value, np.ndarray) or not value.flags.c_contiguous:
        return None
    if not value.flags.writeable:
        return None
    return value.reshape(-1).view(np.uint8)


def _host_bytes(value: Any, *, copy: bool) -> np.ndarray:
    """The tensor's bytes in host memory, C order, as flat uint8: a private writable copy with
    ``copy``, else possibly a read-only view of its own memory."""
    if _is_torch(value):
        import torch

        host = value.detach().to("cpu", copy=copy).contiguous()
        return host.reshape(-1).view(torch.uint8).numpy()
    array = np.asarray(value)
    flat = np.array(array, order="C", copy=True) if copy else np.ascontiguousarray(array)
    return flat.reshape(-1).view(np.uint8)


def _put_back(state: MutableMapping[str, Any], name: str, value: Any, data: np.ndarray) -> None:
    """Bring a tensor that was patched in a host copy up to ``data`` (its new bytes): a torch
    tensor in place (``copy_`` to its device and layout), a NumPy array replaced."""
    if _is_torch(value):
        import torch

        with warnings.catch_warnings():  # read-only bytes, only ever copy_'s source
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            host = torch.from_numpy(data).view(value.dtype).reshape(value.shape)
        value.detach().copy_(host)
        return
    array = np.asarray(value)
    state[name] = data.view(array.dtype).reshape(array.shape)


def _new_array(header: DeltaHeader, data: bytes, like: Any = None) -> Any:
    """The tensor ``header`` describes, holding ``data``: a torch tensor on ``like``'s device
    where the state held a torch tensor there (a state dict stays one), else a NumPy array."""
    if like is not None and _is_torch(like):
        import torch

        dtype = getattr(torch, header.dtype, None)
        if isinstance(dtype, torch.dtype):
            if not data:  # frombuffer refuses an empty buffer
                return torch.empty(header.shape, dtype=dtype, device=like.device)
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return flat.view(dtype).reshape(header.shape).to(like.device)
    return np.frombuffer(bytearray(data), dtype=numpy_dtype(header.dtype)).reshape(header.shape)
