"""MAX's ``Weights`` protocol over a weightserve model: ``RemoteWeights``; and ``RandomWeights``.

A ``RemoteWeights`` object is a cursor: a name prefix over state shared by every cursor made
from it (the model's tensor index, the arrays received so far, ``allocated_weights``).
``w.layers[0].attn`` makes the cursor ``layers.0.attn``; nothing is checked until
``data()`` / ``allocate()``, which behave as MAX's local ``SafetensorWeights`` /
``GGUFWeights`` do on the same checkpoint, messages included.

Bulk loading: once ``items()`` has listed a prefix, the first ``data()`` / ``allocate()`` of
a tensor under it fetches every not-yet-received tensor under that prefix in one request
(``RemoteModel.fetch``), and later calls are served from what arrived. So MAX's pipeline
path ``{k: v.data() for k, v in weights.items()}`` costs one request (or
``FetchOptions.parallel`` streams for a large model), not one per tensor. ``prefetch()``
does the same explicitly; ``state_dict()`` / ``numpy_state_dict()`` / ``torch_state_dict()``
fetch a prefix in one go.
"""

from __future__ import annotations

import copy
import threading
import zlib
from collections.abc import Iterator
from dataclasses import replace
from functools import cache
from typing import Any

import numpy as np

from weightserve.client._client import Client, FetchOptions, RemoteModel
from weightserve.client._models import TensorInfo
from weightserve.client.errors import TensorNotFound, WeightsClosed
from weightserve.client.max.compat import Backend, backend, ggml_type_number, shareable
from weightserve.client.receive.stream import aligned_empty
from weightserve.client.receive.window import DEFAULT_WINDOW_BYTES
from weightserve.client.transports.base import DEFAULT_READ_TIMEOUT, TLSOptions
from weightserve.client.wire.dtypes import from_numpy_dtype, numpy_dtype, wire_dtype
from weightserve.client.wire.hints import closest_name
from weightserve.client.wire.routes import parse_url

__all__ = ["RandomWeights", "RemoteWeights", "WeightsClosed"]

_FORMAT_TITLES = {"safetensors": "Safetensor", "pytorch": "PyTorch"}


class _MissingWeight(TensorNotFound):
    """A name the checkpoint does not hold; prints as MAX's KeyError does (quoted)."""

    __str__ = KeyError.__str__


def _missing(fmt: str, name: str, names: Any) -> KeyError:
    if fmt == "gguf":
        return _MissingWeight(
            f"Could not find weight named {name}. Please check that the name is correct."
        )
    close = closest_name(name, names)
    hint = f" Did you mean '{close}'?" if close is not None else ""  # MAX's words exactly
    title = _FORMAT_TITLES.get(fmt, fmt)
    return _MissingWeight(f"'{name}' is not a weight in the {title} checkpoint.{hint}")


class _State:
    """What every cursor over one model shares."""

    def __init__(self, model: RemoteModel, backend: Backend, owns_client: bool, bulk: bool):
        self.model = model
        self.index: dict[str, TensorInfo] = model.info.tensors  # items() order
        self.format = model.info.format
        self.alignment = model.info.alignment
        self.backend = backend
        self.owns_client = owns_client
        self.bulk = bulk
        self.arrays: dict[str, np.ndarray] = {}  # served dtype and shape, as received
        self.values: dict[str, Any] = {}  # what data() wraps and allocate() records
        self.allocated: dict[str, Any] = {}
        self.listed: set[str] = set()  # prefixes items() has listed
        self.closed = False
        self.lock = threading.RLock()
        self._file_idx: dict[str, int] | None = None

    def file_idx(self) -> dict[str, int]:
        if self._file_idx is None:
            self._file_idx = dict.fromkeys(self.index, 0)
        return self._file_idx

    def fetch(self, names: list[str]) -> None:
        """Receive these tensors (those not yet here) in one request."""
        with self.lock:
            if self.closed:
                raise WeightsClosed(
                    f"weights of model {self.model.id!r} were closed; their buffers are gone."
                    " Load them again (load_weights) to read tensor data."
                )
            missing = [n for n in names if n not in self.arrays]
            if missing:
                self.arrays.update(self.model.fetch(missing))

    def array(self, name: str) -> np.ndarray:
        with self.lock:
            arr = self.arrays.get(name)
            if arr is not None:
                return arr
            self.fetch(self.bulk_names(name))
            return self.arrays[name]

    def bulk_names(self, name: str) -> list[str]:
        """What to fetch with ``name``: all of the broadest listed prefix holding it."""
        covering = [p for p in self.listed if name.startswith(p)] if self.bulk else []
        if not covering:
            return [name]
        prefix = min(covering, key=len)
        return [n for n in self.index if n.startswith(prefix) and n not in self.arrays]

    def value(self, info: TensorInfo) -> Any:
        with self.lock:
            value = self.values.get(info.name)
            if value is None:
                arr = self.array(info.name)
                value = self.backend.tensor_value(arr, info.dtype, self.format)
                self.values[info.name] = value
            return value


