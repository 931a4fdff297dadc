"""Hub clients through a node cache whose fill outlasts their timeouts: the real
``huggingface_hub`` (in a child process, ``HF_ENDPOINT`` at the node) downloads a model that a
throttled origin takes over 15 s to copy, with no 503 on the way, for an upstream weightserve
(commit known before the fill: files stream as they land) and for S3 (SeaweedFS; the commit is
known once filled: model info and HEADs are held).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import fixtures_safetensors
from tests.support._util import http_request
from tests.support.byte_proxy import SlowProxy
from tests.support.environment import child_environment
from tests.support.paths import REPO
from tests.support.s3_server import S3Server
from weightserve.service.server import ServerConfig, WeightServer

pytestmark = pytest.mark.slow

FILE_BYTES = 3 << 20
FILL_SECONDS = 17.0  # how long the throttled origin takes to pass one model's weights
# Two models per node, each cold: SHARDED for snapshot_download, SINGLE for hf_hub_download as
# from_pretrained calls it (config.json first, then the weights).
SHARDED, SINGLE = "org/sharded", "org/single"

# Run in the child: each download on its own thread (so the four fills overlap), then each
# file's sha256 and how long its download took, or the error it raised.
_CLIENT = """
import hashlib, json, sys, threading, time
from pathlib import Path
from huggingface_hub import hf_hub_download, snapshot_download

nodes = json.loads(sys.argv[1])
cache, snapshot_repo, single_repo = sys.argv[2:5]
results = {}

def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()

def run(key, call):
    started = time.monotonic()
    try:
        files = call()
        results[key] = {"files": files, "seconds": time.monotonic() - started}
    except Exception as e:
        results[key] = {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}

def snapshot(endpoint, where):
    root = Path(snapshot_download(snapshot_repo, endpoint=endpoint, cache_dir=where))
    return {p.relative_to(root).as_posix(): digest(p) for p in root.rglob("*") if p.is_file()}

def pretrained(endpoint, where):
    return {
        name: digest(hf_hub_download(single_repo, name, endpoint=endpoint, cache_dir=where))
        for name in ("config.json", "model.safetensors")
    }

