"""Publishing a patch against the base (``publish(tensors, base=R, base_tensors=PREV)``) to a
real server on loopback: per tensor nothing, an element patch or the whole tensor travels;
loads of the new revision are byte-identical to the intended arrays; a patch computed against
arrays that were not R is refused naming the tensors, leaving ``main`` and nothing behind."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.support.byte_proxy import ByteCountingProxy
from tests.support.publishing import leftovers, raw, serve
from weightserve.client._client import Client
from weightserve.client.errors import RevisionMismatch
from weightserve.service.server import WeightServer

MODEL = "team/policy"
CHANGED_FRACTION = 0.01


def step_one() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    arrays = {
        f"layers.{i}.w": rng.standard_normal((512, 1024)).astype(ml_dtypes.bfloat16)
        for i in range(4)
    }
    arrays["layers.0.b"] = rng.standard_normal(1024).astype(np.float32)
    arrays["embed.q"] = rng.integers(-128, 127, (64, 32), dtype=np.int8)
    return arrays


def nudged(arrays: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """A trainer's next step: 1 % of every bfloat16 tensor's elements changed (by one unit
    in the last place, as small Adam steps do), the rest bit-identical."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, array in arrays.items():
        array = array.copy()
        if array.dtype == ml_dtypes.bfloat16:
            bits = array.reshape(-1).view(np.uint16)
            picked = rng.choice(bits.size, int(bits.size * CHANGED_FRACTION), replace=False)
            bits[picked] += 1
        out[name] = array
    return out


def model_bytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


@pytest.fixture
def server(tmp_path: Path) -> Iterator[WeightServer]:
    """A server whose root is ``tmp_path``."""
    with serve(tmp_path, allow_publish=True) as srv:
        yield srv


def snapshots(root: Path) -> set[str]:
    return {p.name for p in root.glob("models--*/snapshots/*")}


def test_a_patch_of_one_percent_loads_identical_and_moves_a_fraction(
    server, tmp_path: Path
) -> None:
    first = step_one()
    second = nudged(first, seed=1)
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, first)
    with (
        ByteCountingProxy(server.http_port) as proxy,
        Client(f"http://127.0.0.1:{proxy.port}") as c,
    ):
        r2 = c.model(MODEL).publish(second, base=r1.commit, base_tensors=first, message="step 2")
        sent = proxy.bytes_to_upstream
    size = model_bytes(second)
    # 1 % of the elements change: positions and values, compressed, a few % of the model.
    assert sent < 0.04 * size, (sent, size)
    assert r2.parent == r1.commit and r2.message == "step 2"
    with Client(server.http_url) as c:
        model = c.model(MODEL)
        assert model.commit == r2.commit
        got = model.fetch()
        assert set(got) == set(second)
        for name, array in second.items():
            assert raw(got[name]) == raw(array), name
        old = c.model(MODEL, revision=r1.commit).fetch()
        assert all(raw(old[n]) == raw(a) for n, a in first.items())
        # The same arrays sent whole name the same content: the patch changed nothing else.
        again = c.publish(MODEL, second, base=r1.commit)
        assert again.commit == r2.commit
    # The revision is an ordinary safetensors file: the reference reader reads it.
    stored = load_file(
        tmp_path / "models--team--policy" / "snapshots" / r2.commit / "model.safetensors"
    )
    assert set(stored) == set(second)
    assert raw(stored["layers.0.b"]) == raw(second["layers.0.b"])
    assert leftovers(tmp_path) == []


def test_a_patch_against_arrays_that_were_not_the_base_is_refused(server, tmp_path: Path) -> None:
    first = step_one()
    second = nudged(first, seed=1)
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, first)
        before = snapshots(tmp_path)
        model = c.model(MODEL)
        # The trainer kept other arrays than it published: every patched result is wrong.
        kept = nudged(first, seed=2)
        with pytest.raises(RevisionMismatch, match=r"layers\.\d\.w") as refused:
            model.publish(second, base=r1.commit, base_tensors=kept)
        assert r1.commit[:16] in str(refused.value)
        # A tensor the trainer believes unchanged, but the base holds other bytes.
        believed = dict(first, **{"layers.0.b": second["layers.0.b"] + 1})
        changed = dict(second, **{"layers.0.b": second["layers.0.b"] + 1})
        with pytest.raises(RevisionMismatch, match=r"layers\.0\.b"):
            model.publish(changed, base=r1.commit, base_tensors=believed)
        assert c.model(MODEL).commit == r1.commit
        assert [r.commit for r in c.revisions(MODEL)] == [r1.commit]
    assert snapshots(tmp_path) == before
    assert leftovers(tmp_path) == []


def test_a_new_tensor_and_a_dtype_change_travel_whole(server) -> None:
    first = step_one()
    second = dict(first)
    second["layers.0.b"] = first["layers.0.b"].astype(np.float16)  # a dtype change
    second["head"] = np.arange(2048, dtype=np.float32)  # new in this revision
    whole = second["layers.0.b"].nbytes + second["head"].nbytes
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, first)
    with (
        ByteCountingProxy(server.http_port) as proxy,
        Client(f"http://127.0.0.1:{proxy.port}") as c,
    ):
        r2 = c.model(MODEL).publish(second, base=r1.commit, base_tensors=first)
        sent = proxy.bytes_to_upstream
    # The two tensors whole, the unchanged ones nothing: headers and requests aside.
    assert whole <= sent < whole + 16 << 10, (sent, whole)
    with Client(server.http_url) as c:
        model = c.model(MODEL)
        assert model.commit == r2.commit
        assert model.tensors["layers.0.b"].dtype == "float16"
        got = model.fetch()
        assert set(got) == set(second)
        assert all(raw(got[n]) == raw(a) for n, a in second.items())


def test_a_malformed_patch_is_refused_and_the_upload_discarded(server, tmp_path: Path) -> None:
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, step_one())
    uploads = f"/v1/models/{MODEL}/-/uploads"
    line = {"kind": "patch", "name": "layers.0.w", "dtype": "bfloat16", "shape": [512, 1024],
            "nbytes": 512 * 1024 * 2, "digest": "0" * 32, "count": 1, "element_bytes": 2,
            "gap_bytes": 4, "positions_bytes": 3, "values_bytes": 2, "values_raw_bytes": 2}  # fmt: skip
    body = json.dumps(line).encode() + b"\n" + b"\x00" * 5  # positions that are not zstd
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("POST", uploads, body=json.dumps({"base": r1.commit}).encode())
        upload = json.loads(conn.getresponse().read())["upload"]
        conn.request("PUT", f"{uploads}/{upload}/patch", body=body)
        reply = conn.getresponse()
        answer = json.loads(reply.read())
        assert reply.status == 400, answer
        assert "layers.0.w" in json.dumps(answer)
        conn.request("POST", f"{uploads}/{upload}/commit")
        assert conn.getresponse().status == 404  # discarded with its patch
    finally:
        conn.close()
    assert leftovers(tmp_path) == []
    with Client(server.http_url) as c:
        assert c.model(MODEL).commit == r1.commit
