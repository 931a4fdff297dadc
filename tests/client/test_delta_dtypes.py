"""Delta updates for every dtype against a real server: a worker's NumPy state holding one
revision is patched in place to the next, bit for bit (NaN payloads and signed zeros too), for
the plain dtypes a publish stores and for GGUF quantized blocks, which travel as byte patches
(a GGUF model served from the Hugging Face hub cache's layout, its ``refs/main`` moved)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from tests.support.publishing import serve
from tests.support.references import np_dtype, reference_gguf
from weightserve.client._client import Client
from weightserve.service.server import WeightServer

# One model per dtype: an element's bits are its item (1, 2, 4 or 8 bytes).
DTYPES = [
    "float16", "int8", "uint8", "int16", "int32", "int64", "float64", "float8_e4m3fn", "bool",
]  # fmt: skip
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@pytest.fixture(scope="module")
def publisher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightServer]:
    with serve(tmp_path_factory.mktemp("published"), allow_publish=True) as srv:
        yield srv


def two_revisions(dtype: str, density: float) -> tuple[dict[str, np.ndarray], ...]:
    """Revision 1 and 2 of a model of ``dtype``: in ``moved``, ``density`` of the elements get
    other bits (floats: any bits, NaN payloads included; the first moved one goes from +0 to
    the sign bit alone, -0.0 for floats); ``kept`` stays."""
    rng = np.random.default_rng(DTYPES.index(dtype))
    item = np_dtype(dtype).itemsize
    bits = _BITS[item]

    def random_array(shape: tuple[int, ...]) -> np.ndarray:
        if dtype == "bool":
            return rng.integers(0, 2, shape).astype(np.bool_)
        raw = rng.integers(0, 256, (*shape[:-1], shape[-1] * item), dtype=np.uint8)
        return raw.view(np_dtype(dtype))

    r1 = {"moved": random_array((256, 96)), "kept": random_array((64,))}
    flat1 = r1["moved"].reshape(-1).view(bits)
    moved = np.sort(rng.choice(flat1.size, int(flat1.size * density), replace=False))
    flat1[moved[0]] = 0
    r2 = {name: array.copy() for name, array in r1.items()}
    flat2 = r2["moved"].reshape(-1).view(bits)
    if dtype == "bool":
        flat2[moved] ^= 1
    else:
        flat2[moved] ^= rng.integers(1, 1 << (8 * item - 1), moved.size, dtype=np.uint64).astype(
            bits
        )
        flat2[moved[0]] = bits(1) << bits(8 * item - 1)
    return r1, r2


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("published_as", ["tensors", "patch"])
def test_each_dtype_is_patched_in_place_bit_for_bit(
    publisher: WeightServer, dtype: str, published_as: str
) -> None:
    """Published twice (the second whole, or as the publisher's patch against its base), a
    worker's copy of revision 1 becomes revision 2's bytes in the same buffers, the moved tensor
    sent as an element patch of the dtype's item."""
    model_id = f"dtypes/{dtype}-{published_as}"
    r1_weights, r2_weights = two_revisions(dtype, density=0.01)
    with Client(publisher.http_url) as c:
        r1 = c.publish(model_id, r1_weights)
        base_tensors = r1_weights if published_as == "patch" else None
        r2 = c.publish(model_id, r2_weights, base=r1.commit, base_tensors=base_tensors)
        state = {name: array.copy() for name, array in r1_weights.items()}
        held = {name: (array, address(array)) for name, array in state.items()}
        model = c.model(model_id)
        assert model.update(state, since=r1.commit).commit == r2.commit
        for name, array in r2_weights.items():
            assert state[name] is held[name][0] and address(state[name]) == held[name][1], name
            assert state[name].tobytes() == array.tobytes(), name
        done = model.last_update
        assert (done["same"], done["patch"], done["whole"], done["refetched"]) == (1, 1, 0, 0)
        assert done["wire_bytes"] < r2_weights["moved"].nbytes // 4
        updates = {u.name: u for u in model.iter_updates(since=r1.commit)}
    patch = updates["moved"]
    assert patch.kind == "patch" and patch.header.dtype == dtype
    assert patch.header.element_bytes == np_dtype(dtype).itemsize
    bits = _BITS[np_dtype(dtype).itemsize]
    old, new = (w["moved"].reshape(-1).view(bits) for w in (r1_weights, r2_weights))
    assert patch.positions is not None and patch.values is not None
    np.testing.assert_array_equal(patch.positions, np.flatnonzero(old != new))
    np.testing.assert_array_equal(patch.values, new[patch.positions])
    assert updates["kept"].kind == "same"


# GGUF: tensors as the writer stores them; quantized ones as uint8 blocks in byte shape.
Q = GGMLQuantizationType
QUANTIZED = {"blk.0.ffn_up.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q4_0}
HAND_BUILT_Q4_K = "blk.0.attn_q.weight"  # the writer takes any bytes of a K-quant's blocks
Q4_K_BLOCK = (256, 144)  # elements, bytes


def gguf_revision_1(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, Q | None]]:
    tensors: dict[str, tuple[np.ndarray, Q | None]] = {
        "token_embd.weight": (rng.standard_normal((32, 64)).astype(np.float32), None),
        "blk.0.attn_k.weight": (rng.standard_normal((16, 64)).astype(np.float16), None),
    }
    for name, kind in QUANTIZED.items():
        tensors[name] = (quantize(rng.standard_normal((48, 128)).astype(np.float32), kind), kind)
    blocks = rng.integers(0, 256, (8, 2 * Q4_K_BLOCK[1]), dtype=np.uint8)  # 8 x 512 elements
    tensors[HAND_BUILT_Q4_K] = (blocks, Q.Q4_K)
    tensors["output_norm.weight"] = (np.ones(64, dtype=np.float32), None)
    return tensors


def gguf_revision_2(
    r1: dict[str, tuple[np.ndarray, Q | None]], rng: np.random.Generator
) -> dict[str, tuple[np.ndarray, Q | None]]:
    """A few blocks of each quantized tensor quantized again from other values, a few float16
    elements moved; the rest as it was."""
    r2 = dict(r1)
    for name, kind in QUANTIZED.items():
        blocks, _ = r1[name]
        fresh = quantize(rng.standard_normal((48, 128)).astype(np.float32), kind)
        block_bytes = blocks.shape[1] // 4  # 128 elements: 4 blocks of 32 a row
        changed = blocks.copy()
        for row, block in ((3, 0), (17, 2), (40, 3)):
            span = slice(block * block_bytes, (block + 1) * block_bytes)
            changed[row, span] = fresh[row, span]
        r2[name] = (changed, kind)
    q4k = r1[HAND_BUILT_Q4_K][0].copy()
    q4k[5, Q4_K_BLOCK[1] : 2 * Q4_K_BLOCK[1]] = rng.integers(0, 256, Q4_K_BLOCK[1], np.uint8)
    r2[HAND_BUILT_Q4_K] = (q4k, Q.Q4_K)
    k = r1["blk.0.attn_k.weight"][0].copy()
    k.reshape(-1)[[7, 300, 900]] += np.float16(0.5)
    r2["blk.0.attn_k.weight"] = (k, None)
    return r2


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]]) -> None:
    writer = GGUFWriter(path, arch="llama")
    writer.add_name("delta dtypes")
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_snapshot(repo: Path, commit: str, tensors: dict[str, tuple[np.ndarray, Q | None]]) -> Path:
    """A snapshot as ``huggingface_hub`` lays it out: the file in ``blobs/`` under its hash, the
    snapshot's name a relative link to it; ``refs/main`` then names the snapshot."""
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    staged = repo / "blobs" / "incoming"
    write_gguf(staged, tensors)
    blob = repo / "blobs" / hashlib.sha256(staged.read_bytes()).hexdigest()
    os.replace(staged, blob)
    link = repo / "snapshots" / commit / "model.gguf"
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / "main").write_text(commit)
    return link


