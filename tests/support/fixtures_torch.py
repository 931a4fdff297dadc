"""Real PyTorch checkpoints for tests, written with ``torch.save`` (needs torch).

Each ``write_*`` function saves a checkpoint and returns what it saved, so a test can compare a
reader's or a server's answer with ``torch.load(path, weights_only=True)``. ``rewrite_archive``
rebuilds a checkpoint's zip (another folder name, compressed records, replaced records), and
the ``op_*`` helpers write pickles opcode by opcode for hostile or malformed ``data.pkl``.
"""

from __future__ import annotations

import json
import struct
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

# --------------------------------------------------------------------------- checkpoints


def dtype_tensors() -> dict[str, torch.Tensor]:
    """One small tensor per dtype a state dict commonly holds (v2 and v3 pickle paths)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g)
    return {
        "f32": base,
        "f64": base.double() * 3,
        "f16": (base * 2).half(),
        "bf16": (base * 4).bfloat16(),
        "i64": torch.arange(-6, 6, dtype=torch.int64).reshape(3, 4) * 1_000_000_007,
        "i32": torch.arange(-6, 6, dtype=torch.int32),
        "i16": torch.arange(-6, 6, dtype=torch.int16),
        "i8": torch.arange(-6, 6, dtype=torch.int8).reshape(2, 6),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "c64": torch.complex(base, -base),
        "u16": torch.arange(65530, 65536, dtype=torch.int32).to(torch.uint16),  # v3 path
        "f8e4m3": base.to(torch.float8_e4m3fn),  # v3 path
    }


def write_dtypes(path: Path) -> dict[str, torch.Tensor]:
    tensors = dtype_tensors()
    torch.save(tensors, path)
    return tensors


def write_views(path: Path) -> dict[str, torch.Tensor]:
    """Views saved directly: tied weights, slices, transposes, steps, broadcasts.

    Everything derived from ``base`` shares one storage record in the archive.
    """
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    row = torch.arange(5, dtype=torch.float32).reshape(1, 5)
    tensors = {
        "base": base,
        "tied": base,  # the same tensor under a second name
        "rows": base[1:3],  # storage offset 6, contiguous
        "transposed": base.t(),  # strides (1, 6)
        "every_other": base[:, ::2],  # strides (6, 2)
        "column": base[:, 4],  # offset 4, stride (6,)
        "element": base[3, 5],  # a 0-d view at offset 23
        "expanded": row.expand(3, 5),  # stride 0
    }
    torch.save(tensors, path)
    return tensors


def write_offset_only(path: Path) -> torch.Tensor:
    """A slice saved without its base: its record still holds the whole storage."""
    big = torch.arange(100, dtype=torch.int64)
    part = big[40:50]
    torch.save({"part": part}, path)
    return part


def write_edge_shapes(path: Path) -> dict[str, torch.Tensor]:
    tensors = {
        "scalar": torch.tensor(3.5),
        "int_scalar": torch.tensor(7, dtype=torch.int64),
        "empty_rows": torch.zeros(0, 3),
        "empty_cols": torch.ones(2, 0, dtype=torch.float16),
        "one": torch.ones(1, 1, 1),
    }
    torch.save(tensors, path)
    return tensors


def write_nested(path: Path) -> dict:
    """A training checkpoint: nested state dicts plus plain values."""
    obj = {
        "state_dict": {"fc.weight": torch.ones(2, 3), "fc.bias": torch.zeros(2)},
        "model": {"encoder": {"weight": torch.eye(3), "layers": [torch.ones(2), torch.zeros(1)]}},
        "epoch": 3,
        "lr": 0.25,
        "arch": "mlp",
        "betas": (0.9, 0.999),
        "done": False,
    }
    torch.save(obj, path)
    return obj


def make_module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.LayerNorm(16),
        torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32),
        torch.nn.Embedding(10, 16),
    )


def write_module_state(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    state = make_module(seed).state_dict()
    torch.save(state, path)
    return dict(state)


def write_sharded(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    n_shards: int = 2,
    *,
    index: bool = True,
    stem: str = "pytorch_model",
) -> dict[str, str]:
    """Split ``tensors`` over ``n_shards`` files (HF naming) and write the index; returns the
    weight map (name -> shard file name)."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for k in range(n_shards):
        shard = f"{stem}-{k + 1:05d}-of-{n_shards:05d}.bin"
        part = {n: tensors[n] for n in names[k::n_shards]}
        torch.save(part, directory / shard)
        weight_map.update(dict.fromkeys(part, shard))
    if index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / f"{stem}.bin.index.json").write_text(json.dumps(doc, indent=2))
    return weight_map