class _Allocates:
    """MAX's ``Weights.allocate``, said once for both classes here; each makes the weight in
    its ``_allocate``."""

    def allocate(
        self,
        dtype: Any = None,
        shape: Any = None,
        quantization_encoding: Any = None,
        device: Any = None,
    ) -> Any:
        """A ``Weight`` for this name, its value recorded in ``allocated_weights``: for
        ``RemoteWeights`` with the checkpoint's dtype and shape (a different ``dtype`` /
        ``shape`` raises: no casting), for ``RandomWeights`` random values of those given."""
        return self._allocate(dtype, shape, quantization_encoding, device)

    def _allocate(self, dtype: Any, shape: Any, quantization_encoding: Any, device: Any) -> Any:
        raise NotImplementedError


class RemoteWeights(_Allocates):
    """MAX's ``Weights`` protocol for a model on a weightserve server.

    ``RemoteWeights(url_or_model)`` takes a model URL (``http://host:port/v1/models/NAME``,
    ``grpc://host:port/NAME``) or a ``RemoteModel``. With ``max`` installed it returns MAX's
    own types, and for safetensors models an object that is also a
    ``max.graph.weights.SafetensorWeights``. ``use_max=False`` forces the look-alike types.
    ``bulk=False`` turns off fetching a listed prefix as a whole. ``retry_seconds`` bounds
    how long a busy or unreachable server is waited for (see ``Client``). ``verify`` (``"full"``,
    ``"sample"``, ``"none"``; default ``WEIGHTSERVE_VERIFY``, else ``"full"``) says which chunk
    digests are checked, overriding ``options.verify`` (see ``FetchOptions``). ``revision``
    (or ``ID@R`` in the URL) pins a revision of the model, as ``Client.model`` does.
    """

    # Set per instance by _attach (never looked up through __getattr__).
    _state: _State
    _prefix: str

    def __new__(
        cls,
        source: str | RemoteModel,
        *,
        use_max: bool | None = None,
        token: str | None = None,
        tls: TLSOptions | None = None,
        timeout: float = DEFAULT_READ_TIMEOUT,
        options: FetchOptions | None = None,
        bulk: bool = True,
        retry_seconds: float | None = None,
        verify: str | None = None,
        revision: str | None = None,
    ) -> RemoteWeights:
        state = _open(
            source, use_max, token, tls, timeout, options, bulk, retry_seconds, verify, revision
        )
        klass: type = cls
        if cls is RemoteWeights and state.backend.is_max and state.format == "safetensors":
            klass = safetensors_weights_class(state.backend.SafetensorWeights)
        obj: RemoteWeights = object.__new__(klass)
        obj._attach(state, "")
        return obj

    def __init__(self, source: str | RemoteModel, **kwargs: Any) -> None:
        """Everything happens in ``__new__`` (which picks the class)."""

    def _attach(self, state: _State, prefix: str) -> None:
        d = self.__dict__
        d["_state"] = state
        d["_prefix"] = prefix
        # The attributes MAX's SafetensorWeights keeps, for code that reads them.
        d["_allocated"] = state.allocated
        if state.format == "safetensors":
            d["_tensors"] = state.index.keys()
            d["_tensors_to_file_idx"] = state.file_idx()
            d["_filepaths"] = (state.model.client.address.url + "/" + state.model.id,)
            d["_st_weight_map"] = state.values
            d["_st_file_handles"] = {}

    def _child(self, prefix: str) -> RemoteWeights:
        obj = object.__new__(type(self))
        obj._attach(self._state, prefix)
        return obj

    # ----------------------------------------------------------------- naming
    @property
    def name(self) -> str:
        """The current weight name or prefix (``""`` at the root)."""
        return self._prefix

    def __getattr__(self, attr: str) -> RemoteWeights:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)  # copy, pickle, numpy probes: never a weight name
        if "_state" not in self.__dict__:
            raise AttributeError(attr)
        return self._child(f"{self._prefix}.{attr}" if self._prefix else str(attr))

    def __getitem__(self, idx: int | str) -> RemoteWeights:
        part = str(idx)
        return self._child(f"{self._prefix}.{part}" if self._prefix else part)

    __iter__ = None  # not iterable (use items()); stops Python's old __getitem__ iteration

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self._state.model.id!r}, name={self._prefix!r})"

    def __enter__(self) -> RemoteWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- protocol
    def exists(self) -> bool:
        """True when the current name is exactly a tensor name."""
        return self._prefix in self._state.index

    def items(self) -> Iterator[tuple[str, RemoteWeights]]:
        """``(full name, cursor)`` for every tensor whose name starts with the prefix (a raw
        string prefix), in the server's index order: sorted for safetensors, file order
        for GGUF. Reading data under a listed prefix fetches the whole prefix at once."""
        state = self._state
        prefix = self._prefix
        with state.lock:
            state.listed.add(prefix)
        for name in list(state.index):
            if name.startswith(prefix):
                yield name, self._child(name)

    def _info(self) -> TensorInfo:
        state = self._state
        info = state.index.get(self._prefix)
        if info is None:
            raise _missing(state.format, self._prefix, state.index.keys())
        return info

    def _ggml(self, info: TensorInfo) -> Any:
        """MAX's encoding for a GGML block tensor; raises as MAX does where it has none."""
        encoding = self._state.backend.encoding(info.encoding)
        if encoding is None:
            raise ValueError(f"Unknown GGML DType: {ggml_type_number(info.encoding or '')}.")
        return encoding

    def data(self) -> Any:
        """``WeightData(data, name, dtype, shape, quantization_encoding)``: a view of the
        received buffer (no copy). GGML block types MAX has no encoding for come as their
        uint8 block bytes without an encoding (MAX's own GGUF loader raises for them)."""
        state = self._state
        b = state.backend
        info = self._info()
        value = state.value(info)
        if state.format == "gguf":
            encoding = b.encoding(info.encoding) if info.encoding else None
            dims = info.shape if info.encoding else info.logical_shape
            dtype = b.dtype(info.dtype, info.name)
            return b.WeightData(value, self._prefix, dtype, b.shape(dims), encoding)
        dtype = b.dtype(info.dtype, info.name)
        return b.WeightData(value, self._prefix, dtype, b.shape(info.logical_shape))

    def _allocate(self, dtype: Any, shape: Any, quantization_encoding: Any, device: Any) -> Any:
        """A ``Weight`` with the checkpoint's dtype and shape, its value recorded in
        ``allocated_weights``; a different ``dtype`` / ``shape`` raises (no casting)."""
        state = self._state
        b = state.backend
        if device is None:
            device = b.cpu()
        if state.format == "gguf":
            return self._allocate_gguf(dtype, shape, quantization_encoding, device)
        if quantization_encoding is not None:
            title = _FORMAT_TITLES.get(state.format, state.format).lower()
            raise ValueError(
                f"Quantization encodings are not supported in {title} format."
                f" Got: {quantization_encoding}"
            )
        info = self._info()
        value = state.value(info)
        weight_dtype = b.dtype(info.dtype, info.name)
        weight = b.weight(
            name=self._prefix,
            dtype=weight_dtype,
            shape=info.logical_shape,
            # safetensors data sits at any byte offset of the file: alignment 1, as MAX.
            align=1,
            device=device,
        )
        state.allocated[self._prefix] = value
        weight_shape = tuple(dim for dim in weight.shape)
        if shape is not None and weight_shape != tuple(shape):
            raise ValueError(
                f"Value provided to weight '{self.name}' had different shape "
                f"(expected={shape}, actual={weight_shape})"
            )
        if dtype is not None and weight_dtype != dtype:
            raise ValueError(
                f"Value provided to weight '{self.name}' had different dtype "
                f"(expected={dtype}, actual={weight_dtype})"
            )
        return weight

    def _allocate_gguf(self, dtype: Any, shape: Any, quantization_encoding: Any, device: Any):
        state = self._state
        b = state.backend
        info = self._info()
        encoding = self._ggml(info) if info.encoding else None
        weight = b.weight(
            name=info.name,
            dtype=b.DType.uint8 if encoding is not None else b.dtype(info.dtype, info.name),
            shape=info.shape,  # block types: the byte shape
            quantization_encoding=encoding,
            align=state.alignment,
            device=device,
        )
        state.allocated[self._prefix] = state.value(info)
        if shape is not None:
            expected = tuple(shape)
            actual = tuple(int(d) for d in info.logical_shape)  # compared unpacked
            if actual != expected:
                raise ValueError(
                    f"Value provided to weight '{self.name}' had different shape"
                    f" (expected={expected}, actual={actual})"
                )
        if dtype is not None and weight.dtype != dtype:
            raise ValueError(
                f"Value provided to weight '{self.name}' had different dtype"
                f" (expected={dtype}, actual={weight.dtype})"
            )
        if quantization_encoding and not weight.quantization_encoding:
            raise ValueError(
                "Expected quantized weight but checkpoint contained"
                f" unquantized weight for {self._prefix}"
            )
        return weight

    def allocate_as_bytes(self, dtype: Any = None) -> Any:
        """A uint8 ``Weight`` of the tensor's bytes: the last dimension times the itemsize
        (a scalar becomes ``[itemsize]``); the byte view is recorded in
        ``allocated_weights``."""
        state = self._state
        b = state.backend
        info = self._info()
        value = state.value(info)
        raw = b.bytes_value(value, state.array(info.name), info.dtype, info.logical_shape)
        weight = b.weight(name=self._prefix, dtype=b.DType.uint8, shape=raw.shape, device=b.cpu())
        state.allocated[self._prefix] = raw
        return weight

    @property
    def allocated_weights(self) -> dict[str, Any]:
        """The values of every allocated weight, by full name (shared by all cursors), for
        ``session.load(graph, weights_registry=...)``."""
        return self._state.allocated

    def close(self) -> None:
        """Drop every received buffer and ``allocated_weights``; ``exists()`` and
        ``items()`` still work, reading data raises ``WeightsClosed``."""
        state = self._state
        with state.lock:
            state.arrays.clear()
            state.values.clear()
            state.allocated.clear()
            if state.owns_client and not state.closed:
                state.model.client.close()
            state.closed = True

    # ---------------------------------------------------------------- bulk API
    @property
    def remote_model(self) -> RemoteModel:
        """The ``RemoteModel`` underneath (its ``info`` has the whole tensor index)."""
        return self._state.model

    def _names(self, prefix: str | None) -> list[str]:
        p = self._prefix if prefix is None else prefix
        return [n for n in self._state.index if n.startswith(p)]

    def prefetch(self, prefix: str | None = None) -> None:
        """Receive every tensor under ``prefix`` (default: this cursor's name) in one
        request, so later ``data()`` / ``allocate()`` calls make none."""
        self._state.fetch(self._names(prefix))

    @staticmethod
    def _key(name: str, prefix: str, strip: bool) -> str:
        return name[len(prefix) :].lstrip(".") if strip else name

    def state_dict(self, prefix: str | None = None, *, strip_prefix: bool = False) -> dict:
        """``{name: WeightData}`` of every tensor under ``prefix`` (a raw string prefix;
        default: this cursor's name), fetched in one request."""
        p = self._prefix if prefix is None else prefix
        names = self._names(p)
        self._state.fetch(names)
        return {self._key(n, p, strip_prefix): self._child(n).data() for n in names}

    def numpy_state_dict(self, prefix: str | None = None, *, strip_prefix: bool = False) -> dict:
        """``{name: np.ndarray}`` (served dtype and shape: bfloat16/float8 as ml_dtypes,
        GGML blocks as uint8 byte shape), views of the received buffers."""
        p = self._prefix if prefix is None else prefix
        names = self._names(p)
        state = self._state
        state.fetch(names)
        return {self._key(n, p, strip_prefix): state.array(n) for n in names}

    def torch_state_dict(self, prefix: str | None = None, *, strip_prefix: bool = False) -> dict:
        """``{name: torch.Tensor}`` sharing memory with the received buffers, dtypes kept
        (bfloat16 stays ``torch.bfloat16``), ready for ``nn.Module.load_state_dict``."""
        p = self._prefix if prefix is None else prefix
        arrays = self.numpy_state_dict(p)
        index = self._state.index
        return {
            self._key(n, p, strip_prefix): to_torch(a, index[n].dtype, index[n].logical_shape)
            for n, a in arrays.items()
        }

    def iter_torch(
        self,
        prefix: str | None = None,
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        strip_prefix: bool = False,
    ) -> Iterator[tuple[str, Any]]:
        """``(name, torch.Tensor)`` of every tensor under ``prefix`` (default: this cursor's
        name) as it arrives, memory bounded by ``window_bytes``: the iterable engines'
        ``load_weights(weights)`` takes (vLLM, SGLang), so a model loads layer by layer
        without being held whole. Each tensor is a zero-copy view of its received buffer,
        valid until it is dropped; it is not kept here (``data()`` fetches it again)."""
        p = self._prefix if prefix is None else prefix
        index = self._state.index
        arrays = self._state.model.iter_tensors(self._names(p), window_bytes=window_bytes)
        try:
            for name, array in arrays:
                info = index[name]
                tensor = to_torch(array, info.dtype, info.logical_shape)
                del array  # no view kept while the consumer moves on
                yield self._key(name, p, strip_prefix), tensor
                del tensor
        finally:
            arrays.close()  # stopping early closes the stream at once

    def iter_numpy(
        self,
        prefix: str | None = None,
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        strip_prefix: bool = False,
    ) -> Iterator[tuple[str, np.ndarray]]:
        """As ``iter_torch``, with NumPy arrays (served dtype and shape)."""
        p = self._prefix if prefix is None else prefix
        arrays = self._state.model.iter_tensors(self._names(p), window_bytes=window_bytes)
        try:
            for name, array in arrays:
                yield self._key(name, p, strip_prefix), array
                del array
        finally:
            arrays.close()


