"""PyTorch zip checkpoints (``torch.save`` since 1.6), read without torch and without pickle code.

A checkpoint is a zip archive with one folder (``archive/``, or the file stem for writers that
save to a path) holding ``data.pkl`` (the pickled object tree), ``byteorder`` and one record
``data/<key>`` per storage. Tensors in the pickle are calls such as
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` whose storage is a
persistent id ``('storage', torch.FloatStorage, key, location, numel)``.

Safety: ``data.pkl`` is read by a restricted unpickler. ``find_class`` is the only way a pickle
can obtain a callable (GLOBAL, STACK_GLOBAL, INST and EXT all go through it), and it answers a
short allow-list with inert placeholders of this module that only record arguments; any other
global raises ``ForbiddenPickleGlobal`` before anything is called. Placeholders refuse BUILD and
are not types (so NEWOBJ cannot instantiate them); persistent ids must be plain tuples. The
allow-list: ``collections.OrderedDict``, the ``torch._utils._rebuild_tensor*`` and
``_rebuild_parameter*`` functions, ``torch.*Storage`` classes, ``torch.<dtype>`` and, for bytes
values, ``_codecs.encode`` restricted to latin-1. Walking the unpickled tree is bounded too
(depth, and work proportional to the pickle's size), so shared or cyclic containers cannot
make it explode.

Choices: the object may be any nesting of dicts (and lists) of tensors; names are dotted paths
("model.encoder.weight"; int keys count as names, other keys are skipped). Simple non-tensor
values (str, int within 64 bits, float, bool, None, and lists of those) become model metadata
under their dotted name; anything else (bytes, dtypes, ...) is ignored. Tensors are
listed sorted by name, as for safetensors. Storages must be stored uncompressed so they can be
served from the mmap. Legacy (pre-1.6) and big-endian checkpoints are refused with a message
that says how to re-save them.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import struct
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from weightserve.client.wire.dtypes import wire_dtype
from weightserve.service.readers.base import ModelContents, TensorEntry
from weightserve.service.readers.errors import (
    BadMagic,
    CompressedStorage,
    DuplicateTensor,
    ForbiddenPickleGlobal,
    HeaderTooLarge,
    IndexMismatch,
    MalformedHeader,
    MalformedPickle,
    OffsetOutOfFile,
    SizeMismatch,
    UnknownDType,
    UnsupportedVersion,
)

MAX_PICKLE_BYTES = 256 << 20  # data.pkl is headers only; 100k tensors need a few MB
MAX_INDEX_BYTES = 64 << 20
_MAX_DEPTH = 64
_CHECKPOINT_SUFFIXES = {".bin", ".pt", ".pth"}
# The index of a variant (pytorch_model.bin.index.fp16.json) names that variant's shards.
_VARIANT_INDEX = re.compile(r"\.(?:bin|pt|pth)\.index(?:\.[A-Za-z0-9_]+)?\.json$")
# Files the Hugging Face Trainer writes next to weights; they are not state dicts.
_NOT_WEIGHTS = {"training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"}
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# What zipfile raises on a damaged archive besides BadZipFile: undecodable record names
# (UnicodeDecodeError), "zip file version 25.5" or unknown compression (NotImplementedError),
# encrypted records (RuntimeError), broken deflate streams (zlib.error).
_ZIP_ERRORS = (
    zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError,
    NotImplementedError, RuntimeError, struct.error, zlib.error,
)  # fmt: skip

# torch dtype name -> wire dtype name. Known torch dtypes missing here can be named by a
# checkpoint but are refused (UnknownDType) when a tensor uses them.
_WIRE = {
    "float32": "float32", "float64": "float64", "float16": "float16", "bfloat16": "bfloat16",
    "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool",
    "complex64": "complex64", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "float8_e8m0fnu": "float8_e8m0fnu",
}  # fmt: skip
_OTHER_DTYPES = {
    "complex32", "complex128", "float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn_x2",
    "qint8", "qint32", "quint8", "quint4x2", "quint2x4",
}  # fmt: skip
# Legacy typed storage classes (still written for the classic dtypes) -> torch dtype name.
_STORAGES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "QInt8Storage": "qint8", "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8", "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}  # fmt: skip


class _Inert:
    """Base of the placeholders: no attribute dict, and BUILD (``__setstate__``) refused."""

    __slots__ = ()

    def __setstate__(self, state: object) -> None:
        raise pickle.UnpicklingError(f"BUILD on {self!r} is not allowed")


class _DType(_Inert):
    """``torch.<dtype>``; ``name`` is torch's dtype name."""

    __slots__ = ("name",)

    def __init__(self, name: str | None) -> None:
        self.name = name