# --------------------------------------------------------------------------- zip surgery


def archive_prefix(path: Path) -> str:
    with zipfile.ZipFile(path) as zf:
        return next(n[: -len("data.pkl")] for n in zf.namelist() if n.endswith("/data.pkl"))


def rewrite_archive(
    src: Path,
    dst: Path,
    *,
    prefix: str | None = None,
    compress: Iterable[str] = (),
    replace: Mapping[str, bytes] | None = None,
) -> None:
    """Copy a checkpoint's records into a new zip.

    ``prefix``: a new folder name (with its trailing "/"); ``compress``: relative record names
    or name prefixes (``"data/"``) to deflate; ``replace``: relative name -> new bytes. Other
    records stay ZIP_STORED (Python's zipfile writes no alignment padding, which is allowed).
    """
    old = archive_prefix(src)
    new = old if prefix is None else prefix
    compress = tuple(compress)
    replace = dict(replace or {})
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            rel = info.filename[len(old) :]
            data = replace.pop(rel, None)
            data = zin.read(info) if data is None else data
            method = zipfile.ZIP_DEFLATED if rel.startswith(compress) else zipfile.ZIP_STORED
            zout.writestr(zipfile.ZipInfo(new + rel), data, compress_type=method)
        for rel, data in replace.items():  # records the source did not have
            zout.writestr(zipfile.ZipInfo(new + rel), data)


def replace_data_pkl(src: Path, dst: Path, data_pkl: bytes) -> None:
    rewrite_archive(src, dst, replace={"data.pkl": data_pkl})


# --------------------------------------------------------------------------- pickle opcodes
# Protocol-2 opcodes, enough to write a state dict (or a hostile one) without any Pickler.


def op_global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def op_str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def op_int(i: int) -> bytes:
    return b"J" + struct.pack("<i", i)


def op_tuple(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def op_call(func: bytes, *args: bytes) -> bytes:
    """REDUCE: push ``func``, push the argument tuple, call."""
    return func + op_tuple(*args) + b"R"


def op_dict(pairs: Iterable[tuple[bytes, bytes]]) -> bytes:
    return b"}(" + b"".join(k + v for k, v in pairs) + b"u"


def op_pickle(body: bytes) -> bytes:
    return b"\x80\x02" + body + b"."


def op_storage(key: str, numel: int, storage_type: str = "FloatStorage") -> bytes:
    """BINPERSID of torch's storage id ('storage', torch.<type>, key, 'cpu', numel)."""
    pid = op_tuple(
        op_str("storage"),
        op_global("torch", storage_type),
        op_str(key),
        op_str("cpu"),
        op_int(numel),
    )
    return pid + b"Q"


def op_tensor(storage: bytes, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    """torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())."""
    return op_call(
        op_global("torch._utils", "_rebuild_tensor_v2"),
        storage,
        op_int(offset),
        op_tuple(*map(op_int, size)),
        op_tuple(*map(op_int, stride)),
        b"\x89",  # NEWFALSE
        op_call(op_global("collections", "OrderedDict")),
    )


def write_float_checkpoint(path: Path, n: int = 12) -> torch.Tensor:
    """``{"weight": arange(n) float32}``: storage key "0" with n elements, for splicing."""
    weight = torch.arange(n, dtype=torch.float32)
    torch.save({"weight": weight}, path)
    return weight


def write_with_payload(path: Path, work: Path, payload: bytes) -> None:
    """A valid-looking checkpoint whose data.pkl is ``{"weight": <tensor>, "config": payload}``.

    ``payload`` is opcodes that push one object (e.g. ``op_call(op_global("os", "system"),
    op_str("..."))``). The storage record is real, so ``torch.load(weights_only=False)`` would
    run the payload; weightserve must refuse it before anything is called.
    """
    write_float_checkpoint(work, 12)
    body = op_dict(
        [
            (op_str("weight"), op_tensor(op_storage("0", 12), 0, (12,), (1,))),
            (op_str("config"), payload),
        ]
    )
    replace_data_pkl(work, path, op_pickle(body))
