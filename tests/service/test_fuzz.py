"""Fuzzing: format parsers, HTTP and gRPC request decoding, and malicious pickles.

- Each reader (safetensors, GGUF, PyTorch) gets mutated valid files: byte flips, overwritten
  integers, truncations, random safetensors header JSON, random pickle opcodes inside a valid
  PyTorch zip. Only a ``CheckpointError`` (or a clean success) may come out: no other
  exception, no hang (each example runs under an alarm).
- A live server gets random paths, query parameters and JSON bodies over HTTP (never a 5xx)
  and random bytes or random fields as gRPC requests (only deliberate status codes, never
  UNKNOWN); it stays healthy and holds no stream afterwards.
- Checkpoints whose unpickling would call ``os.system``, ``exec``, ``subprocess.Popen`` or
  import a module are refused by name (``ForbiddenPickleGlobal``), and the payload never runs.

Hypothesis runs derandomized with bounded example counts, so CI sees the same examples.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import struct
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlencode

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import fixtures_gguf, fixtures_safetensors
from weightserve.client.errors import CheckpointError
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.service.readers.errors import ForbiddenPickleGlobal
from weightserve.service.readers.gguf import GGUFReader
from weightserve.service.readers.pytorch import PytorchReader
from weightserve.service.readers.safetensors import SafetensorsReader
from weightserve.service.server import ServerConfig, WeightServer

ft = pytest.importorskip(
    "tests.support.fixtures_torch", reason="torch is needed to write checkpoints"
)

FUZZ = settings(
    max_examples=200,
    deadline=None,  # the alarm below bounds each example; timing noise must not fail CI
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
EXAMPLE_SECONDS = 10


@contextlib.contextmanager
def time_limit(seconds: int = EXAMPLE_SECONDS) -> Iterator[None]:
    """Fail (instead of hanging the run) when one example takes this long."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"one fuzz example ran for more than {seconds} s (a hang?)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Files:
    """Fresh file names in one directory (hypothesis examples cannot use tmp_path)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.n = 0

    def write(self, data: bytes, suffix: str) -> Path:
        self.n += 1
        path = self.directory / f"f{self.n}{suffix}"
        path.write_bytes(data)
        return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("fuzz"))


def parse(reader: object, path: Path) -> None:
    """Only a clean result or a CheckpointError may come out of a reader."""
    size = path.stat().st_size
    with time_limit():
        try:
            contents = reader.read([path])  # type: ignore[attr-defined]
        except CheckpointError:
            return
        finally:
            path.unlink()
    for entry in contents.tensors.values():  # what it accepted lies inside the file
        assert entry.offset >= 0 and entry.nbytes >= 0, entry
        if entry.strides is None:
            assert entry.offset + entry.nbytes <= size, entry


def flip(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for position, value in edits:
        out[position % len(out)] = value
    return bytes(out)


INTERESTING = [0, 1, 2, 7, 8, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
               2**64 - 1]  # fmt: skip


def overwrite_u64(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    """Replace little-endian 64-bit words (counts, lengths, offsets) with edge values."""
    out = bytearray(data)
    for position, value in edits:
        at = position % max(1, len(out) - 8)
        out[at : at + 8] = struct.pack("<Q", value)
    return bytes(out)


def edits(limit: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    return st.lists(
        st.tuples(st.integers(0, limit - 1), st.integers(0, 255)), min_size=1, max_size=8
    )


def word_edits(limit: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    value = st.sampled_from(INTERESTING) | st.integers(0, 2**64 - 1)
    return st.lists(st.tuples(st.integers(0, limit - 1), value), min_size=1, max_size=4)


def mutate(blob: bytes, data) -> bytes:
    """Flipped bytes, 64-bit words set to edge values, or a truncation, as drawn."""
    kind = data.draw(st.sampled_from(["flip", "word", "truncate"]))
    if kind == "flip":
        return flip(blob, data.draw(edits(len(blob))))
    if kind == "word":
        return overwrite_u64(blob, data.draw(word_edits(len(blob))))
    return blob[: data.draw(st.integers(0, len(blob) - 1))]


# ----------------------------------------------------------------------------- safetensors


@pytest.fixture(scope="module")
def safetensors_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    d = tmp_path_factory.mktemp("st")
    return fixtures_safetensors.write_mixed_dtypes(d).read_bytes()


def _header_end(blob: bytes) -> int:
    return 8 + struct.unpack("<Q", blob[:8])[0]


@FUZZ
@given(data=st.data())
def test_safetensors_byte_flips(files: Files, safetensors_file: bytes, data) -> None:
    blob = safetensors_file
    # Mostly the header (where every rule lives), sometimes anywhere.
    limit = data.draw(st.sampled_from([_header_end(blob) + 8, len(blob)]))
    mutated = flip(blob, data.draw(edits(limit)))
    parse(SafetensorsReader(), files.write(mutated, ".safetensors"))


@FUZZ
@given(data=st.data())
def test_safetensors_truncated_or_words(files: Files, safetensors_file: bytes, data) -> None:
    blob = safetensors_file
    if data.draw(st.booleans()):
        mutated = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        mutated = overwrite_u64(blob, data.draw(word_edits(_header_end(blob))))
    parse(SafetensorsReader(), files.write(mutated, ".safetensors"))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
DTYPES = ["F32", "F16", "BF16", "I8", "U8", "I64", "BOOL", "F8_E4M3", "F4", "F6_E2M3", "C64",
          "F64", "U64", "X", "", "f32"]  # fmt: skip
DIM = st.integers(0, 6) | st.sampled_from([-1, 2**31, 2**63, 2**64, 10**30]) | JSON
ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(DTYPES) | JSON,
        "shape": st.lists(DIM, max_size=4) | JSON,
        "data_offsets": st.lists(st.integers(-2, 200) | st.sampled_from([2**63, 2**64]), max_size=3)
        | JSON,
        "extra": JSON,
    },
)
HEADER = st.dictionaries(
    st.text(max_size=10) | st.just("__metadata__"),
    ENTRY | JSON | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
    max_size=5,
)


@FUZZ
@given(header=HEADER, data=st.binary(max_size=200), pad=st.integers(0, 9), lie=st.booleans(),
       length=st.integers(0, 2**64 - 1))  # fmt: skip
def test_safetensors_random_header(
    files: Files, header: dict, data: bytes, pad: int, lie: bool, length: int
) -> None:
    raw = json.dumps(header).encode() + b" " * pad
    prefix = struct.pack("<Q", length if lie else len(raw))
    parse(SafetensorsReader(), files.write(prefix + raw + data, ".safetensors"))


@FUZZ
@given(raw=st.binary(max_size=300) | st.text(max_size=200).map(str.encode))
def test_safetensors_random_header_bytes(files: Files, raw: bytes) -> None:
    parse(SafetensorsReader(), files.write(struct.pack("<Q", len(raw)) + raw, ".safetensors"))


# ----------------------------------------------------------------------------- GGUF


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    fixtures_gguf.write_edge(path)  # small: every flip lands in or near the header
    return path.read_bytes()


@FUZZ
@given(data=st.data())
def test_gguf_mutations(files: Files, gguf_file: bytes, data) -> None:
    blob = gguf_file
    mutated = mutate(blob, data)
    parse(GGUFReader(), files.write(mutated, ".gguf"))


# ----------------------------------------------------------------------------- PyTorch


@pytest.fixture(scope="module")
def torch_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pt") / "base.bin"
    ft.write_float_checkpoint(path, 12)
    return path


@FUZZ
@given(data=st.data())
def test_pytorch_file_mutations(files: Files, torch_checkpoint: Path, data) -> None:
    blob = torch_checkpoint.read_bytes()
    mutated = mutate(blob, data)
    parse(PytorchReader(), files.write(mutated, ".bin"))


def _u8(op: bytes) -> st.SearchStrategy[bytes]:
    return st.integers(0, 255).map(lambda n: op + bytes([n]))


def _u32(op: bytes) -> st.SearchStrategy[bytes]:
    return (st.integers(0, 64) | st.sampled_from([2**31, 2**32 - 1])).map(
        lambda n: op + struct.pack("<I", n)
    )


def _counted(op: bytes, fmt: str, payload: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return payload.map(lambda b: op + struct.pack(fmt, len(b)) + b)


ALLOWED_GLOBALS = [
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_parameter"),
    ("collections", "OrderedDict"), ("torch", "FloatStorage"), ("torch", "UntypedStorage"),
    ("torch", "float32"), ("torch", "bfloat16"), ("_codecs", "encode"), ("torch", "qint8"),
]  # fmt: skip
NAMES = st.sampled_from(["storage", "0", "1", "cpu", "weight", "latin1", "a.b", "", "x" * 70])
TEXT = NAMES.map(str.encode) | st.binary(max_size=6)
# Opcodes without an argument: MARK STOP POP POP_MARK DUP NONE BINPERSID REDUCE APPEND BUILD
# DICT APPENDS LIST OBJ SETITEM TUPLE SETITEMS EMPTY_DICT EMPTY_LIST EMPTY_TUPLE TUPLE1-3
# NEWTRUE NEWFALSE NEWOBJ NEWOBJ_EX STACK_GLOBAL MEMOIZE EMPTY_SET ADDITEMS FROZENSET
# NEXT_BUFFER READONLY_BUFFER.
NO_ARGUMENT = b"(.012NQRabdelostu}])\x85\x86\x87\x88\x89\x81\x92\x93\x94\x8f\x90\x91\x97\x98"
# One opcode with its argument, for every opcode the C unpickler knows (protocols 0 to 5).
OPCODE = st.one_of(
    st.sampled_from([bytes([c]) for c in NO_ARGUMENT]),
    _u8(b"K"),
    _u8(b"q"),
    _u8(b"h"),
    _u8(b"\x82"),
    _u8(b"\x80"),
    _u8(b"C"),
    st.integers(0, 2**16 - 1).map(lambda n: b"M" + struct.pack("<H", n)),
    st.integers(-(2**31), 2**31 - 1).map(lambda n: b"J" + struct.pack("<i", n)),
    _u32(b"r"),
    _u32(b"j"),
    _u32(b"B"),
    _u32(b"X"),
    _u32(b"\x84"),
    _counted(b"X", "<I", NAMES.map(str.encode)),
    _counted(b"\x8c", "<B", NAMES.map(str.encode)),
    _counted(b"C", "<B", st.binary(max_size=8)),
    _counted(b"\x8a", "<B", st.binary(max_size=9)),
    _counted(b"\x95", "<Q", st.just(b"")),
    _counted(b"\x8b", "<I", st.binary(max_size=9)),  # LONG4
    _counted(b"T", "<I", st.binary(max_size=8)),  # BINSTRING
    _counted(b"U", "<B", st.binary(max_size=8)),  # SHORT_BINSTRING
    _counted(b"\x8d", "<Q", NAMES.map(str.encode)),  # BINUNICODE8
    _counted(b"\x8e", "<Q", st.binary(max_size=8)),  # BINBYTES8
    _counted(b"\x96", "<Q", st.binary(max_size=8)),  # BYTEARRAY8
    st.integers(0, 2**16 - 1).map(lambda n: b"\x83" + struct.pack("<H", n)),  # EXT2
    st.floats().map(lambda f: b"G" + struct.pack(">d", f)),
    st.sampled_from(ALLOWED_GLOBALS).map(lambda g: f"c{g[0]}\n{g[1]}\n".encode()),
    st.tuples(TEXT, TEXT).map(lambda t: b"c" + t[0] + b"\n" + t[1] + b"\n"),
    st.tuples(TEXT, TEXT).map(lambda t: b"i" + t[0] + b"\n" + t[1] + b"\n"),
    st.sampled_from([b"I", b"L", b"F", b"S", b"V", b"P", b"g", b"p"]).flatmap(
        lambda op: (st.text(max_size=6) | st.just("9" * 5000) | st.just("'x'")).map(
            lambda t: op + t.encode("utf-8", "replace") + b"\n"
        )
    ),
    st.just(ft.op_storage("0", 12)),
    st.just(ft.op_storage("0", 12, "UntypedStorage")),
    st.just(ft.op_tensor(ft.op_storage("0", 12), 0, (12,), (1,))),
)


@FUZZ
@given(ops=st.lists(OPCODE, max_size=40), framed=st.booleans(), proto=st.integers(0, 5))
def test_pytorch_random_pickle_opcodes(
    files: Files, torch_checkpoint: Path, ops: list[bytes], framed: bool, proto: int
) -> None:
    body = b"".join(ops)
    pickle = (b"\x80" + bytes([proto]) + body + b".") if framed else body
    path = files.write(b"", ".bin")
    ft.replace_data_pkl(torch_checkpoint, path, pickle)
    parse(PytorchReader(), path)


@FUZZ
@given(data=st.data())
def test_pytorch_mutated_data_pkl(files: Files, torch_checkpoint: Path, data) -> None:
    with zipfile.ZipFile(torch_checkpoint) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        original = zf.read(name)
    if data.draw(st.booleans()):
        mutated = flip(original, data.draw(edits(len(original))))
    else:
        mutated = original[: data.draw(st.integers(0, len(original) - 1))]
    path = files.write(b"", ".bin")
    ft.replace_data_pkl(torch_checkpoint, path, mutated)
    parse(PytorchReader(), path)


# ----------------------------------------------------------------------------- live server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightServer]:
    root = tmp_path_factory.mktemp("fuzz-root")
    (root / "mixed").mkdir()
    fixtures_safetensors.write_mixed_dtypes(root / "mixed", "model.safetensors")
    fixtures_safetensors.write_packed_dtypes(root)
    fixtures_safetensors.write_sharded(root / "org" / "sharded")
    fixtures_gguf.write_mixed(root / "tiny.gguf")
    (root / "torch").mkdir()
    ft.write_views(root / "torch" / "pytorch_model.bin")
    (root / "broken").mkdir()
    fixtures_safetensors.write_crafted(
        root / "broken" / "model.safetensors",
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
        b"\0" * 8,
    )
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0)
    with WeightServer(config) as srv:
        yield srv


MODELS = ["mixed", "packed.safetensors", "org/sharded", "tiny.gguf", "torch", "broken", "nope"]
TENSOR_NAMES = ["float32", "bfloat16", "scalar.int64", "empty.bfloat16", "f4", "f6_e3m2",
                "model.embed.weight", "token_embd.weight", "blk.0.ffn_up.weight", "transposed",
                "every_other", "element", "expanded", "w", "", "nope"]  # fmt: skip
QUERY_KEYS = ["name", "prefix", "shard", "axis", "resume_tensor", "resume_offset", "chunk_bytes",
              "revision", "x"]  # fmt: skip
SMALL_INT = st.integers(-3, 70) | st.sampled_from([2**31, 2**63, 2**64, 10**30, 64 << 20])
VALUE = (
    st.sampled_from(TENSOR_NAMES)
    | st.text(max_size=8)
    | SMALL_INT.map(str)
    | st.sampled_from(
        ["0/2", "1/2", "3/4", "0/0", "2/1", "-1/2", "1/-2", "a/b", "1/2/3", "0/" + "9" * 30]
    )
)
BODY_VALUES = {
    "names": st.lists(st.sampled_from(TENSOR_NAMES), max_size=5) | JSON,
    "prefix": st.sampled_from(["", "blk.", "model.layers.", "view", "x"]) | JSON,
    "shard": VALUE | JSON,
    "axis": SMALL_INT | JSON,
    "resume_tensor": st.sampled_from(TENSOR_NAMES) | JSON,
    "resume_offset": SMALL_INT | JSON,
    "chunk_bytes": SMALL_INT | JSON,
    "revision": st.text(max_size=4) | JSON,
}
BODY = st.fixed_dictionaries({}, optional=BODY_VALUES) | JSON
SEGMENT = (
    st.sampled_from(MODELS)
    | st.text(max_size=12).map(lambda t: quote(t, safe=""))
    | st.sampled_from(["..", ".", "%2e%2e", "%2F", "%00", "%zz", "//", "%ff%fe"])
)
SUFFIX = st.sampled_from(["", "/stream", "/tensors/w", "/tensors/float32", "/tensors/", "/x"])


def _exchange(
    srv: WeightServer, method: str, path: str, body: bytes | None, headers: dict
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _request(srv: WeightServer, method: str, path: str, body: bytes | None, headers: dict) -> int:
    return _exchange(srv, method, path, body, headers)[0]


@settings(FUZZ, max_examples=300)
@given(
    method=st.sampled_from(["GET", "GET", "POST", "POST", "HEAD", "PUT", "DELETE", "OPTIONS"]),
    segments=st.lists(SEGMENT, min_size=0, max_size=3),
    suffix=SUFFIX,
    query=st.lists(st.tuples(st.sampled_from(QUERY_KEYS), VALUE), max_size=5),
    body=st.none() | BODY,
    raw_body=st.none() | st.binary(max_size=40),
    content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"]),
)  # fmt: skip
def test_http_request_fuzz(
    server: WeightServer, method, segments, suffix, query, body, raw_body, content_type
) -> None:
    path = "/v1/models/" + "/".join(segments) + suffix
    if query:
        path += "?" + urlencode(query)
    data = (
        raw_body if raw_body is not None else (None if body is None else json.dumps(body).encode())
    )
    headers = {"content-type": content_type} if data is not None else {}
    with time_limit(30):
        status, reply = _exchange(server, method, path, data, headers)
    if status == 503:  # deliberate: the refused model ("broken") is unavailable, by name
        if method != "HEAD":  # HEAD answers with the status and headers only
            assert json.loads(reply)["error"]["type"] == "ModelUnavailable", (method, path, reply)
        assert "broken" in path
    else:
        assert status < 500, (method, path, data, reply[:300])


def _grpc_ok(code: grpc.StatusCode, details: str) -> bool:
    allowed = {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,  # a refused model ("broken")
    }
    if code == grpc.StatusCode.INTERNAL:  # only for bytes that are no message at all
        return "deserializ" in details
    return code in allowed


@pytest.fixture(scope="module")
def channel(server: WeightServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(
        f"127.0.0.1:{server.grpc_port}",
        options=[("grpc.max_receive_message_length", 80 << 20)],
    ) as ch:
        yield ch


def _call_raw(channel: grpc.Channel, method: str, request: bytes) -> None:
    full = f"/weightserve.v1.WeightService/{method}"
    with time_limit(30):
        try:
            if method == "StreamTensors":
                for _ in channel.unary_stream(full)(request, timeout=20):
                    pass
            else:
                channel.unary_unary(full)(request, timeout=20)
        except grpc.RpcError as e:
            assert _grpc_ok(e.code(), e.details() or ""), (method, request, e.code(), e.details())


@settings(FUZZ, max_examples=300)
@given(
    method=st.sampled_from(["StreamTensors", "StreamTensors", "GetModel", "ListModels"]),
    request=st.binary(max_size=80),
)
def test_grpc_random_bytes(channel: grpc.Channel, method: str, request: bytes) -> None:
    _call_raw(channel, method, request)


I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)


@settings(FUZZ, max_examples=300)
@given(
    model=st.sampled_from(MODELS) | st.text(max_size=10),
    names=st.lists(st.sampled_from(TENSOR_NAMES) | st.text(max_size=6), max_size=4),
    prefix=st.sampled_from(["", "blk.", "model.", "view", "zz"]),
    use_prefix=st.booleans(),
    shard=st.tuples(st.integers(-2, 5) | I32, st.integers(-2, 5) | I32, st.integers(-1, 4) | I32),
    resume=st.tuples(st.sampled_from(TENSOR_NAMES), st.integers(-1, 5000) | I64),
    chunk_bytes=st.integers(-1, 5000) | I64,
    revision=st.sampled_from(["", "0123456789abcdef"]),
    resume_on=st.booleans(),
)
def test_grpc_request_fields(
    channel, model, names, prefix, use_prefix, shard, resume, chunk_bytes, revision, resume_on
) -> None:
    request = pb.TensorRequest(
        model=model,
        names=names,
        prefix=prefix,
        use_prefix=use_prefix,
        shard_index=shard[0],
        shard_count=shard[1],
        shard_axis=shard[2],
        resume_tensor=resume[0] if resume_on else "",
        resume_offset=resume[1] if resume_on else 0,
        chunk_bytes=chunk_bytes,
        revision=revision,
    )
    _call_raw(channel, "StreamTensors", request.SerializeToString())


def test_server_healthy_after_fuzz(server: WeightServer, channel: grpc.Channel) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert _request(server, "GET", "/healthz", None, {}) == 200
    assert _request(server, "GET", "/readyz", None, {}) == 200
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert server.state.open_streams == 0


# ----------------------------------------------------------------------------- malicious pickles


EVIL_MODULE = "weightserve_evil_payload_module"


def payloads(marker: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (the global that must be named in the refusal, opcodes pushing the payload)."""
    cmd = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"
    g, s, call, tup = ft.op_global, ft.op_str, ft.op_call, ft.op_tuple
    return {
        "os-system": ("os.system", call(g("os", "system"), s(cmd))),
        "posix-system": ("posix.system", call(g("posix", "system"), s(cmd))),
        "builtins-exec": ("builtins.exec", call(g("builtins", "exec"), s(code))),
        "builtins-eval": ("builtins.eval", call(g("builtins", "eval"), s(code))),
        "py2-builtin-eval": ("__builtin__.eval", call(g("__builtin__", "eval"), s(code))),
        "subprocess-popen": (
            "subprocess.Popen",
            call(g("subprocess", "Popen"), tup(s("touch"), s(str(marker)))),
        ),
        "import-module": (
            "importlib.import_module",
            call(g("importlib", "import_module"), s(EVIL_MODULE)),
        ),
        "import-by-global": (f"{EVIL_MODULE}.run", call(g(EVIL_MODULE, "run"), s(cmd))),
        "stack-global": ("os.system", s("os") + s("system") + b"\x93" + tup(s(cmd)) + b"R"),
        "inst": ("os.system", b"(" + s(cmd) + b"ios\nsystem\n"),
        "getattr-chain": (
            "builtins.getattr",
            call(g("builtins", "getattr"), g("collections", "OrderedDict"), s("__init__")),
        ),
        "torch-load": ("torch.load", call(g("torch", "load"), s(str(marker)))),
    }


