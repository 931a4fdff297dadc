"""Mistakes a user makes starting or pointing at a server, as the user meets them.

Each start-up mistake runs a real ``weightserve serve`` subprocess and checks what it prints:
one line on stderr naming the flag (and its variable) or the listener, exit status 2, no
traceback. Wrong-transport URLs go to a real server on loopback, through the library and
through the command line. The README's Configuration table is checked against the parser.
"""

from __future__ import annotations

import gc
import re
import shutil
import socket
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support import fixtures_safetensors as fx
from tests.support.commands import ANY_PORTS, clean_env, free_port, run_cli, start_server
from tests.support.node_caches import config
from tests.support.paths import REPO
from weightserve.client import Client, RemoteWeights
from weightserve.client.errors import WrongTransport
from weightserve.service.config import SETTINGS
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.transports.listener import StartupError

MODEL = "org/sharded"


def serve_fails(*args: str, env: dict[str, str] | None = None) -> str:
    """Run ``weightserve serve ARGS`` that must not start; its one error line."""
    result = run_cli("serve", *args, env=env, timeout=60)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == "" or "ready" not in result.stdout.splitlines()
    # Structured log lines may come before it (the catalog's scan); the error is one line.
    plain = [line for line in result.stderr.splitlines() if not line.startswith('{"time"')]
    assert len(plain) == 1, result.stderr
    assert result.stderr.endswith(plain[0] + "\n")
    assert plain[0].startswith("weightserve serve: "), plain[0]
    return plain[0]


@pytest.fixture
def empty_root(tmp_path: Path) -> Path:
    root = tmp_path / "empty"
    root.mkdir()
    return root


# ------------------------------------------------------------------------------ flag values


@pytest.mark.parametrize(
    ("args", "flag", "why"),
    [
        (["--http-port", "99999"], "--http-port", "a port is 0..65535, got '99999'"),
        (["--grpc-port", "-1"], "--grpc-port", "a port is 0..65535"),
        (["--flight-port", "-2"], "--flight-port", "or -1 for none"),
        (["--flight-public-port", "70000"], "--flight-public-port", "a port is 0..65535"),
        (["--max-streams", "0"], "--max-streams", "must be at least 1, got '0'"),
        (["--max-streams", "-5"], "--max-streams", "must be at least 1, got '-5'"),
        (["--max-streams", "many"], "--max-streams", "expected a whole number, got 'many'"),
        (["--max-streams-per-client", "0"], "--max-streams-per-client", "at least 1"),
        (["--grace", "-1"], "--grace", "must be 0 seconds or more, got '-1'"),
        (["--rescan", "-1"], "--rescan", "must be 0 seconds or more"),
        (["--idle-timeout", "0"], "--idle-timeout", "must be more than 0 seconds"),
        (["--grace", "nan"], "--grace", "expected a finite number"),
        (["--log-level", "loud"], "--log-level", "expected one of debug, info, warning, error"),
    ],
)
def test_flag_values_are_checked_by_the_parser(
    args: list[str], flag: str, why: str, empty_root: Path
) -> None:
    line = serve_fails(str(empty_root), *args)
    assert line.startswith(f"weightserve serve: error: argument {flag}: ")
    assert why in line
    assert line.endswith("(see weightserve serve --help)")


@pytest.mark.parametrize(
    ("variable", "value", "flag"),
    [
        ("WEIGHTSERVE_MAX_STREAMS", "0", "--max-streams"),
        ("WEIGHTSERVE_MAX_STREAMS_PER_CLIENT", "-3", "--max-streams-per-client"),
        ("WEIGHTSERVE_HTTP_PORT", "99999", "--http-port"),
        ("WEIGHTSERVE_FLIGHT_PORT", "fifty", "--flight-port"),
        ("WEIGHTSERVE_GRACE_SECONDS", "-1", "--grace"),
        ("WEIGHTSERVE_RESCAN_SECONDS", "-1", "--rescan"),
        ("WEIGHTSERVE_IDLE_TIMEOUT", "0", "--idle-timeout"),
        ("WEIGHTSERVE_PROTECT_METRICS", "maybe", "--protect-metrics"),
        ("WEIGHTSERVE_LOG_LEVEL", "chatty", "--log-level"),
    ],
)
def test_environment_values_are_checked_like_flags(
    variable: str, value: str, flag: str, empty_root: Path
) -> None:
    line = serve_fails(str(empty_root), env=clean_env(**{variable: value}))
    assert line.startswith(f"weightserve serve: {variable}={value!r} (the variable of {flag}): ")