@cache
def safetensors_weights_class(max_class: type) -> type:
    """``RemoteWeights`` that is also MAX's ``SafetensorWeights`` (``max_class``), for MAX
    architectures that accept only that class. It never runs SafetensorWeights' file-opening
    constructor; every method comes from ``RemoteWeights``."""

    class RemoteSafetensorWeights(RemoteWeights, max_class):  # type: ignore[misc,valid-type]
        """Remote safetensors weights, usable wherever MAX requires SafetensorWeights."""

        def _load_tensor(self, dtype: Any = None) -> Any:
            # SafetensorWeights' private accessor: the tensor's Buffer.
            return self._state.value(self._info())

    RemoteSafetensorWeights.__module__ = RemoteWeights.__module__
    RemoteSafetensorWeights.__qualname__ = "RemoteSafetensorWeights"
    return RemoteSafetensorWeights


def _open(
    source: str | RemoteModel,
    use_max: bool | None,
    token: str | None,
    tls: TLSOptions | None,
    timeout: float,
    options: FetchOptions | None,
    bulk: bool,
    retry_seconds: float | None = None,
    verify: str | None = None,
    revision: str | None = None,
) -> _State:
    b = backend(use_max)
    if isinstance(source, RemoteModel):
        if revision is not None:
            raise ValueError(
                "revision= goes with a URL; a RemoteModel is pinned where it is made: "
                "client.model(ID, revision=R)"
            )
        if verify is not None:  # the caller's model keeps its own options
            source = copy.copy(source)
            source.options = replace(source.options, verify=verify)
        return _State(source, b, owns_client=False, bulk=bulk)
    if verify is not None:
        options = replace(options or FetchOptions(), verify=verify)
    url = str(source)
    _, model_id = parse_url(url)
    if not model_id:
        raise ValueError(
            f"{url!r} names a server, not a model: use http://HOST:PORT/v1/models/MODEL"
            " or grpc://HOST:PORT/MODEL"
        )
    client = Client(url, token=token, tls=tls, timeout=timeout, retry_seconds=retry_seconds)
    try:
        model = client.model(model_id, options, revision=revision)
    except BaseException:
        client.close()
        raise
    return _State(model, b, owns_client=True, bulk=bulk)


