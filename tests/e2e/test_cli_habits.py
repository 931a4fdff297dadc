"""The ``weightserve`` command's habits a newcomer meets first, run as a user runs them (real
processes, real ports): ``--version``, a quick failure naming ``--retry-seconds`` when nothing
listens, help placeholders that say what a setting takes, install hints that work from a
checkout, a refused token that names ``--token``, and ``weightserve max``'s program name."""

from __future__ import annotations

import importlib.metadata
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.commands import ANY_PORTS, WEIGHTSERVE, clean_env, start_server
from tests.support.paths import REPO
from weightserve.client import Client
from weightserve.client._extras import TORCH_REQUIREMENT
from weightserve.client.errors import Unauthenticated
from weightserve.service.server import ServerConfig, WeightServer

TOKEN = "habits-token"
# Well within the 15 s a newcomer should wait for "nothing listens there", on a loaded machine.
FAIL_FAST_SECONDS = 15.0


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*WEIGHTSERVE, *args],
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        timeout=timeout,
    )


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -c CODE`` in this environment (CODE may hide a package first)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        timeout=120,
    )


def refused_port() -> int:
    """A port nothing listens on: bound, then closed (a fixed one such as 9 might be open)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightServer]:
    """A server of one small model, ``tiny``, that needs the token ``TOKEN``."""
    root = tmp_path_factory.mktemp("root")
    (root / "tiny").mkdir()
    save_file({"w": np.arange(4, dtype=np.float32)}, root / "tiny" / "model.safetensors")
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, token_file=str(tokens)
    )
    with WeightServer(config) as srv:
        yield srv


# ------------------------------------------------------------------------------ --version


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_comes_from_the_installed_package(flag: str) -> None:
    result = run(flag)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"weightserve {importlib.metadata.version('weightserve')}\n"
    assert re.fullmatch(r"weightserve \d+\.\d+\.\d+\S*\n", result.stdout)


# ------------------------------------------------------------------------------ fail fast


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "http://127.0.0.1:{port}"],
        ["ls", "grpc://127.0.0.1:{port}"],
        ["pull", "http://127.0.0.1:{port}/v1/models/tiny", "--out", "{tmp}/out"],
        ["publish", "http://127.0.0.1:{port}/v1/models/tiny", "{tmp}"],
        ["watch", "http://127.0.0.1:{port}/v1/models/tiny"],
        ["cache", "prefetch", "http://127.0.0.1:{port}", "tiny"],
        ["cache", "evict", "http://127.0.0.1:{port}", "tiny"],
        ["cache", "verify", "http://127.0.0.1:{port}", "tiny"],
    ],
)
def test_a_refused_connection_fails_within_seconds_naming_the_flag(
    args: list[str], tmp_path: Path
) -> None:
    port = refused_port()
    argv = [a.format(port=port, tmp=tmp_path) for a in args]
    started = time.monotonic()
    result = run(*argv, timeout=FAIL_FAST_SECONDS + 30)
    took = time.monotonic() - started
    assert result.returncode == 1, result
    assert took < FAIL_FAST_SECONDS, f"{argv} took {took:.1f} s to fail"
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"weightserve {args[0]}: ServerUnreachable: cannot reach")
    assert f"127.0.0.1:{port}" in lines[0]
    assert "--retry-seconds N" in lines[0] and "WEIGHTSERVE_RETRY_SECONDS" in lines[0]
    assert not (tmp_path / "out").exists()


def test_every_server_command_takes_retry_seconds() -> None:
    for args in (["ls"], ["pull"], ["publish"], ["watch"], ["cache", "prefetch"]):
        helped = run(*args, "--help")
        assert helped.returncode == 0, helped.stderr
        assert "--retry-seconds" in helped.stdout, args


def test_the_environment_sets_the_wait_too() -> None:
    port = refused_port()
    started = time.monotonic()
    result = run("ls", f"http://127.0.0.1:{port}", env=clean_env(WEIGHTSERVE_RETRY_SECONDS="0"))
    assert time.monotonic() - started < FAIL_FAST_SECONDS
    assert result.returncode == 1
    assert "cannot reach" in result.stderr and "gave up" not in result.stderr  # tried once


def test_retry_seconds_waits_for_a_server_that_is_starting(tmp_path: Path) -> None:
    port = refused_port()
    waiting = subprocess.Popen(
        [*WEIGHTSERVE, "ls", f"http://127.0.0.1:{port}", "--retry-seconds", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        time.sleep(3)  # longer than the default wait: only the flag keeps it waiting
        assert waiting.poll() is None, waiting.communicate()
        args = ["--demo", *ANY_PORTS, "--http-port", str(port)]
        served = start_server(args, clean_env(WEIGHTSERVE_CACHE_DIR=str(tmp_path)), tmp_path)
        try:
            out, err = waiting.communicate(timeout=120)
        finally:
            assert served.stop() == 0
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 0, err
    assert out.startswith("MODEL")


# ------------------------------------------------------------------------------ help


def test_serve_help_names_what_each_setting_takes() -> None:
    helped = run("serve", "--help")
    assert helped.returncode == 0, helped.stderr
    text = " ".join(helped.stdout.split())
    assert "--origin-token TOKEN" in text and "--cache-dir DIR" in text
    assert "--origin-token FILE" not in text and "--cache-dir FILE" not in text
    for flag in ("--token-file", "--tls-cert", "--tls-key", "--origin-ca", "--origin-key"):
        assert f"{flag} FILE" in text, flag
    assert "--uds PATH" in text and "--cache-size SIZE" in text and "--pin MODEL" in text


# ------------------------------------------------------------------------------ install hints


def test_a_missing_torch_names_the_pinned_version(server: WeightServer) -> None:
    pinned = re.search(
        r'^torch = \["(torch==[^"]+)"\]', (REPO / "pyproject.toml").read_text(), re.M
    )
    assert pinned and pinned.group(1) == TORCH_REQUIREMENT
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from weightserve.client import Client\n"
        f"with Client({server.http_url!r}, token={TOKEN!r}) as c:\n"
        "    c.model('tiny').to_device('cpu')\n"
    )
    result = run_python(code)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: loading onto a device needs PyTorch")
    assert f"pip install {TORCH_REQUIREMENT}" in last
    assert "pip install -e '.[torch]'" in last and "python -m build" in last


def test_serve_without_the_server_extra_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['weightserve.service.config'] = None\n"
        "from weightserve.client._cli import main\n"
        "sys.exit(main(['serve', '--demo']))\n"
    )
    result = run_python(code)
    assert result.returncode == 2
    assert result.stderr.startswith("weightserve serve needs the server extra: ")
    assert "pip install -e '.[server]'" in result.stderr
    assert "python -m build" in result.stderr and "[server]'" in result.stderr


def test_max_without_max_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['max'] = None\n"
        "from weightserve.client._cli import main\n"
        "sys.exit(main(['max', 'generate', '--help']))\n"
    )
    result = run_python(code)
    assert result.returncode == 2
    assert result.stderr.startswith("weightserve max needs MAX: ")
    assert "pip install -e '.[max]' 'max[serve]'" in result.stderr


def test_no_hint_names_a_package_index_install() -> None:
    for tree in ("client", "service"):
        for path in (REPO / tree).rglob("*.py"):
            assert "pip install 'weightserve[" not in path.read_text(), path


# ------------------------------------------------------------------------------ tokens


def test_a_missing_token_names_the_flag_and_the_variable(server: WeightServer) -> None:
    for url in (server.http_url, server.grpc_url):
        refused = run("ls", url)
        assert refused.returncode == 1, refused.stdout
        assert refused.stderr.startswith("weightserve ls: Unauthenticated: "), refused.stderr
        assert "--token" in refused.stderr and "WEIGHTSERVE_TOKEN" in refused.stderr
        assert "Traceback" not in refused.stderr
        with_variable = run("ls", url, env=clean_env(WEIGHTSERVE_TOKEN=TOKEN))
        assert with_variable.returncode == 0, with_variable.stderr
        assert "tiny" in with_variable.stdout
    # The Python API's error keeps the server's message; the hint is a note under it.
    for url in (server.http_url, server.grpc_url):
        with Client(url) as client, pytest.raises(Unauthenticated) as refused_call:
            client.list_models()
        notes = getattr(refused_call.value, "__notes__", None)
        if sys.version_info >= (3, 11):
            assert notes and "token=" in notes[0] and "WEIGHTSERVE_TOKEN" in notes[0]


# ------------------------------------------------------------------------------ max --help


@pytest.mark.max
def test_max_help_names_the_command() -> None:
    python = Path(os.environ.get("WEIGHTSERVE_MAX_PYTHON") or REPO / ".venv-max/bin/python")
    if not python.is_file():
        pytest.skip(f"no MAX serving environment at {python} (.ci/run makes one)")
    helped = subprocess.run(
        [str(python), "-m", "weightserve.client._cli", "max", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert helped.returncode == 0, helped.stderr
    assert "Usage: weightserve max " in helped.stdout
    assert "python -m" not in helped.stdout
