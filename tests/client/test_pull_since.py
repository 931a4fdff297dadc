"""``weightserve pull --since R``: a directory pulled at revision R updated in place to the next
published revision, against a real server on loopback: unchanged files kept, the weights
patched from the delta stream, side files fetched whole, files the revision lacks removed, and
the result byte-identical to a fresh pull; a corrupted local file or an unknown R fetched whole.
"""

from __future__ import annotations

import filecmp
from pathlib import Path

import ml_dtypes
import numpy as np

from tests.support import publishing
from tests.support.commands import run_cli
from weightserve.client._client import Client
from weightserve.client._download import STATE_FILE
from weightserve.client.wire.dtypes import from_numpy_dtype
from weightserve.client.wire.file_patch import parse_safetensors_header
from weightserve.client.wire.safetensors_layout import LayoutEntry, safetensors_header
from weightserve.service.server import WeightServer

server = publishing.server  # the fixture: a server on loopback that takes publishes

MODEL = "team/policy"
WEIGHTS = "model.safetensors"


def first_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "layers.0.w": rng.standard_normal((1024, 1024)).astype(ml_dtypes.bfloat16),
        "norm": rng.standard_normal(1024).astype(np.float32),
        "embed.q": rng.integers(-128, 127, (256, 64), dtype=np.int8),
        "head": rng.standard_normal((32, 64)).astype(np.float32),
    }


