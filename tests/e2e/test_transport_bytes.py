"""Bytes on the wire, over HTTP and gRPC, against each format's reference reader.

Every tensor of every model of the shared root (``model_root``) is fetched singly, by a name
list and by prefix, and must be byte-identical to what ``safetensors.safe_open``,
``gguf.GGUFReader`` or ``torch.load(weights_only=True)`` return, with the same dtype and shape.
Shards must equal ``numpy.array_split`` of the whole tensor (GGML blocks: split on block
boundaries along the last axis). Resume, digest checks and broken connections are exercised
with a server-side byte flip and a loopback TCP proxy that cuts one connection.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from tests.support._util import record_streams
from tests.support.environment import child_environment
from tests.support.references import PACKED_DTYPES, Ref, np_dtype
from weightserve.client._client import Client, FetchOptions
from weightserve.client.errors import DataCorruption, InvalidRequest
from weightserve.client.transports.base import StreamParams
from weightserve.client.transports.flight import FlightPool

# "grpc" moves tensor data over the server's Arrow Flight endpoint (what gRPC clients do by
from weightserve.service.serving import streams as streaming
from weightserve.service.transports import flight as flight_app

# "grpc" moves tensor data over the server's Arrow Flight endpoint (what gRPC clients do by
# default); "grpc-streamtensors" keeps it on the gRPC service's own StreamTensors.
TRANSPORTS = ("http", "grpc", "grpc-streamtensors")


@pytest.fixture(params=TRANSPORTS, scope="module")
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


def url_of(server, transport: str) -> str:
    return server.http_url if transport == "http" else server.grpc_url


def connect(server, transport: str, url: str | None = None) -> Client:
    return Client(url or url_of(server, transport), flight=transport != "grpc-streamtensors")


@pytest.fixture(scope="module")
def client(server, transport: str) -> Iterator[Client]:
    with connect(server, transport) as c:
        yield c


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, what
    assert got.shape == want.shape, what
    assert got.tobytes() == want.tobytes(), what


def assert_all_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, arr in want.items():
        assert_same(got[name], arr, name)


def expected_shard(ref: Ref, k: int, n: int, axis: int) -> np.ndarray:
    """Part k of n along axis, as numpy.array_split cuts it; GGML blocks along the last axis
    are split whole (never inside a block); tensors with fewer dims than axis+1 come whole."""
    a = ref.array
    if a.ndim <= axis:
        return a
    if ref.encoding is not None and axis == a.ndim - 1:
        block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ref.encoding]][1]
        blocks = a.reshape(*a.shape[:-1], a.shape[-1] // block_bytes, block_bytes)
        part = np.array_split(blocks, n, axis=axis)[k]
        return part.reshape(*a.shape[:-1], part.shape[-2] * block_bytes)
    return np.array_split(a, n, axis=axis)[k]


def read_table(source) -> pa.Table:
    """A whole stream from a transport's byte source, read by pyarrow."""
    out = bytearray()
    buf = memoryview(bytearray(1 << 20))
    while n := source.readinto(buf):
        out += buf[:n]
    source.close()
    return pa.ipc.open_stream(bytes(out)).read_all()


def some_prefix(names: list[str]) -> str:
    """The prefix that selects the largest proper, non-empty subset (longest on ties)."""
    candidates = sorted({n[:i] for n in names for i in range(1, len(n) + 1)})
    counts = {p: sum(n.startswith(p) for n in names) for p in candidates}
    useful = [p for p in candidates if counts[p] < len(names)]
    return max(useful, key=lambda p: (counts[p], len(p)))


# --------------------------------------------------------------------------- whole tensors


def test_index_matches_reference(client: Client, model_id: str, reference) -> None:
    ref = reference(model_id)
    info = client.model(model_id).info
    assert list(info.tensors) == list(ref)  # items() order
    for name, r in ref.items():
        t = info.tensors[name]
        assert (t.dtype, t.shape, t.logical_shape, t.encoding, t.nbytes) == (
            r.dtype,
            r.shape,
            r.logical_shape,
            r.encoding,
            r.array.nbytes,
        ), name


def test_whole_model_by_prefix(client: Client, model_id: str, reference) -> None:
    ref = reference(model_id)
    got = client.model(model_id).fetch(prefix="")
    assert list(got) == list(ref)
    assert_all_same(got, {n: r.array for n, r in ref.items()})


