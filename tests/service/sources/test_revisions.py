"""Revisions from content, and no mixed data when a file changes under a stream.

- Byte-identical copies (new paths, inodes and mtimes) have one revision; one changed byte
  gives a new one. File digests are remembered by file identity across restarts.
- Two replicas of copied files behind a round-robin TCP proxy (a plain Kubernetes Service):
  a load whose connections land on both, and a resume on the other replica, succeed.
- A file overwritten in place (``cp`` over it, or rewritten through the same inode) while a
  load runs, over HTTP, gRPC with Flight and gRPC StreamTensors: every trial returns version
  A whole, version B whole, or raises a weightserve error. Never a mix.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.faults import (
    CHUNK,
    MIB,
    CuttingProxy,
    assert_arrays,
    connect,
    eventually,
    once,
    save_atomic,
    tensors,
)
from tests.support.revisions import overwrite_in_place
from weightserve.client._client import FetchOptions
from weightserve.client.errors import WeightserveError
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.files.stamps import file_stamp
from weightserve.service.sources.local.catalog import Catalog
from weightserve.service.sources.revisions.content import DigestStore


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTSERVE_TOKEN", raising=False)


def copy_root(src: Path, dst: Path) -> None:
    """A copy as ``cp -r`` makes it: new inodes and new mtimes."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)


def test_identical_copies_share_a_revision_and_a_changed_byte_does_not(tmp_path: Path) -> None:
    a = tmp_path / "a"
    (a / "org" / "m").mkdir(parents=True)
    save_file(tensors(1, 3, 4096), a / "org" / "m" / "model.safetensors")
    copy_root(a, tmp_path / "elsewhere" / "b")
    b = tmp_path / "elsewhere" / "b"
    first, second = Catalog(a), Catalog(b)
    assert first.get("org/m").revision == second.get("org/m").revision

    path = b / "org" / "m" / "model.safetensors"
    with open(path, "r+b") as f:  # one byte of tensor data, in place
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    second.scan()
    assert second.get("org/m").revision != first.get("org/m").revision


def test_file_digests_are_remembered_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * MIB + 17))
    stamp = file_stamp(path.stat())
    digest = DigestStore(tmp_path / "cache").digest(path, stamp)
    # A new store over the same directory (a restarted server) answers for this file version
    # without reading it: it does not even need the file to exist under that name.
    again = DigestStore(tmp_path / "cache").digest(tmp_path / "gone.bin", stamp)
    assert again == digest
    # A store without a directory has nothing remembered, and reads the file.
    with pytest.raises(FileNotFoundError):
        DigestStore().digest(tmp_path / "gone.bin", stamp)


def test_digests_computed_together_are_the_ones_each_file_has_and_are_remembered(
    tmp_path: Path,
) -> None:
    paths = []
    for i in range(50):
        paths.append(tmp_path / f"f{i}.json")
        paths[-1].write_bytes(b'{"i": %d}' % i)
    stamps = [file_stamp(p.stat()) for p in paths]
    store = DigestStore(tmp_path / "cache")
    store.prime(zip(paths, stamps, strict=True))
    alone = [DigestStore().digest(p, s) for p, s in zip(paths, stamps, strict=True)]
    assert [store.digest(p, s) for p, s in zip(paths, stamps, strict=True)] == alone
    # Written to the table together: a restarted server answers without the files.
    gone = tmp_path / "gone.bin"
    assert [DigestStore(tmp_path / "cache").digest(gone, s) for s in stamps] == alone


@pytest.mark.parametrize("transport", ["http", "grpc-streamtensors"])
def test_replicas_of_copied_files_behind_a_round_robin_proxy(
    tmp_path: Path, transport: str
) -> None:
    root = tmp_path / "a"
    (root / "big").mkdir(parents=True)
    big = tensors(5, 4, 6 * MIB)  # 24 MiB
    save_file(big, root / "big" / "model.safetensors")
    copy_root(root, tmp_path / "b")
    configs = [
        ServerConfig(str(r), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0)
        for r in (root, tmp_path / "b")
    ]
    with WeightServer(configs[0]) as one, WeightServer(configs[1]) as two:
        assert one.catalog.get("big").revision == two.catalog.get("big").revision
        port = "http_port" if transport == "http" else "grpc_port"
        # The cut (once, after 9 MiB) makes the client resume on a new connection, which the
        # proxy sends to the other replica.
        proxy = CuttingProxy([getattr(one, port), getattr(two, port)], cut_after=9 * MIB)
        try:
            scheme = "http" if transport == "http" else "grpc"
            with connect(f"{scheme}://127.0.0.1:{proxy.port}", transport, timeout=20) as client:
                model = client.model("big", FetchOptions(parallel=1, chunk_bytes=CHUNK))
                got = model.fetch(prefix="")
                assert_arrays(got, big)
                assert proxy.cuts == 1
                assert all(proxy.connections), proxy.connections  # both replicas served
                # Whole loads on alternating replicas, each pinned to the revision of the info
                # that the other replica answered.
                for _ in range(3):
                    assert_arrays(client.model("big").fetch(prefix=""), big)
        finally:
            proxy.close()


@pytest.mark.parametrize("how", ["cp", "rewrite"])
@pytest.mark.parametrize("transport", ["http", "grpc", "grpc-streamtensors"])
def test_overwrite_in_place_during_loads_never_mixes(
    tmp_path: Path, transport: str, how: str
) -> None:
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    path = root / "m" / "model.safetensors"
    version_a, version_b = tensors(21, 8, 2 * MIB), tensors(22, 8, 2 * MIB)  # 16 MiB each
    save_file(version_b, path)
    bytes_b = path.read_bytes()
    save_atomic(version_a, path)
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0, watch=False
    )
    outcomes = {"A": 0, "B": 0, "error": 0}
    rng = np.random.default_rng(7)
    with WeightServer(config) as srv:
        url = srv.http_url if transport == "http" else srv.grpc_url
        with connect(url, transport, timeout=20) as client:
            revision_a = client.model("m").info.revision
            for _trial in range(8):
                save_atomic(version_a, path)  # back to A, and wait until it is served again
                eventually(
                    lambda: client.model("m").info.revision == revision_a, 5, "A served again"
                )
                writer = threading.Thread(target=overwrite_in_place, args=(path, bytes_b, how))

                # The overwrite starts while the stream runs, from the reading thread, at a
                # point that varies between trials; it then races with the server's reads.
                trigger = once(writer.start, after_bytes=int(rng.integers(1, 12)) * MIB)
                model = client.model("m", FetchOptions(parallel=1, chunk_bytes=CHUNK))
                try:
                    got = model.fetch(prefix="", on_bytes=trigger)
                except WeightserveError:
                    outcomes["error"] += 1
                else:
                    names = list(version_a)
                    same_a = [got[n].tobytes() == version_a[n].tobytes() for n in names]
                    same_b = [got[n].tobytes() == version_b[n].tobytes() for n in names]
                    assert all(same_a) or all(same_b), (
                        f"mixed data: tensors from A {same_a}, from B {same_b}"
                    )
                    outcomes["A" if all(same_a) else "B"] += 1
                if writer.ident is not None:  # it started
                    writer.join()
    # Each trial ended one of the three honest ways; the counts show which happened.
    assert sum(outcomes.values()) == 8, outcomes