def next_weights(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """1 % of the bfloat16 elements move, the head changes everywhere (sent whole), the rest
    stays."""
    rng = np.random.default_rng(1)
    nxt = {name: array.copy() for name, array in weights.items()}
    w = nxt["layers.0.w"].reshape(-1)
    moved = rng.choice(w.size, w.size // 100, replace=False)
    w[moved] = (w[moved].astype(np.float32) + 0.5).astype(ml_dtypes.bfloat16)
    nxt["head"] = rng.standard_normal(nxt["head"].shape).astype(np.float32)
    return nxt


def files_of(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def assert_same_tree(updated: Path, fresh: Path) -> None:
    assert files_of(updated) == files_of(fresh)  # no .partial, no state file, nothing stale
    for name in files_of(fresh):
        assert filecmp.cmp(updated / name, fresh / name, shallow=False), name


def publish_two(client: Client) -> tuple[str, str, dict[str, np.ndarray]]:
    """R1 (weights, config, tokenizer, a notes file), then R2 (weights stepped, config
    changed, tokenizer the same, no notes file): both commits and R1's weights."""
    weights = first_weights()
    tokenizer = b'{"model_max_length": 128}\n'
    r1 = client.publish(
        MODEL,
        weights,
        files={"config.json": b'{"step": 1}\n', "tokenizer.json": tokenizer, "notes.txt": b"r1"},
    )
    r2 = client.publish(
        MODEL,
        next_weights(weights),
        files={"config.json": b'{"step": 2}\n', "tokenizer.json": tokenizer},
    )
    return r1.commit, r2.commit, weights


def test_pull_since_patches_in_place_and_matches_a_fresh_pull(
    server: WeightServer, tmp_path: Path
) -> None:
    url = f"{server.http_url}/v1/models/{MODEL}"
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    with Client(server.http_url) as client:
        r1, _, weights = publish_two(client)
        client.model(MODEL, revision=r1).download(out)
        client.model(MODEL).download(fresh)
    tokenizer_inode = (out / "tokenizer.json").stat().st_ino
    done = run_cli("pull", url, "--out", str(out), "--since", r1, "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert "1 patched" in done.stderr and "removed" in done.stderr, done.stderr
    assert_same_tree(out, fresh)
    assert not (out / "notes.txt").exists() and not (out / STATE_FILE).exists()
    assert (out / "tokenizer.json").stat().st_ino == tokenizer_inode  # kept, not rewritten
    with Client(server.http_url) as client:
        client.model(MODEL, revision=r1).download(out, force=True)  # back to R1
        model = client.model(MODEL)
        assert model.download(out, since=r1) == out  # the library form
        counts = model.last_update
    assert_same_tree(out, fresh)
    model_bytes = sum(a.nbytes for a in weights.values())
    assert (counts["kept"], counts["patched"], counts["whole"], counts["removed"]) == (1, 1, 1, 1)
    # 1 % of the bfloat16 elements and the head: a few percent of the model.
    assert counts["wire_bytes"] < model_bytes // 10, counts
    assert counts["wire_bytes"] >= weights["head"].nbytes


def test_a_corrupted_local_file_is_fetched_whole(server: WeightServer, tmp_path: Path) -> None:
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    with Client(server.http_url) as client:
        r1, _, _ = publish_two(client)
        client.model(MODEL, revision=r1).download(out)
        client.model(MODEL).download(fresh)
        with open(out / WEIGHTS, "r+b") as f:  # a byte of the tensor no revision changed
            prefix = f.read(8)
            layout = parse_safetensors_header(prefix + f.read(int.from_bytes(prefix, "little")))
            assert layout is not None
            at = layout.data_start + layout.tensors["embed.q"][2] + 5
            f.seek(at)
            flipped = f.read(1)[0] ^ 0xFF
            f.seek(at)
            f.write(bytes([flipped]))
        model = client.model(MODEL)
        model.download(out, since=r1)
    assert_same_tree(out, fresh)
    assert model.last_update["patched"] == 0
    assert model.last_update["wire_bytes"] >= (fresh / WEIGHTS).stat().st_size


def test_an_unknown_since_fetches_the_changed_files_whole(
    server: WeightServer, tmp_path: Path
) -> None:
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    with Client(server.http_url) as client:
        r1, _, _ = publish_two(client)
        client.model(MODEL, revision=r1).download(out)
        client.model(MODEL).download(fresh)
        model = client.model(MODEL)
        model.download(out, since="0" * 40)  # a revision the server never held
    counts = model.last_update
    assert (counts["patched"], counts["whole"], counts["removed"]) == (0, 2, 0)
    assert counts["wire_bytes"] >= (fresh / WEIGHTS).stat().st_size
    assert (out / "notes.txt").exists()  # R unknown: which files were R's is unknown too
    (out / "notes.txt").unlink()
    assert_same_tree(out, fresh)


def test_a_changed_layout_is_fetched_whole(server: WeightServer, tmp_path: Path) -> None:
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    with Client(server.http_url) as client:
        r1, r2, weights = publish_two(client)
        grown = dict(weights, head=np.zeros((33, 64), np.float32))
        client.publish(MODEL, grown, base=r2)
        client.model(MODEL, revision=r1).download(out)
        client.model(MODEL).download(fresh)
        model = client.model(MODEL)
        model.download(out, since=r1)
    assert model.last_update["patched"] == 0
    assert_same_tree(out, fresh)


def test_a_header_that_changed_in_metadata_only_is_rewritten_locally(
    server: WeightServer, tmp_path: Path
) -> None:
    """A longer header moves the data: it is copied to its new offset, no tensor travels."""
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    weights = first_weights()
    entries = [
        LayoutEntry(n, from_numpy_dtype(a.dtype), a.shape, a.nbytes) for n, a in weights.items()
    ]
    data = b"".join(a.tobytes() for a in weights.values())
    with Client(server.http_url) as client:
        r1 = client.publish(MODEL, files={WEIGHTS: safetensors_header(entries) + data}).commit
        header = safetensors_header(entries, {"format": "pt", "step": "2" * 100})
        client.publish(MODEL, files={WEIGHTS: header + data})
        client.model(MODEL, revision=r1).download(out)
        client.model(MODEL).download(fresh)
        model = client.model(MODEL)
        model.download(out, since=r1)
    assert model.last_update["patched"] == 1, model.last_update
    assert model.last_update["wire_bytes"] < 4096, model.last_update
    assert_same_tree(out, fresh)