@pytest.fixture(scope="module")
def evil(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """A root of checkpoints whose pickles would run payloads, and the marker they'd create.

    ``EVIL_MODULE`` is importable while the tests run: importing it creates the marker too.
    """
    base = tmp_path_factory.mktemp("evil")
    marker = base / "PAYLOAD-RAN"
    (base / "lib").mkdir()
    (base / "lib" / f"{EVIL_MODULE}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef run(*a):\n    open({str(marker)!r}, 'w').close()\n"
    )
    root = base / "root"
    table = payloads(marker)
    for name, (_, payload) in table.items():
        (root / name).mkdir(parents=True)
        ft.write_with_payload(root / name / "pytorch_model.bin", base / f"{name}.work", payload)
    return root, marker, table


@pytest.fixture
def evil_importable(evil, monkeypatch: pytest.MonkeyPatch) -> Path:
    root, marker, _ = evil
    monkeypatch.syspath_prepend(str(root.parent / "lib"))
    sys.modules.pop(EVIL_MODULE, None)
    return marker


def test_malicious_pickles_refused_by_reader(evil, evil_importable: Path) -> None:
    root, marker, table = evil
    for name, (global_name, _) in table.items():
        with pytest.raises(ForbiddenPickleGlobal) as info:
            PytorchReader().read([root / name / "pytorch_model.bin"])
        assert f"'{global_name}'" in str(info.value), name
    assert not marker.exists()
    assert EVIL_MODULE not in sys.modules


def test_malicious_pickles_refused_by_server(evil, evil_importable: Path) -> None:
    root, marker, table = evil
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0)
    with WeightServer(config) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=10)
        conn.request("GET", "/v1/models")
        listing = json.loads(conn.getresponse().read())
        conn.close()
        assert listing["models"] == []
        problems = {p["model"]: p for p in listing["problems"]}
        assert set(problems) == set(table)
        for name, (global_name, _) in table.items():
            reason = problems[name]["reason"]
            assert ForbiddenPickleGlobal.rule in reason and f"'{global_name}'" in reason, reason
            assert problems[name]["file"].endswith("pytorch_model.bin")
            status = _request(srv, "GET", f"/v1/models/{name}", None, {})
            assert status == 503
    assert not marker.exists()
    assert EVIL_MODULE not in sys.modules


