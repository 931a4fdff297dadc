"""The ``weightserve`` command as a user runs it: real subprocesses, real ports, real files.

One demo server (``weightserve serve --demo`` on ports 0) serves the module; the shutdown and
environment tests start their own.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from tests.support import fixtures_safetensors as fx
from tests.support.commands import (
    ANY_PORTS,
    WEIGHTSERVE,
    Served,
    clean_env,
    free_port,
    run_cli,
    start_server,
)
from weightserve.service.demo import DEMO_GGUF, DEMO_LM, DEMO_MODEL, demo_tensors

DEMO_NAMES = sorted(demo_tensors())


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cache = tmp_path_factory.mktemp("cache")
    served = start_server(
        ["--demo", "--http-port", "0", "--grpc-port", "0", "--flight-port", "0"],
        clean_env(WEIGHTSERVE_CACHE_DIR=str(cache)),
        cache,
    )
    served.cache = cache  # type: ignore[attr-defined]
    try:
        yield served
    finally:
        assert served.stop() == 0


def demo_file(demo: Served) -> Path:
    return demo.cache / "demo-root" / DEMO_MODEL / "model.safetensors"  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------ help


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        ([], ["serve", "ls", "pull"]),
        (["serve"], ["--demo", "--host", "--http-port", "--grpc-port", "--flight-port",
                     "--flight-public-port", "WEIGHTSERVE_FLIGHT_PORT", "--grace",
                     "--max-streams", "--log-level", "WEIGHTSERVE_ROOT", "WEIGHTSERVE_HTTP_PORT",
                     "WEIGHTSERVE_GRPC_PORT"]),
        (["ls"], ["url", "--prefix", "--token"]),
        (["pull"], ["url", "--out", "--force", "--to", "--prefix", "--token", "--parallel"]),
    ],
)  # fmt: skip
def test_help(args: list[str], mentions: list[str]) -> None:
    result = run_cli(*args, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: weightserve")
    for word in mentions:
        assert word in result.stdout, f"{word} missing from {args} --help"
    assert result.stderr == ""


def test_no_command_is_a_usage_error() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "usage: weightserve" in result.stderr


# ------------------------------------------------------------------------------ serve --demo


def test_demo_prints_urls_then_ready(demo: Served) -> None:
    lines = demo.lines
    assert lines[-1] == "ready"
    assert lines[0].startswith("weightserve: 3 models from ")
    http_line = next(i for i, line in enumerate(lines) if line.strip().startswith("HTTP"))
    grpc_line = next(i for i, line in enumerate(lines) if line.strip().startswith("gRPC"))
    assert http_line < len(lines) - 1 and grpc_line < len(lines) - 1
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", demo.http)
    assert re.fullmatch(r"grpc://127\.0\.0\.1:\d+", demo.grpc)
    assert int(demo.http.rsplit(":", 1)[1]) != 0 and int(demo.grpc.rsplit(":", 1)[1]) != 0
    assert f"  model {demo.http}/v1/models/{DEMO_MODEL}" in lines
    assert get_json(f"{demo.http}/healthz") == (200, {"status": "ok"})
    status, body = get_json(f"{demo.http}/readyz")
    assert status == 200 and body["status"] == "ready" and body["models"] == 3
    assert demo_file(demo).is_file()  # written under WEIGHTSERVE_CACHE_DIR


def test_ls_server_over_http(demo: Served) -> None:
    result = run_cli("ls", demo.http)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "FORMAT", "TENSORS", "SIZE", "REVISION"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {DEMO_MODEL, DEMO_GGUF, DEMO_LM}
    assert rows[DEMO_MODEL][1:3] == ["safetensors", str(len(DEMO_NAMES))]
    assert rows[DEMO_GGUF][1:3] == ["gguf", str(len(DEMO_NAMES) - 1)]  # no int64 in GGUF
    # The same listing over gRPC.
    result_grpc = run_cli("ls", demo.grpc)
    assert result_grpc.returncode == 0, result_grpc.stderr
    assert result_grpc.stdout == result.stdout


def test_ls_model_over_grpc_and_http(demo: Served) -> None:
    result = run_cli("ls", f"{demo.grpc}/{DEMO_MODEL}")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    head = lines[0].split()
    assert head[:4] == [DEMO_MODEL, "safetensors", "revision", head[3]]
    assert head[4:6] == [str(len(DEMO_NAMES)), "tensors"]
    assert [line.split()[0] for line in lines[1:]] == DEMO_NAMES
    row = next(line.split() for line in lines[1:] if line.startswith("lm_head.weight "))
    assert row[1] == "bfloat16" and "".join(row[2:4]) == "[1024,256]"

    http_result = run_cli("ls", f"{demo.http}/v1/models/{DEMO_MODEL}")
    assert http_result.returncode == 0, http_result.stderr
    assert http_result.stdout == result.stdout

    prefixed = run_cli("ls", f"{demo.grpc}/{DEMO_MODEL}", "--prefix", "model.layers.1.")
    assert prefixed.returncode == 0, prefixed.stderr
    names = [line.split()[0] for line in prefixed.stdout.splitlines()[1:]]
    assert names == [n for n in DEMO_NAMES if n.startswith("model.layers.1.")] and len(names) == 9


def test_ls_gguf_model_shows_encodings(demo: Served) -> None:
    result = run_cli("ls", f"{demo.http}/v1/models/{DEMO_GGUF}")
    assert result.returncode == 0, result.stderr
    q = next(line for line in result.stdout.splitlines() if line.startswith("lm_head.weight "))
    assert "uint8 (Q8_0 [1024, 256])" in q


def _load_pt(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a Mapping


@pytest.mark.torch
@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_pull_whole_model_equals_the_served_file(
    demo: Served, tmp_path: Path, transport: str
) -> None:
    torch = pytest.importorskip("torch")
    url = (
        f"{demo.http}/v1/models/{DEMO_MODEL}"
        if transport == "http"
        else f"{demo.grpc}/{DEMO_MODEL}"
    )
    out = tmp_path / "out"
    result = run_cli("pull", url, "--to", "safetensors", "--out", str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out / "model.safetensors")
    assert result.stderr == ""  # --quiet: no progress bar
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # no .partial left

    pulled = _load_pt(out / "model.safetensors")
    source = _load_pt(demo_file(demo))
    assert list(pulled) == list(source) == DEMO_NAMES
    dtypes = set()
    for name, expected in source.items():
        got = pulled[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got, expected), name
        dtypes.add(got.dtype)
    assert dtypes == {torch.bfloat16, torch.float32, torch.int64}

    from safetensors import safe_open

    metadata = []
    for path in (out / "model.safetensors", demo_file(demo)):
        with safe_open(str(path), framework="pt") as f:
            metadata.append(f.metadata())
    assert metadata[0] == metadata[1]  # the source's own, exactly


@pytest.mark.torch
def test_pull_prefix_pulls_only_those(demo: Served, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    out = tmp_path / "layer0"
    result = run_cli(
        "pull", f"{demo.http}/v1/models/{DEMO_MODEL}", "--to", "safetensors",
        "--prefix", "model.layers.0", "--out", str(out), "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    pulled = _load_pt(out / "model.safetensors")
    source = _load_pt(demo_file(demo))
    wanted = [n for n in DEMO_NAMES if n.startswith("model.layers.0")]
    assert len(wanted) == 9
    assert list(pulled) == wanted
    for name in wanted:
        assert torch.equal(pulled[name], source[name]), name


def test_pull_default_out_dir_is_the_model_name(demo: Served, tmp_path: Path) -> None:
    result = subprocess.run(
        [*WEIGHTSERVE, "pull", f"{demo.grpc}/{DEMO_MODEL}", "--quiet"],
        capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "tiny-llama"
    source = demo_file(demo)
    assert (tmp_path / "tiny-llama" / source.name).read_bytes() == source.read_bytes()


def test_pull_unknown_model_fails_clearly(demo: Served, tmp_path: Path) -> None:
    out = tmp_path / "nope"
    for url in (f"{demo.http}/v1/models/demo/no-such-model", f"{demo.grpc}/demo/no-such-model"):
        result = run_cli("pull", url, "--out", str(out), "--quiet")
        assert result.returncode == 1
        assert result.stdout == ""
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith("weightserve pull: ModelNotFound: ")
        assert "'demo/no-such-model'" in result.stderr
        assert not out.exists()


def test_pull_prefix_without_match_fails_clearly(demo: Served, tmp_path: Path) -> None:
    out = tmp_path / "none"
    url = f"{demo.http}/v1/models/{DEMO_MODEL}"
    result = run_cli(
        "pull", url, "--to", "safetensors", "--prefix", "no.such.prefix", "--out", str(out),
        "--quiet",
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "no tensor whose name starts with 'no.such.prefix'" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_ls_with_nothing_listening_is_server_unreachable(scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:{free_port()}"
    # --retry-seconds 0: no waiting for the server to come up
    # (tests/service/serving/test_admission.py waits)
    result = run_cli("ls", url, "--retry-seconds", "0", timeout=60)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(
        f"weightserve ls: ServerUnreachable: cannot reach weightserve at {url}"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ls", "localhost:8080"], "not a weightserve URL: 'localhost:8080'"),
        (["pull", "http://127.0.0.1:1/models/x"], "an HTTP model URL looks like"),
        (["pull", "http://127.0.0.1:1"], "give a model URL"),
    ],
)
def test_malformed_urls_are_usage_errors(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert message in result.stderr


# ------------------------------------------------------------------------------ serve errors


def test_serve_without_root_fails_clearly(tmp_path: Path) -> None:
    result = run_cli("serve", "--http-port", "0", "--grpc-port", "0")
    assert result.returncode == 2
    assert "give a model root directory, or --demo" in result.stderr
    missing = tmp_path / "missing"
    result = run_cli("serve", str(missing), "--http-port", "0", "--grpc-port", "0")
    assert result.returncode == 2
    assert f"model root {missing} is not a directory" in result.stderr


def test_serve_rejects_unknown_options() -> None:
    result = run_cli("serve", "--no-such-option")
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-option" in result.stderr


# ------------------------------------------------------------------------------ environment


def test_environment_configures_serve(tmp_path: Path) -> None:
    root = tmp_path / "root"
    fx.write_sharded(root / "org" / "sharded")
    http_port, grpc_port, flight_port = free_port(), free_port(), free_port()
    env = clean_env(
        WEIGHTSERVE_ROOT=str(root),
        WEIGHTSERVE_HOST="127.0.0.1",
        WEIGHTSERVE_HTTP_PORT=str(http_port),
        WEIGHTSERVE_GRPC_PORT=str(grpc_port),
        WEIGHTSERVE_FLIGHT_PORT=str(flight_port),
        WEIGHTSERVE_LOG_LEVEL="warning",
        WEIGHTSERVE_GRACE_SECONDS="7",
    )
    served = start_server([], env, tmp_path)
    try:
        assert served.http == f"http://127.0.0.1:{http_port}"
        assert served.grpc == f"grpc://127.0.0.1:{grpc_port}"
        assert f"Flight grpc://127.0.0.1:{flight_port} " in "\n".join(served.lines)
        assert served.lines[0] == f"weightserve: 1 models from {root}"
        status, listing = get_json(f"{served.http}/v1/models")
        assert status == 200
        assert [m["id"] for m in listing["models"]] == ["org/sharded"]
        ls = run_cli("ls", served.grpc)
        assert ls.returncode == 0 and "org/sharded" in ls.stdout
        # warning level: the info lines of a normal start are not logged
        assert '"level":"INFO"' not in served.stderr.read_text()
    finally:
        assert served.stop(signal.SIGINT) == 0
    assert served.more_output() == ["weightserve: shutting down, open streams get 7 s"]


def test_flags_override_the_environment(tmp_path: Path) -> None:
    env_root = tmp_path / "env-root"
    fx.write_sharded(env_root / "from-env")
    flag_root = tmp_path / "flag-root"
    fx.write_sharded(flag_root / "from-flag")
    env = clean_env(WEIGHTSERVE_ROOT=str(env_root), WEIGHTSERVE_HTTP_PORT=str(free_port()))
    served = start_server(
        [str(flag_root), "--http-port", "0", "--grpc-port", "0", "--flight-port", "0"],
        env,
        tmp_path,
    )
    try:
        status, listing = get_json(f"{served.http}/v1/models")
        assert [m["id"] for m in listing["models"]] == ["from-flag"]
        assert served.http.rsplit(":", 1)[1] != env["WEIGHTSERVE_HTTP_PORT"]
    finally:
        assert served.stop() == 0


# ------------------------------------------------------------------------------ shutdown


def write_big_model(path: Path, nbytes: int) -> Path:
    """A safetensors file with one F32 tensor of ``nbytes`` (a sparse hole: reads as zeros)."""
    header = {"big.weight": {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fx.write_crafted(path, header)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + nbytes)
    return path


def test_sigterm_drains_open_streams_then_exits_0(tmp_path: Path) -> None:
    nbytes = 128 << 20  # far more than the socket buffers hold
    write_big_model(tmp_path / "root" / "big" / "model.safetensors", nbytes)
    served = start_server(
        [
            str(tmp_path / "root"),
            *ANY_PORTS,
            "--grace",
            "60",
        ],
        clean_env(),
        tmp_path,
    )
    host, port = served.http.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/v1/models/big/stream?prefix=")
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("content-type", "").startswith(
            "application/vnd.apache.arrow.stream"
        )
        received = bytearray(response.read(1 << 20))

        served.proc.send_signal(signal.SIGTERM)
        # While the stream is open: readiness goes 503 on a new connection, new streams are
        # refused, and the process stays up.
        deadline = time.monotonic() + 10
        while True:
            status, body = get_json(f"{served.http}/readyz")
            if status == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (status, body["status"]) == (503, "draining")
        status, body = get_json(f"{served.http}/v1/models/big/stream?prefix=")
        assert status == 503 and body["error"]["type"] == "ModelUnavailable"
        assert "shutting down" in body["error"]["message"]
        time.sleep(0.5)
        assert served.proc.poll() is None, "the server exited with a stream still open"

        # Finish reading the stream slowly-then-fully: every byte arrives intact.
        while chunk := response.read(4 << 20):
            received += chunk
    finally:
        conn.close()
    started = time.monotonic()
    assert served.proc.wait(timeout=15) == 0
    assert time.monotonic() - started < 10

    table = pa.ipc.open_stream(bytes(received)).read_all()
    assert set(table.column("name").to_pylist()) == {"big.weight"}
    data = table.column("data").to_pylist()
    assert sum(len(d) for d in data) == nbytes
    assert table.column("total_bytes").to_pylist()[0] == nbytes
    offsets = table.column("offset").to_pylist()
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(d == bytes(len(d)) for d in data[:2])  # the hole is zeros
    assert served.more_output() == ["weightserve: shutting down, open streams get 60 s"]


def test_sigterm_idle_server_exits_quickly(small_root: Path, tmp_path: Path) -> None:
    served = start_server(
        [str(small_root), "--http-port", "0", "--grpc-port", "0", "--flight-port", "0"],
        clean_env(),
        tmp_path,
    )
    # The grace period is 30 s: exiting within 15 shows an idle server doesn't wait it out.
    assert served.stop(signal.SIGTERM, timeout=15) == 0


@pytest.fixture
def small_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    fx.write_sharded(root / "m")
    shutil.copy(root / "m" / fx.SHARD_NAMES[0], root / "single.safetensors")
    return root


def test_token_file_from_the_environment_guards_both_transports(
    small_root: Path, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("cli-secret-token\n")
    served = start_server(
        [
            str(small_root),
            *ANY_PORTS,
            "--rescan",
            "0",
        ],
        clean_env(WEIGHTSERVE_TOKEN_FILE=str(tokens)),
        tmp_path,
    )
    try:
        for url in (served.http, served.grpc):
            refused = run_cli("ls", url)
            assert refused.returncode == 1
            assert "Unauthenticated" in refused.stderr and "Traceback" not in refused.stderr
            allowed = run_cli("ls", url, env=clean_env(WEIGHTSERVE_TOKEN="cli-secret-token"))
            assert allowed.returncode == 0, allowed.stderr
            assert "single.safetensors" in allowed.stdout and "m " in allowed.stdout
            flag = run_cli("ls", url, "--token", "cli-secret-token")
            assert flag.returncode == 0 and flag.stdout == allowed.stdout
    finally:
        assert served.stop(signal.SIGTERM, timeout=15) == 0