threads = []
for kind, endpoint in nodes.items():
    for what, call in (("snapshot", snapshot), ("pretrained", pretrained)):
        where = f"{cache}/{kind}-{what}"
        threads.append(threading.Thread(target=run, args=(f"{kind}/{what}", lambda c=call, e=endpoint, w=where: c(e, w))))
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results))
"""


def write_models(root: Path) -> dict[str, dict[str, str]]:
    """Each model's files under ``root``, and their sha256 by repo file name: SHARDED's
    second shard is copied only after its first, so a download of it waits for its bytes."""
    rng = np.random.default_rng(7)
    weights = {
        SHARDED: {"model-00001-of-00002.safetensors": 2 * FILE_BYTES // 3,
                  "model-00002-of-00002.safetensors": FILE_BYTES // 3},
        SINGLE: {"model.safetensors": FILE_BYTES},
    }  # fmt: skip
    expected = {}
    for repo, files in weights.items():
        (root / repo).mkdir(parents=True)
        weight_map = {}
        for name, size in files.items():
            tensor = f"w{len(weight_map)}"
            data = rng.standard_normal(size // 4, dtype=np.float32)
            fixtures_safetensors.save_file({tensor: data}, root / repo / name)
            weight_map[tensor] = name
        if len(files) > 1:
            fixtures_safetensors.write_index(root / repo, weight_map)
        (root / repo / "config.json").write_text(json.dumps({"model_type": "bert"}))
        expected[repo] = {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (root / repo).iterdir()
        }
    return expected


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, str]]]:
    root = tmp_path_factory.mktemp("hub-fill-models")
    return root, write_models(root)


@pytest.fixture(scope="module")
def upstream(models: tuple[Path, dict]) -> Iterator[WeightServer]:
    config = ServerConfig(
        str(models[0]), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False
    )
    with WeightServer(config) as server:
        yield server


@contextlib.contextmanager
def node(
    origin_port: int, uri_of: Callable[[int], str], cache: Path, **settings: object
) -> Iterator[tuple[WeightServer, SlowProxy]]:
    """A node cache whose origin is reached through a SlowProxy (unthrottled until the test
    throttles it, so the node starts and lists at full speed)."""
    proxy = SlowProxy(origin_port)
    try:
        config = ServerConfig(
            uri_of(proxy.port),
            http_port=0,
            grpc_port=0,
            flight_port=None,
            rescan_seconds=0,
            watch=False,
            cache_dir=str(cache),
            **settings,  # type: ignore[arg-type]
        )
        with WeightServer(config) as server:
            yield server, proxy
    finally:
        proxy.close()


def status_codes(server: WeightServer) -> dict[str, int]:
    """``weightserve_requests_total`` of the HTTP transport, by status code."""
    text = http_request(server.http_port, "/metrics").body.decode()
    codes: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "weightserve_requests_total" and sample.labels["transport"] == "http":
                code = sample.labels["code"]
                codes[code] = codes.get(code, 0) + int(sample.value)
    return codes


@pytest.mark.s3
def test_hub_downloads_through_a_node_whose_fill_outlasts_the_client_timeouts(
    models: tuple[Path, dict[str, dict[str, str]]],
    upstream: WeightServer,
    s3_server: S3Server,
    tmp_path: Path,
) -> None:
    root, expected = models
    s3_server.upload(root, "hub-fill")
    with contextlib.ExitStack() as stack:
        nodes = {
            "upstream": stack.enter_context(
                node(upstream.http_port, lambda p: f"http://127.0.0.1:{p}", tmp_path / "n1")
            ),
            "s3": stack.enter_context(
                node(s3_server.port, lambda p: s3_server.uri("hub-fill", port=p), tmp_path / "n2")
            ),
        }
        for _, proxy in nodes.values():
            proxy.rate = FILE_BYTES / FILL_SECONDS
        env = child_environment()
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_ENDPOINT"):
            env.pop(key, None)
        env.update(
            HF_HOME=str(tmp_path / "hf-home"),
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
        )
        endpoints = {kind: server.http_url for kind, (server, _) in nodes.items()}
        started = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _CLIENT,
                json.dumps(endpoints),
                str(tmp_path / "hf-cache"),
                SHARDED,
                SINGLE,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads(done.stdout.strip().splitlines()[-1])
        for kind, (server, _) in nodes.items():
            for what, repo in (("snapshot", SHARDED), ("pretrained", SINGLE)):
                result = results[f"{kind}/{what}"]
                assert "error" not in result, (kind, what, result, done.stderr[-3000:])
                assert result["files"] == expected[repo], (kind, what)
                # Longer than the client's 10 s timeouts: the fill was waited out.
                assert result["seconds"] > 15, (kind, what, result["seconds"])
            codes = status_codes(server)
            assert "503" not in codes, (kind, codes)
            # Held and redirected to itself: a file queued behind the first shard (upstream),
            # a HEAD whose commit only the fill tells (S3).
            assert codes.get("307"), (kind, codes)
        assert time.monotonic() - started < 120


def resolve(repo: str, name: str) -> str:
    return f"/{repo}/resolve/main/{name}"


def test_a_file_streams_as_its_fill_lands_with_ranges_and_a_failed_fill_cuts_it_short(
    models: tuple[Path, dict], upstream: WeightServer, tmp_path: Path
) -> None:
    """Over an upstream (content digests listed): HEAD is answered from the listing at once,
    GET and a Range GET stream the bytes as they land, byte for byte; a fill that fails
    mid-stream ends the body short (the client sees the transfer fail), never a short file."""
    root = models[0]
    weights = (root / SINGLE / "model.safetensors").read_bytes()
    listed = http_request(upstream.http_port, f"/api/models/{SINGLE}").json()
    etag = http_request(upstream.http_port, resolve(SINGLE, "model.safetensors"), "HEAD")
    url = lambda p: f"http://127.0.0.1:{p}"  # noqa: E731
    with node(upstream.http_port, url, tmp_path / "n", origin_stall_seconds=1.0) as (server, proxy):
        proxy.rate = FILE_BYTES / 5
        started = time.monotonic()
        head = http_request(server.http_port, resolve(SINGLE, "model.safetensors"), "HEAD")
        assert time.monotonic() - started < 3  # not held for the fill
        assert head.status == 200, head.headers
        assert head.headers["x-repo-commit"] == listed["sha"]
        assert head.headers["etag"] == etag.headers["etag"]
        assert head.headers["content-length"] == str(len(weights))

        replies: dict[str, object] = {}

        def get(key: str, headers: dict[str, str]) -> None:
            replies[key] = http_request(
                server.http_port, resolve(SINGLE, "model.safetensors"), headers=headers
            )

        threads = [
            threading.Thread(target=get, args=("whole", {})),
            threading.Thread(target=get, args=("tail", {"range": "bytes=1000000-"})),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        whole, tail = replies["whole"], replies["tail"]
        assert whole.status == 200 and whole.body == weights  # type: ignore[attr-defined]
        assert tail.status == 206, tail.headers  # type: ignore[attr-defined]
        assert tail.headers["content-range"] == f"bytes 1000000-{len(weights) - 1}/{len(weights)}"  # type: ignore[attr-defined]
        assert tail.body == weights[1000000:]  # type: ignore[attr-defined]
        assert time.monotonic() - started > 4  # they were streamed during the fill

        # The other model's fill stalls after its first MiB landed: the body is cut there.
        proxy.stall_after = proxy.bytes_from_upstream + (1536 << 10)
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        try:
            conn.request("GET", resolve(SHARDED, "model-00001-of-00002.safetensors"))
            reply = conn.getresponse()
            assert reply.status == 200
            with pytest.raises(http.client.IncompleteRead) as cut:
                reply.read()
            assert 0 < len(cut.value.partial) < 2 * FILE_BYTES // 3
        finally:
            conn.close()


@pytest.mark.s3
def test_over_object_storage_model_info_and_head_are_held_not_refused(
    models: tuple[Path, dict], s3_server: S3Server, tmp_path: Path
) -> None:
    """The commit is known once filled: model info is held with the connection kept alive
    (200 committed, then spaces, then the JSON), a HEAD is held then redirected to itself; a
    side file's download, which needs no commit, comes without a fill."""
    s3_server.upload(models[0], "hub-held")
    s3 = lambda p: s3_server.uri("hub-held", port=p)  # noqa: E731
    with node(s3_server.port, s3, tmp_path / "n") as (server, proxy):
        # A side file's download needs no commit: fetched alone, no fill.
        config = http_request(server.http_port, resolve(SHARDED, "config.json"))
        assert config.status == 200, config.body
        assert config.body == (models[0] / SHARDED / "config.json").read_bytes()
        assert "x-repo-commit" not in config.headers
        state = http_request(server.http_port, f"/v1/admin/cache/{SHARDED}").json()
        assert state["state"] == "remote", state

        proxy.rate = FILE_BYTES / 10
        replies: dict[str, tuple[float, object]] = {}

        def ask(key: str, path: str, method: str) -> None:
            started = time.monotonic()
            reply = http_request(server.http_port, path, method)
            replies[key] = (time.monotonic() - started, reply)

        threads = [
            threading.Thread(target=ask, args=("info", f"/api/models/{SINGLE}", "GET")),
            threading.Thread(
                target=ask, args=("head", resolve(SINGLE, "model.safetensors"), "HEAD")
            ),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        head_seconds, head = replies["head"]
        assert head.status == 307, head.headers  # type: ignore[attr-defined]
        location = resolve(SINGLE, "model.safetensors") + "?held=1"  # the hops are counted
        assert head.headers["location"] == location  # type: ignore[attr-defined]
        assert 5 < head_seconds < 9.5  # under huggingface_hub's 10 s for a HEAD
        info_seconds, info = replies["info"]
        assert info.status == 200 and info_seconds > 8  # type: ignore[attr-defined]
        assert info.body.startswith(b" ")  # type: ignore[attr-defined]
        body = json.loads(info.body)  # type: ignore[attr-defined]
        assert body["id"] == SINGLE and len(body["sha"]) == 40
        again = http_request(server.http_port, resolve(SINGLE, "model.safetensors"), "HEAD")
        assert again.status == 200 and again.headers["x-repo-commit"] == body["sha"]
