"""A completed load never changes, whatever is written to the root afterwards or meanwhile.

- Same-node handoff, in a client process of its own (a fault would show as its death): the
  arrays loaded keep their bytes and the process lives on after the file is overwritten in
  place with other bytes of the same size, with a shorter file, or truncated to zero; for a
  model root's file (a sealed snapshot, or a copy when the snapshot budget is spent) and for
  the node cache's own file while its origin is overwritten.
- During a load: the handoff's trials return version A whole, B whole, or an error (the
  streams are tested the same way in test_revisions.py); after a load over HTTP and gRPC the
  received arrays are unchanged.
- The snapshot is made once per file version and shared: two clients map the same memfd; it
  is let go when the file changes; the budget is kept (a model larger than it keeps its first
  snapshots and copies the rest); an older client (no ``can_copy``) gets such tensors over a
  stream; the budget's setting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
from safetensors.numpy import save_file

from tests.support.faults import MIB, save_atomic, tensors
from tests.support.paths import REPO
from tests.support.proc_maps import mapping_of
from tests.support.revisions import overwrite_in_place
from weightserve.client._client import Client
from weightserve.client.errors import WeightserveError
from weightserve.client.transports.handoff import HandoffClient, handoff_socket_path
from weightserve.client.wire.handoff import FILE_COPY, FILE_OWNED, FILE_SEALED, encode_frame
from weightserve.client.wire.handoff import read_frame as read_handoff_frame
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.files import snapshots

# A client process: loads the model over the handoff, prints each array's xxh3 and the
# descriptors it mapped, waits for a line on stdin (the test writes the file meanwhile), then
# prints the digests again from the same arrays.
CLIENT = r"""
import json, sys
import xxhash
from weightserve.client import Client

url, model_id = sys.argv[1], sys.argv[2]
with Client(url, data_plane="handoff") as client:
    got = client.model(model_id).fetch(prefix="")

def digests():
    return {name: xxhash.xxh3_64_hexdigest(arr.tobytes()) for name, arr in got.items()}

def mapped():
    found = []
    for line in open("/proc/self/maps"):
        parts = line.split(None, 5)
        if len(parts) == 6 and ("memfd:weightserve" in parts[5] or ".safetensors" in parts[5]):
            found.append([parts[3], int(parts[4]), parts[5].strip()])
    return found

print(json.dumps({"digests": digests(), "mapped": mapped(),
                  "writable": [bool(a.flags.writeable) for a in got.values()]}), flush=True)
sys.stdin.readline()
print(json.dumps({"digests": digests()}), flush=True)
"""


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTSERVE_TOKEN", raising=False)
    monkeypatch.delenv("WEIGHTSERVE_DATA_PLANE", raising=False)


def socket_dir() -> str:
    return tempfile.mkdtemp(prefix="ws-")  # Unix socket paths are short (107 bytes)


def digests_of(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    return {name: xxhash.xxh3_64_hexdigest(arr.tobytes()) for name, arr in arrays.items()}


def overwrite(path: Path, how: str) -> None:
    """In place (the same inode): other bytes of the same size, a shorter file, or nothing."""
    size = path.stat().st_size
    if how == "same-size":
        with open(path, "r+b") as f:
            f.write(os.urandom(size))
    elif how == "shorter":
        with open(path, "wb") as f:  # what cp of a smaller file does
            f.write(os.urandom(size // 3))
    else:
        os.truncate(path, 0)


class ClientProcess:
    """The CLIENT script in its own process, for one load."""

    def __init__(self, url: str, model_id: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, url, model_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def loaded(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise AssertionError(f"client died ({self.proc.returncode}): {self.stderr()}")
        return json.loads(line)

    def after_write(self) -> tuple[dict, int]:
        """The digests after the write, and the exit status (negative: killed by a signal)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        rc = self.proc.wait(30)
        assert line, f"client died ({rc}) after the write: {self.stderr()}"
        return json.loads(line), rc

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-2000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def local_server(root: Path, directory: str, **settings: object) -> WeightServer:
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, uds=f"{directory}/ws.sock",
        rescan_seconds=0, watch=False, **settings,  # type: ignore[arg-type]
    )  # fmt: skip
    return WeightServer(config)