def test_prefix_subset(client: Client, model_id: str, reference) -> None:
    ref = reference(model_id)
    prefix = some_prefix(list(ref))
    got = client.model(model_id).fetch(prefix=prefix)
    want = {n: r.array for n, r in ref.items() if n.startswith(prefix)}
    assert 0 < len(want) < len(ref)
    assert list(got) == list(want)
    assert_all_same(got, want)


def test_raw_string_prefix(client: Client, model_root, reference) -> None:
    """A prefix is a raw string prefix (MAX's items()): "blk.1" also selects "blk.10..."."""
    if "smollm2.gguf" in model_root.skipped:
        pytest.skip(model_root.skipped["smollm2.gguf"])
    ref = reference("smollm2.gguf")
    got = client.model("smollm2.gguf").fetch(prefix="blk.1")
    want = [n for n in ref if n.startswith("blk.1")]
    assert any(n.startswith("blk.10.") for n in want) and any(n.startswith("blk.1.") for n in want)
    assert list(got) == want
    assert_all_same(got, {n: ref[n].array for n in want})


def test_name_list_in_any_order(client: Client, model_id: str, reference) -> None:
    ref = reference(model_id)
    names = list(reversed(ref))
    got = client.model(model_id).fetch(names)
    assert list(got) == names
    assert_all_same(got, {n: ref[n].array for n in names})


def test_each_tensor_singly(client: Client, model_id: str, reference) -> None:
    ref = reference(model_id)
    remote = client.model(model_id)
    for name, r in ref.items():
        got = remote.fetch([name])
        assert list(got) == [name]
        assert_same(got[name], r.array, name)


def test_dtypes_served_as_stored(client: Client) -> None:
    """The mixed file's special dtypes arrive as themselves, not reinterpreted."""
    got = client.model("mixed").fetch(prefix="")
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "complex64"):
        assert got[name].dtype == np_dtype(name)
    assert got["scalar.bfloat16"].shape == () and float(got["scalar.bfloat16"]) == -2.25
    assert got["scalar.int64"].shape == () and int(got["scalar.int64"]) == -(2**40)
    assert got["empty.bfloat16"].shape == (5, 0, 2) and got["empty.bfloat16"].nbytes == 0


