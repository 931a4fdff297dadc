"""HTTP routes that no model id or tensor name can collide with, HEAD wherever GET is, and
API docs that load nothing from another host.

One real server serves models whose ids and tensor names look like routes (``edge/stream``,
``x/tensors/y``, ``enc/layer_0/kernel``, ``stream``) or need percent-encoding (``%``, ``?``,
``#``, spaces). Requests go through the client library and through ``http.client`` with the
path exactly as written, on the routes with the reserved ``-`` part and on the older ones.
"""

from __future__ import annotations

import http.client
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlencode

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.support._util import Reply, http_request
from weightserve.client import Client, RemoteWeights
from weightserve.client.errors import InvalidRequest
from weightserve.client.wire.routes import http_model_path, parse_url
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.sources.layout import validate_model_id

ODD_NAMES = (
    "enc/layer_0/kernel",
    "stream",
    "tensors/x",
    "a/-/stream",
    "-",
    "100% sure?#frag x",
    "plain",
)
# model id -> tensor names; directories are written from the ids.
MODELS = {
    "odd/names": ODD_NAMES,
    "edge": ("w",),
    "edge/stream": ("w",),
    "x/tensors/y": ("w",),
    "we%ird ?#/id": ("w", "x/y"),
    "amb": ("k/tensors/w",),
    "amb/tensors/k": ("w",),
}
TOKEN = "edge-only-token-0123456789"


def arrays_for(model_id: str) -> dict[str, np.ndarray]:
    """Distinct contents per model and tensor, so a wrong route shows as wrong bytes."""
    seed = sum(map(ord, model_id))
    return {
        name: np.arange(6, dtype=np.float32).reshape(2, 3) + seed + 100 * i
        for i, name in enumerate(MODELS[model_id])
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("awkward-root")
    for model_id in MODELS:
        (root / model_id).mkdir(parents=True, exist_ok=True)
        save_file(arrays_for(model_id), root / model_id / "model.safetensors")
    # A directory named like the reserved part is reported, never served.
    (root / "org" / "-").mkdir(parents=True)
    save_file({"w": np.zeros(2, np.float32)}, root / "org" / "-" / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def srv(root: Path) -> Iterator[WeightServer]:
    with WeightServer(ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0)) as s:
        yield s


@pytest.fixture(scope="module")
def auth_srv(root: Path) -> Iterator[WeightServer]:
    tokens = root.parent / "routes-tokens"
    tokens.write_text(f"{TOKEN} edge\n")
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, token_file=str(tokens)
    )
    with WeightServer(config) as s:
        yield s


def request(
    server: WeightServer,
    path: str,
    method: str = "GET",
    body: dict | None = None,
    headers: dict | None = None,
) -> Reply:
    return http_request(server.http_port, path, method, body, headers)


def expected(model_id: str, *names: str) -> dict[str, bytes]:
    arrays = arrays_for(model_id)
    return {name: arrays[name].tobytes() for name in names}


# ------------------------------------------------------------------------ through the client


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_client_reaches_every_awkward_id_and_name(
    srv: WeightServer, root: Path, transport: str
) -> None:
    base = srv.http_url if transport == "http" else srv.grpc_url
    with Client(base) as client:
        served = {m.id for m in client.list_models()[0]}
        assert served == set(MODELS)
        for model_id, names in MODELS.items():
            model = client.model(model_id)
            assert model.info.id == model_id
            got = model.fetch(list(names))
            reference = load_file(root / model_id / "model.safetensors")  # the oracle
            assert set(got) == set(names)
            for name in names:
                np.testing.assert_array_equal(got[name], reference[name])


def test_model_urls_with_encoded_ids_and_route_suffixes_parse(srv: WeightServer) -> None:
    model_id = "we%ird ?#/id"
    for suffix in ("", "/-/stream", "/-/tensors/x%2Fy"):
        url = f"{srv.http_url}{http_model_path(model_id)}{suffix}"
        assert parse_url(url)[1] == model_id, url
    assert parse_url(f"{srv.http_url}/v1/models/odd/names")[1] == "odd/names"
    weights = RemoteWeights(f"{srv.http_url}{http_model_path(model_id)}")
    try:
        got = weights.numpy_state_dict()
    finally:
        weights.close()
    assert set(got) == set(MODELS[model_id])
    for name, array in arrays_for(model_id).items():
        np.testing.assert_array_equal(got[name], array)


