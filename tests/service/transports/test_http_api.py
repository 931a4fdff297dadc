"""The HTTP API as a plain HTTP client sees it: listing, model info, errors, operations.

Requests go through ``http.client`` with the raw path as written (no client-side
normalisation), so traversal attempts reach the server exactly as an attacker would send them.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pyarrow as pa
import pytest

from tests.support import fixtures_safetensors
from tests.support._util import ARROW, Reply, http_request


@pytest.fixture(scope="module")
def api(server):
    def request(
        path: str, method: str = "GET", body: dict | None = None, headers: dict | None = None
    ) -> Reply:
        return http_request(server.http_port, path, method, body, headers)

    return request


def rows_by_name(table: pa.Table) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for row in table.to_pylist():
        out[row["name"]] = out.get(row["name"], b"") + row["data"]
    return out


# --------------------------------------------------------------------------- listing and info


def test_list_models_and_problems(api, model_root, reference) -> None:
    r = api("/v1/models")
    assert r.status == 200
    listing = r.json()
    assert set(listing) == {"models", "problems", "variants"}
    assert listing["variants"] == []  # no other weight sets in this root
    models = {m["id"]: m for m in listing["models"]}
    assert set(models) == set(model_root.models)
    for model_id, (fmt, _) in model_root.models.items():
        m = models[model_id]
        ref = reference(model_id)
        assert m["format"] == fmt
        assert re.fullmatch(r"[0-9a-f]{16}", m["revision"])
        assert m["tensor_count"] == len(ref)
        assert m["total_bytes"] == sum(t.array.nbytes for t in ref.values())
    assert len(listing["problems"]) == 1
    problem = listing["problems"][0]
    assert set(problem) == {"model", "file", "reason"}
    assert problem["model"] == "broken"
    # The file is named (absolute, or relative to the root) and the rule is spelled out.
    named = Path(model_root.path.resolve(), problem["file"]).resolve()
    assert named == model_root.broken["broken"].resolve()
    assert "tensor data lies outside the file" in problem["reason"]


def test_broken_model_refused_others_serve(api) -> None:
    r = api("/v1/models/broken")
    assert r.status == 503
    kind, message = r.error()
    assert kind == "ModelUnavailable"
    assert "refused" in message and "lies outside the file" in message
    assert api("/v1/models/broken/stream?prefix=").status == 503
    ok = api("/v1/models/mixed/stream?name=float32")
    assert ok.status == 200 and ok.headers["content-type"] == ARROW


def test_model_info_etag_and_304(api, reference) -> None:
    r = api("/v1/models/mixed")
    assert r.status == 200
    info = r.json()
    assert info["id"] == "mixed" and info["format"] == "safetensors"
    assert r.headers["etag"] == f'"{info["revision"]}"'
    assert info["metadata"] == fixtures_safetensors.MIXED_METADATA
    ref = reference("mixed")
    assert [t["name"] for t in info["tensors"]] == list(ref)
    bf16 = next(t for t in info["tensors"] if t["name"] == "bfloat16")
    assert bf16 == {
        "name": "bfloat16",
        "dtype": "bfloat16",
        "shape": [3, 5],
        "logical_shape": [3, 5],
        "encoding": None,
        "nbytes": 30,
    }

    cached = api("/v1/models/mixed", headers={"if-none-match": r.headers["etag"]})
    assert cached.status == 304
    assert cached.body == b""
    assert cached.headers["etag"] == r.headers["etag"]
    stale = api("/v1/models/mixed", headers={"if-none-match": '"0000000000000000"'})
    assert stale.status == 200 and stale.json() == info


def test_gguf_info(api, reference) -> None:
    info = api("/v1/models/tiny.gguf").json()
    assert info["format"] == "gguf" and info["alignment"] == 32
    assert info["metadata"]["general.name"] == "weightserve mixed fixture"
    q8 = next(t for t in info["tensors"] if t["name"] == "blk.0.ffn_up.weight")
    assert (q8["dtype"], q8["encoding"], q8["shape"], q8["logical_shape"]) == (
        "uint8",
        "Q8_0",
        [24, 68],
        [24, 64],
    )
    assert [t["name"] for t in info["tensors"]] == list(reference("tiny.gguf"))


def test_model_id_with_slashes(api, reference) -> None:
    ref = reference("org/sharded")
    info = api("/v1/models/org/sharded")
    assert info.status == 200 and info.json()["id"] == "org/sharded"
    stream = api("/v1/models/org/sharded/stream?prefix=model.layers.0.")
    assert stream.status == 200
    got = rows_by_name(stream.table())
    want = {n: r.array.tobytes() for n, r in ref.items() if n.startswith("model.layers.0.")}
    assert list(got) == list(want) and got == want
    one = api("/v1/models/org/sharded/tensors/lm_head.weight")
    assert one.status == 200
    assert rows_by_name(one.table()) == {"lm_head.weight": ref["lm_head.weight"].array.tobytes()}


# --------------------------------------------------------------------------- errors


def test_unknown_model(api) -> None:
    for path in ("/v1/models/nope", "/v1/models/nope/stream?prefix=", "/v1/models/org/nope"):
        r = api(path)
        assert r.status == 404, path
        kind, message = r.error()
        assert kind == "ModelNotFound"
        assert "nope" in message
    kind, message = api("/v1/models/mixd").error()
    assert kind == "ModelNotFound" and message.endswith("Did you mean 'mixed'?")


def test_unknown_tensor_suggests(api) -> None:
    r = api("/v1/models/mixed/stream?name=float32&name=bfloat61")
    assert r.status == 404
    kind, message = r.error()
    assert kind == "TensorNotFound"
    assert "'bfloat61'" in message and message.endswith("Did you mean 'bfloat16'?")
    r = api("/v1/models/mixed/stream", "POST", {"names": ["flaot32"]})
    assert r.status == 404
    assert r.error() == (
        "TensorNotFound",
        "No weight named 'flaot32' in model 'mixed'. Did you mean 'float32'?",
    )
    r = api("/v1/models/mixed/tensors/flaot32")
    assert r.status == 404
    assert r.error()[0] == "TensorNotFound"


@pytest.mark.parametrize(
    "query",
    [
        "name=float32&shard=3/3",
        "name=float32&shard=-1/2",
        "name=float32&shard=0/0",
        "name=float32&shard=abc",
        "name=float32&shard=1/2&axis=-1",
        "name=float32&chunk_bytes=0",
        "name=float32&resume_tensor=int64",
        "name=float32&resume_tensor=float32&resume_offset=61",
        "name=float32&resume_tensor=float32&resume_offset=-1",
        "",  # neither names nor a prefix
    ],
)
def test_bad_request_is_400(api, query: str) -> None:
    r = api(f"/v1/models/mixed/stream?{query}")
    assert r.status == 400, r.body
    assert r.error()[0] == "InvalidRequest"


def test_bad_shard_in_post_body_is_400(api) -> None:
    r = api("/v1/models/mixed/stream", "POST", {"names": ["float32"], "shard": "2/2"})
    assert r.status == 400
    assert r.error() == ("InvalidRequest", "shard 2/2: need 0 <= index < count")


def test_bad_revision_is_412(api) -> None:
    revision = api("/v1/models/mixed").json()["revision"]
    assert api(f"/v1/models/mixed/stream?name=float32&revision={revision}").status == 200
    r = api("/v1/models/mixed/stream?name=float32&revision=0123456789abcdef")
    assert r.status == 412
    kind, message = r.error()
    assert kind == "RevisionMismatch"
    assert revision in message and "0123456789abcdef" in message
    r = api("/v1/models/mixed/stream", "POST", {"prefix": "", "revision": "x"})
    assert r.status == 412 and r.error()[0] == "RevisionMismatch"


@pytest.fixture(scope="module")
def outside(model_root, tmp_path_factory) -> str:
    """A valid checkpoint next to (not inside) the model root; returns its path from the root."""
    directory = tmp_path_factory.mktemp("outside")
    fixtures_safetensors.write_mixed_dtypes(directory, "model.safetensors")
    return f"../{directory.name}"


def test_path_traversal_refused(api, outside: str) -> None:
    name = outside.removeprefix("../")
    attempts = [
        f"/v1/models/{outside}",
        f"/v1/models/%2e%2e/{name}",
        f"/v1/models/%2E%2E%2F{name}",
        f"/v1/models/..%2f{name}",
        f"/v1/models/org/../../{name}",
        f"/v1/models/./../{name}",
        "/v1/models//etc/passwd",
        "/v1/models/%2Fetc%2Fpasswd",
        "/v1/models/..",
        "/v1/models/mixed/../../etc/passwd/stream?prefix=",
    ]
    for path in attempts:
        for p in (path, f"{path}/stream?prefix=", f"{path}/tensors/float32"):
            r = api(p)
            assert 400 <= r.status < 500, (p, r.status)
            assert r.headers.get("content-type") != ARROW, p
            assert b"float32" not in r.body, p  # nothing of the outside file was read
    r = api(f"/v1/models/{outside}")
    assert r.status == 400 and r.error()[0] == "InvalidRequest"


# --------------------------------------------------------------------------- streams


def test_stream_content_type_and_exact_length(api, reference) -> None:
    for path in (
        "/v1/models/mixed/stream?prefix=",
        "/v1/models/mixed/stream?name=empty.uint8&name=scalar.float32",
        "/v1/models/tiny.gguf/stream?prefix=blk.0.&chunk_bytes=100&shard=1/3&axis=1",
    ):
        r = api(path)
        assert r.status == 200, path
        assert r.headers["content-type"] == ARROW
        assert int(r.headers["content-length"]) == len(r.body)
        assert "transfer-encoding" not in r.headers
        assert r.body.endswith(b"\xff\xff\xff\xff\x00\x00\x00\x00")
        r.table()  # a valid Arrow IPC stream
    r = api("/v1/models/mixed/stream?prefix=")
    revision = api("/v1/models/mixed").json()["revision"]
    assert r.headers["etag"] == f'"{revision}"'
    assert r.headers["x-weightserve-revision"] == revision
    assert r.headers["x-weightserve-tensors"] == str(len(reference("mixed")))


def test_get_and_post_streams_are_identical(api, reference) -> None:
    ref = reference("mixed")
    get = api("/v1/models/mixed/stream?name=int64&name=bfloat16&shard=1/3&axis=1&chunk_bytes=7")
    post = api(
        "/v1/models/mixed/stream",
        "POST",
        {"names": ["int64", "bfloat16"], "shard": "1/3", "axis": 1, "chunk_bytes": 7},
    )
    assert get.status == post.status == 200
    assert get.body == post.body
    rows = get.table().to_pylist()
    assert all(len(r["data"]) <= 7 for r in rows)
    got = rows_by_name(get.table())
    assert got["int64"] == ref["int64"].array[:, 1:2, :].tobytes()  # dim 3 in 3 parts
    assert got["bfloat16"] == ref["bfloat16"].array[:, 2:4].tobytes()  # dim 5: 2, 2, 1


def test_one_tensor_route(api, reference) -> None:
    ref = reference("mixed")
    r = api("/v1/models/mixed/tensors/float8_e5m2")
    assert r.status == 200 and r.headers["content-type"] == ARROW
    assert int(r.headers["content-length"]) == len(r.body)
    rows = r.table().to_pylist()
    assert [(x["name"], x["dtype"], x["shape"]) for x in rows] == [
        ("float8_e5m2", "float8_e5m2", [3, 5])
    ]
    assert rows[0]["data"] == ref["float8_e5m2"].array.tobytes()
    part = api("/v1/models/mixed/tensors/float32?shard=2/3&axis=0")
    assert rows_by_name(part.table()) == {"float32": ref["float32"].array[2:3].tobytes()}


def test_resume_over_http(api, reference) -> None:
    ref = reference("mixed")
    r = api(
        "/v1/models/mixed/stream?name=float32&name=float64"
        "&resume_tensor=float64&resume_offset=100&chunk_bytes=8"
    )
    rows = r.table().to_pylist()
    assert [x["name"] for x in rows] == ["float64"] * 3
    assert [x["offset"] for x in rows] == [100, 108, 116]
    assert b"".join(x["data"] for x in rows) == ref["float64"].array.tobytes()[100:]


# --------------------------------------------------------------------------- operations


def test_health_and_readiness(api, model_root) -> None:
    r = api("/healthz")
    assert r.status == 200 and r.json() == {"status": "ok"}
    r = api("/readyz")
    assert r.status == 200
    assert r.json() == {
        "status": "ready",
        "models": len(model_root.models),
        "refused": 1,
        "revisions_pending": 0,  # every model's content revision is known
    }


def _bytes_served(api, model: str) -> float:
    text = api("/metrics").body.decode()
    pattern = rf'^weightserve_bytes_served_total\{{[^}}]*model="{re.escape(model)}"[^}}]*transport="http"[^}}]*\}} (\S+)$'
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def test_metrics_count_bytes_served(api, model_root) -> None:
    r = api("/metrics")
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/plain")
    before = _bytes_served(api, "org/sharded")
    stream = api("/v1/models/org/sharded/stream?prefix=")
    assert stream.status == 200
    deadline = time.monotonic() + 5  # the counter moves when the server's send loop ends
    while _bytes_served(api, "org/sharded") == before and time.monotonic() < deadline:
        time.sleep(0.02)
    after = _bytes_served(api, "org/sharded")
    # Tensor data bytes, not framing: exactly the model's bytes, less than the whole body.
    total = api("/v1/models/org/sharded").json()["total_bytes"]
    assert after - before == total < len(stream.body)
    text = api("/metrics").body.decode()
    assert "# TYPE weightserve_bytes_served_total counter" in text
    assert "weightserve_open_streams" in text
    assert f"weightserve_models {float(len(model_root.models))}" in text
    assert "weightserve_refused_models 1.0" in text


def test_docs_and_openapi(api) -> None:
    r = api("/docs")
    assert r.status == 200 and r.headers["content-type"].startswith("text/html")
    assert b"swagger" in r.body.lower()
    spec = api("/openapi.json").json()
    assert spec["info"]["title"] == "weightserve"
    paths = spec["paths"]
    for path in (
        "/v1/models",
        "/v1/models/{model}",
        "/v1/models/{model}/stream",
        "/v1/models/{model}/tensors/{name}",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in paths, path
    assert set(paths["/v1/models/{model}/stream"]) == {"get", "post"}


def test_model_info_lists_files_with_sizes(api, model_root) -> None:
    info = api("/v1/models/org/sharded").json()
    _, files = model_root.models["org/sharded"]
    sizes = {f.name: f.stat().st_size for f in files}
    listed = {f["name"]: f["size"] for f in info["files"]}
    assert {k: v for k, v in listed.items() if k in sizes} == sizes
    assert set(listed) - set(sizes) == {"model.safetensors.index.json"}