def test_large_loads_split_into_parallel_streams_by_bytes(
    server, transport: str, model_root, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above PARALLEL_MIN_BYTES a load is cut into ``parallel`` streams of about equal bytes,
    in index order; below it, one stream. Bytes are the same either way."""
    from weightserve.client import _fetch

    model = "minilm" if "minilm" not in model_root.skipped else "org/sharded"
    ref = reference(model)
    with connect(server, transport) as c:
        remote = c.model(model, FetchOptions(parallel=2))
        opened = record_streams(c.transport)
        total = sum(r.array.nbytes for r in ref.values())
        assert total < _fetch.PARALLEL_MIN_BYTES
        assert_all_same(remote.fetch(prefix=""), {n: r.array for n, r in ref.items()})
        assert len(opened) == 1
        # A bulk load asks for the transport's bulk chunk (HTTP's: its chunks land in place).
        assert opened[0].chunk_bytes == c.transport.bulk_chunk_bytes
        opened.clear()
        monkeypatch.setattr(_fetch, "PARALLEL_MIN_BYTES", 0)
        monkeypatch.setattr(_fetch, "STREAM_MIN_BYTES", 1)
        assert_all_same(remote.fetch(prefix=""), {n: r.array for n, r in ref.items()})
    assert len(opened) == 2
    order = remote.names()
    # the two streams open from two threads, in either order
    first, second = sorted((list(p.names or ()) for p in opened), key=lambda g: order.index(g[0]))
    assert first + second == order  # index order, every tensor once
    sizes = [sum(ref[n].array.nbytes for n in group) for group in (first, second)]
    largest = max(r.array.nbytes for r in ref.values())
    assert abs(sizes[0] - sizes[1]) <= largest  # about equal bytes


def test_the_parallel_streams_follow_the_environment_and_each_stays_large(
    server, transport: str, model_root, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``WEIGHTSERVE_PARALLEL_STREAMS`` sets a load's streams where the options do not; a
    load too small for that many streams of STREAM_MIN_BYTES gets fewer."""
    from weightserve.client import _fetch

    model = "minilm" if "minilm" not in model_root.skipped else "org/sharded"
    ref = reference(model)
    total = sum(r.array.nbytes for r in ref.values())
    monkeypatch.setattr(_fetch, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setenv(_fetch.PARALLEL_ENV, "3")
    for stream_min, streams in ((1, 3), (total // 2, 2), (total + 1, 1)):
        monkeypatch.setattr(_fetch, "STREAM_MIN_BYTES", stream_min)
        with connect(server, transport) as c:
            remote = c.model(model)
            assert remote.options.parallel == 3
            opened = record_streams(c.transport)
            assert_all_same(remote.fetch(prefix=""), {n: r.array for n, r in ref.items()})
        assert len(opened) == streams, stream_min
    monkeypatch.setenv(_fetch.PARALLEL_ENV, "none")
    with pytest.raises(ValueError, match="WEIGHTSERVE_PARALLEL_STREAMS must be a whole number"):
        _fetch.default_parallel()


# --------------------------------------------------------------------------- shards


@pytest.mark.parametrize("axis", [0, 1])
def test_shards_equal_array_split(client: Client, model_id: str, reference, axis: int) -> None:
    all_ref = reference(model_id)
    ref = {n: r for n, r in all_ref.items() if r.dtype not in PACKED_DTYPES}
    remote = client.model(model_id)
    n = 3  # divides few of the dims: uneven parts, and empty parts for dims < 3
    parts: dict[str, list[np.ndarray]] = {name: [] for name in ref}
    for k in range(n if ref else 0):
        got = remote.fetch(list(ref), shard=(k, n), axis=axis)
        assert list(got) == list(ref)
        for name, r in ref.items():
            assert_same(got[name], expected_shard(r, k, n, axis), f"{name} part {k}/{n}")
            parts[name].append(got[name])
    for name, r in ref.items():  # the parts put back together are the tensor
        if r.array.ndim > axis:
            whole = np.concatenate(parts[name], axis=axis)
            assert whole.tobytes() == r.array.tobytes(), name
    # Packed sub-byte tensors cannot be cut on element boundaries: refused, never garbled.
    # One with fewer dims than the axis comes whole, as any such tensor does.
    for name, r in all_ref.items():
        if r.dtype not in PACKED_DTYPES:
            continue
        if len(r.shape) > axis:
            with pytest.raises(InvalidRequest, match="packed dtype .* cannot be sharded"):
                remote.fetch([name], shard=(0, 2), axis=axis)
        else:
            assert_same(remote.fetch([name], shard=(0, 2), axis=axis)[name], r.array, name)


def test_quantized_shard_headers(client: Client, reference) -> None:
    """Shards of GGML blocks report the logical (element) shape of the part they carry."""
    ref = reference("tiny.gguf")
    names = [n for n, r in ref.items() if r.encoding]
    assert {ref[n].encoding for n in names} >= {"Q8_0", "Q4_0"}
    for k in range(3):
        params = StreamParams(names=tuple(names), shard=(k, 3), axis=1)
        table = read_table(client.transport.open_stream("tiny.gguf", params))
        rows = table.to_pylist()
        assert [r["name"] for r in rows] == names
        for row in rows:
            r = ref[row["name"]]
            block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[r.encoding]]
            want = expected_shard(r, k, 3, 1)
            blocks = want.shape[1] // block_bytes
            assert row["encoding"] == r.encoding
            assert tuple(row["shape"]) == want.shape
            assert tuple(row["logical_shape"]) == (r.logical_shape[0], blocks * block_elems)
            assert row["data"] == want.tobytes()


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("resume_offset", [0, 41, 120])
def test_resume_returns_tail(client: Client, reference, resume_offset: int) -> None:
    ref = reference("mixed")
    info = client.model("mixed").info
    names = ("float32", "float64", "int64")
    assert ref["float64"].array.nbytes == 120
    params = StreamParams(
        names=names,
        resume_tensor="float64",
        resume_offset=resume_offset,
        chunk_bytes=16,
        revision=info.revision,
    )
    rows = read_table(client.transport.open_stream("mixed", params)).to_pylist()
    f64 = [r for r in rows if r["name"] == "float64"]
    assert [r["offset"] for r in f64] == list(range(resume_offset, 120, 16))
    assert all(r["total_bytes"] == 120 for r in f64)
    assert b"".join(r["data"] for r in f64) == ref["float64"].array.tobytes()[resume_offset:]
    rest = [r for r in rows if r["name"] != "float64"]
    assert {r["name"] for r in rest} == {"int64"}  # tensors before the resume point are skipped
    assert b"".join(r["data"] for r in rest) == ref["int64"].array.tobytes()
    assert rest[0]["offset"] == 0


# --------------------------------------------------------------------------- corruption


class Corrupter:
    """Wraps the server's chunk iterator (under HTTP, gRPC and Flight); flips one data byte in
    the first ``bad`` streams (after the digest was computed, as a bad NIC or proxy would)."""

    def __init__(self, original, bad: int) -> None:
        self.original = original
        self.bad = bad
        self.opened = 0
        self.lock = threading.Lock()

    def _opened(self) -> bool:
        with self.lock:
            self.opened += 1
            return self.opened <= self.bad

    @staticmethod
    def _flipped(data) -> memoryview:
        changed = bytearray(data)
        changed[len(changed) // 2] ^= 0x10
        return memoryview(bytes(changed))

    def __call__(self, model, planned, chunk_bytes, on_tensor=None):
        corrupt, flipped = self._opened(), False
        for header, data in self.original(model, planned, chunk_bytes, on_tensor):
            if corrupt and not flipped and len(data) > 0:
                data, flipped = self._flipped(data), True
            yield header, data

    def messages(self, model, planned, chunk_bytes, on_tensor, checks):
        """The same for a stream of messages (HTTP and gRPC): a flipped chunk's message is
        a plain one, sent from memory rather than from its file."""
        corrupt, flipped = self._opened(), False
        for message in streams_messages(model, planned, chunk_bytes, on_tensor, checks):
            if corrupt and not flipped and len(message) > 1 and len(message[1]) > 0:
                message = (message[0], self._flipped(message[1]), *message[2:])
                flipped = True
            yield message


streams_messages = streaming._messages


@pytest.fixture
def corrupter(monkeypatch: pytest.MonkeyPatch):
    def install(bad: int) -> Corrupter:
        c = Corrupter(streaming.stream_chunks, bad)
        monkeypatch.setattr(streaming, "_messages", c.messages)  # what stream_messages calls
        monkeypatch.setattr(flight_app, "stream_chunks", c)
        return c

    return install


def test_corrupted_byte_raises_when_retries_run_out(server, transport: str, corrupter) -> None:
    bad = corrupter(1000)
    with connect(server, transport) as c:
        remote = c.model("mixed", FetchOptions(retries=2, parallel=1))
        with pytest.raises(DataCorruption, match="do not match their digest"):
            remote.fetch(["float32", "int64"])
    assert bad.opened == 3  # the first try and two retries


def test_corrupted_first_try_is_retried(server, transport: str, corrupter, reference) -> None:
    bad = corrupter(1)
    ref = reference("mixed")
    names = ["float32", "int64", "bfloat16"]
    with connect(server, transport) as c:
        got = c.model("mixed", FetchOptions(retries=2, parallel=1)).fetch(names)
    assert bad.opened == 2
    assert_all_same(got, {n: ref[n].array for n in names})


# --------------------------------------------------------------------------- broken connection


class CuttingProxy:
    """A loopback TCP proxy to ``port`` that, once, cuts the first connection after it has
    forwarded ``cut_after`` bytes from the server to the client."""

    def __init__(self, port: int, cut_after: int) -> None:
        self.target = port
        self.cut_after = cut_after
        self.cuts = 0
        self.connections = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_client: bool) -> None:
        forwarded = 0
        try:
            while data := src.recv(1 << 16):
                if to_client and forwarded + len(data) > self.cut_after:
                    with self.lock:
                        cut = self.cuts == 0
                        self.cuts += cut
                    if cut:
                        dst.sendall(data[: self.cut_after - forwarded])
                        return
                dst.sendall(data)
                forwarded += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.listener.close()


def test_broken_stream_resumes(server, transport: str, model_root, reference) -> None:
    model = "minilm" if "minilm" not in model_root.skipped else "tiny.gguf"
    ref = reference(model)
    chunk = 64 << 10
    ports = {"http": server.http_port, "grpc": server.flight_port}
    proxy = CuttingProxy(
        ports.get(transport, server.grpc_port),
        cut_after=min(3 << 20, sum(r.array.nbytes for r in ref.values()) // 2),
    )
    scheme = "http" if transport == "http" else "grpc"
    try:
        if transport == "grpc":  # gRPC control from the server, tensor data via the proxy
            c = connect(server, transport)
            c.transport._flight = FlightPool(f"grpc+tcp://127.0.0.1:{proxy.port}", token=None)
        else:
            c = connect(server, transport, f"{scheme}://127.0.0.1:{proxy.port}")
        with c:
            remote = c.model(model, FetchOptions(retries=3, parallel=1, chunk_bytes=chunk))
            opened = record_streams(c.transport)
            got = remote.fetch(prefix="")
    finally:
        proxy.close()
    assert proxy.cuts == 1
    assert len(opened) == 2
    assert opened[0].resume_tensor is None
    resumed = opened[1]
    assert resumed.resume_tensor in ref and resumed.revision == remote.info.revision
    assert resumed.resume_offset % chunk == 0
    if model == "minilm":  # 3 MiB in, the cut lands inside the 47 MB word embeddings
        assert resumed.resume_tensor == "embeddings.word_embeddings.weight"
        assert resumed.resume_offset > 0
    assert_all_same(got, {n: r.array for n, r in ref.items()})


# --------------------------------------------------------------------------- memory


def _rss_anon(pid: int) -> int:
    """Resident anonymous memory of a process, in bytes (file-backed mmap pages excluded)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def _write_big_safetensors(path: Path, rows: int, cols: int, count: int) -> list[np.memmap]:
    """``count`` float32 tensors of rows x cols with real (non-zero) bytes, plus a bias.

    The data is written through np.memmap, so it is file-backed in this process too.
    Returns read-only maps of the big tensors to compare what arrives with.
    """
    size = rows * cols * 4
    header: dict = {
        f"big.{i}": {
            "dtype": "F32",
            "shape": [rows, cols],
            "data_offsets": [i * size, (i + 1) * size],
        }
        for i in range(count)
    }
    end = count * size
    header["bias"] = {"dtype": "F32", "shape": [cols], "data_offsets": [end, end + 4 * cols]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(start + end + 4 * cols)
    step = 1 << 22
    for i in range(count):
        mm = np.memmap(path, np.uint32, "r+", offset=start + i * size, shape=(size // 4,))
        for at in range(0, mm.size, step):
            n = min(step, mm.size - at)
            mm[at : at + n] = np.arange(at, at + n, dtype=np.uint32) * np.uint32(2654435761) + i
        mm.flush()
        del mm
    return [
        np.memmap(path, np.float32, "r", offset=start + i * size, shape=(rows, cols))
        for i in range(count)
    ]


def _start_cli_server(root: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    """``weightserve serve ROOT`` on free ports, as a user starts it; returns its URLs."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightserve.client._cli", "serve", str(root),
         "--http-port", "0", "--grpc-port", "0", "--flight-port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_environment(),
    )  # fmt: skip
    urls: dict[str, str] = {}
    for line in proc.stdout:  # type: ignore[union-attr]
        words = line.split()
        if words[:1] == ["HTTP"]:
            urls["http"] = words[1].removesuffix("/v1/models")
        elif words[:1] == ["gRPC"]:
            urls["grpc"] = words[1]
        elif line.strip() == "ready":
            break
    if set(urls) != {"http", "grpc"}:
        proc.kill()
        raise AssertionError(f"server did not start (exit {proc.wait()})")
    return proc, urls


@pytest.mark.slow
def test_server_anonymous_memory_stays_flat(tmp_path: Path) -> None:
    """Streaming a model many times larger than the server's anonymous memory leaves that
    memory flat: tensor bytes go from the page cache (file-backed mmap) to the socket.

    What may grow is bounded per stream, not per model: a few 8 MiB chunks in flight (the
    gRPC message, the HTTP/1.1 writer's buffer) and what the allocator keeps of them. One
    stream at a time here; 1 GiB is streamed four times, over both transports.
    """
    (tmp_path / "root" / "big").mkdir(parents=True)
    path = tmp_path / "root" / "big" / "model.safetensors"
    big = _write_big_safetensors(path, rows=8192, cols=16384, count=2)  # 2 x 512 MiB
    proc, urls = _start_cli_server(tmp_path / "root")
    try:
        # Warm up both transports (lazy imports, thread pools) before the baseline.
        for url in urls.values():
            with Client(url) as c:
                c.model("big").fetch(["bias"])
        time.sleep(0.5)
        baseline = _rss_anon(proc.pid)
        assert path.stat().st_size > 4 * baseline, (path.stat().st_size, baseline)

        peak = baseline
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _rss_anon(proc.pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            for url in (urls["http"], urls["grpc"], urls["grpc"], urls["http"]):
                with Client(url) as c:
                    got = c.model("big", FetchOptions(parallel=1)).fetch(prefix="big.")
                assert list(got) == ["big.0", "big.1"]
                for i, want in enumerate(big):
                    assert got[f"big.{i}"].shape == want.shape
                    assert np.array_equal(got[f"big.{i}"].view(np.uint32), want.view(np.uint32))
                del got
        finally:
            done.set()
            sampler.join()
        growth = peak - baseline
        assert growth < 64 << 20, f"server anonymous memory grew by {growth / 2**20:.1f} MiB"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # waits, and closes its stdout
        del big
        path.unlink()