class _StorageType(_DType):
    """``torch.<X>Storage``; ``name`` is its element dtype, None for UntypedStorage (bytes)."""

    __slots__ = ()


class _Storage(_Inert):
    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: str | None, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor(_Inert):
    __slots__ = ("storage", "dtype", "offset", "size", "stride")

    def __init__(self, storage: _Storage, dtype: str, offset: int, size, stride) -> None:
        self.storage, self.dtype, self.offset, self.size, self.stride = (
            storage, dtype, offset, size, stride)  # fmt: skip


class _Call(_Inert):
    """An allowed callable global: calls one of our argument-checking functions, nothing else."""

    __slots__ = ("fn",)

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class _StateDict(dict):
    """What ``collections.OrderedDict`` unpickles to; BUILD state (``_metadata``) is dropped."""

    __slots__ = ()

    def __setstate__(self, state: object) -> None:
        if state is not None and not isinstance(state, dict):
            raise pickle.UnpicklingError("unexpected OrderedDict state")


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise pickle.UnpicklingError(
            f"tensor {what} must be a tuple of ints >= 0, got {value!r:.200}"
        )
    return tuple(value)


def _tensor(storage, offset, size, stride, dtype: str | None, metadata=None) -> _Tensor:
    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0:
        raise pickle.UnpicklingError("tensor rebuilt from something that is not a storage")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride):
        raise pickle.UnpicklingError(f"size {size} and stride {stride} differ in rank")
    if metadata is not None and (not isinstance(metadata, dict) or any(metadata.values())):
        raise pickle.UnpicklingError(f"tensor flags {metadata!r:.200} (conj/neg bits) unsupported")
    if dtype is None:
        raise pickle.UnpicklingError("an untyped storage needs _rebuild_tensor_v3's dtype")
    return _Tensor(storage, dtype, offset, size, stride)


def _rebuild_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None):
    return _tensor(storage, offset, size, stride, getattr(storage, "dtype", None), metadata)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    if type(dtype) is not _DType or getattr(storage, "dtype", "") is not None:
        raise pickle.UnpicklingError("_rebuild_tensor_v3 needs an untyped storage and a dtype")
    return _tensor(storage, offset, size, stride, dtype.name, metadata)


def _rebuild_parameter(data, requires_grad, hooks, state=None):
    if not isinstance(data, _Tensor):
        raise pickle.UnpicklingError("a Parameter must wrap a tensor")
    return data  # requires_grad, hooks and Python state are training-time details


def _ordered_dict(items: Any = ()) -> _StateDict:
    return _StateDict(items)  # OrderedDict() or OrderedDict(pairs); REDUCE passes no kwargs


def _latin1(text: Any, encoding: Any) -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is allowed only as pickle writes bytes")
    return text.encode("latin-1")  # never another codec: some decompress or transform


_ALLOWED: dict[str, object] = {
    "collections.OrderedDict": _Call(_ordered_dict),
    "_codecs.encode": _Call(_latin1),  # protocol 2 writes bytes values this way
    "torch._utils._rebuild_tensor": _Call(lambda s, o, size, st: _rebuild_v2(s, o, size, st, 0, 0)),
    "torch._utils._rebuild_tensor_v2": _Call(_rebuild_v2),
    "torch._utils._rebuild_tensor_v3": _Call(_rebuild_v3),
    "torch._utils._rebuild_parameter": _Call(_rebuild_parameter),
    "torch._utils._rebuild_parameter_with_state": _Call(_rebuild_parameter),
    "torch.storage.UntypedStorage": _StorageType(None),
    "torch.UntypedStorage": _StorageType(None),
    **{f"torch.{name}": _StorageType(dtype) for name, dtype in _STORAGES.items()},
    **{f"torch.{name}": _DType(name) for name in (*_WIRE, *_OTHER_DTYPES)},
}


