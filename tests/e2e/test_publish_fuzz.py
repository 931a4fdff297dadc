"""A hostile publisher against a live server: a seeded mutator sends mutated requests to the
publish routes (start an upload, PUT files, tensors and patches, commit, abort), holds,
watches and the delta stream, for a bounded time (``FUZZ_SECONDS``). No answer may be a 5xx,
the server must stay up, and afterwards ``main`` must load whole.

The mutations start from valid requests (a real upload's bodies, real commits): byte flips,
overwritten words, truncations and extensions of the safetensors and patch bodies; odd file
names (traversal, NUL, over 255 bytes, a file then a directory of the same name); JSON bodies
with wrong types, non-finite numbers, huge numbers and deep nesting; random ``since`` and
``revision`` values. The seed is fixed, so every run sends the same requests; a failure lists
each request that got a 5xx.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode

import ml_dtypes
import numpy as np
import pytest

from tests.support.publishing import serve
from weightserve.client._client import Client
from weightserve.client._publish import _patch_stream, _tensor_stream
from weightserve.service.server import WeightServer

MODEL = "team/fuzz"
SEED = 37
FUZZ_SECONDS = 40.0
REQUEST_TIMEOUT = 20.0


def weights(seed: int) -> dict[str, np.ndarray]:
    """Three tensors of three dtypes (bf16, f32, i8), as a trainer's step ``seed`` sends."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((32, 16)), rng.standard_normal(16), rng.integers(-128, 127, 64)]
    dtypes = [ml_dtypes.bfloat16, np.float32, np.int8]
    names = ["layers.0.w", "layers.0.b", "embed.q"]
    return {n: a.astype(d) for n, a, d in zip(names, arrays, dtypes, strict=True)}


def joined(stream: tuple[int, Iterator[memoryview | bytes]]) -> bytes:
    return b"".join(bytes(chunk) for chunk in stream[1])


@dataclass
class Sent:
    action: str
    method: str
    path: str
    body: bytes | None
    status: int
    reply: bytes

    def describe(self) -> str:
        path = self.path if len(self.path) <= 160 else f"{self.path[:160]}...({len(self.path)})"
        body = self.body if self.body is None or len(self.body) <= 160 else self.body[:160]
        return f"{self.method} {path} body={body!r} -> {self.status} {self.reply[:200]!r}"


def failures(sent: list[Sent], shown: int = 3) -> list[str]:
    """The requests answered with a server error, a few of each action."""
    by_action: dict[str, list[Sent]] = {}
    for s in sent:
        if s.status >= 500 and s.status != 503:  # 503: a deliberate "try again" (named)
            by_action.setdefault(s.action, []).append(s)
    return [
        f"[{action}: {len(found)}] {s.describe()}"
        for action, found in sorted(by_action.items())
        for s in found[:shown]
    ]