def test_gguf_quantized_blocks_travel_as_byte_patches(tmp_path: Path) -> None:
    """A worker holding a GGUF model's first snapshot is brought to the next one the hub cache
    gained: every tensor's bytes are the reference reader's of the new file, in the same
    buffers; the quantized tensors went as patches of single bytes."""
    rng = np.random.default_rng(26)
    repo = tmp_path / "hub" / "models--team--quant"
    r1_tensors = gguf_revision_1(rng)
    r2_tensors = gguf_revision_2(r1_tensors, rng)
    first, second = "1" * 40, "2" * 40
    r1_file = add_snapshot(repo, first, r1_tensors)
    # Over HTTP the fetched arrays are the worker's own, writable (the same-node handoff maps
    # the server's read-only snapshots instead).
    with serve(tmp_path / "hub") as srv, Client(srv.http_url, data_plane="http") as c:
        worker_model = c.model("team/quant/model.gguf")
        since = worker_model.commit
        state = worker_model.fetch(prefix="")
        held = {name: (array, address(array)) for name, array in state.items()}
        r2_file = add_snapshot(repo, second, r2_tensors)
        srv.rescan()
        model = c.model("team/quant/model.gguf")
        assert model.commit != since
        assert model.update(state, since=since).commit == model.commit
        done = model.last_update
        updates = {u.name: u for u in model.iter_updates(since=since)}
        # The snapshot's name in the cache names the same revision as its content commit.
        by_snapshot = {u.name: u.kind for u in model.iter_updates(since=first)}
    assert by_snapshot == {name: u.kind for name, u in updates.items()}
    reference_r1, reference_r2 = reference_gguf(r1_file), reference_gguf(r2_file)
    assert list(state) == list(reference_r2)
    for name, ref in reference_r2.items():
        assert state[name] is held[name][0] and address(state[name]) == held[name][1], name
        assert state[name].tobytes() == ref.array.tobytes(), name
    patched = [*QUANTIZED, HAND_BUILT_Q4_K, "blk.0.attn_k.weight"]
    assert (done["patch"], done["whole"], done["refetched"]) == (len(patched), 0, 0)
    assert done["same"] == len(reference_r2) - len(patched)
    assert {n for n, u in updates.items() if u.kind == "patch"} == set(patched)
    for name in [*QUANTIZED, HAND_BUILT_Q4_K]:
        update = updates[name]
        assert reference_r2[name].encoding is not None
        assert update.header.dtype == "uint8" and update.header.element_bytes == 1
        old = reference_r1[name].array.reshape(-1)
        new = reference_r2[name].array.reshape(-1)
        assert update.positions is not None and update.values is not None
        np.testing.assert_array_equal(update.positions, np.flatnonzero(old != new))
        applied = old.copy()
        applied[update.positions] = update.values
        assert applied.tobytes() == new.tobytes(), name
    assert updates["blk.0.attn_k.weight"].header.element_bytes == 2
    assert updates["blk.0.attn_k.weight"].positions.tolist() == [7, 300, 900]