def _text(value: object) -> str | None:
    if isinstance(value, bytes):  # Python 2 era pickles store ASCII bytes
        value = value.decode("ascii", "replace")
    return value if isinstance(value, str) else None


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._path = path
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in _ALLOWED:
            raise ForbiddenPickleGlobal(
                self._path,
                f"data.pkl asks for {full!r}, which a state dict of tensors never needs; "
                "refused before anything was called (save model.state_dict() instead)",
            )
        return _ALLOWED[full]

    def persistent_load(self, pid: Any) -> _Storage:
        if not isinstance(pid, tuple) or len(pid) != 5:
            raise pickle.UnpicklingError(f"persistent id {pid!r:.200} is not a storage tuple")
        kind, stype, key, location, numel = pid
        key = _text(key)
        if (
            _text(kind) != "storage"
            or type(stype) is not _StorageType
            or key is None
            or not _KEY.fullmatch(key)
            or _text(location) is None
            or type(numel) is not int
            or numel < 0
        ):
            raise pickle.UnpicklingError(f"persistent id {pid!r:.200} is not a storage tuple")
        storage = self._storages.setdefault(key, _Storage(key, stype.name, numel))
        if (storage.dtype, storage.numel) != (stype.name, numel):
            raise pickle.UnpicklingError(f"storage {key} is declared with two types or sizes")
        return storage


def _check_magic(path: Path, head: bytes) -> None:
    if head.startswith(b"PK\x03\x04"):
        return
    resave = "load it with torch and re-save it with torch.save(obj, path) (zip format)"
    if head[:1] == b"\x80" and _LEGACY_MAGIC in head[:32]:
        raise UnsupportedVersion(path, f"legacy (pre-1.6, non-zip) torch.save format; {resave}")
    if head[257:262] == b"ustar":
        raise UnsupportedVersion(path, f"tar-based torch.save format (torch < 0.4); {resave}")
    if head[:1] == b"\x80":
        raise BadMagic(path, "a bare pickle, not a torch.save zip checkpoint")
    raise BadMagic(path, f"starts with {head[:4]!r}, not a zip local header b'PK\\x03\\x04'")