class Fuzzer:
    """Mutated requests from ``rng`` against ``server``; every answer is kept in ``sent``."""

    def __init__(self, server: WeightServer, rng: random.Random, bases: list[str]) -> None:
        self.server = server
        self.rng = rng
        self.bases = bases  # commits published before the run
        self.uploads: list[str] = []
        self.sent: list[Sent] = []
        self.action = ""  # what the request being sent does, for the report
        base = weights(1)
        self.tensors_body = joined(_tensor_stream(weights(2), None))
        self.patch_body = joined(_patch_stream(weights(3), base))

    # -- the wire ------------------------------------------------------------------------------

    def exchange(
        self, method: str, path: str, body: bytes | None = None, stream: bool = False
    ) -> Sent:
        """One request on a connection of its own. ``stream``: a long answer (a watch), of
        which only the status and a first read are taken."""
        conn = http.client.HTTPConnection(
            "127.0.0.1", self.server.http_port, timeout=REQUEST_TIMEOUT
        )
        headers = {"Connection": "close"}
        if body is not None:
            headers["content-type"] = "application/octet-stream"
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            if stream and resp.status == 200:
                if conn.sock is not None:
                    conn.sock.settimeout(2.0)
                try:
                    reply = resp.read1(4096)
                except TimeoutError:
                    reply = b""
            else:
                reply = resp.read()
            sent = Sent(self.action, method, path, body, resp.status, reply)
        finally:
            conn.close()
        self.sent.append(sent)
        return sent

    # -- mutations -----------------------------------------------------------------------------

    def mutated(self, data: bytes) -> bytes:
        rng = self.rng
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            kind = rng.randrange(6)
            if kind == 0 and out:  # byte flips
                for _ in range(rng.randint(1, 8)):
                    out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
            elif kind == 1 and len(out) >= 8:  # an overwritten 64-bit word (a length, a count)
                at = rng.randrange(len(out) - 7)
                word = rng.choice([0, 1, 2**27, 2**34, 2**63 - 1, 2**64 - 1, rng.getrandbits(64)])
                out[at : at + 8] = word.to_bytes(8, "little")
            elif kind == 2:  # truncated
                del out[rng.randrange(len(out) + 1) :]
            elif kind == 3:  # extended
                out += rng.randbytes(rng.randint(1, 64))
            elif kind == 4 and out:  # a digit in a text header changed
                digits = [i for i, b in enumerate(out[:4096]) if 48 <= b <= 57]
                if digits:
                    out[rng.choice(digits)] = rng.choice(b"0123456789")
            elif kind == 5 and out:  # a header line's count made huge
                text = bytes(out[:4096])
                at = text.find(b"count=")
                if at >= 0:
                    end = at + 6
                    while end < len(text) and 48 <= text[end] <= 57:
                        end += 1
                    out[at + 6 : end] = str(rng.choice([2**27, 2**34, 2**62])).encode()
        return bytes(out)

    def json_value(self, depth: int = 0) -> object:
        rng = self.rng
        choices: list[Callable[[], object]] = [
            lambda: None,
            lambda: rng.choice([True, False]),
            lambda: rng.choice([0, -1, 1, 2**63, -(2**63), 1e308, -1e308, 0.5]),
            lambda: rng.choice(["", "main", "x" * 300, "0" * 40, "\u0000", "../.."]),
            lambda: rng.choice(self.bases),
        ]
        if depth < 3:
            choices += [
                lambda: [self.json_value(depth + 1) for _ in range(rng.randint(0, 3))],
                lambda: {
                    rng.choice(["a", "commit", "seconds", ""]): self.json_value(depth + 1)
                    for _ in range(rng.randint(0, 3))
                },
            ]
        return rng.choice(choices)()

    def json_body(self, fields: dict[str, Callable[[], object]]) -> bytes:
        rng = self.rng
        kind = rng.randrange(8)
        if kind == 0:  # not JSON at all, or JSON's non-finite numbers
            return rng.choice(
                [b"", b"{", b"[]", b"null", b'"x"', b"{\"seconds\": Infinity}",
                 b"{\"seconds\": NaN, \"commit\": \"0\"}", b"{\"seconds\": -Infinity}",
                 rng.randbytes(rng.randint(1, 40))]
            )  # fmt: skip
        if kind == 1:  # deeply nested
            depth = rng.choice([100, 1000, 5000])
            return b'{"metadata": ' + b"[" * depth + b"]" * depth + b"}"
        body = {name: make() for name, make in fields.items() if rng.random() < 0.8}
        for name in list(body):
            if rng.random() < 0.3:
                body[name] = self.json_value()
        return json.dumps(body).encode()

    def file_name(self) -> str:
        rng = self.rng
        return rng.choice(
            [
                "config.json", "model.safetensors", "sub/model.safetensors", "a.json",
                "a.json/sub", "../escape.json", "..", ".", "", "x" * 300, "d/" * 40 + "f",
                "nul\u0000.json", "line\nbreak.json", ".hidden", "sp ace.json", "%2e%2e/x",
                "tokenizer.json", "model.gguf", "pytorch_model.bin", "\u00e9t\u00e9.json",
            ]
        )  # fmt: skip

    def model_path(self) -> str:
        rng = self.rng
        model = rng.choice(
            [MODEL, MODEL, MODEL, "team/other", "a" * 300, "x:y", "a%0Ab", "..", "team/fuzz@main"]
        )
        return f"/v1/models/{model}/-"

    def upload_id(self) -> str:
        rng = self.rng
        if self.uploads and rng.random() < 0.8:
            return rng.choice(self.uploads)
        return rng.choice(["nope", "0" * 32, "..", "%00", "x" * 300])

    # -- one request ---------------------------------------------------------------------------

    def step(self) -> None:
        rng = self.rng
        action = rng.choice(
            ["start", "start", "file", "file", "tensors", "patch", "commit", "abort", "hold",
             "watch", "watch_all", "delta", "revisions"]
        )  # fmt: skip
        self.action = action
        model = self.model_path()
        if action == "start":
            body = self.json_body(
                {
                    "base": lambda: rng.choice([None, *self.bases, "main", "0" * 40]),
                    "message": lambda: rng.choice(["", "fuzz", "m" * 1000]),
                    "metadata": lambda: {"step": rng.randint(0, 9)},
                }
            )
            sent = self.exchange("POST", f"{model}/uploads", body)
            if sent.status == 201:
                self.uploads.append(str(json.loads(sent.reply)["upload"]))
        elif action == "file":
            name = quote(self.file_name(), safe="/")
            content = rng.choice([b"{}", self.tensors_body, rng.randbytes(rng.randint(0, 200))])
            if rng.random() < 0.5:
                content = self.mutated(content)
            self.exchange("PUT", f"{model}/uploads/{self.upload_id()}/files/{name}", content)
        elif action == "tensors":
            body = self.tensors_body if rng.random() < 0.2 else self.mutated(self.tensors_body)
            self.exchange("PUT", f"{model}/uploads/{self.upload_id()}/tensors", body)
        elif action == "patch":
            body = self.patch_body if rng.random() < 0.2 else self.mutated(self.patch_body)
            self.exchange("PUT", f"{model}/uploads/{self.upload_id()}/patch", body)
        elif action == "commit":
            self.exchange("POST", f"{model}/uploads/{self.upload_id()}/commit", b"")
        elif action == "abort":
            self.exchange("DELETE", f"{model}/uploads/{self.upload_id()}")
        elif action == "hold":
            body = self.json_body(
                {
                    "commit": lambda: rng.choice([*self.bases, "main", "0" * 40, "zz"]),
                    "seconds": lambda: rng.choice([0, 1, 60, 3600, -5, 1e308, 10**30, "60"]),
                }
            )
            self.exchange("POST", f"{model}/holds", body)
        elif action in ("watch", "watch_all"):
            since = rng.choice([None, "", "zzzz", "0" * 40, *self.bases, "x" * 300])
            query = f"?{urlencode({'since': since})}" if since is not None else ""
            path = f"{model}/watch" if action == "watch" else "/v1/watch"
            self.exchange("GET", path + query, stream=True)
        elif action == "delta":
            query = urlencode(
                {
                    "since": rng.choice(["", "zzzz", "0" * 40, "main", *self.bases]),
                    "revision": rng.choice(["main", "", "zzzz", *self.bases]),
                }
            )
            self.exchange("GET", f"{model}/delta?{query}", stream=True)
        else:
            self.exchange("GET", f"{model}/revisions")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[WeightServer]:
    root = tmp_path / "root"
    root.mkdir()
    with serve(root, allow_publish=True, keep_revisions=3, grace_seconds=1) as srv:
        yield srv


def test_mutated_publish_hold_watch_and_delta_requests(server: WeightServer) -> None:
    with Client(server.http_url) as c:
        first = c.publish(MODEL, weights(1), files={"config.json": b"{}"})
        second = c.model(MODEL).publish(weights(3), base=first.commit, base_tensors=weights(1))
    fuzzer = Fuzzer(server, random.Random(SEED), [first.commit, second.commit])
    deadline = time.monotonic() + FUZZ_SECONDS
    while time.monotonic() < deadline:
        fuzzer.step()
    failed = failures(fuzzer.sent)
    statuses = sorted({s.status for s in fuzzer.sent})
    assert len(fuzzer.sent) > 100, statuses  # the run did reach the server
    fuzzer.action = "health"
    health = fuzzer.exchange("GET", "/healthz")
    assert health.status == 200
    with Client(server.http_url) as c:  # main loads whole, whatever was committed meanwhile
        model = c.model(MODEL)
        got = model.fetch()
        assert set(got) == set(model.tensors) and got
        for name, info in model.tensors.items():
            assert np.asarray(got[name]).nbytes == info.nbytes, name
    assert failed == [], "\n".join(failed)