# ----------------------------------------------------------------------- torch
_TORCH_VIA_UNSIGNED = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")


def to_torch(arr: np.ndarray, wire: str, logical_shape: tuple[int, ...] = ()) -> Any:
    """A torch tensor over the array's memory with the matching torch dtype (no copy).

    bfloat16 and float8 go through NumPy as unsigned integers and are viewed back;
    float4 becomes ``torch.float4_e2m1fn_x2`` (two values a byte) where torch has it;
    types torch lacks stay raw uint8 bytes.
    """
    import torch

    arr = shareable(arr)  # a handoff view: its copy-on-write alias (torch wants writable)
    if wire_dtype(wire).numpy_name is None:
        raw = arr
        if (
            wire == "float4_e2m1fn"
            and hasattr(torch, "float4_e2m1fn_x2")
            and logical_shape
            and logical_shape[-1] % 2 == 0
        ):
            packed = raw.reshape(*logical_shape[:-1], logical_shape[-1] // 2)
            return torch.from_numpy(packed).view(torch.float4_e2m1fn_x2)
        return torch.from_numpy(raw)
    if wire in _TORCH_VIA_UNSIGNED:
        bits = torch.from_numpy(arr.view(np.dtype(f"u{arr.dtype.itemsize}")))
        target = getattr(torch, wire, None)
        return bits.view(target) if target is not None else bits
    return torch.from_numpy(arr)


# ---------------------------------------------------------------------- random
class _RandomState:
    def __init__(self, seed: int, scale: float, backend: Backend) -> None:
        self.seed = seed
        self.scale = scale
        self.backend = backend
        self.arrays: dict[str, np.ndarray] = {}
        self.values: dict[str, Any] = {}
        self.allocated: dict[str, Any] = {}


def random_array(seed: int, name: str, wire: str, shape: tuple[int, ...], scale: float = 0.02):
    """Deterministic random data for one weight: the same (seed, name, dtype, shape) always
    gives the same values. Floats are normal * ``scale``; integers small; 64-byte aligned."""
    dtype = numpy_dtype(wire)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if wire == "bool":
        values: np.ndarray = rng.integers(0, 2, shape).astype(np.bool_)
    elif dtype.kind in "iu":
        low = 0 if dtype.kind == "u" else -8
        values = rng.integers(low, 8, shape).astype(dtype)
    else:
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
        if wire == "float8_e8m0fnu":  # exponent-only: positive powers of two
            values = np.abs(values) + np.float32(scale)
        values = values.astype(dtype)
    out = aligned_empty(values.nbytes).view(dtype).reshape(shape)
    out[...] = values
    return out


class RandomWeights(_Allocates):
    """A ``Weights`` source of synthetic data, for tests: ``allocate(dtype, shape)``
    generates deterministic random values of that dtype and shape, ``exists()`` is always
    True and ``items()`` is empty. ``data()`` works for what was allocated."""

    _state: _RandomState
    _prefix: str

    def __init__(self, seed: int = 0, *, scale: float = 0.02, use_max: bool | None = None):
        self.__dict__["_state"] = _RandomState(seed, scale, backend(use_max))
        self.__dict__["_prefix"] = ""

    def _child(self, prefix: str) -> RandomWeights:
        obj = object.__new__(type(self))
        obj.__dict__["_state"] = self._state
        obj.__dict__["_prefix"] = prefix
        return obj

    @property
    def name(self) -> str:
        return self._prefix

    def __getattr__(self, attr: str) -> RandomWeights:
        if (attr.startswith("__") and attr.endswith("__")) or "_state" not in self.__dict__:
            raise AttributeError(attr)
        return self._child(f"{self._prefix}.{attr}" if self._prefix else str(attr))

    def __getitem__(self, idx: int | str) -> RandomWeights:
        part = str(idx)
        return self._child(f"{self._prefix}.{part}" if self._prefix else part)

    __iter__ = None

    def __repr__(self) -> str:
        return f"RandomWeights(seed={self._state.seed}, name={self._prefix!r})"

    def exists(self) -> bool:
        return True

    def items(self) -> Iterator[tuple[str, RandomWeights]]:
        return iter(())

    def _generated(self, missing: Exception) -> np.ndarray:
        """This name's generated array; ``missing`` is raised before ``allocate`` made one."""
        arr = self._state.arrays.get(self._prefix)
        if arr is None:
            raise missing
        return arr

    def data(self) -> Any:
        state = self._state
        b = state.backend
        arr = self._generated(
            _MissingWeight(
                f"RandomWeights has no data for '{self._prefix}' yet: allocate(dtype, shape)"
                " says what to generate."
            )
        )
        return b.WeightData(
            state.values[self._prefix], self._prefix, b.dtype(_wire_of(arr)), b.shape(arr.shape)
        )

    def _allocate(self, dtype: Any, shape: Any, quantization_encoding: Any, device: Any) -> Any:
        """A ``Weight`` of random values of ``dtype`` and ``shape`` (both needed)."""
        state = self._state
        b = state.backend
        if dtype is None or shape is None:
            raise ValueError(
                f"RandomWeights.allocate needs a dtype and a shape for '{self._prefix}'"
                " (there is no checkpoint to take them from)"
            )
        if quantization_encoding is not None:
            raise ValueError(
                f"RandomWeights cannot generate quantized data ({quantization_encoding})"
            )
        wire = getattr(dtype, "name", str(dtype))
        dims = tuple(int(d) for d in shape)
        arr = random_array(state.seed, self._prefix, wire, dims, state.scale)
        value = b.tensor_value(arr, wire, "random")
        state.arrays[self._prefix] = arr
        state.values[self._prefix] = value
        state.allocated[self._prefix] = value
        return b.weight(
            name=self._prefix, dtype=b.dtype(wire), shape=dims, device=device or b.cpu()
        )

    def allocate_as_bytes(self, dtype: Any = None) -> Any:
        state = self._state
        b = state.backend
        arr = self._generated(
            ValueError(
                f"RandomWeights.allocate_as_bytes: allocate '{self._prefix}' (dtype, shape)"
                " first, so there are bytes to view"
            )
        )
        raw = b.bytes_value(state.values[self._prefix], arr, _wire_of(arr), arr.shape)
        state.allocated[self._prefix] = raw
        return b.weight(name=self._prefix, dtype=b.DType.uint8, shape=raw.shape, device=b.cpu())

    @property
    def allocated_weights(self) -> dict[str, Any]:
        return self._state.allocated

    def close(self) -> None:
        state = self._state
        state.arrays.clear()
        state.values.clear()
        state.allocated.clear()


def _wire_of(arr: np.ndarray) -> str:
    return from_numpy_dtype(arr.dtype)