def test_http_model_path_encodes_each_part() -> None:
    assert http_model_path("org/m") == "/v1/models/org/m"
    assert http_model_path("we%ird ?#/id") == "/v1/models/we%25ird%20%3F%23/id"
    assert http_model_path("org/m", "stream") == "/v1/models/org/m/-/stream"
    assert http_model_path("org/m", "tensors", "a/b?%") == "/v1/models/org/m/-/tensors/a%2Fb%3F%25"


# ------------------------------------------------------------------------ raw HTTP, new routes


def test_every_tensor_by_its_own_url(srv: WeightServer) -> None:
    for model_id, names in MODELS.items():
        for name in names:
            # Fully encoded, and with the name's slashes left as they are: both reach it.
            for encoded in (quote(name, safe=""), quote(name, safe="/")):
                path = f"{http_model_path(model_id)}/-/tensors/{encoded}"
                assert request(srv, path).rows() == expected(model_id, name), path


def test_streams_and_info_on_the_new_routes(srv: WeightServer) -> None:
    names = list(ODD_NAMES)
    query = urlencode([("name", n) for n in names])
    got = request(srv, f"/v1/models/odd/names/-/stream?{query}").rows()
    assert got == expected("odd/names", *names)
    posted = request(srv, "/v1/models/odd/names/-/stream", "POST", {"names": names})
    assert posted.rows() == got
    prefix = request(srv, "/v1/models/odd/names/-/stream?prefix=" + quote("a/-/"))
    assert prefix.rows() == expected("odd/names", "a/-/stream")
    for model_id in MODELS:
        info = request(srv, http_model_path(model_id))
        assert info.status == 200 and info.json()["id"] == model_id
        assert [t["name"] for t in info.json()["tensors"]] == sorted(MODELS[model_id])
        stream = request(srv, http_model_path(model_id, "stream") + "?prefix=")
        assert stream.rows() == expected(model_id, *MODELS[model_id])


def test_reserved_part_is_no_model_id(srv: WeightServer) -> None:
    problems = {p["model"]: p for p in request(srv, "/v1/models").json()["problems"]}
    assert "org/-" in problems and "reserved" in problems["org/-"]["reason"]
    for path in ("/v1/models/org/-", "/v1/models/org/-/-/stream?prefix=", "/v1/models/a/-/nope"):
        r = request(srv, path)
        assert r.status == 400, path
        assert r.json()["error"]["type"] == "InvalidRequest"
        assert "'-' is reserved" in r.json()["error"]["message"], path
    for model_id in ("-", "org/-", "-/x", "a/-/b"):
        with pytest.raises(InvalidRequest, match="reserved"):
            validate_model_id(model_id)
    assert validate_model_id("a-b/-c/d-") == "a-b/-c/d-"


# ------------------------------------------------------------------------ raw HTTP, old routes


def test_old_routes_resolve_by_the_catalog(srv: WeightServer) -> None:
    # A path that is a model id is that model, whatever it ends in.
    assert request(srv, "/v1/models/edge/stream").json()["id"] == "edge/stream"
    assert request(srv, "/v1/models/x/tensors/y").json()["id"] == "x/tensors/y"
    # The old stream and tensor forms, where one reading names a model.
    old = request(srv, "/v1/models/edge/stream/stream?prefix=")
    assert old.rows() == expected("edge/stream", "w")
    assert request(srv, "/v1/models/x/tensors/y/tensors/w").rows() == expected("x/tensors/y", "w")
    tensor = request(srv, "/v1/models/odd/names/tensors/enc/layer_0/kernel")
    assert tensor.rows() == expected("odd/names", "enc/layer_0/kernel")
    assert request(srv, "/v1/models/odd/names/tensors/stream").rows() == expected(
        "odd/names", "stream"
    )
    assert request(srv, "/v1/models/odd/names/stream?name=plain").rows() == expected(
        "odd/names", "plain"
    )
    posted = request(srv, "/v1/models/odd/names/stream", "POST", {"names": ["tensors/x"]})
    assert posted.rows() == expected("odd/names", "tensors/x")
    # The model `edge` stays reachable, on the new route.
    assert request(srv, "/v1/models/edge/-/stream?prefix=").rows() == expected("edge", "w")


