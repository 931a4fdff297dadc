"""``weightserve max`` before MAX runs: which arguments are model URLs, and a URL the server
cannot answer fails as the other commands fail, naming the error, with nothing left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from weightserve.client.max.command import model_urls
from weightserve.service.server import ServerConfig, WeightServer

URL = "http://127.0.0.1:8080/v1/models/org/llama@main"


def test_model_urls_are_found_in_every_spelling() -> None:
    argv = ["serve", "--model-path", URL, "--port", "8000"]
    assert model_urls(argv) == {2: URL}
    assert model_urls(["generate", f"--model-path={URL}"]) == {1: URL}
    assert model_urls(["generate", "--model", "grpc://h:50051/m"]) == {2: "grpc://h:50051/m"}
    # A Hugging Face id or a local directory is MAX's to resolve, as is any other flag's URL.
    assert model_urls(["generate", "--model-path", "org/llama", "--weight-path", URL]) == {}
    assert model_urls(["generate", "--model-path"]) == {}


def test_a_model_the_server_lacks_fails_with_its_name(tmp_path: Path, child_env) -> None:
    (tmp_path / "root" / "tiny").mkdir(parents=True)
    save_file({"w": np.zeros(4, np.float32)}, tmp_path / "root" / "tiny" / "model.safetensors")
    config = ServerConfig(str(tmp_path / "root"), http_port=0, grpc_port=0, flight_port=None)
    env = {**child_env, "TMPDIR": str(tmp_path / "tmp"), "WEIGHTSERVE_RETRY_SECONDS": "0"}
    (tmp_path / "tmp").mkdir()
    with WeightServer(config) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "weightserve.client._cli", "max", "generate",
             "--model-path", f"{srv.grpc_url}/tinny", "--prompt", "hi"],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "weightserve max: ModelNotFound" in proc.stderr and "'tiny'" in proc.stderr
    assert list((tmp_path / "tmp").iterdir()) == []  # the side-file directory is removed


def test_a_server_url_is_a_usage_error(child_env) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "weightserve.client._cli", "max", "generate", "--model-path",
         "http://127.0.0.1:9/v1/models", "--prompt", "hi"],
        capture_output=True, text=True, timeout=60, env=child_env,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "names a server, not a model" in proc.stderr