def test_abused_allowed_globals_refused(files: Files, torch_checkpoint: Path, evil) -> None:
    """Globals on the allow-list, called in ways a state dict never does, are refused too."""
    _, marker, _ = evil
    g, s, call, tup = ft.op_global, ft.op_str, ft.op_call, ft.op_tuple
    abuses = [
        call(g("_codecs", "encode"), s("x"), s("zlib_codec")),  # a codec that transforms
        call(g("_codecs", "encode"), s("x"), s("rot13")),
        g("collections", "OrderedDict") + b")" + b"\x81",  # NEWOBJ on a placeholder
        call(g("torch._utils", "_rebuild_tensor_v2"), s("not a storage"), ft.op_int(0),
             tup(), tup(), b"\x89", call(g("collections", "OrderedDict"))),
        g("torch", "FloatStorage") + b")" + b"\x81",
        call(g("torch._utils", "_rebuild_parameter"), s("x"), b"\x89",
             call(g("collections", "OrderedDict"))),
        ft.op_tensor(ft.op_storage("0", 12), 0, (13,), (1,)),  # past the storage
        ft.op_tensor(ft.op_storage("0", 2**31 - 1), 0, (4,), (1,)),  # more than the record
    ]  # fmt: skip
    for payload in abuses:
        body = ft.op_dict([(s("w"), payload)])
        path = files.write(b"", ".bin")
        ft.replace_data_pkl(torch_checkpoint, path, ft.op_pickle(body))
        with pytest.raises(CheckpointError):
            PytorchReader().read([path])
    # BUILD on an OrderedDict (torch writes its _metadata so) is accepted and its state dropped:
    # a state such as {"__class__": ...} cannot retype anything.
    payload = call(g("collections", "OrderedDict")) + b"}" + s("__class__") + s("x") + b"sb"
    path = files.write(b"", ".bin")
    ft.replace_data_pkl(
        torch_checkpoint,
        path,
        ft.op_pickle(ft.op_dict([(s("w"), payload), (s("t"), ft.op_tensor(
            ft.op_storage("0", 12), 0, (12,), (1,)))])),
    )  # fmt: skip
    contents = PytorchReader().read([path])
    assert list(contents.tensors) == ["t"] and contents.metadata == {}
    assert not marker.exists()


def test_fuzz_models_listed_consistently(server: WeightServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/v1/models")
    listing = json.loads(conn.getresponse().read())
    conn.close()
    assert {m["id"] for m in listing["models"]} == {
        "mixed", "packed.safetensors", "org/sharded", "tiny.gguf", "torch",
    }  # fmt: skip
    assert [p["model"] for p in listing["problems"]] == ["broken"]
    assert np.all(np.array([m["total_bytes"] for m in listing["models"]]) > 0)
