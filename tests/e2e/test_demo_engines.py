"""The demo's language model (``demo/tiny-lm``) runs in real engines from the server, as the
README shows: transformers through the Hub routes (``HF_ENDPOINT``) and MAX through
``weightserve max generate``, each giving exactly the text it gives from the local
directory; a served model without what MAX needs is refused before MAX starts, by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.environment import child_environment, engine_cache_dir
from tests.support.paths import REPO
from weightserve.service.demo import DEMO_LM, DEMO_MODEL, write_demo
from weightserve.service.server import ServerConfig, WeightServer

PROMPT = "The capital of France is"

# Greedy text from transformers, for a model given as a local directory or a Hub id.
TRANSFORMERS_GENERATE = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
source = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(source)
model = AutoModelForCausalLM.from_pretrained(source)
ids = tokenizer(sys.argv[2], return_tensors="pt")
out = model.generate(**ids, max_new_tokens=16, do_sample=False)
print(json.dumps(tokenizer.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)))
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WeightServer, Path]]:
    root = write_demo(tmp_path_factory.mktemp("demo-root"))
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=None)
    with WeightServer(config) as srv:
        yield srv, root


def transformers_text(source: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_GENERATE, source, PROMPT],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_transformers_generates_from_the_served_demo_model(demo, tmp_path: Path) -> None:
    srv, root = demo
    env = child_environment()
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        env.pop(key, None)
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{srv.http_port}",
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
    )
    served = transformers_text(DEMO_LM, env)
    local = transformers_text(str(root / DEMO_LM), {**env, "HF_HUB_OFFLINE": "1"})
    assert len(served) >= 8 and served.isprintable(), served
    assert served == local


# -- MAX -------------------------------------------------------------------------------------


def max_python() -> Path:
    path = Path(os.environ.get("WEIGHTSERVE_MAX_PYTHON") or REPO / ".venv-max" / "bin" / "python")
    if not path.is_file():
        pytest.skip(f"no MAX serving environment at {path} (.ci/run makes it)")
    return path


def max_environment(tmp: Path) -> dict[str, str]:
    """A worker's environment: MAX's compiled graphs kept with the other MAX tests', its own
    temporary and side-file directories, no Hugging Face network."""
    cache = engine_cache_dir()
    (tmp / "tmp").mkdir(exist_ok=True)
    return {
        **child_environment(),
        "XDG_CACHE_HOME": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(tmp / "tmp"),
        "WEIGHTSERVE_MAX_DIR": str(tmp / "models"),
    }


def max_generate(command: list[str], model_path: str, env: dict[str, str]) -> str:
    """The text ``max generate`` prints, greedy, on CPU (its statistics follow the text)."""
    done = subprocess.run(
        [*command, "generate", "--model-path", model_path, "--prompt", PROMPT,
         "--max-new-tokens", "16", "--devices", "cpu", "--top-k", "1", "--max-length", "128",
         "--max-batch-size", "1"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "Prompt size:" in done.stdout, done.stdout[-3000:]
    return done.stdout[: done.stdout.index("Prompt size:")].strip()


@pytest.mark.slow
@pytest.mark.max
def test_weightserve_max_generates_from_the_served_demo_model(demo, tmp_path: Path) -> None:
    srv, root = demo
    python = max_python()
    env = max_environment(tmp_path)
    url = f"http://127.0.0.1:{srv.http_port}/v1/models/{DEMO_LM}"
    served = max_generate([str(python), "-m", "weightserve.client._cli", "max"], url, env)
    assert len(served) >= 8, served
    weight_files = [p for p in (tmp_path / "models").rglob("*.safetensors")]
    assert weight_files == []  # the side files came; the weights went straight into MAX
    local = max_generate([str(python.parent / "max")], str(root / DEMO_LM), env)
    assert served == local


@pytest.mark.max
def test_a_model_without_config_or_tokenizer_is_refused_before_max_starts(
    demo, tmp_path: Path
) -> None:
    srv, _ = demo
    url = f"http://127.0.0.1:{srv.http_port}/v1/models/{DEMO_MODEL}"
    done = subprocess.run(
        [str(max_python()), "-m", "weightserve.client._cli", "max", "generate",
         "--model-path", url, "--prompt", PROMPT, "--devices", "cpu"],
        env=max_environment(tmp_path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    message = done.stderr.strip().splitlines()
    assert len(message) == 1, done.stderr  # one line, no traceback
    assert DEMO_MODEL in message[0]
    assert "config.json (the architecture)" in message[0]
    assert "tokenizer (one of tokenizer.json" in message[0]