def _archive_prefix(path: Path, zf: zipfile.ZipFile) -> str:
    names = zf.namelist()
    if len(set(names)) != len(names):
        raise MalformedHeader(path, "the zip archive holds two records with the same name")
    # The folder is "archive/" for file objects and the file stem for paths; find it.
    found = [n[: -len("data.pkl")] for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if not found:
        raise BadMagic(path, "zip archive without <folder>/data.pkl: not a PyTorch checkpoint")
    if len(found) > 1:
        raise MalformedHeader(path, f"several data.pkl records: {sorted(found)}")
    prefix = found[0]
    if prefix + "constants.pkl" in names:
        raise UnsupportedVersion(path, "a TorchScript archive; save model.state_dict() instead")
    if prefix + "byteorder" in names:
        order = zf.read(prefix + "byteorder")[:16].strip()
        if order == b"big":
            raise UnsupportedVersion(
                path, "big-endian checkpoint; re-save it with torch.save on a little-endian host"
            )
        if order != b"little":
            raise MalformedHeader(path, f"byteorder record is {order!r}")
    return prefix


def _unpickle(path: Path, zf: zipfile.ZipFile, prefix: str) -> Any:
    info = zf.getinfo(prefix + "data.pkl")
    if info.file_size > MAX_PICKLE_BYTES:
        raise HeaderTooLarge(path, f"data.pkl is {info.file_size} bytes > {MAX_PICKLE_BYTES}")
    with zf.open(info) as f:  # the bounded read also stops a deflate bomb
        data = f.read(MAX_PICKLE_BYTES + 1)
    try:
        return _RestrictedUnpickler(data, path).load()
    except (ForbiddenPickleGlobal, MalformedPickle):
        raise
    except Exception as exc:  # any failure of an untrusted pickle is a malformed pickle
        raise MalformedPickle(path, f"data.pkl: {type(exc).__name__}: {exc}") from None


def _simple(value: object) -> bool:
    """A value that JSON (and so the model metadata) can carry as is."""
    if isinstance(value, str):
        try:  # pickled strings may hold lone surrogates, which no wire can carry
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    return (
        value is None
        or isinstance(value, (bool, float))
        or (type(value) is int and -(2**63) <= value < 2**64)
    )


def _flatten(path: Path, root: dict, budget: int) -> tuple[dict[str, _Tensor], dict[str, Any]]:
    """Dotted names for tensors and simple values.

    ``budget`` bounds the work: a legitimate tree costs at most a few units per byte of pickle,
    while shared or cyclic containers (memo references) could make a naive walk exponential.
    """
    tensors: dict[str, _Tensor] = {}
    meta: dict[str, Any] = {}

    def walk(obj: Any, name: str, depth: int) -> None:
        nonlocal budget
        budget -= 1 + (len(obj) if isinstance(obj, (dict, list, tuple)) else 0)
        if budget < 0 or depth > _MAX_DEPTH:
            raise MalformedPickle(path, f"object tree too deep or shared/cyclic at {name!r}")
        if isinstance(obj, _Tensor):
            if name in tensors:  # {"a": {"b": t}} and {"a.b": t} flatten to one name
                raise DuplicateTensor(path, "two tensors flatten to one dotted name", tensor=name)
            if not _simple(name):
                raise MalformedPickle(path, f"tensor name {name!r} is not valid UTF-8")
            tensors[name] = obj
        elif _simple(obj) or (isinstance(obj, (list, tuple)) and all(map(_simple, obj))):
            meta[name] = list(obj) if isinstance(obj, tuple) else obj
        elif isinstance(obj, (dict, list, tuple)):
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            for key, value in items:
                if isinstance(key, str) or (type(key) is int and _simple(key)):
                    walk(value, f"{name}.{key}" if name else str(key), depth + 1)
        # anything else (bytes, bare storages, dtypes) is not served: ignored

    walk(root, "", 0)
    return tensors, meta


class _Records:
    """Locates storage records: absolute data offsets from the local headers, checked once."""

    def __init__(self, path: Path, fh, zf: zipfile.ZipFile, prefix: str) -> None:
        self.path, self.fh, self.zf, self.prefix = path, fh, zf, prefix
        self.file_size = os.fstat(fh.fileno()).st_size
        self.found: dict[str, tuple[int, int]] = {}

    def locate(self, key: str, tensor: str) -> tuple[int, int]:
        if key not in self.found:
            self.found[key] = self._read_local_header(f"{self.prefix}data/{key}", tensor)
        return self.found[key]

    def _read_local_header(self, name: str, tensor: str) -> tuple[int, int]:
        path = self.path
        try:
            info = self.zf.getinfo(name)
        except KeyError:
            raise MalformedHeader(path, f"storage record {name!r} missing", tensor=tensor) from None
        self.fh.seek(info.header_offset)
        head = self.fh.read(30)
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise MalformedHeader(path, f"no local header for {name!r} at {info.header_offset}")
        flags, method = struct.unpack_from("<HH", head, 6)
        csize, usize, name_len, extra_len = struct.unpack_from("<IIHH", head, 18)
        if info.compress_type != zipfile.ZIP_STORED or method != 0 or flags & 1:
            raise CompressedStorage(
                path,
                f"record {name!r} uses compression method {method} (or encryption); storages "
                "must be stored so they can be served from the file; re-save with torch.save",
                tensor=tensor,
            )
        if self.fh.read(name_len).decode("utf-8", "replace") != info.orig_filename:
            raise MalformedHeader(path, f"local header of {name!r} names another record")
        sizes_known = not flags & 8 and 0xFFFFFFFF not in (csize, usize)
        if info.compress_size != info.file_size or (
            sizes_known and (csize, usize) != (info.compress_size, info.file_size)
        ):
            raise MalformedHeader(path, f"sizes of {name!r} disagree between zip headers")
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.file_size > self.file_size:
            raise OffsetOutOfFile(
                path,
                f"record {name!r} spans bytes {start}..{start + info.file_size} of a file of "
                f"{self.file_size} bytes",
                tensor=tensor,
            )
        return start, info.file_size


def _entry(path: Path, name: str, t: _Tensor, records: _Records) -> TensorEntry:
    wire = _WIRE.get(t.dtype)
    if wire is None:
        raise UnknownDType(path, f"torch dtype {t.dtype} has no wire dtype", tensor=name)
    itemsize = wire_dtype(wire).itemsize
    storage = t.storage
    storage_bytes = storage.numel * (itemsize if storage.dtype is not None else 1)
    start, record_bytes = records.locate(storage.key, name)
    if record_bytes < storage_bytes:
        raise SizeMismatch(
            path,
            f"storage record data/{storage.key} holds {record_bytes} bytes, the pickle declares "
            f"{storage.numel} elements = {storage_bytes} bytes",
            tensor=name,
        )
    numel = math.prod(t.size)
    if numel == 0:
        return TensorEntry(name, wire, t.size, path, start, 0, t.size)
    last = t.offset + sum((n - 1) * s for n, s in zip(t.size, t.stride, strict=True))
    if (last + 1) * itemsize > storage_bytes:
        raise OffsetOutOfFile(
            path,
            f"view reaches element {last} of a storage of {storage_bytes // itemsize} elements",
            tensor=name,
        )
    expected, contiguous = 1, True  # C order; strides of size-1 dims do not matter
    for n, s in zip(reversed(t.size), reversed(t.stride), strict=True):
        contiguous &= n == 1 or s == expected
        expected *= n
    strides = None if contiguous else t.stride
    offset = start + t.offset * itemsize
    return TensorEntry(name, wire, t.size, path, offset, numel * itemsize, t.size, strides=strides)


def read_checkpoint(path: Path) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """Index one zip checkpoint: its tensors by dotted name, and its simple values."""
    with open(path, "rb") as fh:
        _check_magic(path, fh.read(512))
        try:
            zf = zipfile.ZipFile(fh)
            prefix = _archive_prefix(path, zf)
            root = _unpickle(path, zf, prefix)
        except _ZIP_ERRORS as exc:
            raise MalformedHeader(path, f"damaged zip archive: {exc}") from None
        if not isinstance(root, dict):
            raise MalformedPickle(path, f"top-level object is {type(root).__name__}, not a dict")
        tensors, metadata = _flatten(path, root, 2 * zf.getinfo(prefix + "data.pkl").file_size)
        records = _Records(path, fh, zf, prefix)
        entries = {name: _entry(path, name, t, records) for name, t in tensors.items()}
    return entries, metadata


def _read_index(index: Path, paths: Sequence[Path]) -> tuple[dict[str, str], list[Path]]:
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise HeaderTooLarge(index, f"index larger than {MAX_INDEX_BYTES} bytes")
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise MalformedHeader(index, f"not a shard index with a weight_map: {exc}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and Path(v).name == v and v not in ("", ".", "..")
        for v in weight_map.values()
    ):
        raise IndexMismatch(index, "weight_map must map names to file names in its folder")
    beside = {p.name: p for p in paths if p.parent == index.parent}
    missing = sorted(set(weight_map.values()) - set(beside))
    if missing:
        raise IndexMismatch(index, f"shards named by the index are missing: {missing}")
    return weight_map, sorted(beside[n] for n in set(weight_map.values()))


class PytorchReader:
    """Reads one model: a single checkpoint, or shards with ``pytorch_model.bin.index.json``.

    With an index only the shards it names are read (other ``.bin`` files in the folder are
    ignored); without one every ``.bin``/``.pt``/``.pth`` except known Trainer artifacts is.
    """

    format: ClassVar[str] = "pytorch"

    def read(self, files: Sequence[Path]) -> ModelContents:
        paths = [Path(f) for f in files]
        indexes = [p for p in paths if _VARIANT_INDEX.search(p.name)]
        if len(indexes) > 1:
            raise IndexMismatch(indexes[0], f"several shard indexes: {[p.name for p in indexes]}")
        weight_map: dict[str, str] | None = None
        if indexes:
            weight_map, shards = _read_index(indexes[0], paths)
        else:
            shards = sorted(
                p
                for p in paths
                if p.suffix in _CHECKPOINT_SUFFIXES
                and p.name not in _NOT_WEIGHTS
                and not p.name.startswith("rng_state")
            )
            if not shards and len(paths) == 1:
                shards = paths  # a single file given explicitly, whatever its suffix
            if not shards:
                raise BadMagic(paths[0] if paths else "<no files>", "no PyTorch checkpoint")
        tensors: dict[str, TensorEntry] = {}
        metadata: dict[str, Any] = {}
        for shard in shards:
            entries, meta = read_checkpoint(shard)
            for name, entry in entries.items():
                if name in tensors:
                    raise DuplicateTensor(shard, f"also in {tensors[name].file.name}", tensor=name)
                tensors[name] = entry
            for key, value in meta.items():
                metadata.setdefault(key, value)
        if weight_map is not None:
            for name, entry in tensors.items():
                if weight_map.get(name) != entry.file.name:
                    raise IndexMismatch(
                        indexes[0],
                        f"found in {entry.file.name}, index says {weight_map.get(name)}",
                        tensor=name,
                    )
            absent = sorted(set(weight_map) - set(tensors))
            if absent:
                raise IndexMismatch(
                    indexes[0], f"not found in shard {weight_map[absent[0]]}", tensor=absent[0]
                )
        return ModelContents(self.format, dict(sorted(tensors.items())), metadata)
