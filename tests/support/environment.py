"""The process environment of a test session: child Python processes run inside this virtual
environment whatever MAX set, and servers keep their caches in the session's temporary
directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def child_environment() -> dict[str, str]:
    """The environment for a child Python process, passed explicitly.

    Importing ``max.pipelines`` sets PYTHONEXECUTABLE and PYTHONPATH with C-level setenv (not
    through ``os.environ``); a child started with ``env=None`` inherits them and runs outside
    the virtual environment. ``os.environ`` never saw them, and any such variable is dropped.
    """
    drop = {"PYTHONEXECUTABLE", "PYTHONPATH", "PYTHONHOME", "MOJO_PYTHON_LIBRARY"}
    return {k: v for k, v in os.environ.items() if k not in drop}


_LEAKED_BY_MAX = ("PYTHONEXECUTABLE", "PYTHONPATH", "PYTHONHOME", "MOJO_PYTHON_LIBRARY")
_ENV_AT_START = {k: os.environ.get(k) for k in _LEAKED_BY_MAX}


@pytest.fixture(autouse=True)
def _restore_process_environment() -> Iterator[None]:
    """Undo MAX's C-level setenv after each test, so any later subprocess (even one started
    with ``env=None``) runs inside this virtual environment."""
    yield
    for key, value in _ENV_AT_START.items():
        if value is None:
            os.unsetenv(key)
            os.environ.pop(key, None)
        else:
            os.environ[key] = value  # also calls putenv


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Servers the tests start (in process or as ``weightserve serve``) keep file digests and
    the demo under the session's temporary directory, never in the user's cache."""
    before = os.environ.get("WEIGHTSERVE_CACHE_DIR")
    os.environ["WEIGHTSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop("WEIGHTSERVE_CACHE_DIR", None)
    else:
        os.environ["WEIGHTSERVE_CACHE_DIR"] = before


@pytest.fixture
def child_env() -> dict[str, str]:
    """``env=`` for subprocesses that run ``sys.executable`` (see child_environment)."""
    return child_environment()


def engine_python(variable: str, venv: str, install: str) -> Path:
    """The Python of an inference engine's own environment (MAX's, vLLM's): ``variable``
    names it, else ``venv`` in the repository (which .ci/run makes); skips, saying how to
    make it (``install``), where there is none."""
    from tests.support.paths import REPO

    path = Path(os.environ.get(variable) or REPO / venv / "bin" / "python")
    if not path.is_file():
        pytest.skip(f"no {venv} environment at {path}: python -m venv {venv} && {install}")
    return path


def engine_cache_dir() -> Path:
    """Where engines keep what outlives a test run (MAX's compiled graphs, the converted
    SmolLM2): a stable directory outside the repository, so a first compile or conversion
    happens once per machine, not per run. ``WEIGHTSERVE_TEST_CACHE`` moves it."""
    import tempfile

    cache = Path(
        os.environ.get("WEIGHTSERVE_TEST_CACHE")
        or Path(tempfile.gettempdir()) / "weightserve-test-max-cache"
    )
    cache.mkdir(parents=True, exist_ok=True)
    return cache