def test_a_flag_wins_over_a_bad_variable_and_other_commands_ignore_it(
    empty_root: Path,
) -> None:
    env = clean_env(WEIGHTSERVE_MAX_STREAMS="0", WEIGHTSERVE_REQUIRE_MODELS="1")
    # The flag is given, so the variable is never read: the next mistake is the empty root.
    line = serve_fails(str(empty_root), "--max-streams", "4", *ANY_PORTS, env=env)
    assert line.startswith("weightserve serve: --require-models (WEIGHTSERVE_REQUIRE_MODELS)")
    for command in (["ls", "--help"], ["pull", "--help"]):
        result = run_cli(*command, env=env)
        assert result.returncode == 0 and result.stderr == "", result.stderr


def test_pull_parallel_zero_is_a_usage_error() -> None:
    result = run_cli("pull", "http://127.0.0.1:1/v1/models/x", "--parallel", "0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr == (
        "weightserve pull: error: argument --parallel: must be at least 1, got '0' "
        "(see weightserve pull --help)\n"
    )


# ------------------------------------------------------------------------------ listeners


@pytest.mark.parametrize(
    ("flag", "variable", "listener"),
    [
        ("--http-port", "WEIGHTSERVE_HTTP_PORT", "HTTP"),
        ("--grpc-port", "WEIGHTSERVE_GRPC_PORT", "gRPC"),
        ("--flight-port", "WEIGHTSERVE_FLIGHT_PORT", "Arrow Flight"),
    ],
)
def test_a_port_in_use_names_the_listener_and_its_flag(
    flag: str, variable: str, listener: str, empty_root: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = serve_fails(str(empty_root), *ANY_PORTS, flag, str(port))
    assert line.startswith(f"weightserve serve: {flag} ({variable}): the {listener} endpoint ")
    assert f"127.0.0.1:{port}: the port is already in use" in line
    assert "choose another port (0: any free port)" in line


def test_a_second_server_on_the_same_ports_is_refused(tmp_path: Path) -> None:
    """gRPC servers bind with SO_REUSEPORT by default; a second weightserve on the same gRPC
    or Flight port must fail instead of sharing the port with the first."""
    root = tmp_path / "root"
    fx.write_sharded(root / "org" / "sharded")
    first = start_server([str(root), *ANY_PORTS], clean_env(), tmp_path)
    try:
        flight = next(line for line in first.lines if line.strip().startswith("Flight"))
        ports = {
            "--http-port": first.http.rsplit(":", 1)[1],
            "--grpc-port": first.grpc.rsplit(":", 1)[1],
            "--flight-port": re.search(r":(\d+)\s", flight + " ").group(1),  # type: ignore[union-attr]
        }
        for flag, port in ports.items():
            line = serve_fails(str(root), *ANY_PORTS, flag, port)
            assert line.startswith(f"weightserve serve: {flag} "), line
            assert f":{port}: the port is already in use" in line
    finally:
        assert first.stop() == 0


def test_two_listeners_on_one_port(empty_root: Path) -> None:
    port = str(free_port())
    line = serve_fails(str(empty_root), *ANY_PORTS, "--http-port", port, "--grpc-port", port)
    assert line == (
        "weightserve serve: --grpc-port (WEIGHTSERVE_GRPC_PORT): the gRPC and HTTP endpoints "
        f"are both given port {port}; each needs its own"
    )


def test_a_host_that_is_not_this_machine(empty_root: Path) -> None:
    line = serve_fails(str(empty_root), *ANY_PORTS, "--host", "no-such-host.invalid")
    assert line.startswith("weightserve serve: --host (WEIGHTSERVE_HOST): cannot listen on ")
    assert "not an address of this machine" in line


# ------------------------------------------------------------------------------ files


def test_token_file_missing_or_empty(tmp_path: Path, empty_root: Path) -> None:
    missing = tmp_path / "no-tokens"
    line = serve_fails(str(empty_root), *ANY_PORTS, "--token-file", str(missing))
    assert line == (
        "weightserve serve: --token-file (WEIGHTSERVE_TOKEN_FILE): cannot read the token file "
        f"{missing}: No such file or directory"
    )
    empty = tmp_path / "tokens"
    empty.write_text("# tokens go here\n\n")
    line = serve_fails(
        str(empty_root), *ANY_PORTS, env=clean_env(WEIGHTSERVE_TOKEN_FILE=str(empty))
    )
    assert line.startswith("weightserve serve: --token-file (WEIGHTSERVE_TOKEN_FILE): ")
    assert "holds no token; write one bearer token per line" in line


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cert.pem / key.pem (a pair), other-key.pem, and junk.txt (not PEM)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line tool is not installed")
    d = tmp_path_factory.mktemp("pem")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(d, "req", "-x509", *ec, "-keyout", "key.pem", "-out", "cert.pem",
             "-days", "1", "-subj", "/CN=127.0.0.1")  # fmt: skip
    _openssl(d, "req", "-x509", *ec, "-keyout", "other-key.pem", "-out", "other-cert.pem",
             "-days", "1", "-subj", "/CN=other")  # fmt: skip
    (d / "junk.txt").write_text("not a certificate\n")
    return d


@pytest.mark.parametrize(
    ("files", "flag", "why"),
    [
        ({"--tls-cert": "cert.pem"}, "--tls-key (WEIGHTSERVE_TLS_KEY)",
         "the certificate is given, the private key is not"),
        ({"--tls-key": "key.pem"}, "--tls-cert (WEIGHTSERVE_TLS_CERT)",
         "the private key is given, the certificate is not"),
        ({"--tls-cert": "junk.txt", "--tls-key": "key.pem"}, "--tls-cert (WEIGHTSERVE_TLS_CERT)",
         "junk.txt is not a PEM certificate"),
        ({"--tls-cert": "cert.pem", "--tls-key": "junk.txt"}, "--tls-key (WEIGHTSERVE_TLS_KEY)",
         "junk.txt is not a PEM private key"),
        ({"--tls-cert": "cert.pem", "--tls-key": "other-key.pem"},
         "--tls-key (WEIGHTSERVE_TLS_KEY)", "does not fit the certificate"),
        ({"--tls-cert": "missing.pem", "--tls-key": "key.pem"},
         "--tls-cert (WEIGHTSERVE_TLS_CERT)", "cannot read the certificate"),
        ({"--tls-cert": "cert.pem", "--tls-key": "key.pem", "--tls-client-ca": "junk.txt"},
         "--tls-client-ca (WEIGHTSERVE_TLS_CLIENT_CA)", "junk.txt is not a PEM CA certificate"),
        ({"--tls-client-ca": "cert.pem"}, "--tls-client-ca (WEIGHTSERVE_TLS_CLIENT_CA)",
         "mutual TLS needs the server's own certificate and key too"),
    ],
)  # fmt: skip
def test_tls_files(files: dict[str, str], flag: str, why: str, pem: Path, empty_root: Path) -> None:
    args = [part for f, name in files.items() for part in (f, str(pem / name))]
    line = serve_fails(str(empty_root), *ANY_PORTS, *args)
    assert line.startswith(f"weightserve serve: {flag}: "), line
    assert why in line
    assert "port in use" not in line  # what a bad certificate used to be reported as


# ------------------------------------------------------------------------------ the root


def test_root_missing_not_a_directory_or_not_given(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    assert serve_fails(str(missing), *ANY_PORTS) == (
        f"weightserve serve: ROOT (WEIGHTSERVE_ROOT): model root {missing} is not a directory: "
        "give the directory that holds the models"
    )
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert "is not a directory" in serve_fails(
        *ANY_PORTS, env=clean_env(WEIGHTSERVE_ROOT=str(a_file))
    )
    assert serve_fails(*ANY_PORTS) == (
        "weightserve serve: ROOT (WEIGHTSERVE_ROOT): give a model root directory, or --demo"
    )


def test_an_empty_root_warns_and_require_models_makes_it_fatal(
    empty_root: Path, tmp_path: Path
) -> None:
    line = serve_fails(str(empty_root), *ANY_PORTS, "--require-models")
    assert line.startswith(
        f"weightserve serve: --require-models (WEIGHTSERVE_REQUIRE_MODELS): no models found "
        f"under {empty_root.resolve()}: the server looks for *.safetensors files"
    )
    assert "*.gguf" in line and "*.bin" in line
    env_line = serve_fails(
        str(empty_root), *ANY_PORTS, env=clean_env(WEIGHTSERVE_REQUIRE_MODELS="1")
    )
    assert env_line == line

    served = start_server([str(empty_root), *ANY_PORTS], clean_env(), tmp_path)
    try:
        assert served.lines[0] == f"weightserve: 0 models from {empty_root.resolve()}"
    finally:
        assert served.stop() == 0
    warnings = [line for line in served.stderr.read_text().splitlines() if '"WARNING"' in line]
    assert len(warnings) == 1, warnings
    assert f"no models found under {empty_root.resolve()}: the server looks for" in warnings[0]
    assert "--require-models makes this fatal" in warnings[0]


# ------------------------------------------------------------------------------ help, README


def _readme_configuration() -> dict[str, tuple[str, str]]:
    """flag -> (variable, default) from the README's Configuration table."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)`[^|]*\| `(WEIGHTSERVE_\w+)` \| ([^|]+?) \|", section, re.M)
    return {flag: (variable, default) for flag, variable, default in rows}


def _serve_flags() -> set[str]:
    """Every flag (and the positional ROOT, as "root") the ``serve`` parser knows."""
    from weightserve.client._cli import build_parser

    serve = build_parser().parse_args(["serve"]).command_parser
    flags = set()
    for action in serve._actions:
        if action.option_strings:
            flags.update(o for o in action.option_strings if o.startswith("--"))
        else:
            flags.add(action.dest)
    return flags - {"--help"}


def test_readme_lists_every_serve_flag_with_its_variable_and_default() -> None:
    readme = _readme_configuration()
    settings = {("ROOT" if s.flag == "root" else s.flag): (s.env, s.default_text) for s in SETTINGS}
    assert readme == settings
    assert {s.flag for s in SETTINGS} == _serve_flags()


def test_serve_help_shows_every_variable_and_default() -> None:
    result = run_cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines anywhere
    for s in SETTINGS:
        assert f"(env {s.env}; default {s.default_text})" in text, s.flag
        if s.flag.startswith("--"):
            assert f" {s.flag} " in text, s.flag


def test_readme_names_what_pip_install_installs() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    text = " ".join((REPO / "README.md").read_text().split())
    paragraph = text.split("The package alone is the client:", 1)[1]
    client_part, server_part = paragraph.split("The `server` extra adds the server:", 1)
    server_part = server_part.split("`[max]`", 1)[0]
    for requirement, part in [(r, client_part) for r in project["dependencies"]] + [
        (r, server_part) for r in project["optional-dependencies"]["server"]
    ]:
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]
        assert re.search(rf"\b{re.escape(name)}\b", part, re.I), f"README omits {name}"


# ------------------------------------------------------------------------------ wrong transport


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightServer]:
    root = tmp_path_factory.mktemp("root")
    fx.write_sharded(root / "org" / "sharded")
    with WeightServer(ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0)) as srv:
        yield srv


def _wrong(url: str) -> str:
    """The WrongTransport message a client gets at ``url``, which it must get at once."""
    start = time.monotonic()
    with pytest.raises(WrongTransport) as caught, Client(url) as client:
        client.list_models()
    assert time.monotonic() - start < 10  # not retried: the same URL cannot start working
    return str(caught.value)


def test_http_url_at_the_grpc_or_flight_port(server: WeightServer) -> None:
    for port in (server.grpc_port, server.flight_port):
        message = _wrong(f"http://127.0.0.1:{port}")
        assert f"this is a gRPC port; use grpc://127.0.0.1:{port}" in message
        assert "\\x00" not in message and "\x00" not in message  # no raw HTTP/2 bytes


def test_grpc_url_at_the_flight_port(server: WeightServer) -> None:
    message = _wrong(f"grpc://127.0.0.1:{server.flight_port}")
    assert message.startswith(
        f"grpc://127.0.0.1:{server.flight_port} is the server's Arrow Flight data port"
    )
    assert "use the gRPC port" in message and "UNIMPLEMENTED" not in message


def test_grpc_url_at_the_http_port(server: WeightServer) -> None:
    message = _wrong(f"grpc://127.0.0.1:{server.http_port}")
    assert message.startswith(f"grpc://127.0.0.1:{server.http_port} is an HTTP port")
    assert f"use http://127.0.0.1:{server.http_port}" in message
    with pytest.raises(WrongTransport, match="is an HTTP port"):
        RemoteWeights(f"grpc://127.0.0.1:{server.http_port}/{MODEL}")


def test_the_right_urls_still_work(server: WeightServer) -> None:
    for url in (server.http_url, server.grpc_url):
        with Client(url) as client:
            assert [m.id for m in client.list_models()[0]] == [MODEL]


@pytest.mark.parametrize(
    ("command", "url", "says"),
    [
        ("ls", "http://127.0.0.1:{grpc}", "this is a gRPC port; use grpc://127.0.0.1:{grpc}"),
        ("ls", "grpc://127.0.0.1:{flight}", "is the server's Arrow Flight data port"),
        ("pull", "grpc://127.0.0.1:{http}/" + MODEL, "is an HTTP port, not gRPC"),
        ("pull", "http://127.0.0.1:{flight}/v1/models/" + MODEL, "this is a gRPC port"),
    ],
)
def test_cli_says_which_url_to_use(
    server: WeightServer, tmp_path: Path, command: str, url: str, says: str
) -> None:
    ports = {"http": server.http_port, "grpc": server.grpc_port, "flight": server.flight_port}
    extra = ["--out", str(tmp_path / "out"), "--quiet"] if command == "pull" else []
    result = run_cli(command, url.format(**ports), *extra, timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"weightserve {command}: WrongTransport: ")
    assert says.format(**ports) in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_node_that_fails_to_start_lets_go_of_its_cache_and_origin(tmp_path: Path) -> None:
    """A pinned model the origin lacks fails the start after the cache directory was taken and
    the origin listed: both are closed (no file or connection left to the collector), so a
    node started again at once takes the same directory."""
    origin_root = tmp_path / "origin"
    origin_root.mkdir()
    fx.save_file({"w": np.ones(4, dtype=np.float32)}, origin_root / "m.safetensors")

    def node(*pins: str) -> WeightServer:
        return WeightServer(config(upstream.http_url, tmp_path / "cache", pins=pins))

    with WeightServer(config(str(origin_root), tmp_path / "unused")) as upstream:
        with warnings.catch_warnings(record=True) as left:
            warnings.simplefilter("always")
            with pytest.raises(StartupError, match="pinned"):
                node("not/there").start()
            gc.collect()
        assert [str(w.message) for w in left if w.category is ResourceWarning] == []
        with node() as again, Client(again.http_url) as c:  # the directory is free
            assert [m.id for m in c.list_models()[0]] == ["m.safetensors"]