@pytest.fixture
def one_model(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A root with model ``m``: one 4 MiB safetensors file."""
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    arrays = tensors(3, 4, MIB)
    save_file(arrays, str(root / "m" / "model.safetensors"))
    return root, arrays


@pytest.fixture
def sockets() -> Iterator[str]:
    directory = socket_dir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("how", ["same-size", "shorter", "empty"])
@pytest.mark.parametrize("budget", [None, 1], ids=["sealed-snapshot", "copy"])
def test_handoff_load_outlives_an_in_place_write(one_model, sockets, how, budget) -> None:
    root, arrays = one_model
    path = root / "m" / "model.safetensors"
    want = digests_of(arrays)
    with local_server(root, sockets, handoff_snapshot_bytes=budget):
        client = ClientProcess(f"unix://{sockets}/ws.sock", "m")
        try:
            first = client.loaded()
            assert first["digests"] == want
            if budget is None:  # mapped: a sealed memfd, never the file
                assert first["mapped"] and all("memfd:weightserve" in m[2] for m in first["mapped"])
                assert not any(first["writable"])
            else:  # copied out: nothing mapped
                assert first["mapped"] == [] and all(first["writable"])
            overwrite(path, how)
            after, rc = client.after_write()
        finally:
            client.close()
    assert rc == 0
    assert after["digests"] == want


@pytest.mark.parametrize("how", ["same-size", "shorter", "empty"])
def test_node_cache_files_are_mapped_and_outlive_the_origin(tmp_path, sockets, how) -> None:
    """The node cache's files are weightserve's own (written once, replaced by rename): the
    handoff maps them as they are; the origin written in place changes nothing loaded."""
    origin = tmp_path / "origin"
    (origin / "m").mkdir(parents=True)
    arrays = tensors(5, 4, MIB)
    save_file(arrays, str(origin / "m" / "model.safetensors"))
    config = ServerConfig(
        f"file://{origin}", http_port=0, grpc_port=0, flight_port=None,
        uds=f"{sockets}/ws.sock", cache_dir=str(tmp_path / "cache"), rescan_seconds=0,
        watch=False,
    )  # fmt: skip
    with WeightServer(config) as srv:
        client = ClientProcess(f"unix://{sockets}/ws.sock", "m")
        try:
            first = client.loaded()
            assert first["digests"] == digests_of(arrays)
            cached = [m for m in first["mapped"] if "node-cache" in m[2]]
            assert cached and not any("memfd" in m[2] for m in first["mapped"])
            overwrite(origin / "m" / "model.safetensors", how)
            after, rc = client.after_write()
        finally:
            client.close()
        got = HandoffClient(handoff_socket_path(srv.config.uds)).open("m", prefix="")
        assert {f.kind for f in got.files} == {FILE_OWNED}
    assert rc == 0
    assert after["digests"] == digests_of(arrays)


def test_two_clients_share_one_sealed_snapshot(one_model, sockets) -> None:
    root, arrays = one_model
    path = root / "m" / "model.safetensors"
    with local_server(root, sockets) as srv:
        handoff = HandoffClient(handoff_socket_path(srv.config.uds))
        first, second = handoff.open("m", prefix=""), handoff.open("m", prefix="")
        assert [f.kind for f in first.files] == [FILE_SEALED]
        assert first.files[0].identity == second.files[0].identity
        st = path.stat()
        assert first.files[0].identity != (st.st_dev, st.st_ino)  # not the file
        assert srv._handoff.snapshots.bytes_held == st.st_size  # type: ignore[union-attr]
        # Two client processes map the same memfd (device and inode of their mappings).
        clients = [ClientProcess(f"unix://{sockets}/ws.sock", "m") for _ in range(2)]
        try:
            seen = [c.loaded()["mapped"] for c in clients]
        finally:
            for c in clients:
                c.close()
        inodes = [{(m[0], m[1]) for m in found} for found in seen]
        assert len(inodes[0]) == 1 and inodes[0] == inodes[1]
        for name, arr in arrays.items():
            assert first.tensors[name].buffer.tobytes() == arr.tobytes(), name


def test_snapshots_keep_to_the_budget_and_follow_the_file(tmp_path, sockets, monkeypatch):
    monkeypatch.setattr(snapshots, "SWEEP_SECONDS", 0.0)
    root = tmp_path / "root"
    for name, seed in (("a", 1), ("b", 2)):
        (root / name).mkdir(parents=True)
        save_file(tensors(seed, 2, MIB), str(root / name / "model.safetensors"))
    size = (root / "a" / "model.safetensors").stat().st_size
    with local_server(root, sockets, handoff_snapshot_bytes=size + 4096) as srv:
        store = srv._handoff.snapshots  # type: ignore[union-attr]
        handoff = HandoffClient(handoff_socket_path(srv.config.uds))
        a = handoff.open("a", prefix="")
        assert [f.kind for f in a.files] == [FILE_SEALED]
        # The server lets go of a's snapshot just after the descriptor is sent: a held one is
        # never evicted, so wait for that before asking for b.
        deadline = time.monotonic() + 5
        while any(s.holds for s in store._snapshots.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        b = handoff.open("b", prefix="")  # room for one: a's snapshot goes (a keeps its pages)
        assert [f.kind for f in b.files] == [FILE_SEALED]
        assert store.bytes_held == size
        assert a.tensors["t0"].buffer.tobytes() == tensors(1, 2, MIB)["t0"].tobytes()
        # A new version of b (renamed over): the old snapshot is let go, the new one made.
        save_atomic(tensors(9, 2, MIB), root / "b" / "model.safetensors")
        srv.rescan()
        fresh = handoff.open("b", prefix="")
        assert fresh.files[0].identity != b.files[0].identity
        assert fresh.tensors["t1"].buffer.tobytes() == tensors(9, 2, MIB)["t1"].tobytes()
        assert store.bytes_held == size


def test_a_file_larger_than_the_budget_is_copied(one_model, sockets) -> None:
    root, arrays = one_model
    with local_server(root, sockets, handoff_snapshot_bytes=MIB) as srv:
        got = HandoffClient(handoff_socket_path(srv.config.uds)).open("m", prefix="")
        assert [f.kind for f in got.files] == [FILE_COPY]
        for name, arr in arrays.items():
            assert got.tensors[name].buffer.tobytes() == arr.tobytes(), name
            assert got.tensors[name].buffer.flags.writeable  # the client's own copy
        assert srv._handoff.snapshots.bytes_held == 0  # type: ignore[union-attr]
        # The Client fetches the same bytes, and maps nothing of the file.
        with Client(f"unix://{sockets}/ws.sock") as client:
            fetched = client.model("m").fetch(prefix="")
        assert digests_of(fetched) == digests_of(arrays)
        assert not any(mapping_of(arr).startswith("/") for arr in fetched.values())  # no file


def test_an_older_client_gets_mutable_files_over_a_stream(one_model, sockets) -> None:
    """A client that does not say ``can_copy`` would map what it is given: tensors of a file
    that may change are named under ``copy`` (fetched over a stream), with no descriptor."""
    root, _ = one_model
    with local_server(root, sockets, handoff_snapshot_bytes=1) as srv:
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(handoff_socket_path(srv.config.uds))
            s.sendall(encode_frame({"op": "open", "model": "m", "prefix": ""}))
            fds: list[int] = []
            answer = read_handoff_frame(s, fds)
            assert answer is not None
            s.sendall(encode_frame({"op": "done"}))
        assert fds == [] and answer["files"] == [] and answer["tensors"] == []
        assert sorted(answer["copy"]) == ["t0", "t1", "t2", "t3"]


def test_overwrite_in_place_during_handoffs_never_mixes(tmp_path: Path, sockets: str) -> None:
    """As test_revisions.py does for the streams: the writer starts at a point that varies
    between trials, before or while the snapshot is made and the client maps and checks."""
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    path = root / "m" / "model.safetensors"
    version_a, version_b = tensors(21, 8, 2 * MIB), tensors(22, 8, 2 * MIB)
    save_file(version_b, path)
    bytes_b = path.read_bytes()
    outcomes = {"A": 0, "B": 0, "error": 0}
    rng = np.random.default_rng(11)
    with local_server(root, sockets) as srv, Client(f"unix://{sockets}/ws.sock") as client:
        for trial in range(12):
            save_atomic(version_a, path)
            srv.rescan()
            how = ("cp", "rewrite")[trial % 2]
            writer = threading.Timer(
                float(rng.uniform(0, 0.03)), overwrite_in_place, (path, bytes_b, how)
            )
            writer.start()
            try:
                got = client.model("m").fetch(prefix="")
            except WeightserveError:
                outcomes["error"] += 1
                got = None
            writer.join()  # the file is B now: what was loaded must not have followed it
            if got is not None:
                same_a = [got[n].tobytes() == version_a[n].tobytes() for n in version_a]
                same_b = [got[n].tobytes() == version_b[n].tobytes() for n in version_b]
                assert all(same_a) or all(same_b), f"mixed: A {same_a}, B {same_b}"
                outcomes["A" if all(same_a) else "B"] += 1
    assert sum(outcomes.values()) == 12, outcomes


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_streamed_loads_outlive_an_in_place_write(one_model, transport: str) -> None:
    root, arrays = one_model
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0, watch=False
    )
    with WeightServer(config) as srv:
        url = srv.http_url if transport == "http" else srv.grpc_url
        with Client(url) as client:
            got = client.model("m").fetch(prefix="")
        overwrite(root / "m" / "model.safetensors", "shorter")
    assert digests_of(got) == digests_of(arrays)


def test_a_model_larger_than_the_budget_keeps_its_snapshots(tmp_path, sockets) -> None:
    """Room for one of two shards: the first is a snapshot, the second copied, on every load
    (a shard being handed out is never let go to make room for the next)."""
    root = tmp_path / "root"
    (root / "two").mkdir(parents=True)
    shards = [tensors(seed, 2, MIB) for seed in (31, 32)]
    for i, arrays in enumerate(shards):
        named = {f"s{i}.{name}": arr for name, arr in arrays.items()}
        save_file(named, str(root / "two" / f"model-0000{i + 1}-of-00002.safetensors"))
    size = (root / "two" / "model-00001-of-00002.safetensors").stat().st_size
    with local_server(root, sockets, handoff_snapshot_bytes=size + 4096) as srv:
        handoff = HandoffClient(handoff_socket_path(srv.config.uds))
        for _ in range(2):
            got = handoff.open("two", prefix="")
            assert [f.kind for f in got.files] == [FILE_SEALED, FILE_COPY]
            for i, arrays in enumerate(shards):
                for name, arr in arrays.items():
                    assert got.tensors[f"s{i}.{name}"].buffer.tobytes() == arr.tobytes()
        assert srv._handoff.snapshots.bytes_held == size  # type: ignore[union-attr]


def test_the_snapshot_budget_setting() -> None:
    from weightserve.service.config import SETTINGS_BY_DEST, byte_budget

    assert byte_budget("0") == 0 and byte_budget("8GiB") == 8 << 30
    with pytest.raises(argparse.ArgumentTypeError):
        byte_budget("plenty")
    setting = SETTINGS_BY_DEST["handoff_snapshot_bytes"]
    assert setting.env == "WEIGHTSERVE_HANDOFF_SNAPSHOT_BYTES"
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < snapshots.default_snapshot_bytes() <= total // 4