def test_ambiguous_old_route_names_the_unambiguous_urls(srv: WeightServer) -> None:
    r = request(srv, "/v1/models/amb/tensors/k/tensors/w")
    assert r.status == 400
    message = r.json()["error"]["message"]
    assert "ambiguous" in message
    assert "/v1/models/amb/-/tensors/k%2Ftensors%2Fw" in message
    assert "/v1/models/amb/tensors/k/-/tensors/w" in message
    for path in ("/v1/models/amb/-/tensors/k/tensors/w", "/v1/models/amb/tensors/k/-/tensors/w"):
        assert len(request(srv, path).rows()) == 1, path


def test_old_routes_never_resolve_to_a_model_the_token_hides(auth_srv: WeightServer) -> None:
    """With a token for `edge` only, `/v1/models/edge/stream` is edge's stream: the hidden
    model `edge/stream` neither wins nor shows in the answer."""
    auth = {"authorization": f"Bearer {TOKEN}"}
    r = request(auth_srv, "/v1/models/edge/stream?prefix=", headers=auth)
    assert r.rows() == expected("edge", "w")
    r = request(auth_srv, "/v1/models/edge/stream", headers={})
    assert r.status == 401


# ------------------------------------------------------------------------ HEAD


def head_and_get(server: WeightServer, path: str) -> tuple[Reply, Reply]:
    """HEAD then GET on one kept-alive connection: any body sent after the HEAD's headers
    would be read as the GET's status line and break it."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("HEAD", path)
        head = Reply(conn.getresponse())
        conn.request("GET", path)
        return head, Reply(conn.getresponse())
    finally:
        conn.close()


def test_head_answers_wherever_get_does(srv: WeightServer) -> None:
    spec = request(srv, "/openapi.json").json()
    fill = {"{model}": "odd/names", "{name}": "enc/layer_0/kernel"}
    paths = []
    for template, operations in spec["paths"].items():
        assert operations.keys() & {"get", "post", "put", "delete"}, template
        if template.endswith("/watch"):
            continue  # a watch answers for as long as the client listens: no HEAD to compare
        if "get" in operations:
            for key, value in fill.items():
                template = template.replace(key, value)
            paths.append(template + "?prefix=")
    paths += ["/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui.css"]
    paths += ["/v1/models/nope", "/v1/models/odd/names/-/stream?name=nope"]  # errors too
    assert len(paths) >= 13
    for path in paths:
        head, get = head_and_get(srv, path)
        assert head.status == get.status, path
        assert head.body == b"", path
        for header in ("content-type", "etag", "x-weightserve-revision"):
            assert head.headers.get(header) == get.headers.get(header), (path, header)
        if "content-length" in get.headers and not path.startswith("/metrics"):  # counts grow
            assert head.headers["content-length"] == str(len(get.body)), path
    assert srv.state.open_streams == 0  # a HEAD holds no stream slot


def test_head_of_a_stream_is_its_size_without_a_slot(srv: WeightServer) -> None:
    path = "/v1/models/odd/names/-/stream?prefix=&chunk_bytes=8"
    for _ in range(srv.state.limits.max_streams + 2):
        head, _ = head_and_get(srv, path)
        assert head.status == 200
    get = request(srv, path)
    assert head.headers["content-length"] == str(len(get.body))
    assert head.headers["x-weightserve-tensors"] == str(len(ODD_NAMES))
    assert srv.state.open_streams == 0


# ------------------------------------------------------------------------ docs, offline


def local_references(html: str) -> list[str]:
    refs = re.findall(r"""(?:src|href|spec-url)\s*=\s*["']([^"']+)["']""", html)
    refs += re.findall(r"""\burl:\s*["']([^"']+)["']""", html)
    return refs


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_load_only_from_this_server(srv: WeightServer, page: str) -> None:
    r = request(srv, page)
    assert r.status == 200 and r.headers["content-type"].startswith("text/html")
    html = r.body.decode()
    assert "http://" not in html and "https://" not in html
    refs = local_references(html)
    assert len(refs) >= 3, refs  # script, favicon, spec (and stylesheet for Swagger UI)
    for ref in refs:
        assert ref.startswith("/") and not ref.startswith("//"), ref
        asset = request(srv, ref)
        assert asset.status == 200, ref
        assert len(asset.body) > 0, ref
    scripts = [ref for ref in refs if ref.endswith(".js")]
    assert scripts and all(ref.startswith("/docs/assets/") for ref in scripts)
